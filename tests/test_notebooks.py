"""The example notebooks, run as a reader would run them: each executes top to bottom in a real
Jupyter kernel (nbclient + ipykernel, the kernel being this venv's python), prints the seed
notebooks' numbers (read back from the outputs and compared with tests/notebook_seed_numbers.py),
and exports to HTML (nbconvert) that headless Chromium opens: every inline view draws, no console
error, no request.

The five kernels run at once: their time is mostly importing torch, which two cores share better
than one after the other.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from pathlib import Path

import executed_notebooks
import pytest
from browser import Browser, browser_fixture, unavailable_reason  # noqa: F401 (the browser fixture)
from notebook_seed_numbers import EXPECTED, Bounded, Lines, Numbers

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
nbconvert = pytest.importorskip("nbconvert")
pytest.importorskip("ipykernel")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(path.stem for path in EXAMPLES.glob("*.ipynb"))
KERNEL = "attnkit-test-venv"
CHECK_TAG = re.compile(r"^check:(.+)$")
# Floats as torch and Python print them (a decimal point or an exponent), and inf / nan; integers
# (shapes, indices, "Backward0") are not numbers of a tensor printout.
NUMBER = re.compile(r"-?inf\b|\bnan\b|-?\d+\.\d*(?:e[-+]?\d+)?|-?\d+e[-+]?\d+")

# nbconvert's own page template loads require.js, MathJax and Mermaid from a CDN; without them
# the exported page is the notebook alone, so any request or console error seen comes from it.
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def test_there_is_one_notebook_per_seed_and_none_is_committed_with_outputs():
    seeds = sorted(path.name[:3] for path in (EXAMPLES.parent.parent / "shared" / "seeds").glob("*.txt"))
    assert [name[:3] for name in NOTEBOOKS] == (seeds or ["000", "001", "002", "003", "004"])
    for name in NOTEBOOKS:
        notebook = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
        nbformat.validate(notebook)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name}: committed with outputs"


# --- running them -------------------------------------------------------------------------------
def _kernel_spec_manager(directory: Path):
    """A kernel spec naming this interpreter, so the notebooks run in this venv whatever else
    Jupyter would find on the machine."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = directory / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "attnkit tests (this venv)", "language": "python",
    }))
    return KernelSpecManager(kernel_dirs=[str(directory / "kernels")])


async def _execute_all(notebooks: dict, specs) -> dict[str, BaseException | None]:
    from jupyter_client.manager import AsyncKernelManager

    async def run(name: str) -> BaseException | None:
        manager = AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)
        client = nbclient.NotebookClient(notebooks[name], km=manager, timeout=120,
                                         resources={"metadata": {"path": str(EXAMPLES)}})
        try:
            await client.async_execute()
        except Exception as error:  # reported per notebook by test_the_notebook_runs
            return error
        return None

    results = await asyncio.gather(*(run(name) for name in notebooks))
    return dict(zip(notebooks, results))


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    shared = executed_notebooks.cached(NOTEBOOKS)  # this session's docs build ran the same kernels
    if shared is not None:
        return {name: nbformat.reads(text, as_version=4) for name, text in shared.items()}, dict.fromkeys(NOTEBOOKS)
    notebooks = {name: nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4) for name in NOTEBOOKS}
    errors = asyncio.run(_execute_all(notebooks, _kernel_spec_manager(tmp_path_factory.mktemp("jupyter"))))
    return notebooks, errors


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_notebook_runs_in_a_real_kernel(executed, name):
    notebooks, errors = executed
    assert errors[name] is None, f"{name} failed:\n{errors[name]}"
    assert notebooks[name].metadata.kernelspec.name == "python3"  # what a reader's Jupyter starts


# --- reading the seed numbers back ----------------------------------------------------------------
def printed_text(cell) -> str:
    """What a code cell printed or returned, as text."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
    return "".join(parts)


def printed_numbers(text: str) -> list[float]:
    return [float(token) for token in NUMBER.findall(text)]


def _close(got: float, want: float | None, atol: float, rtol: float) -> bool:
    if want is None:
        return True
    if math.isinf(want):
        return got == want
    return abs(got - want) <= atol + rtol * abs(want)


def printed_after(text: str, label: str) -> float | None:
    """The first number (an integer too) printed after ``label``, or None without one."""
    start = text.find(label)
    if start < 0:
        return None
    match = re.compile(r"-?inf\b|\bnan\b|-?\d+(?:\.\d*)?(?:e[-+]?\d+)?").search(text, start + len(label))
    return None if match is None else float(match[0])


def within(got: float | None, low: float | None, high: float | None) -> bool:
    return got is not None and not math.isnan(got) and (low is None or got >= low) and (high is None or got <= high)


def find_printed(expected: Numbers, got: list[float]) -> bool:
    """Whether ``expected.values`` appear consecutively in ``got``, each within tolerance."""
    size = len(expected.values)
    return any(all(_close(g, w, expected.atol, expected.rtol) for g, w in zip(got[start:start + size], expected.values))
               for start in range(len(got) - size + 1))


def checked_cells(notebook) -> dict[str, object]:
    cells = {}
    for cell in notebook.cells:
        for tag in cell.metadata.get("tags", []):
            match = CHECK_TAG.match(tag)
            if match:
                assert match[1] not in cells, f"two cells tagged {tag}"
                cells[match[1]] = cell
    return cells


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_notebook_prints_the_seed_numbers(executed, name):
    notebooks, errors = executed
    if errors[name] is not None:
        pytest.skip(f"{name} did not run to the end (see test_the_notebook_runs_in_a_real_kernel)")
    cells = checked_cells(notebooks[name])
    assert set(cells) == set(EXPECTED[name]), "every checked cell has its expected numbers, and the reverse"
    for check, expected in EXPECTED[name].items():
        text = printed_text(cells[check])
        if isinstance(expected, Lines):
            for line in expected.texts:
                assert line in text, f"{name}, check:{check}: {line!r} not printed in:\n{text}"
        elif isinstance(expected, Bounded):
            for label, low, high in expected.bounds:
                got = printed_after(text, label)
                assert within(got, low, high), \
                    f"{name}, check:{check}: after {label!r} printed {got}, expected within [{low}, {high}] in:\n{text}"
        else:
            assert find_printed(expected, printed_numbers(text)), \
                f"{name}, check:{check}: the seed's numbers {expected.values} are not printed in:\n{text}"


def test_the_number_reader_catches_a_wrong_or_missing_number():
    text = "tensor([[0.1385, 0.2379,   -inf],\n        [1.9287e-22, nan, 3.0000]], grad_fn=<SoftmaxBackward0>) 12"
    got = printed_numbers(text)
    assert got[:3] == [0.1385, 0.2379, -math.inf] and got[3] == 1.9287e-22 and math.isnan(got[4]) and len(got) == 6
    assert find_printed(Numbers((0.2379, -math.inf, 1.9287e-22, None, 3.0)), got)
    assert not find_printed(Numbers((0.2379, -math.inf, 1.9287e-22, None, 3.0002)), got)  # off by 2e-4
    assert not find_printed(Numbers((0.1385, 0.2379, 1.0)), got)  # -inf is not a number near 1
    assert not find_printed(Numbers((0.1385, 0.2379, -math.inf, 1.9287e-22, 0.5, 3.0)), got)  # nan is no number
    assert not find_printed(Numbers((3.0, 4.0)), got)  # runs past the end


def test_the_bound_reader_reads_the_number_after_its_label():
    text = "eager: 0 calls\nattnkit: 2 calls\nmax |a - b|: 3.81e-06\ninduction head: layer 1, head 0; score nan"
    assert printed_after(text, "eager:") == 0 and printed_after(text, "attnkit:") == 2
    assert printed_after(text, "max |a - b|:") == 3.81e-06 and within(3.81e-06, 0.0, 1e-4)
    assert printed_after(text, "induction head: layer") == 1
    assert printed_after(text, "missing label") is None and not within(None, None, None)
    assert not within(printed_after(text, "score"), 0.5, None)  # nan is within no bound
    assert not within(2e-4, 0.0, 1e-4) and not within(0.4, 0.5, None)


# --- exported to HTML and opened in a browser -----------------------------------------------------
@pytest.fixture(scope="module")
def exported(executed, tmp_path_factory):
    from jinja2 import DictLoader

    notebooks, errors = executed
    exporter = nbconvert.HTMLExporter(template_name="lab", template_file="offline.html.j2",
                                      extra_loaders=[DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})])
    directory = tmp_path_factory.mktemp("exported")
    pages = {}
    for name, notebook in notebooks.items():
        if errors[name] is None:
            body, _ = exporter.from_notebook_node(notebook)
            pages[name] = directory / f"{name}.html"
            pages[name].write_text(body, encoding="utf-8")
    return pages




def views_in(notebook) -> int:
    """How many inline views the notebook's outputs hold."""
    return sum(output.get("data", {}).get("text/html", "").count('class="attnkit-view"')
               for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs)


# Inside one view's frame: its page has drawn, and the canvas of the view it shows is not blank.
DRAWN = """
const canvas = document.querySelector("main section:not([hidden]) canvas");
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
let inked = 0;
for (let i = 0; i < pixels.length; i += 4) {
  if (pixels[i + 3] > 0 && (pixels[i] < 240 || pixels[i + 1] < 240 || pixels[i + 2] < 240)) inked++;
}
return {view: canvas.id, inked, height: Math.ceil(document.documentElement.getBoundingClientRect().height),
        layer: document.getElementById("layer").value, head: document.getElementById("head").value,
        heads: [...document.querySelectorAll("#head-toggles input:checked")].map((box) => Number(box.dataset.head)),
        tabs: document.querySelector("nav").hidden ? []
          : [...document.querySelectorAll("nav button")].filter((b) => !b.hidden).map((b) => b.dataset.view)};
"""


def frames_drawn(browser: Browser, expected: int) -> list[dict]:
    """Visit every view's frame once it has drawn and the host page has fitted its height."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser.driver
    frames = driver.find_elements("css selector", "iframe.attnkit-view")
    assert len(frames) == expected, f"{len(frames)} view frames on the page, {expected} views in the notebook"
    found = []
    for frame in frames:
        driver.switch_to.frame(frame)
        try:
            WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.documentElement.dataset.ready")
                                            == "true")
            state = driver.execute_script(DRAWN)
        finally:
            driver.switch_to.default_content()
        # The host script fits the frame to the height the page reports (plus 4 px of slack).
        WebDriverWait(driver, 10).until(
            lambda d: abs(frame.rect["height"] - (state["height"] + 4)) <= 1,
            message=f"frame height {frame.rect['height']} never fitted its page ({state['height']} px)")
        found.append(state)
    return found


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_exported_notebook_draws_every_view_offline(browser, executed, exported, name):
    if name not in exported:
        pytest.skip(f"{name} did not run to the end (see test_the_notebook_runs_in_a_real_kernel)")
    notebook = executed[0][name]
    page = exported[name]
    browser.drain_logs()
    browser.driver.get(page.resolve().as_uri())
    views = frames_drawn(browser, views_in(notebook))
    assert views, f"{name} shows no inline view"
    for i, view in enumerate(views):
        assert view["inked"] > 200, f"{name}: view {i} ({view['view']}) drew nothing"
        # One view per output; the model view's heads enlarge into a heatmap tab beside it.
        assert view["tabs"] == (["model", "heatmap"] if view["view"] == "model-canvas" else []), view
    assert browser.console_errors() == []
    assert browser.requested_urls() == [page.resolve().as_uri()]
    browser.screenshot(f"notebook_{name}")
    if name == "004_attention_layer":  # head_view(encoded, layer=2, heads=[3]), then heatmap(layer=2, head=3)
        assert (views[0]["view"], views[0]["layer"], views[0]["heads"]) == ("head-canvas", "2", [3])
        assert (views[1]["view"], views[1]["layer"], views[1]["head"]) == ("heatmap-canvas", "2", "3")


def test_the_browser_checks_see_inside_sandboxed_frames(browser, tmp_path):
    # Guards the test above: a request and a console error made inside a sandboxed srcdoc frame,
    # like a view's, are both caught.
    inner = "<img src='http://127.0.0.1:9/x.png'><script>console.error('inside the frame')</script>"
    page = tmp_path / "frame.html"
    page.write_text(f'<html><body><iframe sandbox="allow-scripts" srcdoc="{inner}"></iframe></body></html>')
    browser.drain_logs()
    browser.driver.get(page.resolve().as_uri())
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser.driver, 10).until(lambda d: any("inside the frame" in e for e in browser.console_errors()))
    assert "http://127.0.0.1:9/x.png" in browser.requested_urls()
    browser.drain_logs()
