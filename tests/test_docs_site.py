"""The documentation site (docs/, `make docs`): it builds offline with warnings as errors, its API
reference has every public name (enumerated by tests/public_api.py), the example notebooks are
pages with their outputs, and its search works from ``file://`` in headless Chromium with no
request leaving the machine.

The site is built once per session, into a temporary folder, by the command `make docs` runs
(``sphinx-build -W --keep-going -n``): a broken link, an unresolved cross-reference, a docstring
that is not valid reStructuredText or a notebook that fails fails the build. ``--keep-going``
writes the whole site even then, so the other tests still look at it.
"""

from __future__ import annotations

import contextlib
import posixpath
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import executed_notebooks
from browser import Browser, browser_fixture, unavailable_reason  # noqa: F401 (the browser fixture)
from public_api import importable, public_modules, public_objects

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")
pytest.importorskip("furo")
pytest.importorskip("nbclient")
pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
# `make docs` must build in under a minute on a 2-core machine. Wall time depends on whatever
# else the machine runs (the suite's other jobs, other users), so the bounds are on CPU time:
# Sphinx's own process runs on one core (it must fit in the minute) while the notebook kernels run
# beside it; together they must fit in two cores' minute with room for what does not overlap.
SPHINX_CPU_BUDGET_S = 50
TOTAL_CPU_BUDGET_S = 100


@dataclass
class Site:
    html: Path
    returncode: int
    log: str
    wall_s: float
    sphinx_cpu_s: float
    kernels_cpu_s: float


def run_measured(args: list[str], log: Path) -> tuple[int, float, float, float]:
    """Run a command; return its exit code, wall time, its own CPU time and its descendants'
    (sampled every 0.2 s: the notebook kernels)."""
    import psutil

    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
        root = psutil.Process(process.pid)
        own, descendants = 0.0, {}
        while process.poll() is None:
            try:
                times = root.cpu_times()
                own = times.user + times.system
                for child in root.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        times = child.cpu_times()
                        descendants[child.pid] = times.user + times.system
            except psutil.Error:
                pass
            time.sleep(0.2)
        try:
            process.wait(timeout=900)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    return process.returncode, time.perf_counter() - start, own, sum(descendants.values())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Site:
    out = tmp_path_factory.mktemp("docs")
    code, wall, own, kernels = run_measured(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
         "-d", str(out / "doctrees"), str(DOCS), str(out / "html")], out / "build.log")
    print(f"docs built in {wall:.1f} s: {own:.1f} CPU seconds in Sphinx, {kernels:.1f} in the notebook kernels")
    executed_notebooks.directory = out / "doctrees" / "executed-notebooks"  # test_notebooks.py reuses them
    return Site(out / "html", code, (out / "build.log").read_text(), wall, own, kernels)


def warnings_of(log: str) -> list[str]:
    return [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line or "CRITICAL" in line]


def test_the_site_builds_with_no_warning(site):
    assert site.returncode == 0, "the docs build warned (warnings are errors):\n" + "\n".join(warnings_of(site.log)) \
        + "\n--- full log ---\n" + site.log[-20000:]
    assert (site.html / "index.html").exists()


def test_the_site_builds_in_under_a_minute_of_two_cores(site):
    measured = f"Sphinx {site.sphinx_cpu_s:.0f} CPU s, kernels {site.kernels_cpu_s:.0f} CPU s, wall {site.wall_s:.0f} s"
    assert site.kernels_cpu_s > 5, f"the notebook kernels were not seen running ({measured})"
    assert site.sphinx_cpu_s < SPHINX_CPU_BUDGET_S, measured
    assert site.sphinx_cpu_s + site.kernels_cpu_s < TOTAL_CPU_BUDGET_S, measured


def test_the_build_check_fails_on_a_broken_link(tmp_path):
    # Guards the first test: the same flags turn an unresolved reference into a failed build.
    (tmp_path / "conf.py").write_text('extensions = ["myst_parser"]\nnitpicky = True\n')
    (tmp_path / "index.md").write_text("# Page\n\n[nowhere](missing.md) and {py:func}`attnkit.nowhere`\n")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                             str(tmp_path), str(tmp_path / "_build")], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "missing" in result.stderr and "attnkit.nowhere" in result.stderr


# --- the reference --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inventory(site) -> dict[str, dict[str, object]]:
    from sphinx.util.inventory import InventoryFile

    with open(site.html / "objects.inv", "rb") as stream:
        return InventoryFile.load(stream, "", posixpath.join)


def documented(inventory, name: str) -> str | None:
    """The page documenting a name, whatever its kind (function, class, method, ...)."""
    for kind, entries in inventory.items():
        if kind.startswith("py:") and name in entries:
            entry = entries[name]
            return entry.uri if hasattr(entry, "uri") else entry[2]
    return None


def test_every_public_module_has_its_reference_page(inventory):
    modules = [name for name in public_modules() if importable(name) is not None]
    assert "attnkit.integrations.transformers" in modules  # transformers is installed with the docs
    missing = [name for name in modules if name not in inventory.get("py:module", {})]
    assert not missing, f"public modules missing from the reference: {missing}"


def test_every_public_name_is_in_the_reference(inventory):
    names = [name for name, _ in public_objects()]
    assert len(names) > 100
    missing = [name for name in names if documented(inventory, name) is None]
    assert not missing, f"public names missing from the reference (objects.inv): {missing}"
    assert documented(inventory, "attnkit.attention").startswith("reference/attnkit.html#")
    assert documented(inventory, "attnkit.masks.sliding_window").startswith("reference/attnkit.masks.html#")


def test_a_name_exported_by_several_modules_is_listed_by_each(inventory):
    # attnkit.masks.constructors.sliding_window is attnkit.masks.sliding_window: documented once,
    # listed (pointing there) on the module page that defines it too.
    assert documented(inventory, "attnkit.masks.constructors.sliding_window")
    assert documented(inventory, "attnkit.core.attention")


def test_the_reference_shows_a_docstring(site):
    page = (site.html / "reference" / "attnkit.masks.html").read_text(encoding="utf-8")
    assert 'id="attnkit.masks.sliding_window"' in page
    assert "sliding_window" in page and "causal" in page


# --- the notebooks --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(path.stem for path in EXAMPLES.glob("*.ipynb")))
def test_each_notebook_is_a_page_with_its_outputs(site, name):
    page = site.html / "notebooks" / f"{name}.html"
    assert page.exists(), f"{name} has no page"
    html = page.read_text(encoding="utf-8")
    assert html.count('class="cell_output') >= 3, f"{name} is rendered without its outputs"
    assert "Traceback (most recent call last)" not in html, f"{name} shows an error"
    assert "iframe" in html and 'class="attnkit-view"' in html, f"{name}: its inline views are not on the page"


def test_the_landing_page_leads_to_guides_notebooks_and_the_reference(site):
    page = (site.html / "index.html").read_text(encoding="utf-8")
    for target in ("guides/attention.html", "guides/layers.html", "guides/models.html", "guides/gpt.html",
                   "guides/inside.html", "guides/backends.html", "distributed.html", "performance.html",
                   "architecture.html", "notebooks/000_scaled_dot_product.html", "reference/index.html"):
        assert f'href="{target}' in page, f"the landing page has no link to {target}"


# --- in a browser, from file:// ---------------------------------------------------------------------


def test_searching_finds_a_reference_entry_offline(browser, site):
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser.driver
    browser.drain_logs()
    driver.get((site.html / "index.html").as_uri())
    box = WebDriverWait(driver, 30).until(lambda d: d.find_element("css selector", "input[name=q]"))
    box.send_keys("sliding_window" + Keys.RETURN)
    WebDriverWait(driver, 60).until(lambda d: "search.html" in d.current_url)
    links = WebDriverWait(driver, 60, ignored_exceptions=(Exception,)).until(
        lambda d: d.find_elements("css selector", "#search-results ul.search li a")
        and d.execute_script("return [...document.querySelectorAll('#search-results ul.search li a')]"
                             ".map((a) => a.href)"))
    assert any("/reference/" in href and "sliding_window" in href for href in links), links
    target = next(href for href in links if "/reference/" in href and "sliding_window" in href)
    driver.get(target)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    assert driver.find_elements("id", target.rsplit("#", 1)[1])  # the result leads to the entry
    browser.screenshot("docs_search_sliding_window")
    assert browser.console_errors() == []
    leaving = [url for url in browser.requested_urls() if not url.startswith(("file://", "data:", "about:"))]
    assert leaving == [], f"the site asked for {leaving}"


def test_a_notebook_page_draws_its_views_offline(browser, site):
    # The notebook's inline views (sandboxed frames holding the report page) inside the theme's
    # page: each draws and fits its height; no console error, no request leaves the machine.
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser.driver
    browser.drain_logs()
    driver.get((site.html / "notebooks" / "002_attention_step_by_step.html").as_uri())
    frames = driver.find_elements("css selector", "iframe.attnkit-view")
    assert len(frames) >= 4
    for frame in frames:
        driver.switch_to.frame(frame)
        try:
            WebDriverWait(driver, 60).until(
                lambda d: d.execute_script("return document.documentElement.dataset.ready") == "true")
            inked = driver.execute_script(
                """const c = document.querySelector("main section:not([hidden]) canvas");
                const p = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 0; i < p.length; i += 4) if (p[i + 3] > 0 && p[i] < 240) n++;
                return n;""")
        finally:
            driver.switch_to.default_content()
        assert inked > 200, "a view drew nothing"
        WebDriverWait(driver, 20).until(lambda d: frame.rect["height"] > 150)
    driver.execute_script("document.querySelector('iframe.attnkit-view').scrollIntoView()")
    browser.screenshot("docs_notebook_002")
    assert browser.console_errors() == []
    leaving = [url for url in browser.requested_urls() if not url.startswith(("file://", "data:", "about:"))]
    assert leaving == [], f"the page asked for {leaving}"
