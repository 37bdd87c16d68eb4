"""The HTML report as a file: standalone, nothing to fetch, weights embedded exactly (or to the
stated float16 precision), text safely escaped, a progress bar for many sentences."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from viz_data import attention_like, words

from attnkit.viz import AttentionRecord, progress, render_report, write_report
from attnkit.viz.encode import EXACT_LIMIT, choose_precision, decode_weights


def _record(layers=2, heads=3, tokens=5, **kwargs) -> AttentionRecord:
    return AttentionRecord("a sentence", words(tokens), attention_like(layers, heads, tokens, **kwargs), model="m")


def _embedded(page: str) -> tuple[dict, dict[str, str]]:
    meta = json.loads(re.search(r'<script type="application/json" id="attnkit-meta">(.*?)</script>', page, re.S)[1])
    data = dict(re.findall(r'<script type="application/octet-stream" id="([\w-]+)">([A-Za-z0-9+/=]*)</script>', page))
    return meta, data


def test_the_page_refers_to_no_url_and_forbids_fetching():
    page = render_report([_record(), _record(seed=1)])
    for needle in ("http:", "https:", "//cdn", "src=", "href=", "url(", "@import", "fetch(", "XMLHttpRequest"):
        assert needle not in page, needle
    assert "default-src 'none'" in page  # the Content-Security-Policy blocks any load we forgot


def test_float32_weights_round_trip_exactly_and_float16_within_its_rounding():
    records = [_record(causal=True), _record(tokens=9, padded=2)]
    meta, data = _embedded(render_report(records))
    assert len(meta["records"]) == 2
    for record, entry in zip(records, meta["records"]):
        assert entry["dtype"] == "float32" and entry["tokens"] == record.tokens
        decoded = decode_weights(data[entry["data"]], "float32", tuple(record.attentions.shape))
        assert torch.equal(decoded, record.attentions)
    meta, data = _embedded(render_report(records[1], precision="float16"))
    decoded = decode_weights(data[meta["records"][0]["data"]], "float16", tuple(records[1].attentions.shape))
    # float16 keeps 11 significant bits: relative error <= 2**-11 for normal numbers, and
    # absolute error <= 2**-25 below the smallest normal (6.1e-5); exact zeros stay zero.
    torch.testing.assert_close(decoded, records[1].attentions, rtol=2**-11, atol=2**-25)
    assert torch.equal(decoded == 0, records[1].attentions == 0)


def test_auto_precision_is_exact_for_minilm_sized_sentences():
    assert choose_precision(6 * 12 * 128 * 128) == "float32"  # all-MiniLM-L6-v2 at its 128 tokens
    assert choose_precision(6 * 12 * 512 * 512) == "float16"
    assert choose_precision(EXACT_LIMIT + 1, "float32") == "float32"
    with pytest.raises(ValueError, match="precision: got 'int8'"):
        choose_precision(10, "int8")


def test_text_that_looks_like_markup_stays_text():
    tokens = ["</script><script>alert(1)</script>", "<!--", "&amp;", "ü"]
    record = AttentionRecord("</script> & <b>", tokens, attention_like(1, 1, 4))
    page = render_report(record, title="<b>title</b>")
    meta, _ = _embedded(page)
    assert meta["records"][0]["tokens"] == tokens and meta["records"][0]["text"] == "</script> & <b>"
    assert "<title>&lt;b&gt;title&lt;/b&gt;</title>" in page
    assert page.count("</script>") == 3  # meta, one data block, the program


def test_write_report_to_a_directory_or_a_file(tmp_path):
    path = write_report(_record(), tmp_path / "new" / "dir")
    assert path == tmp_path / "new" / "dir" / "attention.html" and path.read_text().startswith("<!DOCTYPE html>")
    assert write_report([_record()], tmp_path / "mine.html") == tmp_path / "mine.html"


def test_bad_records_are_refused():
    with pytest.raises(ValueError, match="records: got none"):
        render_report([])
    with pytest.raises(TypeError, match="records: item 1 is a Tensor"):
        render_report([_record(), torch.zeros(1, 1, 2, 2)])


def test_many_sentences_show_a_progress_bar_on_stderr(capsys):
    render_report([_record(seed=i) for i in range(5)])
    err = capsys.readouterr().err
    assert "encoding attention [" in err and "5/5" in err and err.endswith("\n")
    render_report([_record()])
    assert capsys.readouterr().err == ""


def test_progress_yields_everything_and_counts():
    stream = io.StringIO()
    assert list(progress(iter(range(7)), total=7, label="texts", stream=stream)) == list(range(7))
    text = stream.getvalue()
    assert text.startswith("\rtexts [") and "] 7/7 " in text and "#" * 30 in text
    silent = io.StringIO()
    assert list(progress(range(3), stream=silent)) == [0, 1, 2] and silent.getvalue() == ""
