"""Hugging Face transformers on attnkit: ``attn_implementation="attnkit"``.

Importing this module registers the name ``"attnkit"`` twice in transformers: as an attention
function (``AttentionInterface``) and as a mask builder (``AttentionMaskInterface``). Then every
attention call of a model goes through :func:`attnkit.attention`::

    import attnkit.integrations.transformers          # registers "attnkit"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")
    model.set_attn_implementation("attnkit")          # or switch a loaded model

**Masks stay rules.** transformers describes a mask as a rule (a mask function such as causal or
causal-with-a-window, the query and key offsets given by the cache, and the 2-D padding mask) and
asks the registered mask builder to turn it into whatever the attention function wants. Here it
becomes an attnkit structured mask (:mod:`attnkit.masks`), never an ``Lq x Lk`` tensor:

=====================================  =================================================
transformers gives                     attnkit receives
=====================================  =================================================
causal, queries level with the keys    ``masks.causal()`` (bottom-right aligned)
causal + sliding window ``w``          ``masks.sliding_window(w)``
bidirectional (encoders)               no mask; ``sliding_window(w, w)`` with a window
queries not level with the keys        ``masks.key_ranges(lo, hi)`` per query row (O(Lq))
(a static cache longer than its
filled part, a rolling window cache)
right padding                          ``& masks.padding(lengths)``
left padding (any one run of real      ``& masks.key_ranges(first, last)`` per sequence
keys per sequence)
=====================================  =================================================

attnkit's ``causal`` is aligned **bottom-right** (query ``i`` sees keys ``j <= i + Lk - Lq``), which
is where transformers puts queries when the cache holds exactly the keys before them::

    prompt (Lq = Lk = 4)     decoding (Lq = 1, Lk = 5)     static cache (Lq = 1, Lk = 8, 5 filled)
    # . . .                  # # # # #                     # # # # # . . .   <- key_ranges: the
    # # . .                                                                     unfilled keys are
    # # # .                                                                     never read
    # # # #

Rules attnkit has no structured form for (a packed-sequence mask inferred from ``position_ids``,
chunked attention, image-token overlays, custom ``or``/``and`` mask functions, padding with holes)
are evaluated by transformers' own ``sdpa_mask`` into a boolean ``[B, 1, Lq, Lk]`` tensor: exact,
but dense. A model that hands the attention function a tensor (T5's relative position bias, a
user's 4-D mask) gets it as attnkit's dense mask (a float bias stays an additive float mask).

**Model features go to attnkit's vocabulary:** grouped-query attention natively (key/value keep
their ``Hkv`` heads, no ``repeat_kv``), ``softcap`` (Gemma 2) -> ``softcap=``, ``s_aux`` /
``module.sinks`` (GPT-OSS) -> ``sinks=``, an ``alibi_slopes`` keyword -> ``alibi_slopes=``, the
module's ``scaling`` -> ``scale=``, ``dropout`` while ``module.training`` -> ``dropout=`` (attnkit's
own dropout pattern, drawn from the global RNG: not the one eager's ``nn.functional.dropout``
draws; ``attention_dropout=1.0`` drops every weight: zero output and zero weights, as eager).
``output_attentions=True`` returns attnkit's weights (``return_weights=True``). A keyword
attnkit cannot express is refused with a ``ValueError`` naming it, never ignored.

**Padded query rows.** With left padding in a decoder, a padding query has no real key before
it: attnkit gives its output row **zeros** (and zero weights), where eager attention spreads it
uniformly over masked keys (junk either way; transformers ignores those positions). Real tokens
match eager to float rounding. Right padding in an encoder masks keys only, so padded query rows
attend the real keys in both implementations.

Works eagerly; a static cache's query offset is read with ``int()``, so ``torch.compile`` breaks
the graph there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import masks as _masks
from .._optional import require
from ..core import attention
from ..masks import StructuredMask

_transformers = require("transformers", "attnkit.integrations.transformers", extra="transformers")
from transformers import masking_utils as _masking  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

try:  # the model's output collector: how output_attentions reaches attention functions in recent versions
    from transformers.utils.output_capturing import _active_collector  # noqa: E402
except ImportError:  # pragma: no cover - older transformers pass the keyword
    _active_collector = None

__all__ = ["NAME", "register", "attnkit_attention_forward", "attnkit_mask", "TransformersMask"]

#: The ``attn_implementation`` name this module registers.
NAME = "attnkit"

#: Keywords models pass to every attention function that do not change what attention computes
#: here (bookkeeping, or information the mask already holds: the window is in the mask rule, and
#: FlashAttention's packed lengths restate the mask built from ``position_ids``).
_IGNORED = frozenset({
    "position_ids", "cache_position", "output_attentions", "output_hidden_states", "output_router_logits",
    "num_items_in_batch", "use_cache", "past_key_values", "position_embeddings", "layer_idx",
    "sliding_window", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
    "deterministic", "return_dict", "kernel_options", "is_causal",
})


@dataclass(frozen=True)
class TransformersMask:
    """What the ``"attnkit"`` mask builder hands to a model for one attention call.

    ``mask`` is what :func:`attnkit.attention` receives: a structured mask, a boolean tensor
    ``[B, 1, Lq, Lk]`` (rules attnkit has no structured form for, and a decoding step's one row of
    keys), or None (every key). The object
    answers ``shape``, ``ndim`` (4), ``contiguous()`` and ``to()`` as a 4-D mask would, because
    ``generate()`` builds masks ahead of the model for static caches and passes them back in.
    Frozen; :func:`attnkit.integrations.transformers.attnkit_mask` makes them.

    Example:

        >>> from attnkit import masks
        >>> from attnkit.integrations.transformers import TransformersMask
        >>> built = TransformersMask(masks.causal(), batch_size=2, q_length=3, kv_length=3)
        >>> built.shape, built.ndim
        (torch.Size([2, 1, 3, 3]), 4)
        >>> built.dense()[0, 0]
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """

    mask: StructuredMask | Tensor | None
    batch_size: int
    q_length: int
    kv_length: int

    ndim = 4

    @property
    def shape(self) -> torch.Size:
        """``[B, 1, Lq, Lk]``, the shape of the 4-D mask it stands for (``torch.Size``).

        Example:

            >>> from attnkit import masks
            >>> from attnkit.integrations.transformers import TransformersMask
            >>> TransformersMask(masks.sliding_window(2), batch_size=1, q_length=4, kv_length=6).shape
            torch.Size([1, 1, 4, 6])
        """
        return torch.Size((self.batch_size, 1, self.q_length, self.kv_length))

    def contiguous(self) -> TransformersMask:
        """The mask itself (it holds no tensor to lay out): for callers that treat it as a tensor.

        Example:

            >>> from attnkit.integrations.transformers import TransformersMask
            >>> built = TransformersMask(None, batch_size=1, q_length=2, kv_length=2)
            >>> built.contiguous() is built
            True
        """
        return self

    def to(self, *args: object, **kwargs: object) -> TransformersMask:
        """The mask itself, whatever the arguments (a device or dtype: a structured mask goes with
        the inputs where :func:`attnkit.attention` runs): for callers that treat it as a tensor.

        Example:

            >>> import torch
            >>> from attnkit import masks
            >>> from attnkit.integrations.transformers import TransformersMask
            >>> built = TransformersMask(masks.causal(), batch_size=1, q_length=2, kv_length=2)
            >>> built.to("cpu") is built, built.to(torch.float16) is built
            (True, True)
        """
        return self

    def dense(self, device: torch.device | str | None = None) -> Tensor:
        """The boolean mask ``[B or 1, 1, Lq, Lk]`` (True = may attend), for callers that need a tensor.

        Args:
            device: where to build it (default: the CPU, or the tensor's own device).

        Returns:
            A boolean tensor; ``[1, 1, Lq, Lk]`` of True for no mask.

        Example:

            >>> from attnkit import masks
            >>> from attnkit.integrations.transformers import TransformersMask
            >>> TransformersMask(None, batch_size=2, q_length=1, kv_length=3).dense()
            tensor([[[[True, True, True]]]])
            >>> padded = TransformersMask(masks.padding([3, 1]), batch_size=2, q_length=1, kv_length=3)
            >>> padded.dense().shape, padded.dense()[1, 0, 0].tolist()
            (torch.Size([2, 1, 1, 3]), [True, False, False])
        """
        if self.mask is None:
            return torch.ones(1, 1, self.q_length, self.kv_length, dtype=torch.bool, device=device)
        if isinstance(self.mask, Tensor):
            return self.mask.to(device) if device is not None else self.mask
        allowed = self.mask.dense(self.q_length, self.kv_length, device=device)
        return allowed if allowed.dim() == 4 else allowed[None, None]


# -- the mask builder ---------------------------------------------------------------------------------


def _closure(function: Callable) -> dict[str, object]:
    return inspect.getclosurevars(function).nonlocals if getattr(function, "__closure__", None) else {}


def _local_name(function: Callable) -> str:
    return getattr(function, "__qualname__", "")


def _rule_of(mask_function: Callable) -> tuple[str, int | None] | None:
    """The rule behind one of transformers' mask functions: ``("causal" | "bidirectional", window)``,
    or None for a rule attnkit has no structured form for. transformers builds its rules from a few
    module-level functions and closures (``and_masks``, ``sliding_window_overlay``, ...); they are
    recognised by identity and by the closure they were made from, never by calling them."""
    if mask_function is _masking.causal_mask_function:
        return "causal", None
    if mask_function is _masking.bidirectional_mask_function:
        return "bidirectional", None
    if _local_name(mask_function) != "and_masks.<locals>.and_mask":
        return None
    parts = tuple(_closure(mask_function).get("mask_functions", ()))
    if len(parts) != 2:
        return None
    overlay, base = parts
    window = _closure(overlay).get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    if base is _masking.causal_mask_function and _local_name(overlay) == "sliding_window_overlay.<locals>.inner_mask":
        return "causal", window
    if (base is _masking.bidirectional_mask_function
            and _local_name(overlay) == "sliding_window_bidirectional_overlay.<locals>.inner_mask"):
        return "bidirectional", window
    return None


def _rule_mask(kind: str, window: int | None, q_length: int, kv_length: int, shift: int) -> StructuredMask | None:
    """The rule as attnkit's mask. Query ``i`` sits at key index ``i + shift`` (``shift`` = query
    offset - key offset, from the cache); attnkit's own alignment puts it at ``i + Lk - Lq``."""
    level = shift == kv_length - q_length
    if kind == "causal":
        if level:
            return _masks.causal() if window is None else _masks.sliding_window(window)
        rows = torch.arange(q_length) + shift  # transformers' causal: key <= query; window: key > query - w
        lo = torch.zeros_like(rows) if window is None else rows - window + 1
        return _masks.key_ranges(lo, rows + 1)
    if window is None:
        return None
    if level:  # transformers' bidirectional window: |query - key| <= w
        return _masks.sliding_window(window, window)
    rows = torch.arange(q_length) + shift
    return _masks.key_ranges(rows - window, rows + window + 1)


def _padding_mask(attention_mask: Tensor | None, batch_size: int, q_length: int, kv_length: int,
                  kv_offset: int) -> StructuredMask | Tensor | None:
    """The 2-D padding mask (True = real token, over every position the cache has seen) over this
    call's keys: None without padding, ``padding(lengths)`` for right padding, ``key_ranges`` for
    one run of real keys per sequence (left padding), the boolean ``[B, Lk]`` otherwise."""
    if attention_mask is None:
        return None
    keys = _masking.prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
    keys = keys.to(torch.bool).expand(batch_size, kv_length).cpu()
    if bool(keys.all()):
        return None
    index = torch.arange(kv_length)
    real = keys.any(1)
    first = torch.where(keys, index, kv_length).amin(1)
    last = torch.where(keys, index, -1).amax(1) + 1
    if not bool(((keys.sum(1) == last - first) | ~real).all()):
        return keys  # holes inside a sequence: no run of keys describes it
    first, last = torch.where(real, first, 0), torch.where(real, last, 0)
    if not bool(first.any()):
        return _masks.padding(last)
    return _masks.key_ranges(first[:, None].expand(batch_size, q_length), last[:, None].expand(batch_size, q_length))


def attnkit_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor = 0, kv_offset: int = 0,
                 mask_function: Callable = _masking.causal_mask_function, attention_mask: Tensor | None = None,
                 **kwargs: object) -> TransformersMask:
    """transformers' mask builder for ``"attnkit"`` (``AttentionMaskInterface``): the rule
    ``mask_function`` at these offsets, with the 2-D padding ``attention_mask``, as a
    :class:`attnkit.integrations.transformers.TransformersMask` holding a structured mask where
    attnkit has one for the rule (else a boolean ``[B, 1, Lq, Lk]`` tensor). transformers calls it;
    the arguments are those of its mask builders.

    Args:
        batch_size, q_length, kv_length: ``B``, ``Lq`` and ``Lk`` of the attention call.
        q_offset, kv_offset: the first query's and key's positions (from the cache).
        mask_function: transformers' rule (``causal_mask_function``, a sliding-window one, ...).
        attention_mask: the 2-D padding mask ``[B, positions]`` (1 = real token), or a
            :class:`attnkit.integrations.transformers.TransformersMask` built ahead (returned as
            it is).

    Returns:
        A :class:`attnkit.integrations.transformers.TransformersMask`.

    Example:

        >>> import torch
        >>> from transformers import masking_utils
        >>> from attnkit.integrations.transformers import attnkit_mask
        >>> attnkit_mask(2, 4, 4)  # causal, no padding
        TransformersMask(mask=causal(), batch_size=2, q_length=4, kv_length=4)
        >>> attnkit_mask(2, 4, 4, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])).mask
        causal() & padding([4, 2])
        >>> attnkit_mask(1, 4, 4, mask_function=masking_utils.sliding_window_causal_mask_function(2)).mask
        sliding_window(2)
        >>> print(attnkit_mask(1, 4, 4, mask_function=masking_utils.bidirectional_mask_function).mask)
        None
    """
    if isinstance(attention_mask, TransformersMask):
        return attention_mask  # generate() built it ahead of the forward (static caches)
    q_offset = int(q_offset)  # a static cache keeps it as a tensor
    rule = _rule_of(mask_function)
    padding = _padding_mask(attention_mask, batch_size, q_length, kv_length, kv_offset)
    if rule is None or isinstance(padding, Tensor):
        dense = _masking.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False, use_vmap=bool(kwargs.get("use_vmap", False)),
            device=kwargs.get("device", "cpu"))
        return TransformersMask(dense, batch_size, q_length, kv_length)
    mask = _rule_mask(*rule, q_length, kv_length, q_offset - kv_offset)
    if padding is not None:
        mask = padding if mask is None else mask & padding
    if q_length == 1 and mask is not None and not mask.is_causal:
        # A decoding step: the mask is one row of keys per sequence, [B, 1, 1, Lk] (never L x L),
        # built here once for every layer (each would densify it for SDPA, policy rule 5). A plain
        # causal mask stays: over one row it is no mask at all.
        mask = mask.dense(1, kv_length, ndim=4, device=kwargs.get("device", "cpu"))
    return TransformersMask(mask, batch_size, q_length, kv_length)


# -- the attention function ---------------------------------------------------------------------------


def _weights_wanted(kwargs: dict) -> bool:
    """``output_attentions`` reaches the attention function as a keyword, or only through the
    model's output collector (when set in the config): either asks for the weights."""
    if kwargs.get("output_attentions"):
        return True
    if _active_collector is None:  # pragma: no cover
        return False
    collected = _active_collector.get()
    return bool(collected) and ("attentions" in collected or "cross_attentions" in collected)


def _with_bias(mask: object, bias: Tensor, q_length: int, kv_length: int) -> Tensor:
    """An additive float bias (T5's relative positions) joined with the mask: the bias where the
    mask allows, ``-inf`` elsewhere. Dense: the bias is a tensor ``[.., Lq, Lk]`` already."""
    bias = bias[..., :q_length, :kv_length]
    if mask is None:
        return bias
    if isinstance(mask, TransformersMask):
        mask = mask.dense(bias.device)
    elif isinstance(mask, StructuredMask):
        allowed = mask.dense(q_length, kv_length, device=bias.device)
        mask = allowed if allowed.dim() == 4 else allowed[None, None]
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


def attnkit_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              attention_mask: TransformersMask | Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, softcap: float | None = None,
                              s_aux: Tensor | None = None, sinks: Tensor | None = None,
                              position_bias: Tensor | None = None, alibi_slopes: Tensor | None = None,
                              **kwargs: object) -> tuple[Tensor, Tensor | None]:
    """transformers' attention function for ``"attnkit"`` (``AttentionInterface``).

    Args:
        module: the model's attention module (``training``, ``is_causal``, GPT-OSS's ``sinks``).
        query: ``[B, H, Lq, D]``; key, value: ``[B, Hkv, Lk, D]`` (``H % Hkv == 0``, passed as they are).
        attention_mask: what :func:`attnkit.integrations.transformers.attnkit_mask` built, a 4-D
            tensor (boolean, or an additive float mask), or None (then the module's ``is_causal``,
            as transformers' SDPA path reads it).
        dropout: as models pass it (applied in training only).
        scaling: the score scale models pass (None: ``1 / sqrt(D)``).
        softcap: Gemma 2's soft cap of the scores, or None.
        s_aux: GPT-OSS's per-head sink logits ``[H]``, or None (then ``sinks``, then ``module.sinks``).
        sinks: the same, under the other name models use.
        position_bias: an additive bias where a model passes one, or None.
        alibi_slopes: ALiBi slopes ``[H]``, or None.

    Returns:
        ``(output [B, Lq, H, Dv], weights [B, H, Lq, Lk] or None)``: the weights with
        ``output_attentions``.

    Raises:
        ValueError: for a keyword attnkit cannot express (``head_mask``, ...), naming it; and
            whatever :func:`attnkit.attention` refuses.

    Example:

        Models call it; by hand, with a module that is causal:

        >>> import torch
        >>> from attnkit.integrations.transformers import attnkit_attention_forward, attnkit_mask
        >>> module = torch.nn.Module().eval()
        >>> module.is_causal = True
        >>> g = torch.Generator().manual_seed(0)
        >>> q = torch.randn(1, 4, 5, 8, generator=g)  # [B, H, Lq, D]
        >>> k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(2))  # [B, Hkv, Lk, D]
        >>> out, weights = attnkit_attention_forward(module, q, k, v, attnkit_mask(1, 5, 5), scaling=8 ** -0.5)
        >>> out.shape, weights
        (torch.Size([1, 5, 4, 8]), None)
        >>> out2, weights = attnkit_attention_forward(module, q, k, v, None, output_attentions=True)
        >>> weights.shape, torch.allclose(out, out2, atol=1e-6)
        (torch.Size([1, 4, 5, 5]), True)
        >>> attnkit_attention_forward(module, q, k, v, None, head_mask=torch.ones(4))
        Traceback (most recent call last):
            ...
        ValueError: attn_implementation='attnkit' cannot express 'head_mask' (passed by Module); use ...
    """
    unknown = sorted(name for name, value in kwargs.items()
                     if name not in _IGNORED and value is not None and value is not False)
    if unknown:
        raise ValueError(f"attn_implementation='attnkit' cannot express {', '.join(map(repr, unknown))} "
                         f"(passed by {type(module).__name__}); use attn_implementation='eager' for this model")
    q_length, kv_length = query.shape[-2], key.shape[-2]
    if module.training and float(dropout) == 1.0:
        return _all_dropped(query, key, value, _weights_wanted(kwargs))
    mask: object = attention_mask.mask if isinstance(attention_mask, TransformersMask) else attention_mask
    causal = False
    if attention_mask is None:
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal) and q_length > 1
    elif isinstance(mask, Tensor):
        mask = mask[..., :kv_length]  # eager and flex read the mask up to the keys they got
    if position_bias is not None:
        if causal:
            mask, causal = _masks.causal(), False
        mask = _with_bias(mask, position_bias, q_length, kv_length)
    sink_logits = s_aux if s_aux is not None else sinks
    if sink_logits is None and isinstance(getattr(module, "sinks", None), Tensor):
        sink_logits = module.sinks
    want_weights = _weights_wanted(kwargs)
    result = attention(
        query, key, value, mask=mask, causal=causal, scale=scaling,
        dropout=float(dropout) if module.training else 0.0, return_weights=want_weights,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sink_logits)
    output, weights = result if want_weights else (result, None)
    return output.transpose(1, 2).contiguous(), weights


def _all_dropped(query: Tensor, key: Tensor, value: Tensor, want_weights: bool) -> tuple[Tensor, Tensor | None]:
    """``attention_dropout=1.0`` in training: every weight is dropped, so eager attention returns
    zero weights and a zero output. attnkit's own dropout stops short of 1 (its kept weights are
    scaled by ``1/(1-p)``), so the result eager computes is built here instead of refused."""
    batch, heads, q_length = query.shape[:3]
    output = value.new_zeros(batch, q_length, heads, value.shape[-1])
    weights = query.new_zeros(batch, heads, q_length, key.shape[-2]) if want_weights else None
    return output, weights


def register(name: str = NAME) -> None:
    """Register ``name`` (default ``"attnkit"``) as an attention implementation and its mask
    builder in transformers. Importing this module does it once; calling again is harmless.

    Example:

        A tiny random Llama gives eager's logits on attnkit:

        >>> import torch, transformers
        >>> from attnkit.integrations.transformers import register
        >>> register()  # importing the module already did
        >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> ids = torch.tensor([[1, 5, 7, 3]])
        >>> with torch.no_grad():
        ...     model.set_attn_implementation("eager")
        ...     eager = model(ids).logits
        ...     model.set_attn_implementation("attnkit")
        ...     ours = model(ids).logits
        >>> torch.allclose(ours, eager, atol=1e-5)
        True
    """
    AttentionInterface.register(name, attnkit_attention_forward)
    AttentionMaskInterface.register(name, attnkit_mask)


register()
