"""A decoder-only transformer on attnkit: the Llama architecture, in one file.

::

    tokens [B, T] --embed_tokens--> x [B, T, hidden]
    N x Block:   x = x + Attention(RMSNorm(x), rotary positions, causal & mask)   (GQA, no bias)
                 x = x + SwiGLU(RMSNorm(x))              down(silu(gate(x)) * up(x))
    RMSNorm --lm_head--> logits [B, T, vocab]

Every attention call goes through one place, the ``attention_fn`` attribute of each
:class:`attnkit.models.gpt.Attention` (by default :func:`attnkit.attention`), so a different
implementation (sequence-parallel attention, say) is swapped in with
:meth:`attnkit.models.gpt.GPT.set_attention_fn` without touching the rest. The parameter names
follow Hugging Face's ``LlamaForCausalLM`` (``model.`` prefix aside, ``out_proj`` for
``o_proj``), so :mod:`attnkit.models.llama_export` writes a checkpoint transformers loads.

Packed rows: pass ``mask=masks.document(ids=doc_ids)`` and ``positions=document_positions(doc_ids)``
(:func:`attnkit.masks.document`, :func:`attnkit.models.gpt.document_positions`) and each document
in a row is computed exactly as if it ran alone (tested). ``causal`` is always on and bottom-right
aligned, which is what decoding with a :class:`~attnkit.nn.KVCache` needs::

    prefill (3 tokens)   then 1 token     (query rows are the last rows of one causal pass)
    # . .                # # # #
    # # .
    # # #
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import attention
from ..nn import KVCache, MultiHeadAttention
from ..nn._traced import traced_call

# attention_fn(query [B, H, Lq, D], key [B, Hkv, Lk, D], value [B, Hkv, Lk, D], *, mask, causal,
# dropout, generator, return_weights, backend) -> out [B, H, Lq, D] (or (out, weights)):
# the signature of attnkit.attention, which any replacement keeps.
AttentionFn = Callable[..., Tensor | tuple[Tensor, Tensor]]


@dataclass
class GPTConfig:
    """Sizes of a :class:`attnkit.models.gpt.GPT`, named as in Hugging Face's ``LlamaConfig``.

    ``attention_only=True`` drops the feed-forward blocks (the induction-head demo's model);
    such a model has no Llama equivalent and is not exported.

    ``num_key_value_heads`` below ``num_attention_heads`` is grouped-query attention; ``bos_token_id``
    and ``eos_token_id`` are used by :func:`attnkit.models.generate.generate_text`.

    Raises:
        ValueError: a size is not an int >= 1, ``hidden_size`` is not divisible by
            ``num_attention_heads``, ``num_attention_heads`` not by ``num_key_value_heads``, the head
            size is odd, ``rope_theta`` is not > 0, or ``attention_dropout`` not in ``[0, 1)``.

    Example:

    >>> from attnkit.models.gpt import GPTConfig
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> config.head_dim, config.attention_only
    (8, False)
    >>> GPTConfig(hidden_size=30)
    Traceback (most recent call last):
    ...
    ValueError: GPTConfig: hidden_size (30) must be divisible by num_attention_heads (4)
    """

    vocab_size: int = 1024
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 352
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    attention_only: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an int >= 1, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"GPTConfig: hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"GPTConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"GPTConfig: rotary embeddings need an even head_dim, got {self.head_dim}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"GPTConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"GPTConfig.attention_dropout must be in [0, 1), got {self.attention_dropout!r}")

    @property
    def head_dim(self) -> int:
        """The size of each head's features, ``hidden_size // num_attention_heads`` (an ``int``).

        Example:

        >>> from attnkit.models.gpt import GPTConfig
        >>> GPTConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2).head_dim
        16
        """
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        """Every field as a JSON-serialisable ``dict`` (what
        :meth:`attnkit.models.gpt.GPTConfig.from_dict` reads back).

        Example:

        >>> import json
        >>> from attnkit.models.gpt import GPTConfig
        >>> raw = GPTConfig(num_hidden_layers=2).to_dict()
        >>> raw["num_hidden_layers"], raw["vocab_size"]
        (2, 1024)
        >>> GPTConfig.from_dict(json.loads(json.dumps(raw))) == GPTConfig(num_hidden_layers=2)
        True
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "GPTConfig":
        """Build from :meth:`attnkit.models.gpt.GPTConfig.to_dict`'s output (unknown keys are an
        error naming them); missing keys take their defaults.

        Raises:
            ValueError: ``raw`` has a key that is no field, or a value the constructor refuses.

        Example:

        >>> from attnkit.models.gpt import GPTConfig
        >>> GPTConfig.from_dict({"hidden_size": 64}).head_dim
        16
        >>> GPTConfig.from_dict({"hidden_size": 64, "n_layer": 2})
        Traceback (most recent call last):
        ...
        ValueError: GPTConfig: unknown key(s) ['n_layer']
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"GPTConfig: unknown key(s) {unknown}")
        return cls(**raw)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 as Llama does.

    Args:
        dim: the size of the last dimension, normalised over; ``weight`` is ``[dim]`` (ones).
        eps: added to the mean square.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import RMSNorm
    >>> norm = RMSNorm(4)
    >>> x = torch.tensor([[1.0, -2.0, 3.0, -4.0]])
    >>> torch.allclose(norm(x), x / x.pow(2).mean(-1, keepdim=True).sqrt())
    True
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., dim]`` -> ``[..., dim]``, normalised in float32 then cast back to ``x``'s dtype
        before ``weight`` scales it (so the result has the dtype promoted from both).

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import RMSNorm
        >>> norm = RMSNorm(8)
        >>> y = norm(torch.randn(2, 3, 8))
        >>> y.shape, torch.allclose(y.pow(2).mean(-1), torch.ones(2, 3), atol=1e-3)
        (torch.Size([2, 3, 8]), True)
        >>> norm.to(torch.bfloat16)(torch.randn(2, 8, dtype=torch.bfloat16)).dtype
        torch.bfloat16
        """
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embeddings (RoFormer), in Llama's half-split layout: the first and second
    halves of each head's features form the rotated pairs (so weights export unpermuted).

    Args:
        head_dim: each head's feature size (even).
        theta: the rotary base (``rope_theta``); feature pair ``i`` turns by
            ``position * theta ** (-2 i / head_dim)``.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import Rotary
    >>> rotary = Rotary(head_dim=8, theta=10000.0)
    >>> cos, sin = rotary(torch.arange(5), torch.float32)
    >>> cos.shape, sin.shape
    (torch.Size([1, 1, 5, 8]), torch.Size([1, 1, 5, 8]))
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [T]`` or ``[B, T]`` -> ``(cos, sin)``, each ``[1 or B, 1, T, head_dim]``.

        The angles are computed in float32 (as Llama does), then cast to ``dtype``; the results
        broadcast against queries and keys ``[B, H, T, head_dim]`` in
        :func:`attnkit.models.gpt.rotate`.

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import Rotary
        >>> rotary = Rotary(head_dim=8, theta=10000.0)
        >>> cos, sin = rotary(torch.tensor([[0, 1, 2], [5, 6, 7]]), torch.bfloat16)
        >>> cos.shape, cos.dtype
        (torch.Size([2, 1, 3, 8]), torch.bfloat16)
        >>> bool((cos[0, 0, 0] == 1).all() and (sin[0, 0, 0] == 0).all())  # position 0: no rotation
        True
        """
        positions = positions if positions.dim() == 2 else positions[None]
        angles = positions[..., None].float() * self.inv_freq.float()   # float32, as Llama does
        angles = torch.cat((angles, angles), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply the rotation to ``x [B, H, T, D]``: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: ``[B, H, T, D]`` queries or keys.
        cos, sin: from :class:`attnkit.models.gpt.Rotary`, ``[1 or B, 1, T, D]``.

    Returns:
        ``[B, H, T, D]``: each feature pair ``(x[i], x[i + D/2])`` turned by its angle, so the dot
        product of a rotated query and key depends only on their distance.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import Rotary, rotate
    >>> cos, sin = Rotary(head_dim=8, theta=10000.0)(torch.arange(6), torch.float32)
    >>> q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    >>> def score(i, j):  # query at position i, key at position j
    ...     return (rotate(q, cos[:, :, i:i + 1], sin[:, :, i:i + 1])
    ...             * rotate(k, cos[:, :, j:j + 1], sin[:, :, j:j + 1])).sum()
    >>> torch.allclose(score(3, 1), score(5, 3), atol=1e-5)  # same distance, same score
    True
    >>> torch.allclose(rotate(q, cos, sin).norm(dim=-1), q.norm(dim=-1).expand(1, 1, 6))
    True
    """
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(MultiHeadAttention):
    """Causal self-attention with rotary positions: attnkit's :class:`attnkit.nn.MultiHeadAttention`
    (GQA, no biases) with the rotation applied between the projections and the attention call.

    The one attention call is ``self.attention_fn`` (default :func:`attnkit.attention`).

    Args:
        config: a :class:`attnkit.models.gpt.GPTConfig` (``hidden_size``, the head counts,
            ``attention_dropout``).

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import Attention, GPTConfig, Rotary
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> attention = Attention(config)
    >>> attention.num_heads, attention.num_kv_heads, attention.head_dim
    (4, 2, 8)
    >>> rope = Rotary(config.head_dim, config.rope_theta)(torch.arange(5), torch.float32)
    >>> attention(torch.randn(2, 5, 32), rope).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.hidden_size, config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                         bias=False, dropout=config.attention_dropout, causal=True)
        self.attention_fn: AttentionFn = attention

    @traced_call
    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        *,
        mask: object = None,
        cache: KVCache | None = None,
        generator: torch.Generator | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x [B, T, hidden]`` -> ``[B, T, hidden]`` (and weights ``[B, H, T, Lk]``).

        With a ``cache`` the new keys and values are only *staged*: :class:`attnkit.models.gpt.GPT`
        commits every layer's cache once the whole forward succeeded.

        Args:
            x: ``[B, T, hidden]`` (already normalised).
            rope: ``(cos, sin)`` from :class:`attnkit.models.gpt.Rotary` for the ``T`` new positions.
            mask: any :func:`attnkit.attention` mask, intersected with the causal mask.
            cache: an :class:`attnkit.nn.KVCache` of this layer, or None.
            generator: for attention dropout in training mode.
            need_weights: also return the attention weights.

        Returns:
            ``[B, T, hidden]``, or with ``need_weights`` ``(output, weights [B, H, T, Lk])``
            (``Lk`` counts cached keys too).

        Raises:
            ValueError: a ``mask`` that does not fit (raised by :func:`attnkit.attention`).

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import Attention, GPTConfig, Rotary
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> attention = Attention(config)
        >>> rope = Rotary(config.head_dim, config.rope_theta)(torch.arange(5), torch.float32)
        >>> out, weights = attention(torch.randn(2, 5, 32), rope, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 32]), torch.Size([2, 4, 5, 5]))
        >>> bool((weights.triu(diagonal=1) == 0).all())  # causal
        True
        """
        batch, length, _ = x.shape
        queries = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        queries, keys = rotate(queries, cos, sin), rotate(keys, cos, sin)
        if cache is not None:
            keys, values = cache.stage(keys, values)
        result = self.attention_fn(  # causal is bottom-right: a decoding step's one row sees every key
            queries, keys, values, mask=mask, causal=True,
            dropout=self.dropout if self.training else 0.0, generator=generator,
            return_weights=need_weights, backend=self.backend,
        )
        heads = result[0] if need_weights else result
        output = self.out_proj(heads.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))
        return (output, result[1]) if need_weights else output


class SwiGLU(nn.Module):
    """Llama's feed-forward: ``down(silu(gate(x)) * up(x))``.

    Args:
        config: a :class:`attnkit.models.gpt.GPTConfig` (``hidden_size``, ``intermediate_size``).

    Example:

    >>> from attnkit.models.gpt import GPTConfig, SwiGLU
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> mlp = SwiGLU(config)
    >>> mlp.gate_proj.weight.shape, mlp.down_proj.weight.shape
    (torch.Size([64, 32]), torch.Size([32, 64]))
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., hidden]`` -> ``[..., hidden]``.

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPTConfig, SwiGLU
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> SwiGLU(config)(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
        """
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: attention, then (unless attention-only) the feed-forward.

    ``x = x + Attention(RMSNorm(x))``, then ``x = x + SwiGLU(RMSNorm(x))``; with
    ``config.attention_only`` the second step (and its norm) is left out and ``mlp`` is None.

    Args:
        config: a :class:`attnkit.models.gpt.GPTConfig`.

    Example:

    >>> from attnkit.models.gpt import Block, GPTConfig
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> Block(config).mlp is None, Block(GPTConfig(attention_only=True)).mlp is None
    (False, True)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.mlp: nn.Module | None = None
        if not config.attention_only:
            self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], *, mask: object = None, cache: KVCache | None = None,
                generator: torch.Generator | None = None, need_weights: bool = False):
        """``x [B, T, hidden]`` -> ``[B, T, hidden]``; the arguments are those of
        :meth:`attnkit.models.gpt.Attention.forward`.

        Returns:
            ``[B, T, hidden]``, or with ``need_weights`` ``(output, weights [B, H, T, Lk])``.

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import Block, GPTConfig, Rotary
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> rope = Rotary(config.head_dim, config.rope_theta)(torch.arange(5), torch.float32)
        >>> out, weights = Block(config)(torch.randn(2, 5, 32), rope, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 32]), torch.Size([2, 4, 5, 5]))
        """
        result = self.self_attn(self.input_layernorm(x), rope, mask=mask, cache=cache, generator=generator,
                                need_weights=need_weights)
        x = x + (result[0] if need_weights else result)
        if self.mlp is not None:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return (x, result[1]) if need_weights else x


def document_positions(ids: Tensor) -> Tensor:
    """Position of each token within its document: ``ids [B, T]`` (contiguous runs of equal
    labels) -> ``[B, T]`` int64, restarting at 0 where the label changes.

    Raises:
        ValueError: ``ids`` is not 2-D.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import document_positions
    >>> document_positions(torch.tensor([[7, 7, 7, 2, 2], [1, 1, 1, 1, 1]]))
    tensor([[0, 1, 2, 0, 1],
            [0, 1, 2, 3, 4]])
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


class GPT(nn.Module):
    """A Llama-architecture decoder-only language model (see :mod:`attnkit.models.gpt`).

    ``forward(tokens [B, T]) -> logits [B, T, vocab]``.

    Args:
        config: a :class:`attnkit.models.gpt.GPTConfig`; the weights are initialised by
            :meth:`attnkit.models.gpt.GPT.reset_parameters` (from the global RNG).

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import GPT, GPTConfig
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> model = GPT(config)
    >>> model(torch.tensor([[1, 2, 3], [4, 5, 6]])).shape
    torch.Size([2, 3, 64])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: normal(0, 0.02), the residual projections scaled down by
        sqrt(2 * layers) so the residual stream's variance does not grow with depth; norm weights
        are set to one. Draws from the global RNG (seed it with ``torch.manual_seed``).

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> model = GPT(config)
        >>> with torch.no_grad():
        ...     _ = model.norm.weight.mul_(3.0)
        >>> model.reset_parameters()
        >>> bool((model.norm.weight == 1).all())
        True
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.num_hidden_layers)
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(parameter)
            elif name.endswith(("out_proj.weight", "down_proj.weight")):
                nn.init.normal_(parameter, std=residual_std)
            else:
                nn.init.normal_(parameter, std=0.02)

    def set_attention_fn(self, fn: AttentionFn) -> None:
        """Run every layer's attention through ``fn``, which takes :func:`attnkit.attention`'s
        arguments (``query [B, H, Lq, D]``, ``key`` and ``value [B, Hkv, Lk, D]``, then keywords)
        and returns what it returns.

        Example:

        >>> import torch, attnkit
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> model = GPT(config)
        >>> calls = []
        >>> def logged(query, key, value, **options):
        ...     calls.append((tuple(query.shape), tuple(key.shape)))
        ...     return attnkit.attention(query, key, value, **options)
        >>> model.set_attention_fn(logged)
        >>> _ = model(torch.tensor([[1, 2, 3]]))
        >>> calls  # one call per layer: 4 query heads share 2 key/value heads
        [((1, 4, 3, 8), (1, 2, 3, 8)), ((1, 4, 3, 8), (1, 2, 3, 8))]
        """
        for block in self.layers:
            block.self_attn.attention_fn = fn

    def set_backend(self, backend: str) -> None:
        """The :func:`attnkit.attention` backend of every layer (one of :func:`attnkit.backends`).

        Raises:
            ValueError: ``backend`` is not a registered backend (refused at the first layer, so
                nothing changes).

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> model = GPT(config)
        >>> tokens = torch.tensor([[1, 2, 3, 4]])
        >>> before = model(tokens)
        >>> model.set_backend("reference")
        >>> torch.allclose(model(tokens), before, atol=1e-5)
        True
        >>> model.set_backend("nope")
        Traceback (most recent call last):
        ...
        ValueError: unknown backend 'nope'; available: (...)
        """
        for block in self.layers:
            block.self_attn.backend = backend

    def new_cache(self, batch_size: int, max_length: int | None = None) -> list[KVCache]:
        """One empty :class:`attnkit.nn.KVCache` per layer (default length:
        ``max_position_embeddings``), for ``batch_size`` rows; pass it to
        :meth:`attnkit.models.gpt.GPT.forward` to decode a token at a time.

        Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> model = GPT(config).eval()
        >>> tokens = torch.tensor([[1, 2, 3, 4]])
        >>> cache = model.new_cache(batch_size=1, max_length=8)
        >>> len(cache), len(cache[0])
        (2, 0)
        >>> _ = model(tokens[:, :3], cache=cache)   # prefill
        >>> last = model(tokens[:, 3:], cache=cache)  # one step, reads the cache
        >>> len(cache[0]), torch.allclose(last[:, -1], model(tokens)[:, -1], atol=1e-5)
        (4, True)
        """
        length = max_length or self.config.max_position_embeddings
        return [block.self_attn.new_cache(batch_size, length) for block in self.layers]

    def forward(
        self,
        tokens: Tensor,
        *,
        positions: Tensor | None = None,
        mask: object = None,
        cache: list[KVCache] | None = None,
        generator: torch.Generator | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits.

        Args:
            tokens: ``[B, T]`` token ids.
            positions: rotary positions, ``[T]`` or ``[B, T]``; default ``0..T-1``, or after the
                cached tokens with a ``cache``. Packed rows pass
                :func:`attnkit.models.gpt.document_positions`.
            mask: any :func:`attnkit.attention` mask (True = may attend), intersected with the
                causal mask that always applies: ``masks.document(ids=...)`` for packed rows, a
                boolean ``[B, 1, 1, Lk]`` for left padding. ``Lk`` counts cached keys too.
            cache: :meth:`attnkit.models.gpt.GPT.new_cache`'s list; the new tokens are appended to
                every layer's cache, and counted only when the whole forward succeeds.
            generator: for attention dropout (``config.attention_dropout``) in training mode.
            need_weights: also return each layer's attention weights ``[B, H, T, Lk]``.

        Returns:
            ``logits [B, T, vocab_size]`` (float32 for float32 weights), and with
            ``need_weights`` the list of per-layer weights.

        Raises:
            ValueError: ``tokens`` is not an integer tensor ``[B, T]``, ``cache`` does not hold one
                :class:`attnkit.nn.KVCache` per layer, ``positions`` has the wrong shape, or a
                ``mask`` does not fit.

        In the example, two documents packed in one row compute as they would alone.

        Example:

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.models.gpt import GPT, GPTConfig, document_positions
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> model = GPT(config).eval()
        >>> tokens = torch.tensor([[5, 6, 7, 8, 9]])
        >>> logits, weights = model(tokens, need_weights=True)
        >>> logits.shape, len(weights), weights[0].shape
        (torch.Size([1, 5, 64]), 2, torch.Size([1, 4, 5, 5]))
        >>> doc_ids = torch.tensor([[0, 0, 0, 1, 1]])
        >>> packed = model(tokens, mask=masks.document(ids=doc_ids), positions=document_positions(doc_ids))
        >>> torch.allclose(packed[:, 3:], model(tokens[:, 3:]), atol=1e-5)
        True
        """
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an integer tensor [B, T], got {got}")
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache must hold one KVCache per layer ({len(self.layers)}), got {len(cache)}")
        start = len(cache[0]) if cache else 0
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        elif positions.shape[-1] != tokens.shape[1] or positions.dim() not in (1, 2):
            raise ValueError(f"positions must be [T] or [B, T] with T={tokens.shape[1]}, got {tuple(positions.shape)}")
        x = self.embed_tokens(tokens)
        rope = self.rotary(positions, x.dtype)
        weights = []
        for index, block in enumerate(self.layers):
            result = block(x, rope, mask=mask, cache=cache[index] if cache else None, generator=generator,
                           need_weights=need_weights)
            x = result[0] if need_weights else result
            if need_weights:
                weights.append(result[1])
        if cache:
            for layer_cache in cache:
                layer_cache.commit()
        logits = self.lm_head(self.norm(x))
        return (logits, weights) if need_weights else logits

    def num_parameters(self, *, embeddings: bool = True) -> int:
        """The number of parameters (a tied ``lm_head`` counted once); with ``embeddings=False``,
        without the token embeddings and the output layer.

        Example:

        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
        >>> model = GPT(config)
        >>> model.num_parameters(), model.num_parameters(embeddings=False)
        (22688, 18592)
        """
        total = sum(p.numel() for p in self.parameters())
        if not embeddings:
            total -= self.embed_tokens.weight.numel()
            if not self.config.tie_word_embeddings:
                total -= self.lm_head.weight.numel()
        return total


def language_model_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the targets that are not ``-100`` (document ends, padding);
    half-precision logits are scored in float32.

    Args:
        logits: ``[B, T, vocab]`` (any leading shape), as :class:`attnkit.models.gpt.GPT` returns.
        targets: ``[B, T]`` int64 next-token ids, ``-100`` where nothing is predicted.

    Returns:
        The scalar loss (float32 for half-precision logits).

    Example:

    >>> import math, torch
    >>> from attnkit.models.gpt import language_model_loss
    >>> logits = torch.zeros(1, 3, 8)  # uniform over 8 tokens
    >>> loss = language_model_loss(logits, torch.tensor([[1, 2, -100]]))
    >>> loss.shape, math.isclose(loss.item(), math.log(8), rel_tol=1e-6)
    (torch.Size([]), True)
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)
