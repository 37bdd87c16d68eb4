"""Sphinx configuration of attnkit's documentation site (`make docs` builds it into docs/_build/html).

The pages are Markdown (MyST, through myst-nb), the API reference is generated from the docstrings
(reStructuredText, Google-style ``Args:`` sections) by docs/_ext/apiref.py, and the example
notebooks are executed and rendered with their outputs by docs/_ext/notebooks.py. The build runs
offline and with warnings as errors (``-W -n``); tests/test_docs_site.py builds it and opens it
in a browser.
"""

from __future__ import annotations

import sys
from importlib.metadata import version as _version
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "attnkit"
author = "the attnkit authors"
copyright = "the attnkit authors"  # noqa: A001 (Sphinx's name)
release = version = _version("attnkit")  # not `import attnkit`: torch would load before the kernels start

extensions = [
    "notebooks",  # first: it starts the notebook kernels, which then run while the rest loads
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_nb",
    "apiref",
]

# .md through myst-nb's MyST parser, .ipynb rendered by myst-nb, the generated reference in .rst.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# --- the theme -------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"attnkit {release}"
html_static_path: list[str] = []
html_last_updated_fmt = None
html_copy_source = False  # the sources are in the repository; not copied next to the pages
html_show_sourcelink = False
# Search results show no summary: Sphinx would fetch() each result's page to cut one from it,
# which a browser refuses from file://, where the site must work.
html_show_search_summary = False

# --- autodoc and the docstrings ---------------------------------------------------------------------
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"  # the docstrings describe the arguments in words
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False  # nn.Module's forward docstring is not attnkit's
autoclass_content = "class"  # the class docstring documents the constructor (tests/public_api.py)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
python_use_unqualified_type_names = True
add_module_names = False
# The reference's functions and classes are not entries of the tables of contents: the theme
# renders the whole navigation tree on every page, and with ~400 object entries that tree cost
# half of the build's time. Each reference page lists its names in order; the search finds them.
toc_object_entries = False

# Every cross-reference must resolve (-n), except to what the build cannot know offline: there is
# no network at build time, hence no intersphinx inventory of Python, PyTorch, NumPy or
# transformers, so references to their objects (mostly type annotations: ``torch.Tensor``,
# ``collections.abc.Sequence``, ...) cannot be linked. attnkit's own names are all checked.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|transformers|safetensors|tokenizers|matplotlib|PIL|triton)(\..*)?"),
    (r"py:.*", r"(Tensor|Generator|Module|Parameter|dtype|device|Size|Sequence|Mapping|Iterator"
               r"|Iterable|Callable|Path|ModuleType|PathLike|Namespace|ArgumentParser|TextIO)"),
    (r"py:.*", r"(typing|collections|collections\.abc|pathlib|os|io|argparse|types|enum|dataclasses"
               r"|concurrent\.futures|numbers|contextlib|functools)\..*"),
    (r"py:.*", r"(int|float|str|bool|bytes|object|type|tuple|list|dict|set|frozenset|slice|None"
               r"|NoneType|Ellipsis|complex|range|callable|Exception|ValueError|TypeError"
               r"|RuntimeError|optional)"),
    # A type expression autodoc could not split (a string annotation such as ``"str | None"``
    # inside ``typing.Tuple``), not a name. Only for types: prose that napoleon took for an
    # exception or a type in a docstring's sections still warns.
    (r"py:class", r".*[|'\[\]].*"),
]

# --- MyST and the notebooks ---------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve
nb_execution_mode = "off"  # docs/_ext/notebooks.py executes them (in parallel) before myst-nb reads them
nb_ipywidgets_js: dict = {}  # no widget script from a CDN: the site works offline
nb_merge_streams = True
