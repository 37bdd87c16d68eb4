"""The ``"torch"`` backend: ``F.scaled_dot_product_attention`` with attnkit's semantics.

The translation is exact: ``is_causal=True`` only where SDPA's top-left causal equals
attnkit's bottom-right one (``Lq == Lk`` and no other mask), a dense mask otherwise; GQA via
``enable_gqa``; the explicit ``scale``. SDPA returns no weights, and its dropout draws its own
pattern from the global RNG: calls that ask for weights or dropout take the materialised path of
:mod:`.fused_weights` instead (attnkit's dropout pattern, the same on every backend). A masked call
whose output came out non-finite is redone by the reference formula when an input holds NaN or inf
or a score could overflow (SDPA lets a masked-out one spread into the row).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _torch_private
from .._call import AttentionCall
from .decode_step import decode_step_attention, serves_decode_step
from .empty_rows import give_empty_rows_a_key
from .fused_weights import fused_weights_attention
from .numerics import all_finite, needs_pairwise, zero_sum_or_non_finite_row
from .reference import reference_attention
from .second_order import twice_differentiable

# Device types whose SDPA kernels already return zeros (and finite gradients) for query rows
# with no allowed key; verified by the test suite for torch >= 2.5 on CPU. Elsewhere such
# rows are given a harmless key to attend and their output is zeroed afterwards.
EMPTY_ROWS_GIVE_ZEROS = {"cpu"}

# Device types where a decoding step (one query row) runs :mod:`.decode_step` (plain ops that give
# the definition, no read of the device) instead of SDPA and the check of its output, which reads
# the output back (on an accelerator, a wait for the queue at every layer). None until a GPU
# measures it: ``benchmarks/transformers.py``'s measurement-only ``attnkit_decode_step`` sets
# {"cuda"} beside "attnkit" and "sdpa" (``cuda_session.sh``'s decode stage). On the CPU SDPA's
# check reads no device and costs less than the ten ops.
DECODE_STEP_DEVICES: frozenset[str] = frozenset()

def _with_alibi_as_mask(call: AttentionCall) -> AttentionCall:
    """The call with its ALiBi bias ``[N, H, Lq, Lk]`` (float32 for half precision) folded into the
    mask, causal included."""
    from .._call import bias_dtype
    from . import layout
    from .reference import alibi_of

    alibi = alibi_of(call).to(bias_dtype(call.query.dtype))
    alibi = alibi.expand(*layout.batch_heads(tuple(call.query.shape)), call.q_len, call.k_len).reshape(call.scores_shape)
    mask = call.dense_mask()
    if mask is not None:
        alibi = alibi.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else alibi + mask
    return replace(call, mask=alibi, causal=False, alibi_slopes=None)


def torch_attention(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    if call.softcap is not None or call.sinks is not None or _torch_private.beyond_first_order():
        # no fused PyTorch kernel soft-caps scores, takes sinks, has forward-mode AD (jvp) or a
        # backward that torch.func can differentiate again: the materialised formula
        output, weights = reference_attention(call)
        return output, weights if call.return_weights else None
    if call.alibi_slopes is not None:  # SDPA takes ALiBi as a dense float32 bias
        call = _with_alibi_as_mask(call)
    if call.return_weights or call.dropout > 0:
        # SDPA draws its dropout from the global RNG with its own pattern: attnkit's pattern
        # (the same on every backend) runs on the materialised path
        output, weights = fused_weights_attention(call)
        return output, weights if call.return_weights else None
    query, key, value = call.query, call.key, call.value
    if query.device.type in DECODE_STEP_DEVICES and serves_decode_step(call):
        return decode_step_attention(call), None
    if call.causal and call.mask is None and call.q_len == call.k_len:
        attn_mask, is_causal = None, True
    else:
        attn_mask, is_causal = call.dense_mask(), False

    no_key = None
    if attn_mask is not None and query.device.type not in EMPTY_ROWS_GIVE_ZEROS:
        attn_mask, no_key = give_empty_rows_a_key(attn_mask)

    if call.is_gqa and call.q_len == 1 and _shared_by_heads(attn_mask):
        output = _one_row_per_head(query, key, value, attn_mask, call.scale)
    else:
        output = F.scaled_dot_product_attention(
            query, key, value,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=call.scale,
            enable_gqa=call.is_gqa,
        )
    if no_key is not None:
        output = output.masked_fill(no_key, 0.0)
    if _may_differ_from_definition(output) and needs_pairwise(query, key, value, call.scale):
        return reference_attention(call)
    if attn_mask is None or not attn_mask.requires_grad:  # a mask's gradient comes from SDPA's backward only
        output = twice_differentiable(output, lambda q, k, v: reference_attention(
            replace(call, query=q, key=k, value=v))[0], query, key, value)
    return output, None


def _may_differ_from_definition(output: Tensor) -> bool:
    """Whether SDPA's ``output`` may differ from the definition, which happens only where an input
    is not finite or a score overflows (the caller then checks the inputs). Two signs, read from the
    output:
    - a non-finite output: with a mask SDPA adds it to the scores, so a masked-out NaN or inf score
      turned its row NaN; without one, a bf16 row with a +inf score came out NaN in only some
      features (``[2, 2, 128, 65]``), where the definition makes the whole row NaN;
    - on the CPU, a row of zeros (read as a row that sums to 0): SDPA's CPU kernel takes its row
      maximum with NaN skipped, so a row whose scores are all NaN, or NaN among -inf, reads as a row
      with no key and gives zeros where the definition gives NaN (torch 2.13: a NaN query row over
      fewer than 8 keys, NaN among -inf scores at any length), and so does a half-precision row
      with a +inf score over 16 keys or more (test_nonfinite.py). An empty row's zeros are right,
      and cost the check of the inputs.
    A finite output with no zero row is right: every non-finite attended score reaches it."""
    if output.device.type in EMPTY_ROWS_GIVE_ZEROS:
        return zero_sum_or_non_finite_row(output)
    return not all_finite(output)


def _shared_by_heads(mask: Tensor | None) -> bool:
    """The mask is the same for every head (absent, or a head dim of 1)."""
    return mask is None or mask.dim() < 3 or mask.shape[-3] == 1


def _one_row_per_head(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """GQA with one query row (a decoding step) as the plain problem it is: the ``G`` heads of a group
    become ``G`` query rows over their one key/value head, ``[B, Hkv, G, D]`` (as transformers'
    ``pack_gqa``). SDPA's GQA path took 1.7x the time for ``[1, 8, 1, 64]`` over 2100 keys of 2 heads."""
    batch, heads, _, _ = query.shape
    kv_heads = key.shape[1]
    rows = query.reshape(batch, kv_heads, heads // kv_heads, query.shape[-1])
    if mask is not None and mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    output = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
    return output.reshape(batch, heads, 1, value.shape[-1])
