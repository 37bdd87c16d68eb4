"""``attention()``: the one functional core. Layers and models call it; backends plug in behind it."""

from __future__ import annotations

import torch
from torch import Tensor

from dataclasses import replace

from . import _backends, _steps
from ._backends import dropout as _dropout
from ._autocast import follows_autocast
from ._call import AttentionCall, make_call, with_fields
from .masks import StructuredMask


@follows_autocast
def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | StructuredMask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
    backend: str = "auto",
    return_lse: bool = False,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, ...]:
    r"""Scaled dot-product attention: ``softmax(query @ key^T * scale + mask) @ value``.

    Args:
        query: ``[..., Lq, Dk]``, any number of leading dims (2-D ``[Lq, Dk]`` to 6-D and beyond).
        key: ``[..., Lk, Dk]``. With 4-D ``[B, H, L, D]`` inputs, key and value may have
            ``Hkv`` heads where ``H % Hkv == 0`` (grouped-query attention: query head ``h``
            reads key/value head ``h // (H // Hkv)``). Otherwise the leading dims equal query's.
        value: ``[..., Lk, Dv]``; ``Dv`` may differ from ``Dk``.
        mask: ``None``, a **boolean mask (True = may attend)**, or a floating additive bias
            (``-inf`` removes a key), broadcastable to ``[..., Lq, Lk]``; or a structured mask
            from :mod:`attnkit.masks` (``causal()``, ``sliding_window(512)``, ``document(...)``,
            ``prefix_lm(...)``, ``padding(...)`` and their ``&``), which the ``"tiled"`` backend
            uses to skip masked blocks and every other backend receives in dense form.
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
            pass it only in training. Which weights are dropped is a function of one seed drawn
            per call and the weight's position (batch, head, row, key), the same on every backend,
            kernel and device: the same ``generator`` state gives the same result everywhere.
        generator: the random source of the dropout seed (on the inputs' device type); with one,
            the global RNG is neither read nor reseeded. ``torch.compile`` cannot trace a
            generator: under ``fullgraph=True`` pass ``None`` (the seed then comes from the
            global RNG).
        return_weights: also return the weights ``[..., Lq, Lk]`` (per query head) that were
            applied to ``value``, after masking and dropout, so ``output == weights @ value``.
        backend: ``"auto"`` (attnkit's policy, ``attnkit._backends.policy``: on the CPU, ``"tiled"`` for a
            structured mask long enough to profit, for ``return_lse``, or for dropout where
            attnkit's native CPU kernel runs; else, and on every other device, ``"torch"``; the
            same choice compiled and eager), ``"reference"`` (the readable formula),
            ``"torch"`` (``F.scaled_dot_product_attention``; with ``return_weights`` or dropout a
            materialised path of fused ops: baddbmm, in-place softmax, bmm) or ``"tiled"``
            (block-sparse, O(L) memory); see :func:`attnkit.backends`. A named backend is never
            replaced, with two documented exceptions that cannot change the result: with no keys
            at all (``Lk = 0``) every row is zeros, computed by the reference formula; and while
            :func:`attnkit.trace.record` listens, calls run the reference backend, the one that
            reports its steps.
        return_lse: also return the log-sum-exp of each row, ``[..., Lq]``: the natural log of
            ``sum_j exp(scale * q.k_j + bias_j)`` over the keys the row may attend, before dropout;
            ``-inf`` for a row with no key; float32 for half-precision inputs. Differentiable.
            It lets partial results over disjoint keys be merged exactly. With ``sinks`` it counts
            the sink too (a row with no key then has lse = its sink).
        softcap: attention-logit soft-capping (Gemma 2): each score becomes
            ``softcap * tanh(score / softcap)``, after the scale and before ALiBi and the mask.
        alibi_slopes: ALiBi (BLOOM, MPT; FlashAttention's ``alibi_slopes``): float ``[H]`` or
            ``[B, H]`` slopes; adds ``-slope * |i + Lk - Lq - j|`` to the score of query ``i`` and key
            ``j``, computed per block, never as an ``Lq x Lk`` tensor on the tiled path.
        sinks: attention sinks (GPT-OSS): a learned logit per query head, float ``[H]``, that joins
            every row's softmax normaliser with no value: it takes probability mass, so the weights
            of a row's keys sum to less than 1. Differentiable.

    Returns:
        ``output [..., Lq, Dv]``; with ``return_weights`` and/or ``return_lse``, a tuple
        ``(output, weights, lse)`` holding the ones asked for, in that order.
        A query row with no key it may attend gives zeros (and zero weights) in every backend,
        with finite gradients; never NaN. A masked-out (query, key) pair contributes nothing,
        whatever its query, key or value hold; NaN and inf in attended pairs propagate (an
        attended NaN or +inf score makes its row NaN), as in the reference backend.
        Under ``torch.autocast`` (CPU or CUDA) the call is treated as autocast treats
        ``F.scaled_dot_product_attention``: float32 inputs run in the autocast dtype and the
        result comes back in it, whatever backend runs.

    Raises:
        TypeError or ValueError: a malformed argument, named with its shape and the one expected
            (a key whose ``Dk`` differs from the query's, a head count that does not divide the
            query's, a mask that does not broadcast, ...).
        ValueError: an unknown ``backend``, or one that cannot do what the call asks (``return_weights``
            or ``return_lse`` where it has none, inputs on a device it does not run on).

    Example:

        >>> import torch
        >>> import attnkit
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))  # [B, H, L, D]
        >>> attnkit.attention(q, k, v, causal=True).shape
        torch.Size([2, 4, 8, 16])
        >>> out, weights = attnkit.attention(q, k, v, mask=attnkit.masks.sliding_window(3),
        ...                                  return_weights=True)
        >>> torch.allclose(out, weights @ v, atol=1e-6)
        True
        >>> (weights[0, 0] > 0).sum(-1)  # keys each query attends: itself and up to 2 before
        tensor([1, 2, 3, 3, 3, 3, 3, 3])

        Grouped-query attention (4 query heads read 2 key/value heads), and a shape error:

        >>> attnkit.attention(q, k[:, :2], v[:, :2]).shape
        torch.Size([2, 4, 8, 16])
        >>> attnkit.attention(q, k[..., :8], v)
        Traceback (most recent call last):
            ...
        ValueError: key's last dim (Dk) must equal query's: expected key [..., Lk, 16],
        got key (2, 4, 8, 8) with query (2, 4, 8, 16)

        Bottom-right causal with fewer queries than keys, as when decoding after a cache:

        >>> _, weights = attnkit.attention(q[0, 0, :2], k[0, 0, :5], v[0, 0, :5], causal=True,
        ...                                return_weights=True)
        >>> print(attnkit.masks.to_string(weights > 0))
        # # # # .
        # # # # #
    """
    call = make_call(
        query, key, value,
        mask=mask, causal=causal, scale=scale, dropout=dropout,
        generator=generator, return_weights=return_weights, return_lse=return_lse,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
    )
    return _run(call, backend, None)


def attention_piece(query: Tensor, key: Tensor, value: Tensor, *, seed: Tensor | None, heads: int = 0,
                    rows: int = 0, keys: int = 0, backend: str = "auto", **arguments) -> Tensor | tuple[Tensor, ...]:
    """Private (for :mod:`attnkit.distributed`): :func:`attnkit.attention` on a piece of a larger
    call whose query heads start at ``heads``, query rows at ``rows`` and keys at ``keys`` of the
    whole, with the whole call's dropout ``seed`` (int64 scalar, drawn once for the whole): the piece
    draws the whole call's dropout pattern at its own positions
    (``attnkit._backends.dropout.at_positions``). ``arguments`` are :func:`attnkit.attention`'s,
    ``generator`` excepted (the seed is given).

    Args:
        query: the piece's ``[..., Lq, Dk]`` (4-D ``[B, H, Lq, Dk]`` to split heads).
        key: the piece's ``[..., Lk, Dk]``.
        value: the piece's ``[..., Lk, Dv]``.
        seed: the whole call's dropout seed, an int64 tensor of one element; ``None`` without dropout.
        heads, rows, keys: where the piece starts in the whole call: its first query head, query
            row and key.
        backend: as for :func:`attnkit.attention`.

    Returns:
        What :func:`attnkit.attention` returns for the piece: ``output [..., Lq, Dv]``, or a tuple
        with the weights and/or lse asked for.

    Raises:
        TypeError: ``generator`` among the arguments, or dropout with a ``seed`` that is not an int64
            tensor of one element; and every error of :func:`attnkit.attention`.

    Example:

        Two pieces of query rows draw the same dropout as the whole call:

        >>> import torch
        >>> from attnkit.core import attention_piece
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
        >>> seed = torch.tensor(1234)
        >>> whole = attention_piece(q, k, v, seed=seed, dropout=0.5)
        >>> top = attention_piece(q[..., :2, :], k, v, seed=seed, rows=0, dropout=0.5)
        >>> bottom = attention_piece(q[..., 2:, :], k, v, seed=seed, rows=2, dropout=0.5)
        >>> torch.allclose(torch.cat([top, bottom], -2), whole)
        True

        Two pieces of keys merge exactly through their log-sum-exp:

        >>> out1, lse1 = attention_piece(q, k[..., :3, :], v[..., :3, :], seed=None, return_lse=True)
        >>> out2, lse2 = attention_piece(q, k[..., 3:, :], v[..., 3:, :], seed=None, keys=3,
        ...                              return_lse=True)
        >>> lse = torch.logaddexp(lse1, lse2)
        >>> merged = (lse1 - lse).exp()[..., None] * out1 + (lse2 - lse).exp()[..., None] * out2
        >>> torch.allclose(merged, attention_piece(q, k, v, seed=None), atol=1e-6)
        True
    """
    call, seed = _piece(query, key, value, seed, heads, rows, keys, arguments)
    return _run(call, backend, seed)


def piece_gradients(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                    grad_lse: Tensor | None, *, seed: Tensor | None, heads: int = 0, rows: int = 0, keys: int = 0,
                    backend: str = "auto", **arguments) -> tuple[Tensor, Tensor, Tensor]:
    """Private (for :mod:`attnkit.distributed`): the gradients ``(dq, dk, dv)`` (shaped like query,
    key, value) of :func:`attnkit.core.attention_piece` called with the same arguments and
    ``return_lse=True``, from the ``out [..., Lq, Dv]`` and ``lse [..., Lq]`` it returned and their
    gradients (``grad_lse`` None where the lse was not used), without recomputing the forward: the
    backend's ``gradients`` (see :class:`attnkit.Backend`), resolved from ``backend`` as the
    forward's was, with the same dropout pattern.

    Args:
        query, key, value, seed, heads, rows, keys, backend: as for
            :func:`attnkit.core.attention_piece`.
        out: ``[..., Lq, Dv]``, the piece's output.
        lse: ``[..., Lq]``, the piece's log-sum-exp.
        grad_out: ``[..., Lq, Dv]``, the gradient of the output.
        grad_lse: ``[..., Lq]``, the gradient of the lse, or ``None``.

    Returns:
        ``(grad_query, grad_key, grad_value)``, shaped like ``query``, ``key`` and ``value``.

    Raises:
        ValueError: the backend returns no lse or has no backward from its output and lse (only
            ``"tiled"`` has one); and the errors of :func:`attnkit.core.attention_piece`.

    Example:

        >>> import torch
        >>> from attnkit.core import attention_piece, piece_gradients
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 4, 8, generator=g, requires_grad=True) for _ in range(3))
        >>> out, lse = attention_piece(q, k, v, seed=None, return_lse=True)
        >>> grad_out = torch.randn(out.shape, generator=g)
        >>> grads = piece_gradients(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
        ...                         grad_out, None, seed=None)
        >>> [g.shape for g in grads]
        [torch.Size([1, 2, 4, 8]), torch.Size([1, 2, 4, 8]), torch.Size([1, 2, 4, 8])]
        >>> expected = torch.autograd.grad((out * grad_out).sum(), (q, k, v))
        >>> all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, expected))
        True
    """
    call, seed = _piece(query, key, value, seed, heads, rows, keys, {**arguments, "return_lse": True})
    chosen, route = _backends.resolve(backend, call)
    call = replace(call, route=route)
    if chosen.gradients is None:
        raise ValueError(f"backend {chosen.name!r} has no backward from its output and lse")
    if not chosen.structured:
        call = call.densified()
    if seed is not None:
        call = replace(call, seed=seed)
    return chosen.gradients(call, out, lse, grad_out, grad_lse)


def _piece(query: Tensor, key: Tensor, value: Tensor, seed: Tensor | None, heads: int, rows: int, keys: int,
           arguments: dict) -> tuple[AttentionCall, Tensor | None]:
    """The validated call of a piece and its dropout seed placed at the piece's positions."""
    if "generator" in arguments:
        raise TypeError("attention_piece takes the whole call's seed, not a generator")
    call = make_call(query, key, value, **{"mask": None, "causal": False, "scale": None, "dropout": 0.0,
                                           "generator": None, "return_weights": False, **arguments})
    if call.dropout > 0:
        if not (isinstance(seed, Tensor) and seed.dtype == torch.int64 and seed.numel() == 1):
            raise TypeError(f"seed must be an int64 tensor of one element with dropout, got {seed!r}")
        seed = _dropout.at_positions(seed.to(call.query.device), heads, rows, keys)
    return call, seed


def _run(call, backend: str, seed: Tensor | None) -> Tensor | tuple[Tensor, ...]:
    """Run a validated call; ``seed``: the dropout seed when given (else one is drawn)."""
    return_weights, return_lse = call.return_weights, call.return_lse
    chosen, route = _backends.resolve(backend, call)
    call = with_fields(call, route=route)
    if call.dropout > 0:  # drawn only once the call is valid: a failed call leaves the generator alone
        if seed is None:
            seed = _dropout.draw_seed(call.generator, call.query.device)
        call = with_fields(call, seed=seed)
    tracing = _steps.active() and not return_lse
    if (call.k_len == 0 and not return_lse) or tracing:
        # No keys at all (every row is empty), or a trace is listening: the readable formula
        # handles the first directly and is the one backend that reports its steps.
        chosen = _backends.get_backend("reference")
    if not chosen.structured:
        call = call.densified()
    if tracing:
        with _steps.group(None):
            for name, tensor in (("queries", call.query), ("keys", call.key), ("values", call.value)):
                _steps.record(name, tensor)
            output, weights, *lse = chosen.run(call)
    else:
        output, weights, *lse = chosen.run(call)
    extras = ([weights] if return_weights else []) + (lse if return_lse else [])
    return (output, *extras) if extras else output
