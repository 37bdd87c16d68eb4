"""The ``"torch"`` backend: ``F.scaled_dot_product_attention`` with attnkit's semantics.

The translation is exact: ``is_causal=True`` only where SDPA's top-left causal equals
attnkit's bottom-right one (``Lq == Lk`` and no other mask), a dense mask otherwise; GQA via
``enable_gqa``; the explicit ``scale``; dropout drawn from ``generator`` when one is given.
SDPA returns no weights: calls that ask for them take the materialised path of
:mod:`.fused_weights` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from .._call import AttentionCall
from .empty_rows import give_empty_rows_a_key
from .fused_weights import fused_weights_attention

# Device types whose SDPA kernels already return zeros (and finite gradients) for query rows
# with no allowed key; verified by the test suite for torch >= 2.5 on CPU. Elsewhere such
# rows are given a harmless key to attend and their output is zeroed afterwards.
EMPTY_ROWS_GIVE_ZEROS = {"cpu"}


@contextmanager
def _rng_from(generator: torch.Generator | None, device: torch.device) -> Iterator[None]:
    """Run SDPA's dropout from ``generator``: SDPA itself only draws from the global RNG."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
    else:
        module = torch.get_device_module(device.type)
        with torch.random.fork_rng(devices=[device], device_type=device.type), module.device(device):
            module.manual_seed(seed)
            yield


def torch_attention(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    if call.return_weights:
        return fused_weights_attention(call)
    query, key, value = call.query, call.key, call.value
    if call.causal and call.mask is None and call.q_len == call.k_len:
        attn_mask, is_causal = None, True
    else:
        attn_mask, is_causal = call.dense_mask(), False

    no_key = None
    if attn_mask is not None and query.device.type not in EMPTY_ROWS_GIVE_ZEROS:
        attn_mask, no_key = give_empty_rows_a_key(attn_mask)

    with _rng_from(call.generator if call.dropout > 0 else None, query.device):
        output = F.scaled_dot_product_attention(
            query, key, value,
            attn_mask=attn_mask,
            dropout_p=call.dropout,
            is_causal=is_causal,
            scale=call.scale,
            enable_gqa=call.is_gqa,
        )
    if no_key is not None:
        output = output.masked_fill(no_key, 0.0)
    return output, None
