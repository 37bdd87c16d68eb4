"""``attention()``: the one functional core. Layers and models call it; backends plug in behind it."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _backends, _steps
from ._call import make_call


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Scaled dot-product attention: ``softmax(query @ key^T * scale + mask) @ value``.

    Args:
        query: ``[..., Lq, Dk]``.
        key: ``[..., Lk, Dk]``. With 4-D ``[B, H, L, D]`` inputs, key and value may have
            ``Hkv`` heads where ``H % Hkv == 0`` (grouped-query attention: query head ``h``
            reads key/value head ``h // (H // Hkv)``). Otherwise the leading dims equal query's.
        value: ``[..., Lk, Dv]``; ``Dv`` may differ from ``Dk``.
        mask: ``None``, a **boolean mask (True = may attend)**, or a floating additive bias
            (``-inf`` removes a key), broadcastable to ``[..., Lq, Lk]``.
        causal: query ``i`` sees only keys ``j <= i + Lk - Lq`` (**bottom-right** aligned, as
            KV-cache decoding needs); intersected with ``mask``. For ``Lq=2, Lk=5`` and
            ``Lq=5, Lk=2`` (``#`` may attend)::

                # # # # .        . .   (rows with no key
                # # # # #        . .    give zeros)
                                 . .
                                 # .
                                 # #

        scale: multiplies the scores; default ``1 / sqrt(Dk)``.
        dropout: probability of zeroing each weight (the rest are scaled by ``1/(1-p)``);
            pass it only in training. Reproducible with ``generator``.
        generator: the random source of dropout (on the inputs' device type).
        return_weights: also return the weights ``[..., Lq, Lk]`` (per query head) that were
            applied to ``value``, after masking and dropout, so ``output == weights @ value``.
        backend: ``"auto"`` (currently ``"torch"``), ``"reference"`` (the readable formula) or
            ``"torch"`` (``F.scaled_dot_product_attention``; with ``return_weights`` a
            materialised path of fused ops: baddbmm, in-place softmax, bmm); see
            :func:`attnkit.backends`.

    Returns:
        ``output [..., Lq, Dv]``, or ``(output, weights)`` when ``return_weights=True``.
        A query row with no key it may attend gives zeros (and zero weights) in every backend,
        with finite gradients; never NaN.

    Raises:
        TypeError / ValueError naming the offending argument, its shape and the one expected.
    """
    call = make_call(
        query, key, value,
        mask=mask, causal=causal, scale=scale, dropout=dropout,
        generator=generator, return_weights=return_weights,
    )
    chosen = _backends.resolve(backend, call)
    if call.k_len == 0 or _steps.active():
        # No keys at all (every row is empty), or a trace is listening: the readable formula
        # handles the first directly and is the one backend that reports its steps.
        chosen = _backends.get_backend("reference")
    if _steps.active():
        with _steps.group(None):
            for name, tensor in (("queries", call.query), ("keys", call.key), ("values", call.value)):
                _steps.record(name, tensor)
            output, weights = chosen.run(call)
    else:
        output, weights = chosen.run(call)
    if return_weights:
        assert weights is not None
        return output, weights
    return output
