"""PNG and SVG exports: the files exist, have the size asked for, and show something."""

from __future__ import annotations

import base64
import io
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from viz_data import attention_like, words

pytest.importorskip("matplotlib", reason="the image exports need the attnkit[viz] extra (matplotlib)")
from PIL import Image  # noqa: E402  (matplotlib depends on Pillow)

from attnkit.viz import AttentionRecord, save_grid, save_head  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def _record(layers=2, heads=3, tokens=8) -> AttentionRecord:
    return AttentionRecord("the quick brown fox", words(tokens), attention_like(layers, heads, tokens), model="m")


def _pixels(png: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32).copy())


def _not_blank(pixels: torch.Tensor) -> bool:
    # A blank (single-colour) image has zero spread; a heatmap has many distinct shades.
    return float(pixels.std()) > 10 and len(torch.unique(pixels.reshape(-1, 3), dim=0)) > 20


def test_head_png_has_the_asked_pixel_size_and_is_not_blank(tmp_path):
    path = save_head(_record(), 1, 2, tmp_path / "head.png", size=(6, 5), dpi=100)
    pixels = _pixels(path.read_bytes())
    assert pixels.shape[:2] == (500, 600)
    assert _not_blank(pixels)


def test_grid_png_size_follows_the_documented_formula(tmp_path):
    path = save_grid(_record(layers=2, heads=3), tmp_path / "sub" / "grid.png", cell=1.0, dpi=50)
    pixels = _pixels(path.read_bytes())
    assert pixels.shape[:2] == (round((0.9 + 2) * 50), round(max(4, 0.8 + 3) * 50))
    assert _not_blank(pixels)
    wide = save_grid(_record(layers=1, heads=12), tmp_path / "wide.png", cell=0.5, dpi=40)
    assert _pixels(wide.read_bytes()).shape[:2] == (round((0.9 + 0.5) * 40), round((0.8 + 6) * 40))


def _svg(path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return root


def _embedded_images(root: ET.Element) -> list[torch.Tensor]:
    images = []
    for element in root.iter(f"{SVG}image"):
        href = element.get("{http://www.w3.org/1999/xlink}href") or element.get("href")
        assert href.startswith("data:image/png;base64,")
        pixels = _pixels(base64.b64decode(href.split(",", 1)[1]))
        # matplotlib stores rasters bottom-up and flips them back with this transform.
        flipped = "scale(1 -1)" in (element.get("transform") or "")
        images.append(pixels.flip(0) if flipped else pixels)
    return images


def test_head_svg_is_valid_sized_labelled_and_not_blank(tmp_path):
    record = _record()
    root = _svg(save_head(record, 0, 0, tmp_path / "head.svg", size=(6, 5)))
    assert (root.get("width"), root.get("height")) == ("432pt", "360pt")  # inches x 72
    heatmap, colour_bar = _embedded_images(root)  # rasters inside the vector figure
    assert _not_blank(heatmap) and float(colour_bar.std()) > 10
    text = (tmp_path / "head.svg").read_text()
    for token in record.tokens:  # matplotlib names each text group after its string
        assert f"<!-- {token} -->" in text


def test_grid_svg_holds_one_image_per_head(tmp_path):
    root = _svg(save_grid(_record(layers=2, heads=3), tmp_path / "grid.svg"))
    images = _embedded_images(root)
    assert len(images) == 6 and all(_not_blank(i) for i in images)


def test_long_inputs_keep_one_token_wide_patterns_in_the_grid(tmp_path):
    # Every query attends only to its previous token: an off-diagonal line one token wide.
    # Drawn 300 tokens into 50 pixels, plain subsampling would drop it; max pooling keeps it.
    tokens = 300
    weights = torch.zeros(1, 1, tokens, tokens)
    weights[0, 0, 0, 0] = 1
    weights[0, 0, torch.arange(1, tokens), torch.arange(tokens - 1)] = 1
    record = AttentionRecord("prev", words(tokens), weights)
    (image,) = _embedded_images(_svg(save_grid(record, tmp_path / "grid.svg", cell=1.0, dpi=50)))
    assert image.shape[:2] == (50, 50)
    darkness = 255 - image.mean(-1)
    assert (darkness.diagonal() > 150).all()


def test_bad_format_or_index_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="path: got suffix '.jpg'"):
        save_grid(_record(), tmp_path / "grid.jpg")
    with pytest.raises(ValueError, match="head: got 3, expected 0 <= head < 3"):
        save_head(_record(), 0, 3, tmp_path / "head.png")
    with pytest.raises(ValueError, match="scale: got 'log'"):
        save_head(_record(), 0, 0, tmp_path / "head.png", scale="log")
