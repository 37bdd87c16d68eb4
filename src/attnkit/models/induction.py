"""Watch an induction head form (Olsson et al., 2022, "In-context Learning and Induction Heads").

A two-layer, attention-only :class:`~attnkit.models.gpt.GPT` is trained on random tokens
repeated twice (``a b c d | a b c d``). The first half cannot be predicted (loss ~ ln(vocab));
the second half can, by copying: at ``c`` (second time), look for the earlier ``c``, attend to
the token after it (``d``) and copy it. Two heads do this together: a previous-token head in
layer 0 writes "the token before me was c" into each position, and an *induction head* in layer 1
matches its query (``c``) against that, so its attention is a stripe ``half - 1`` below the
diagonal::

    keys ->            a b c d a b c
    query a (2nd)      . # . . . . .     each second-half query attends to the
    query b (2nd)      . . # . . . .     token after the previous occurrence of itself
    query c (2nd)      . . . # . . .

Two scores per head, as Olsson et al. define them:

- prefix matching: the attention a second-half query pays to the token after its own earlier
  occurrence (1 for a perfect induction head; a uniform causal head pays ``1 / (i + 1)``);
- copying: ``sum(eigenvalues) / sum(|eigenvalues|)`` of the head's OV circuit from token to
  logit, ``W_E g W_V W_O g_f W_U`` (norm weights ``g`` folded in): +1 when the head raises the
  logit of the token it attends to, -1 when it lowers it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .gpt import GPT, GPTConfig, language_model_loss


@dataclass
class InductionConfig:
    """The demo's task and model; the defaults train in seconds on 2 CPU cores.

    The task: ``batch_size`` rows of ``half`` random tokens (of ``vocab_size``) repeated twice; the
    model: an attention-only :class:`attnkit.models.gpt.GPT` of ``num_layers`` layers of
    ``num_heads`` heads, trained ``steps`` steps of AdamW at ``learning_rate``, seeded by ``seed``.

    Example:

    >>> from attnkit.models.induction import InductionConfig
    >>> config = InductionConfig(steps=100)
    >>> config.steps, config.half, config.num_layers
    (100, 16, 2)
    """

    vocab_size: int = 64
    half: int = 16                # tokens in each half
    batch_size: int = 32
    steps: int = 250
    learning_rate: float = 3e-3
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    seed: int = 0

    def model_config(self) -> GPTConfig:
        """The :class:`attnkit.models.gpt.GPTConfig` of the demo's model: attention-only, one
        key/value head per head, room for the ``2 * half`` tokens of a row.

        Example:

        >>> from attnkit.models.induction import InductionConfig
        >>> model_config = InductionConfig().model_config()
        >>> model_config.attention_only, model_config.num_hidden_layers, model_config.max_position_embeddings
        (True, 2, 32)
        """
        return GPTConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                         num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
                         intermediate_size=1, max_position_embeddings=2 * self.half, attention_only=True)


def repeated_tokens(batch_size: int, half: int, vocab_size: int, generator: torch.Generator) -> Tensor:
    """``[B, 2 * half]``: random tokens, then the same tokens again.

    Args:
        batch_size: ``B``, the number of rows.
        half: the tokens in each half.
        vocab_size: tokens are drawn uniformly from ``[0, vocab_size)``.
        generator: the ``torch.Generator`` they are drawn from.

    Returns:
        ``[B, 2 * half]`` int64.

    Example:

    >>> import torch
    >>> from attnkit.models.induction import repeated_tokens
    >>> tokens = repeated_tokens(2, 4, 10, torch.Generator().manual_seed(0))
    >>> tokens.shape, torch.equal(tokens[:, :4], tokens[:, 4:])
    (torch.Size([2, 8]), True)
    """
    first = torch.randint(0, vocab_size, (batch_size, half), generator=generator)
    return torch.cat([first, first], dim=1)


@dataclass
class InductionResult:
    """What :func:`attnkit.models.induction.train_induction` returns: the trained ``model`` (a
    :class:`attnkit.models.gpt.GPT` in eval mode), the ``config`` it was trained with, and the
    training loss of every step (``losses``).

    Example:

    >>> from attnkit.models.induction import InductionConfig, train_induction
    >>> result = train_induction(InductionConfig(steps=3, batch_size=4))
    >>> len(result.losses), result.model.training, result.config.steps
    (3, False, 3)
    """

    model: GPT
    config: InductionConfig
    losses: list[float]


def train_induction(config: InductionConfig | None = None) -> InductionResult:
    """Train the attention-only model on repeated random tokens (seeded; the global RNG is left
    as it was).

    Args:
        config: the task and model (default: :class:`attnkit.models.induction.InductionConfig`'s
            defaults, 250 steps).

    Returns:
        An :class:`attnkit.models.induction.InductionResult`.

    The example trains a few steps only; the default 250 form the induction head.

    Example:

    >>> import math
    >>> from attnkit.models.induction import InductionConfig, train_induction
    >>> result = train_induction(InductionConfig(steps=5, batch_size=8))
    >>> len(result.losses)
    5
    >>> abs(result.losses[0] - math.log(64)) < 0.1  # untrained: uniform over the 64 tokens
    True
    """
    config = config or InductionConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = GPT(config.model_config())
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(config.steps):
        tokens = repeated_tokens(config.batch_size, config.half, config.vocab_size, generator)
        loss = language_model_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return InductionResult(model.eval(), config, losses)


@torch.no_grad()
def half_losses(model: GPT, tokens: Tensor) -> tuple[float, float]:
    """Mean loss predicting the first half's tokens (from the second token on) and the second half's.

    Args:
        model: a :class:`attnkit.models.gpt.GPT`.
        tokens: ``[B, 2 * half]`` from :func:`attnkit.models.induction.repeated_tokens`.

    Returns:
        ``(first, second)`` as floats: about ``ln(vocab_size)`` both before training; the second
        falls towards 0 once an induction head copies.

    Example:

    >>> import math, torch
    >>> from attnkit.models.gpt import GPT
    >>> from attnkit.models.induction import InductionConfig, repeated_tokens
    >>> config = InductionConfig()
    >>> model = GPT(config.model_config()).eval()  # untrained: no head copies yet
    >>> tokens = repeated_tokens(8, config.half, config.vocab_size, torch.Generator().manual_seed(0))
    >>> from attnkit.models.induction import half_losses
    >>> first, second = half_losses(model, tokens)
    >>> abs(first - math.log(64)) < 0.1, abs(second - math.log(64)) < 0.1
    (True, True)
    """
    half = tokens.shape[1] // 2
    losses = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:], reduction="none")
    # Target j + 1 is predicted at position j: targets 1..half-1 are first-half tokens.
    return float(losses[:, : half - 1].mean()), float(losses[:, half - 1:].mean())


@torch.no_grad()
def prefix_matching_scores(model: GPT, tokens: Tensor) -> Tensor:
    """``[layers, heads]``: mean attention from each second-half query ``i`` to key ``i - half + 1``
    (the token after the earlier occurrence of the query's token), over ``tokens [B, 2 * half]``.

    Args:
        model: a :class:`attnkit.models.gpt.GPT`.
        tokens: ``[B, 2 * half]`` from :func:`attnkit.models.induction.repeated_tokens`.

    Returns:
        ``[layers, heads]`` float scores in ``[0, 1]``: 1 for a perfect induction head.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import GPT
    >>> from attnkit.models.induction import InductionConfig, repeated_tokens
    >>> config = InductionConfig()
    >>> model = GPT(config.model_config()).eval()  # untrained: no head copies yet
    >>> tokens = repeated_tokens(8, config.half, config.vocab_size, torch.Generator().manual_seed(0))
    >>> from attnkit.models.induction import prefix_matching_scores
    >>> scores = prefix_matching_scores(model, tokens)
    >>> scores.shape, bool((scores < 0.2).all())  # untrained heads spread their attention
    (torch.Size([2, 4]), True)
    """
    half = tokens.shape[1] // 2
    _, weights = model(tokens, need_weights=True)
    queries = torch.arange(half, 2 * half)
    scores = [layer[:, :, queries, queries - half + 1].mean(dim=(0, 2)) for layer in weights]
    return torch.stack(scores)


@torch.no_grad()
def previous_token_scores(model: GPT, tokens: Tensor) -> Tensor:
    """``[layers, heads]``: mean attention from each query ``i >= 1`` to key ``i - 1``.

    Args:
        model: a :class:`attnkit.models.gpt.GPT`.
        tokens: ``[B, T]`` token ids.

    Returns:
        ``[layers, heads]`` float scores in ``[0, 1]``: 1 for a perfect previous-token head.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import GPT
    >>> from attnkit.models.induction import InductionConfig, repeated_tokens
    >>> config = InductionConfig()
    >>> model = GPT(config.model_config()).eval()  # untrained: no head copies yet
    >>> tokens = repeated_tokens(8, config.half, config.vocab_size, torch.Generator().manual_seed(0))
    >>> from attnkit.models.induction import previous_token_scores
    >>> scores = previous_token_scores(model, tokens)
    >>> scores.shape, bool(((scores >= 0) & (scores <= 1)).all())
    (torch.Size([2, 4]), True)
    """
    _, weights = model(tokens, need_weights=True)
    queries = torch.arange(1, tokens.shape[1])
    return torch.stack([layer[:, :, queries, queries - 1].mean(dim=(0, 2)) for layer in weights])


@torch.no_grad()
def copying_scores(model: GPT) -> Tensor:
    """``[layers, heads]``: each head's OV-circuit eigenvalue score, in ``[-1, 1]``.

    The score of a head is ``sum(eigenvalues) / sum(|eigenvalues|)`` of its token-to-logit OV
    circuit (see :mod:`attnkit.models.induction`), computed in float64: +1 when attending to a
    token raises that token's logit.

    Args:
        model: a :class:`attnkit.models.gpt.GPT`.

    Example:

    >>> from attnkit.models.gpt import GPT
    >>> from attnkit.models.induction import InductionConfig, copying_scores
    >>> scores = copying_scores(GPT(InductionConfig().model_config()))
    >>> scores.shape, bool((scores.abs() <= 1).all())
    (torch.Size([2, 4]), True)
    """
    embed = model.embed_tokens.weight.double()                    # [V, d]
    unembed = (model.lm_head.weight.double() * model.norm.weight.double()).T  # [d, V], final norm folded
    scores = []
    for block in model.layers:
        attention = block.self_attn
        heads, dim = attention.num_heads, attention.head_dim
        value = attention.v_proj.weight.double() * block.input_layernorm.weight.double()  # [Hkv * D, d]
        out = attention.out_proj.weight.double()                  # [d, H * D]
        group = heads // attention.num_kv_heads
        row = []
        for head in range(heads):
            kv = head // group
            ov = embed @ value[kv * dim:(kv + 1) * dim].T @ out[:, head * dim:(head + 1) * dim].T @ unembed
            eigenvalues = torch.linalg.eigvals(ov)
            row.append(float(eigenvalues.sum().real / eigenvalues.abs().sum()))
        scores.append(row)
    return torch.tensor(scores)


def best_induction_head(prefix: Tensor, copying: Tensor) -> tuple[int, int]:
    """``(layer, head)`` with the highest prefix-matching score among the copying heads
    (copying score > 0), or overall when no head copies.

    Args:
        prefix: ``[layers, heads]`` from :func:`attnkit.models.induction.prefix_matching_scores`.
        copying: ``[layers, heads]`` from :func:`attnkit.models.induction.copying_scores`.

    Returns:
        ``(layer, head)`` as ints.

    Example:

    >>> import torch
    >>> from attnkit.models.induction import best_induction_head
    >>> prefix = torch.tensor([[0.1, 0.2], [0.9, 0.6]])
    >>> copying = torch.tensor([[0.5, 0.5], [-0.3, 0.8]])
    >>> best_induction_head(prefix, copying)  # (1, 0) matches best but does not copy
    (1, 1)
    """
    masked = torch.where(copying > 0, prefix, prefix - 2)
    return divmod(int(masked.argmax()), prefix.shape[1])


def head_table(model: GPT, tokens: Tensor) -> list[str]:
    """Every head's scores on ``tokens`` as lines of text, the best induction head marked.

    Args:
        model: a :class:`attnkit.models.gpt.GPT`.
        tokens: ``[B, 2 * half]`` from :func:`attnkit.models.induction.repeated_tokens`.

    Returns:
        A header line and one line per head: previous-token, prefix-matching and copying scores.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import GPT
    >>> from attnkit.models.induction import InductionConfig, repeated_tokens
    >>> config = InductionConfig()
    >>> model = GPT(config.model_config()).eval()  # untrained: no head copies yet
    >>> tokens = repeated_tokens(8, config.half, config.vocab_size, torch.Generator().manual_seed(0))
    >>> from attnkit.models.induction import head_table
    >>> lines = head_table(model, tokens)
    >>> lines[0]
    'layer head  previous-token  prefix-matching  copying'
    >>> len(lines), sum("<- induction head" in line for line in lines)
    (9, 1)
    """
    prefix, previous = prefix_matching_scores(model, tokens), previous_token_scores(model, tokens)
    copying = copying_scores(model)
    best = best_induction_head(prefix, copying)
    lines = ["layer head  previous-token  prefix-matching  copying"]
    for layer in range(prefix.shape[0]):
        for head in range(prefix.shape[1]):
            mark = "   <- induction head" if (layer, head) == best else ""
            lines.append(f"{layer:>5} {head:>4}  {float(previous[layer, head]):>14.2f}  "
                         f"{float(prefix[layer, head]):>15.2f}  {float(copying[layer, head]):>7.2f}{mark}")
    return lines
