"""Headless Chromium for the report's tests: Debian's chromium driven through its own
chromedriver by selenium (no browser download is possible here).

Chromium runs with every background service off (on this closed network it would otherwise
keep making refused connections) and a fresh profile, with its console and network logs on.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1400,1000", "--force-device-scale-factor=1",
    # Sandboxed frames (the notebook views) in the page's own process, so that chromedriver's
    # console and network logs see inside them too; what they draw and fetch is the same.
    "--disable-features=IsolateSandboxedIframes",
)
# Screenshots land here (gitignored) for people to look at.
SCREENSHOTS = Path(__file__).resolve().parent.parent / "out" / "screenshots"


def unavailable_reason() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is missing: `make test` installs Debian's chromium and chromium-driver when run as root"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the attnkit[test] extra)"
    return None


@pytest.fixture(scope="module", name="browser")
def browser_fixture():
    """One :class:`Browser` for a test module (``from browser import browser_fixture``: the
    fixture is ``browser``); its tests skip, with the reason, where there is none."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    session = Browser()
    yield session
    session.close()


class Browser:
    """One headless Chromium session, reused by a test module."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="attnkit-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self.profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        self.driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        self.driver.get("about:blank")
        self.drain_logs()

    def close(self) -> None:
        self.driver.quit()
        shutil.rmtree(self.profile, ignore_errors=True)

    def drain_logs(self) -> None:
        """Forget what was logged so far (reading a log empties it)."""
        self.driver.get_log("browser")
        self.driver.get_log("performance")

    def open(self, path: Path) -> None:
        """Load a file fresh and wait until the page says it has drawn."""
        self.driver.get(path.resolve().as_uri())
        self.wait_ready()

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait_ready(self, timeout: float = 30) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        # Two animation frames: hover redraws are scheduled with requestAnimationFrame.
        self.driver.execute_async_script(
            "const done = arguments[0]; requestAnimationFrame(() => requestAnimationFrame(done));")
        WebDriverWait(self.driver, timeout).until(
            lambda d: d.execute_script("return document.documentElement.dataset.ready") == "true")

    def console_errors(self) -> list[str]:
        return [entry["message"] for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]

    def requested_urls(self) -> list[str]:
        """Every URL the page asked for since the last drain, from Chrome's network log."""
        urls = []
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated"):
                urls.append(message["params"].get("request", {}).get("url") or message["params"].get("url"))
        return urls

    def canvas_png(self, canvas_id: str) -> str:
        """What a canvas shows now, as a data URL (to compare before and after an action)."""
        return self.js(f"return document.getElementById('{canvas_id}').toDataURL()")

    def point_at(self, element_id: str, x: float, y: float, *, click: bool = False) -> None:
        """Move the mouse to (x, y) CSS pixels inside an element, scrolling it into view."""
        from selenium.webdriver.common.actions.action_builder import ActionBuilder

        box = self.js(
            """const e = document.getElementById(arguments[0]);
            let box = e.getBoundingClientRect();
            window.scrollBy(0, box.top + arguments[1] - innerHeight / 2);
            box = e.getBoundingClientRect();
            return [box.left, box.top];""", element_id, y)
        actions = ActionBuilder(self.driver)
        actions.pointer_action.move_to_location(int(box[0] + x), int(box[1] + y))
        if click:
            actions.pointer_action.click()
        actions.perform()
        self.wait_ready()

    def screenshot(self, name: str) -> bytes:
        """Save the visible page under out/screenshots/NAME.png and return the PNG bytes."""
        png = base64.b64decode(self.driver.get_screenshot_as_base64())
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        (SCREENSHOTS / f"{name}.png").write_bytes(png)
        return png


def pixel_spread(png: bytes) -> tuple[float, int]:
    """(standard deviation of the channel values, number of distinct colours) of a PNG."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int32)
    packed = (pixels[..., 0] << 16) | (pixels[..., 1] << 8) | pixels[..., 2]
    return float(pixels.std()), len(np.unique(packed))
