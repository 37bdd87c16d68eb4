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
    """The demo's task and model; the defaults train in seconds on 2 CPU cores."""

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
        return GPTConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                         num_attention_heads=self.num_heads, num_key_value_heads=self.num_heads,
                         intermediate_size=1, max_position_embeddings=2 * self.half, attention_only=True)


def repeated_tokens(batch_size: int, half: int, vocab_size: int, generator: torch.Generator) -> Tensor:
    """``[B, 2 * half]``: random tokens, then the same tokens again."""
    first = torch.randint(0, vocab_size, (batch_size, half), generator=generator)
    return torch.cat([first, first], dim=1)


@dataclass
class InductionResult:
    model: GPT
    config: InductionConfig
    losses: list[float]


def train_induction(config: InductionConfig | None = None) -> InductionResult:
    """Train the attention-only model on repeated random tokens (seeded; the global RNG is left
    as it was)."""
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
    """Mean loss predicting the first half's tokens (from the second token on) and the second half's."""
    half = tokens.shape[1] // 2
    losses = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:], reduction="none")
    # Target j + 1 is predicted at position j: targets 1..half-1 are first-half tokens.
    return float(losses[:, : half - 1].mean()), float(losses[:, half - 1:].mean())


@torch.no_grad()
def prefix_matching_scores(model: GPT, tokens: Tensor) -> Tensor:
    """``[layers, heads]``: mean attention from each second-half query ``i`` to key ``i - half + 1``
    (the token after the earlier occurrence of the query's token), over ``tokens [B, 2 * half]``."""
    half = tokens.shape[1] // 2
    _, weights = model(tokens, need_weights=True)
    queries = torch.arange(half, 2 * half)
    scores = [layer[:, :, queries, queries - half + 1].mean(dim=(0, 2)) for layer in weights]
    return torch.stack(scores)


@torch.no_grad()
def previous_token_scores(model: GPT, tokens: Tensor) -> Tensor:
    """``[layers, heads]``: mean attention from each query ``i >= 1`` to key ``i - 1``."""
    _, weights = model(tokens, need_weights=True)
    queries = torch.arange(1, tokens.shape[1])
    return torch.stack([layer[:, :, queries, queries - 1].mean(dim=(0, 2)) for layer in weights])


@torch.no_grad()
def copying_scores(model: GPT) -> Tensor:
    """``[layers, heads]``: each head's OV-circuit eigenvalue score, in ``[-1, 1]``."""
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
    (copying score > 0), or overall when no head copies."""
    masked = torch.where(copying > 0, prefix, prefix - 2)
    return divmod(int(masked.argmax()), prefix.shape[1])


def head_table(model: GPT, tokens: Tensor) -> list[str]:
    """Every head's scores on ``tokens`` as lines of text, the best induction head marked."""
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
