"""Validation of an ``attention()`` call, and the checked description handed to backends.

Every malformed call fails here, before any backend runs, with an error that names the
argument, the shape (or dtype, or device) it got and what was expected. Backends can then
assume well-formed input and stay short.
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from . import _torch_private
from . import masks as _masks


#: Per structured mask object, per (Lq, Lk, causal, device): what calls of that shape built from it
#: (the dense form where small, the row bounds on a GPU, FlexAttention's BlockMask). A model passes
#: one mask object to every layer, so each is built once per forward, not once per layer: a
#: decoding step's dense ``[B, 1, 1, Lk]`` took a quarter of an 8-sequence step's time through
#: attnkit on the CPU when each layer rebuilt it. Masks are immutable; the entries go with the mask.
_PER_MASK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The largest dense mask kept (elements, 1 MiB of bools): a prefill's ``L x L`` is not held.
DENSE_CACHE_LIMIT = 1 << 20


def records_graph(*tensors: Tensor | None) -> bool:
    """Whether autograd records a graph through an op on ``tensors``: grad mode on, and one of them
    (None ones skipped) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def built_for(call: AttentionCall, device: torch.device) -> dict | None:
    """The cache entry of the call's structured mask on ``device`` (None: no structured mask to key
    it by, ``torch.compile`` tracing, or a ``torch.func`` transform running, whose levels may
    wrap what is built there and would then find it escaped in a later call)."""
    if call.structure is None or torch.compiler.is_compiling() or _torch_private.functorch_active():
        return None
    return _PER_MASK.setdefault(call.structure, {}).setdefault((call.q_len, call.k_len, call.causal, device), {})


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call. Backends receive this and nothing else.

    Shapes: ``query [..., Lq, Dk]``, ``key [..., Lk, Dk]``, ``value [..., Lk, Dv]``. With 4-D
    inputs ``[B, H, L, D]`` the key/value head count may divide the query head count (GQA).
    ``mask`` is ``None``, a boolean tensor (True = may attend) or a floating additive bias
    (in the query's dtype, float32 for half-precision queries: :func:`bias_dtype`), broadcastable
    to ``[..., Lq, Lk]``. A structured mask
    (:class:`attnkit.masks.StructuredMask`) arrives as ``structure`` with ``mask=None``; backends
    that do not declare ``structured`` receive the call :meth:`densified` instead. Over one query
    row ``causal`` and a plain ``causal()`` structure are dropped (bottom-right, the row sees every
    key). With dropout,
    ``seed`` fixes the pattern (:mod:`attnkit._backends.dropout`: the same on every backend).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    causal: bool
    scale: float
    dropout: float
    generator: torch.Generator | None
    return_weights: bool
    structure: _masks.StructuredMask | None = None
    return_lse: bool = False
    #: The dropout seed (int64 scalar tensor), drawn once per call after validation (None without dropout).
    seed: Tensor | None = None
    #: Score modifiers, applied in this order after the scale: ``softcap * tanh(s / softcap)``, then
    #: ALiBi ``-slope * |p - j|`` (``alibi_slopes`` float32 ``[H]`` or ``[N, H]`` of the folded
    #: ``[N, H, L, D]`` layout), then the mask. ``sinks`` (``[H]``, the bias dtype): one logit per
    #: head in every row's softmax normaliser, with no value.
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    #: What runs the call (:class:`attnkit._backends.policy.Route`), decided once by
    #: :func:`attnkit._backends.resolve` before the backend runs; None until then.
    route: Any = None

    @property
    def q_len(self) -> int:
        return self.query.shape[-2]

    @property
    def k_len(self) -> int:
        return self.key.shape[-2]

    @property
    def is_gqa(self) -> bool:
        """True when 4-D key/value carry fewer heads than the query (grouped-query attention)."""
        # bool(): under torch.jit.trace sizes are traced tensors, and SDPA's enable_gqa takes a bool only
        return self.query.dim() == 4 and bool(self.key.shape[1] != self.query.shape[1])

    @property
    def group_size(self) -> int:
        """How many query heads share one key/value head (1 without GQA)."""
        return self.query.shape[1] // self.key.shape[1] if self.is_gqa else 1

    @property
    def modifies_scores(self) -> bool:
        """Soft-capping, ALiBi or sinks are asked for (SDPA has none of them fused)."""
        return self.softcap is not None or self.alibi_slopes is not None or self.sinks is not None

    @property
    def needs_grad(self) -> bool:
        """Whether a backward may run through the call: grad mode on, and the query, key, value or
        a floating mask requires grad."""
        floating_mask = self.mask if self.mask is not None and self.mask.is_floating_point() else None
        return records_graph(self.query, self.key, self.value, floating_mask)

    @property
    def scores_shape(self) -> torch.Size:
        """Shape of the score/weight matrix: ``[..., Lq, Lk]`` with the query's batch dims."""
        return self.query.shape[:-1] + (self.k_len,)

    def dense_mask(self) -> Tensor | None:
        """The explicit mask combined with ``causal`` (bottom-right), or None if neither is set.

        Boolean when ``mask`` is boolean or absent, additive (:func:`bias_dtype`) when ``mask`` is floating.
        Broadcastable to ``scores_shape``; not expanded, so no ``Lq x Lk`` copy per batch/head.
        """
        if not self.causal:
            return self.mask
        causal = _masks.causal_mask(self.q_len, self.k_len, device=self.query.device)
        return _masks.combine(self.mask, causal, dtype=bias_dtype(self.query.dtype))

    def densified(self) -> AttentionCall:
        """The same call with a structured mask replaced by its dense boolean form: what backends
        that do not understand structure receive (the one place where structure becomes L x L).
        A plain ``causal()`` becomes ``causal=True``, which keeps fused kernels' causal fast path."""
        if self.structure is None:
            return self
        if self.structure.is_causal:
            return replace(self, structure=None, causal=True)
        return replace(self, structure=None, mask=self._dense_structure())

    def _dense_structure(self) -> Tensor:
        """The structured mask's dense form, kept per mask object (:func:`built_for`) where it is at
        most :data:`DENSE_CACHE_LIMIT` elements."""
        ndim, device = self.query.dim(), self.query.device
        cache = built_for(self, device)
        if cache is not None and ("dense", ndim) in cache:
            return cache["dense", ndim]
        dense = self.structure.dense(self.q_len, self.k_len, ndim=ndim, device=device)
        if cache is not None and dense.numel() <= DENSE_CACHE_LIMIT:
            cache["dense", ndim] = dense
        return dense


def _new_call(values: dict[str, Any]) -> AttentionCall:
    """An :class:`AttentionCall` holding ``values`` (every field), built without the frozen
    dataclass's ``__init__``: it sets each of the 16 fields through ``object.__setattr__``, which
    was a sixth of a decoding step's time in :func:`attnkit.attention` (``[8, 4, 1, 16]`` over 100
    keys on the CPU). The instance is an ordinary frozen one (equality, ``replace``). While
    ``torch.compile`` traces, the constructor runs as written: Dynamo follows dataclasses, not
    writes to an object's ``__dict__``."""
    if torch.compiler.is_compiling():
        return AttentionCall(**values)
    call = object.__new__(AttentionCall)
    call.__dict__.update(values)
    return call


def with_fields(call: AttentionCall, **changes: Any) -> AttentionCall:
    """``dataclasses.replace(call, **changes)`` for already validated values, at a fifth of its
    cost (see :func:`_new_call`)."""
    if torch.compiler.is_compiling():
        return replace(call, **changes)
    unknown = changes.keys() - call.__dict__.keys()
    if unknown:
        raise TypeError(f"AttentionCall has no field {sorted(unknown)[0]!r}")
    return _new_call({**call.__dict__, **changes})


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32, float64), got {t.dtype}"
        )
    if t.dim() < 2:
        raise ValueError(
            f"{name} must have at least 2 dims [..., L, D], got shape {_shape(t)}"
        )
    return t


def _check_shapes(query: Tensor, key: Tensor, value: Tensor) -> None:
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(
            "query, key and value must have the same number of dims, got shapes "
            f"query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key's last dim (Dk) must equal query's: expected key [..., Lk, {query.shape[-1]}], "
            f"got key {_shape(key)} with query {_shape(query)}"
        )
    if query.shape[-1] == 0:
        raise ValueError(f"query and key need a feature dim Dk >= 1, got query {_shape(query)}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"value must have as many rows (Lk) as key: expected value [..., {key.shape[-2]}, Dv], "
            f"got value {_shape(value)} with key {_shape(key)}"
        )
    if key.shape[:-2] != value.shape[:-2]:
        raise ValueError(
            f"key and value must have the same leading dims, got key {_shape(key)} "
            f"and value {_shape(value)}"
        )
    if query.dim() == 4:
        batch, heads = query.shape[0], query.shape[1]
        kv_batch, kv_heads = key.shape[0], key.shape[1]
        if kv_batch != batch:
            raise ValueError(
                f"key/value batch size must equal query's: expected key [{batch}, Hkv, Lk, Dk], "
                f"got key {_shape(key)} with query {_shape(query)}"
            )
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(
                f"grouped-query attention needs the query's heads ({heads}) to be a multiple of "
                f"key/value's heads ({kv_heads}): got query {_shape(query)}, key {_shape(key)}"
            )
    elif key.shape[:-2] != query.shape[:-2]:
        raise ValueError(
            f"key/value leading dims must equal query's {tuple(query.shape[:-2])} (no implicit "
            f"broadcasting), got key {_shape(key)} with query {_shape(query)}"
        )


def _check_same_dtype_device(query: Tensor, key: Tensor, value: Tensor) -> None:
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "query, key and value must share one dtype, got "
            f"query {query.dtype}, key {key.dtype}, value {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            "query, key and value must be on one device, got "
            f"query {query.device}, key {key.device}, value {value.device}"
        )


def _check_structure(structure: _masks.StructuredMask, query: Tensor) -> None:
    """A per-sequence mask must describe one sequence or as many as the batch (dim 0 of 3-D/4-D)."""
    sequences = structure.batch_size
    batch = query.shape[0] if query.dim() >= 3 else 1
    if sequences not in (None, 1, batch):
        expected = f"[{batch}, ...]" if query.dim() >= 3 else "a single sequence (2-D inputs have no batch)"
        raise ValueError(
            f"mask {structure!r} describes {sequences} sequences but the query {_shape(query)} "
            f"has batch {expected}"
        )


def _check_mask(mask: object, query: Tensor, scores_shape: torch.Size) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"mask must be None or a torch.Tensor (bool: True = may attend, or a floating "
            f"additive bias) or a structured mask from attnkit.masks, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = may attend) or floating (additive bias), got {mask.dtype}; "
            "for a 0/1 integer mask pass mask.bool()"
        )
    if mask.device != query.device:
        raise ValueError(f"mask must be on the query's device {query.device}, got {mask.device}")
    expected = tuple(scores_shape)
    got = _shape(mask)
    broadcasts = len(got) <= len(expected) and all(
        m in (1, e) for m, e in zip(reversed(got), reversed(expected))
    )
    if not broadcasts:
        raise ValueError(
            f"mask of shape {got} does not broadcast to the scores' shape [..., Lq, Lk] = {expected}"
        )
    if mask.is_floating_point() and mask.dtype != bias_dtype(query.dtype):
        mask = mask.to(bias_dtype(query.dtype))
    return mask


def bias_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an additive mask is kept in: the inputs' own, but float32 for half-precision
    inputs, whose scores are biased in float32 (as SDPA and FlashAttention do: a bf16 ALiBi-style
    bias rounds logits by up to 0.25 at L = 256)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if type(scale) is float and math.isfinite(scale):  # the common case, without the ABC check below
        return scale
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _check_dropout(dropout: object, generator: object, device: torch.device) -> float:
    if generator is None and (dropout == 0.0 and type(dropout) in (float, int)):  # the common case: no dropout
        return 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__}")
    dropout = float(dropout)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != device.type:
            raise ValueError(
                f"generator must be on the inputs' device type {device.type!r}, got {generator.device}"
            )
    return dropout


def _check_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive real number or None, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be positive and finite, got {softcap}")
    return softcap


def _check_per_head(name: str, values: object, query: Tensor, allow_batch: bool) -> Tensor | None:
    """``[H]`` (or ``[N, H]`` when ``allow_batch``) float values of the query's folded heads, on its
    device, in :func:`bias_dtype`."""
    if values is None:
        return None
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(values).__name__}")
    if not values.is_floating_point():
        raise TypeError(f"{name} must be floating, got {values.dtype}")
    if values.device != query.device:
        raise ValueError(f"{name} must be on the query's device {query.device}, got {values.device}")
    lead = tuple(query.shape[:-2])
    batch, heads = (lead[0] if lead else 1), math.prod(lead[1:])
    shapes = [(heads,)] + ([(batch, heads)] if allow_batch else [])
    if tuple(values.shape) not in shapes:
        expected = " or ".join(str(list(shape)) for shape in shapes)
        raise ValueError(
            f"{name} must be {expected} (one value per head of query {_shape(query)}), got {_shape(values)}")
    return values.to(bias_dtype(query.dtype))


def make_call(
    query: object,
    key: object,
    value: object,
    *,
    mask: object,
    causal: object,
    scale: object,
    dropout: object,
    generator: object,
    return_weights: object,
    return_lse: object = False,
    softcap: object = None,
    alibi_slopes: object = None,
    sinks: object = None,
) -> AttentionCall:
    """Validate the arguments of ``attention()`` and return the normalised call."""
    query = _check_tensor("query", query)
    key = _check_tensor("key", key)
    value = _check_tensor("value", value)
    _check_same_dtype_device(query, key, value)
    _check_shapes(query, key, value)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    scores_shape = query.shape[:-1] + (key.shape[-2],)
    # Bottom-right causal over one query row (a decoding step) is every key: no constraint, so
    # no backend builds a mask or plans for it.
    one_row = query.shape[-2] == 1
    structure = None
    if isinstance(mask, _masks.StructuredMask):
        _check_structure(mask, query)
        structure, mask = (None if one_row and mask.is_causal else mask), None
    return _new_call(dict(
        query=query,
        key=key,
        value=value,
        mask=_check_mask(mask, query, scores_shape),
        causal=causal and not one_row,
        scale=_check_scale(scale, query.shape[-1]),
        dropout=_check_dropout(dropout, generator, query.device),
        generator=generator,
        return_weights=return_weights,
        structure=structure,
        return_lse=return_lse,
        seed=None,
        softcap=_check_softcap(softcap),
        alibi_slopes=_check_per_head("alibi_slopes", alibi_slopes, query, allow_batch=True),
        sinks=_check_per_head("sinks", sinks, query, allow_batch=False),
        route=None,
    ))
