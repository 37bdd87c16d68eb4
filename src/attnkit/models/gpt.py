"""A decoder-only transformer on attnkit: the Llama architecture, in one file.

::

    tokens [B, T] --embed_tokens--> x [B, T, hidden]
    N x Block:   x = x + Attention(RMSNorm(x), rotary positions, causal & mask)   (GQA, no bias)
                 x = x + SwiGLU(RMSNorm(x))              down(silu(gate(x)) * up(x))
    RMSNorm --lm_head--> logits [B, T, vocab]

Every attention call goes through one place, :attr:`Attention.attention_fn` (by default
:func:`attnkit.attention`), so a different implementation (sequence-parallel attention, say) is
swapped in with :meth:`GPT.set_attention_fn` without touching the rest. The parameter names
follow Hugging Face's ``LlamaForCausalLM`` (``model.`` prefix aside, ``out_proj`` for
``o_proj``), so :mod:`attnkit.models.llama_export` writes a checkpoint transformers loads.

Packed rows: pass ``mask=masks.document(ids=doc_ids)`` and ``positions=document_positions(doc_ids)``
and each document in a row is computed exactly as if it ran alone (tested). ``causal`` is always
on and bottom-right aligned, which is what decoding with a :class:`~attnkit.nn.KVCache` needs::

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
    """Sizes of a :class:`GPT`, named as in Hugging Face's ``LlamaConfig``.

    ``attention_only=True`` drops the feed-forward blocks (the induction-head demo's model);
    such a model has no Llama equivalent and is not exported.
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
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "GPTConfig":
        """Build from :meth:`to_dict`'s output (unknown keys are an error naming them)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"GPTConfig: unknown key(s) {unknown}")
        return cls(**raw)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 as Llama does."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embeddings (RoFormer), in Llama's half-split layout: the first and second
    halves of each head's features form the rotated pairs (so weights export unpermuted)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [T]`` or ``[B, T]`` -> ``(cos, sin)``, each ``[1 or B, 1, T, head_dim]``."""
        positions = positions if positions.dim() == 2 else positions[None]
        angles = positions[..., None].float() * self.inv_freq.float()   # float32, as Llama does
        angles = torch.cat((angles, angles), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply the rotation to ``x [B, H, T, D]``: ``x * cos + rotate_half(x) * sin``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(MultiHeadAttention):
    """Causal self-attention with rotary positions: attnkit's :class:`MultiHeadAttention`
    (GQA, no biases) with the rotation applied between the projections and the attention call.

    The one attention call is ``self.attention_fn`` (default :func:`attnkit.attention`).
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

        With a ``cache`` the new keys and values are only *staged*: :class:`GPT` commits every
        layer's cache once the whole forward succeeded.
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
    """Llama's feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: attention, then (unless attention-only) the feed-forward."""

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
        result = self.self_attn(self.input_layernorm(x), rope, mask=mask, cache=cache, generator=generator,
                                need_weights=need_weights)
        x = x + (result[0] if need_weights else result)
        if self.mlp is not None:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return (x, result[1]) if need_weights else x


def document_positions(ids: Tensor) -> Tensor:
    """Position of each token within its document: ``ids [B, T]`` (contiguous runs of equal
    labels) -> ``[B, T]`` int64, restarting at 0 where the label changes.

    ``document_positions(tensor([[7, 7, 7, 2, 2]]))`` is ``[[0, 1, 2, 0, 1]]``.
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


class GPT(nn.Module):
    """A Llama-architecture decoder-only language model (see the module docstring).

    ``forward(tokens [B, T]) -> logits [B, T, vocab]``.
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
        sqrt(2 * layers) so the residual stream's variance does not grow with depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.num_hidden_layers)
        for name, parameter in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(parameter)
            elif name.endswith(("out_proj.weight", "down_proj.weight")):
                nn.init.normal_(parameter, std=residual_std)
            else:
                nn.init.normal_(parameter, std=0.02)

    def set_attention_fn(self, fn: AttentionFn) -> None:
        """Run every layer's attention through ``fn`` (``attnkit.attention``'s signature)."""
        for block in self.layers:
            block.self_attn.attention_fn = fn

    def set_backend(self, backend: str) -> None:
        """The :func:`attnkit.attention` backend of every layer."""
        for block in self.layers:
            block.self_attn.backend = backend

    def new_cache(self, batch_size: int, max_length: int | None = None) -> list[KVCache]:
        """One empty :class:`KVCache` per layer (default length: ``max_position_embeddings``)."""
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
                cached tokens with a ``cache``. Packed rows pass :func:`document_positions`.
            mask: any :func:`attnkit.attention` mask (True = may attend), intersected with the
                causal mask that always applies: ``masks.document(ids=...)`` for packed rows, a
                boolean ``[B, 1, 1, Lk]`` for left padding. ``Lk`` counts cached keys too.
            cache: :meth:`new_cache`'s list; the new tokens are appended to every layer's
                cache, and counted only when the whole forward succeeds.
            generator: for attention dropout (``config.attention_dropout``) in training mode.
            need_weights: also return each layer's attention weights ``[B, H, T, Lk]``.

        Returns:
            ``logits [B, T, vocab_size]`` (float32 for float32 weights), and with
            ``need_weights`` the list of per-layer weights.
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
        total = sum(p.numel() for p in self.parameters())
        if not embeddings:
            total -= self.embed_tokens.weight.numel()
            if not self.config.tie_word_embeddings:
                total -= self.lm_head.weight.numel()
        return total


def language_model_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the targets that are not ``-100`` (document ends, padding);
    half-precision logits are scored in float32."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)
