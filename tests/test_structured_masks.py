"""Structured masks against their definitions, written out independently in tests/strategies.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit._backends import tiled_plan
from attnkit import masks
from strategies import mask_cases

BATCH = 3


@given(case=mask_cases(batch=BATCH), lq=st.integers(0, 30), lk=st.integers(0, 30))
def test_dense_form_matches_the_definition(case, lq, lk):
    expected = case.allowed(lq, lk)
    dense = case.mask.dense(lq, lk)
    if case.mask.batch_size is None:
        assert dense.shape == (lq, lk)
        dense = dense[None]
    else:
        assert dense.shape == (case.mask.batch_size, 1, lq, lk)  # broadcasts against [B, H, Lq, Lk]
        dense = dense[:, 0]
    assert dense.dtype == torch.bool
    assert torch.equal(dense.expand_as(expected), expected.expand_as(dense))


@given(case=mask_cases(batch=BATCH), lq=st.integers(1, 30), lk=st.integers(0, 30), data=st.data())
def test_key_ranges_of_a_block_hold_exactly_the_attended_keys(case, lq, lk, data):
    q_start = data.draw(st.integers(0, lq - 1))
    q_stop = data.draw(st.integers(q_start + 1, lq))
    allowed = case.allowed(lq, lk).expand(BATCH, lq, lk)[:, q_start:q_stop]  # every sequence's rows
    ranges = tiled_plan.key_ranges(case.mask, q_start, q_stop, lq, lk)
    inside = torch.zeros(lk, dtype=torch.bool)
    for previous, current in zip(ranges, ranges[1:]):
        assert previous.stop <= current.start  # sorted, disjoint
    for r in ranges:
        assert 0 <= r.start < r.stop <= lk
        inside[r.start:r.stop] = True
        if r.full:
            assert allowed[:, :, r.start:r.stop].all()
    assert not allowed[:, :, ~inside].any(), "a key outside every range is attended"
    attended = allowed.flatten(0, 1).any(0)
    if ranges:  # tight: the union starts and ends on attended keys
        assert attended[ranges[0].start] and attended[ranges[-1].stop - 1]
    else:
        assert not attended.any()


def test_drawings_match_the_docstring_pictures():
    assert masks.causal().to_string(3, 5) == "# # # . .\n# # # # .\n# # # # #"
    assert masks.causal().to_string(4, 2).splitlines() == [". .", ". .", "# .", "# #"]
    assert masks.sliding_window(3).to_string(5).splitlines()[3] == ". # # # ."
    assert masks.sliding_window(2, causal=False).to_string(5).splitlines()[0] == "# # . . ."
    assert masks.document([2, 3]).to_string(5).splitlines() == [
        "# # . . .", "# # . . .", ". . # # #", ". . # # #", ". . # # #"]
    assert masks.prefix_lm(2).to_string(5).splitlines()[:3] == ["# # . . .", "# # . . .", "# # # . ."]
    assert masks.padding([3]).to_string(3, 5) == "sequence 0:\n# # # . .\n# # # . .\n# # # . ."
    both = masks.sliding_window(3) & masks.document([4, 4])
    assert both.to_string(8, block_size=4) == "+ .\n. +"
    assert masks.causal().to_string(8, block_size=4) == "+ .\n# +"
    assert repr(both) == "sliding_window(3) & document([4, 4])"
    per_sequence = masks.padding(torch.tensor([1, 2])).to_string(1, 2)
    assert per_sequence == "sequence 0:\n# .\nsequence 1:\n# #"


def test_per_sequence_masks_broadcast_over_heads_and_need_a_batch():
    pad = masks.padding(torch.tensor([2, 4]))
    assert pad.dense(3, 5).shape == (2, 1, 3, 5)
    assert pad.dense(3, 5, ndim=3).shape == (2, 3, 5)
    assert masks.padding(4).dense(3, 5, ndim=2).shape == (3, 5)  # one sequence: fits 2-D calls
    with pytest.raises(ValueError, match=r"holds 2 sequences.*ndim >= 3"):
        pad.dense(3, 5, ndim=2)
    scores = torch.zeros(2, 8, 3, 5)
    assert (scores + pad.dense(3, 5)).shape == scores.shape
    assert (pad & masks.causal()).batch_size == 2


@pytest.mark.parametrize("build, error, pattern", [
    (lambda: masks.sliding_window(0), ValueError, r"size must be >= 1, got 0"),
    (lambda: masks.sliding_window(2.5), TypeError, r"size must be an int, got float"),
    (lambda: masks.document([2, -1]), ValueError, r"lengths must be >= 0, got \[2, -1\]"),
    (lambda: masks.document(), TypeError, r"either lengths .* or ids"),
    (lambda: masks.document(ids=torch.tensor([0, 1, 0])), ValueError, r"contiguous runs.*\[0, 1, 0\]"),
    (lambda: masks.document(ids=torch.zeros(2, 2, 2, dtype=torch.long)), TypeError, r"\[T\] or \[B, T\].*\(2, 2, 2\)"),
    (lambda: masks.prefix_lm(-1), ValueError, r"prefix_length must be >= 0, got -1"),
    (lambda: masks.padding(torch.tensor([1.5])), TypeError, r"lengths must be an int or a 1-D sequence of ints \[B\], got a torch.float32 tensor"),
    (lambda: masks.padding([1, 2]) & masks.padding([1, 2, 3]), ValueError, r"different numbers of sequences \[2, 3\]"),
], ids=["window 0", "window float", "negative document", "no document", "non-contiguous ids", "3-D ids",
        "negative prefix", "float padding", "batch mismatch"])
def test_bad_masks_raise_clear_errors(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


def test_attention_rejects_a_mask_for_another_batch():
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match=r"padding\(\[1, 2, 3\]\) describes 3 sequences.*\(2, 4, 5, 8\).*\[2, \.\.\.\]"):
        attnkit.attention(q, q, q, mask=masks.padding([1, 2, 3]))
    with pytest.raises(ValueError, match=r"2-D inputs have no batch"):
        attnkit.attention(q[0, 0], q[0, 0], q[0, 0], mask=masks.padding([1, 2]))


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_every_backend_accepts_structured_masks_as_their_dense_form(backend, rank):
    g = torch.Generator().manual_seed(rank)
    lead = {2: (), 3: (2,), 4: (2, 3)}[rank]
    q, k, v = (torch.randn(*lead, n, 8, generator=g) for n in (7, 9, 9))
    batch = 1 if rank == 2 else 2
    structured = masks.sliding_window(4) & masks.padding(torch.tensor([6, 9][:batch]))
    dense = structured.dense(7, 9, ndim=rank)
    ours = attnkit.attention(q, k, v, mask=structured, backend=backend)
    expected = attnkit.attention(q, k, v, mask=dense, backend="reference")
    torch.testing.assert_close(ours, expected)
    assert dense.sum() < dense.numel()  # the mask really removes keys


def test_plain_causal_reaches_dense_backends_as_the_causal_flag():
    """So SDPA keeps its own causal fast path instead of reading an L x L mask."""
    from attnkit._call import make_call

    q = torch.randn(1, 2, 6, 4)
    call = make_call(q, q, q, mask=masks.causal(), causal=False, scale=None, dropout=0.0, generator=None,
                     return_weights=False).densified()
    assert call.causal and call.mask is None and call.structure is None
    window = make_call(q, q, q, mask=masks.sliding_window(2), causal=True, scale=None, dropout=0.0,
                       generator=None, return_weights=False).densified()
    assert window.causal and torch.equal(window.mask, masks.sliding_window(2).dense(6))


def test_documents_are_stored_by_their_edges_not_per_position():
    """``document(lengths)`` holds O(number of documents): 2**34 positions cost nothing (a mask of
    per-position labels would need 128 GiB), and the rows it gives at a short length are right."""
    import time

    began = time.perf_counter()
    huge = masks.document([2**34, 5])
    assert time.perf_counter() - began < 1.0
    assert huge.edges.numel() == 3
    lo, hi = huge.row_ranges(6, 6)
    assert lo.tolist() == [[[0] * 6]] and hi.tolist() == [[[6] * 6]]
    packed = masks.document(ids=torch.tensor([[4, 4, 9, 9, 9, 9], [1, 2, 2, 2, 2, 2]]))
    assert packed.edges.tolist() == [[0, 2, 6], [0, 1, 6]]
    lo, hi = packed.row_ranges(6, 6)
    assert lo[:, 0].tolist() == [[0, 0, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1]]
    assert hi[:, 0].tolist() == [[2, 2, 6, 6, 6, 6], [1, 6, 6, 6, 6, 6]]


def test_a_small_dense_form_is_built_once_per_mask_object(monkeypatch):
    """A model hands one mask object to every layer: a decoding step's dense mask ``[B, 1, 1, Lk]``
    is built at the first layer and reused (the result unchanged), a prefill's large one is not
    kept alive, and another mask object of the same rule builds its own."""
    built = []
    real = masks.StructuredMask.dense
    monkeypatch.setattr(masks.StructuredMask, "dense",
                        lambda self, *args, **kwargs: built.append(self) or real(self, *args, **kwargs))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    mask = masks.padding([5, 3])
    outputs = [attnkit.attention(q, k, k, mask=mask, backend="torch") for _ in range(3)]
    assert len(built) == 1 and all(torch.equal(out, outputs[0]) for out in outputs)
    assert torch.equal(attnkit.attention(q, k, k, mask=masks.padding([5, 3]), backend="torch"), outputs[0])
    assert len(built) == 2
    built.clear()
    long = torch.randn(1, 1, 1100, 8, generator=g)  # 1100 x 1100 > DENSE_CACHE_LIMIT: built each time
    window = masks.sliding_window(16)
    for _ in range(2):
        attnkit.attention(long, long, long, mask=window, backend="torch")
    assert len(built) == 2


def test_the_row_bounds_are_built_once_per_mask_object_and_shape(monkeypatch):
    """The tiled backend's row bounds are kept per mask object and shape on every device (on the
    CPU they were a sixth of a small window call's time), and per shape for calls with no mask
    object (no mask, ``causal=True``); a new shape or another mask object builds its own, and the
    results do not change."""
    from attnkit._backends import tiled, tiled_plan

    built = []
    real = tiled_plan.intervals
    monkeypatch.setattr(tiled, "intervals", lambda *args: built.append(args) or real(*args))
    real_row_bounds = tiled.row_bounds
    monkeypatch.setattr(tiled, "row_bounds", lambda call: built.append(call) or real_row_bounds(call))
    tiled._unstructured_bounds.cache_clear()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 8, generator=g)
    window = masks.sliding_window(5)
    first = attnkit.attention(q, q, q, mask=window, backend="tiled")
    for _ in range(2):
        assert torch.equal(attnkit.attention(q, q, q, mask=window, backend="tiled"), first)
    assert len(built) == 1
    attnkit.attention(q[:, :, :30], q, q, mask=window, backend="tiled")  # another shape
    attnkit.attention(q, q, q, mask=masks.sliding_window(5), backend="tiled")  # another object
    assert len(built) == 3
    built.clear()
    for causal in (False, True, True, False):
        expected = attnkit.attention(q, q, q, causal=causal, backend="reference")
        torch.testing.assert_close(attnkit.attention(q, q, q, causal=causal, backend="tiled"), expected)
    assert [args[1] for args in built] == [False, True]
    tiled._unstructured_bounds.cache_clear()
