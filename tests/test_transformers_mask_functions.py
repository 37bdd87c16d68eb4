"""attnkit recognises transformers' mask functions by identity and by the closures they are made from
(``integrations/transformers._rule_of``), never by calling them. That is only safe while the installed
transformers ships the functions attnkit knows: this file enumerates **every** mask function and
overlay of ``transformers.masking_utils``, so a release that adds, renames or rebuilds one fails here
rather than in a user's model. Each is checked both ways: a recognised one must equal its rule at
several lengths and cache offsets; an unrecognised one must run densely (transformers' own
``sdpa_mask``) and still equal the function."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

from attnkit import masks  # noqa: E402
from attnkit.integrations import transformers as integration  # noqa: E402

BATCH, HEADS = 2, 1
IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3] * 2,
                    [0] * 10 + [1] * 8 + [-1] * 18])
PADDING = torch.ones(BATCH, 36, dtype=torch.bool)
PADDING[1, :5] = False

#: name -> (how to make one, the rule attnkit reads from it: (kind, window), or None for "runs densely").
#: A mask function transformers adds must be added here, with what attnkit does with it.
KNOWN = {
    "causal_mask_function": (lambda: mu.causal_mask_function, ("causal", None)),
    "bidirectional_mask_function": (lambda: mu.bidirectional_mask_function, ("bidirectional", None)),
    "sliding_window_causal_mask_function": (lambda: mu.sliding_window_causal_mask_function(5), ("causal", 5)),
    "sliding_window_bidirectional_mask_function": (lambda: mu.sliding_window_bidirectional_mask_function(3),
                                                   ("bidirectional", 3)),
    # overlays alone are no rule attnkit has; combined with a base (above) they are
    "sliding_window_overlay": (lambda: mu.sliding_window_overlay(5), None),
    "sliding_window_bidirectional_overlay": (lambda: mu.sliding_window_bidirectional_overlay(3), None),
    "chunked_overlay": (lambda: mu.chunked_overlay(4, torch.zeros(BATCH, dtype=torch.long)), None),
    "chunked_causal_mask_function": (lambda: mu.chunked_causal_mask_function(4, torch.zeros(BATCH, dtype=torch.long)),
                                     None),
    "padding_mask_function": (lambda: mu.padding_mask_function(PADDING), None),
    "packed_sequence_mask_function": (lambda: mu.packed_sequence_mask_function(IDS.clamp(min=0)), None),
    "blockwise_overlay": (lambda: mu.blockwise_overlay(IDS), None),
    "add_offsets_to_mask_function": (lambda: mu.add_offsets_to_mask_function(mu.causal_mask_function, 3, 1), None),
}


def _shipped() -> set[str]:
    """Every function of transformers.masking_utils that is, or makes, a mask function."""
    return {name for name, value in vars(mu).items()
            if callable(value) and getattr(value, "__module__", None) == mu.__name__
            and re.search(r"(_mask_function|_overlay)$", name)}


def test_every_mask_function_transformers_ships_is_known():
    shipped = _shipped()
    assert shipped == set(KNOWN), (
        f"transformers {transformers.__version__} ships mask functions attnkit does not know: "
        f"{sorted(shipped - set(KNOWN))}; gone: {sorted(set(KNOWN) - shipped)}")


def _evaluated(function, q_length: int, kv_length: int, q_offset: int) -> torch.Tensor:
    """The function itself over the grid, ``[B, 1, Lq, Lk]`` (positions in the cache's frame)."""
    b = torch.arange(BATCH)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q = torch.arange(q_length)[None, None, :, None] + q_offset
    kv = torch.arange(kv_length)[None, None, None, :]
    return torch.as_tensor(function(b, h, q, kv)).expand(BATCH, 1, q_length, kv_length)


def _dense(mask, q_length, kv_length) -> torch.Tensor:
    if isinstance(mask, masks.StructuredMask):
        return mask.dense(q_length, kv_length, ndim=4).expand(BATCH, 1, q_length, kv_length)
    return mask.expand(BATCH, 1, q_length, kv_length)


@pytest.mark.parametrize("name", sorted(KNOWN))
@pytest.mark.parametrize("q_length, kv_length, q_offset", [(12, 12, 0), (5, 17, 12), (1, 36, 35), (7, 30, 4)])
def test_each_mask_function_runs_as_its_rule_or_densely_and_equals_itself(name, q_length, kv_length, q_offset):
    make, rule = KNOWN[name]
    function = make()
    assert integration._rule_of(function) == rule
    built = integration.attnkit_mask(BATCH, q_length, kv_length, q_offset=q_offset, mask_function=function)
    expected = _evaluated(function, q_length, kv_length, q_offset)
    if rule is not None and q_length > 1:  # a rule (None: no mask at all), never an L x L tensor
        assert not isinstance(built.mask, torch.Tensor), name
    got = torch.ones(BATCH, 1, q_length, kv_length, dtype=torch.bool) if built.mask is None else \
        _dense(built.mask, q_length, kv_length)
    assert torch.equal(got, expected), name
