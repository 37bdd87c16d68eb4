"""A step-by-step walkthrough of attention in the terminal.

It runs attention under :func:`attnkit.trace.record`, which keeps each named intermediate,
then prints every step with its shape, its (trimmed) values and one line of what it means,
and ends with a plain-language reading of the weights. Two sources: the toy example of
seed 002 (six hand-written 3-d token vectors) and a real pretrained encoder (MiniLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from . import masks, toy, trace
from .core import attention

MAX_ROWS, MAX_COLS = 12, 8


@dataclass(frozen=True)
class Step:
    """One named intermediate of an attention call, with labels for its rows and columns.

    Args:
        name: the step's name (``"scores"``, ``"weights"``...).
        tensor: its values, 1-D or 2-D (e.g. ``weights [L, L]``, ``inputs [L, D]``).
        meaning: one line saying what the step is.
        rows: one label per row (the tokens), or ``None``.
        cols: one label per column (the tokens, for ``[L, L]`` steps), or ``None``.

    Example:

        >>> import torch
        >>> from attnkit.explain import Step, render
        >>> step = Step("weights", torch.tensor([[1.0, 0.0], [0.5, 0.5]]), "who attends to whom",
        ...             rows=["the", "cat"], cols=["the", "cat"])
        >>> print(render([step]))
        Step 1: weights [2, 2]
          who attends to whom
                    the    cat
            the  1.0000 0.0000
            cat  0.5000 0.5000
        <BLANKLINE>
        Reading the weights:
          'the' attends most to 'the' (1.0000)
          'cat' attends most to 'the' (0.5000)
    """

    name: str
    tensor: Tensor
    meaning: str
    rows: Sequence[str] | None = None
    cols: Sequence[str] | None = None


def _keep(n: int, limit: int) -> list[int | None]:
    """Indices to show of ``n``: all if they fit, else the first ones, a gap (None), the last two."""
    if n <= limit:
        return list(range(n))
    return [*range(limit - 3), None, n - 2, n - 1]


def format_matrix(t: Tensor, rows: Sequence[str] | None = None, cols: Sequence[str] | None = None,
                  decimals: int = 4) -> str:
    """A 1-D or 2-D tensor as aligned text with row/column labels, trimmed to fit a terminal.

    Args:
        t: ``[N]`` or ``[R, C]`` values (floats, or booleans shown as ``True`` / ``.``).
        rows: ``R`` row labels, or ``None`` (ignored for a 1-D tensor).
        cols: ``C`` column labels, or ``None``.
        decimals: digits after the point.

    Returns:
        The lines of the table, joined by newlines (no trailing newline). Beyond ``MAX_ROWS``
        rows or ``MAX_COLS`` columns the middle ones become ``...``, keeping the last two.

    Example:

        >>> import torch
        >>> from attnkit.explain import format_matrix
        >>> weights = torch.tensor([[1.0, 0.0], [0.25, 0.75]])
        >>> print(format_matrix(weights, rows=["the", "cat"], cols=["the", "cat"], decimals=2))
              the  cat
        the  1.00 0.00
        cat  0.25 0.75
        >>> print(format_matrix(torch.arange(10.0), decimals=1))   # 10 columns: trimmed
        0.0 1.0 2.0 3.0 4.0 ... 8.0 9.0
        >>> print(format_matrix(weights > 0))
        True    .
        True True
    """
    t = t.detach().cpu()
    if t.dim() == 1:
        t, rows = t[None], None
    row_ids, col_ids = _keep(t.shape[0], MAX_ROWS), _keep(t.shape[1], MAX_COLS)

    def cell(i: int | None, j: int | None) -> str:
        if i is None or j is None:
            return "..."
        value = t[i, j].item()
        if t.dtype == torch.bool:
            return "True" if value else "."
        return f"{value:.{decimals}f}"

    table = [[cell(i, j) for j in col_ids] for i in row_ids]
    col_labels = [cols[j] if j is not None else "..." for j in col_ids] if cols is not None else None
    width = max(len(c) for line in table for c in line)
    if col_labels:
        width = max(width, *(len(c) for c in col_labels))
    row_labels = [rows[i] if i is not None else "..." for i in row_ids] if rows else None
    label_width = max(len(r) for r in row_labels) if row_labels else 0
    lines = []
    if col_labels:
        lines.append(" " * (label_width + 2) + " ".join(c.rjust(width) for c in col_labels))
    for r, line in enumerate(table):
        label = row_labels[r].ljust(label_width) + "  " if row_labels else ""
        lines.append(label + " ".join(c.rjust(width) for c in line))
    return "\n".join(lines)


def toy_steps(*, causal: bool = False, scale: float = 1.0) -> list[Step]:
    """Seed 002's weightless self-attention: the embeddings are queries, keys and values at once.

    Args:
        causal: apply the causal mask (and show it, and the masked scores, as steps).
        scale: the score scale (the seed's example uses 1, no ``1/sqrt(d)``).

    Returns:
        The steps ``inputs [6, 3]``, ``scores``, ``scaled_scores``, (``mask``,
        ``masked_scores``,) ``weights`` (all ``[6, 6]``) and ``context [6, 3]``, labelled with
        the six tokens of ``attnkit.toy.TOKENS``.

    Example:

        >>> from attnkit.explain import toy_steps
        >>> steps = toy_steps(causal=True)
        >>> [step.name for step in steps]
        ['inputs', 'scores', 'scaled_scores', 'mask', 'masked_scores', 'weights', 'context']
        >>> steps[5].rows[1], steps[5].tensor[1]       # "journey" attends to "Your" and itself
        ('journey', tensor([0.3680, 0.6320, 0.0000, 0.0000, 0.0000, 0.0000]))
    """
    tokens = toy.TOKENS
    inputs = toy.embeddings()
    with trace.record() as recorded:
        attention(inputs, inputs, inputs, causal=causal, scale=scale)
    found = recorded[0].steps
    scale_note = ("scale = 1: the seed's weightless example does not divide by sqrt(d)" if scale == 1.0
                  else f"scale = {scale:g} keeps the softmax from saturating")
    steps = [
        Step("inputs", inputs, "one embedding per token; here they serve as queries, keys and values", tokens),
        Step("scores", found["scores"], "query . key for every pair: how similar two tokens are", tokens, tokens),
        Step("scaled_scores", found["scaled_scores"], f"scores x scale ({scale_note})", tokens, tokens),
    ]
    if causal:
        steps.append(Step("mask", masks.causal_mask(len(tokens)),
                          "causal: True where a token may attend (itself and earlier tokens)", tokens, tokens))
        steps.append(Step("masked_scores", found["masked_scores"],
                          "-inf where attention is not allowed, so softmax gives it zero weight", tokens, tokens))
    steps.append(Step("weights", found["weights"],
                      "softmax of each row: the share of attention each token pays to each other, summing to 1",
                      tokens, tokens))
    steps.append(Step("context", found["output"],
                      "weights @ values: each token's attention-weighted average of the value vectors", tokens))
    return steps


def model_steps(encoder, text: str, *, layer: int = 0, head: int = 0, causal: bool = False) -> list[Step]:
    """One head of one layer of a real encoder (see :func:`attnkit.models.load`) on ``text``.

    Args:
        encoder: a loaded :class:`attnkit.models.TextEncoder`.
        text: one text; its tokens (special tokens included) label the steps.
        layer: ``0 <= layer < num_hidden_layers``.
        head: ``0 <= head < num_attention_heads``.
        causal: run every layer with a causal mask (one the model was not trained with).

    Returns:
        The steps of that layer for ``L`` tokens, ``inputs [L, E]``, head ``head``'s
        ``queries``, ``keys``, ``values [L, D]``, ``scores``, ``scaled_scores``,
        (``masked_scores``,) ``weights [L, L]``, ``heads [L, D]``, and the layer's
        ``concatenated`` and ``projected [L, E]``.

    Raises:
        ValueError: ``layer`` or ``head`` is out of range for the model.

    Example:

        >>> from attnkit import models
        >>> from attnkit.explain import model_steps
        >>> encoder = models.load("minilm")                       # 6 layers x 12 heads, E = 384
        >>> steps = model_steps(encoder, "Hello world", layer=5, head=11)
        >>> [(step.name, tuple(step.tensor.shape)) for step in steps][:6]
        [('inputs', (4, 384)), ('queries', (4, 32)), ('keys', (4, 32)), ('values', (4, 32)),
         ('scores', (4, 4)), ('scaled_scores', (4, 4))]
        >>> steps[0].rows
        ['[CLS]', 'hello', 'world', '[SEP]']
        >>> model_steps(encoder, "Hello world", layer=6)
        Traceback (most recent call last):
            ...
        ValueError: layer must be in [0, 5] for this model, got 6
    """
    config = encoder.model.config
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(f"layer must be in [0, {config.num_hidden_layers - 1}] for this model, got {layer}")
    if not 0 <= head < config.num_attention_heads:
        raise ValueError(f"head must be in [0, {config.num_attention_heads - 1}] for this model, got {head}")
    with trace.record() as recorded:
        out = encoder.encode(text, causal=causal)
    tokens = out.tokens[0]
    call = recorded.layers[layer]
    d = call["queries"].shape[-1]
    first = lambda name: call.head(name, head)[0]  # noqa: E731  (batch of one text)
    steps = [
        Step("inputs", call["inputs"][0], f"the hidden states entering layer {layer}: one vector per token", tokens),
        Step("queries", first("queries"), f"inputs @ W_q, head {head}'s slice: what each token looks for", tokens),
        Step("keys", first("keys"), "inputs @ W_k: what each token offers to be found by", tokens),
        Step("values", first("values"), "inputs @ W_v: what each token passes on when attended", tokens),
        Step("scores", first("scores"), "query . key for every pair of tokens", tokens, tokens),
        Step("scaled_scores", first("scaled_scores"), f"scores / sqrt({d}): keeps the softmax from saturating",
             tokens, tokens),
    ]
    if "masked_scores" in call.steps:
        steps.append(Step("masked_scores", first("masked_scores"),
                          "-inf where a token may not attend (padding or the causal mask)", tokens, tokens))
    steps += [
        Step("weights", first("weights"), "softmax of each row: how much each token attends to each other",
             tokens, tokens),
        Step("heads", first("output"), f"weights @ values: head {head}'s context vector for each token", tokens),
        Step("concatenated", call["concatenated"][0], "all heads' context vectors side by side", tokens),
        Step("projected", call["projected"][0], "concatenated @ W_o: the attention layer's output", tokens),
    ]
    return steps


class GPTDirectory:
    """A GPT that ``attnkit train`` wrote (:func:`attnkit.models.llama_export.written_by_save_llama`),
    run by attnkit's own :class:`~attnkit.models.gpt.GPT`, for :func:`attnkit.explain.checkpoint_steps`.
    Not through transformers: its ``AutoModel`` is the Llama body without the LM head, and loading
    the head's weights into it printed a load report about an unexpected ``lm_head.weight``.

    Args:
        directory: a Llama-format directory with ``config.json``, ``model.safetensors`` and
            ``tokenizer.json``.

    Attributes ``model`` (the GPT, in eval mode), ``tokenizer``, ``name`` (the directory's
    name), ``num_layers`` and ``num_heads``.

    Raises:
        FileNotFoundError: the directory or its weights are missing.
        ValueError: it has no ``tokenizer.json``, or a file is damaged (see
            :func:`attnkit.models.llama_export.load_llama`).

    Example:

        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.models.llama_export import save_llama
        >>> from attnkit.training.corpus import train_tokenizer
        >>> config = GPTConfig(vocab_size=300, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=32)
        >>> tokenizer = train_tokenizer(["the cat sat on the mat"] * 4, 300)
        >>> directory = save_llama(GPT(config), "tiny-gpt", tokenizer)   # what attnkit train writes
        >>> from attnkit.explain import GPTDirectory
        >>> gpt = GPTDirectory(directory)
        >>> gpt.name, gpt.num_layers, gpt.num_heads
        ('tiny-gpt', 2, 4)
    """

    def __init__(self, directory: str | Path) -> None:
        from .models.llama_export import load_llama

        self.model, self.tokenizer = load_llama(directory)
        if self.tokenizer is None:
            raise ValueError(f"model directory {str(directory)!r} has no tokenizer.json")
        self.name = Path(directory).name or str(directory)
        self.num_layers = self.model.config.num_hidden_layers
        self.num_heads = self.model.config.num_attention_heads

    def trace(self, text: str) -> tuple[trace.Trace, list[str]]:
        """Every attention call of ``text`` (a batch of one), one per layer, and its tokens.

        Args:
            text: the text to run through the model (a decoder: each token sees itself and
                the tokens before it).

        Returns:
            A pair ``(trace, tokens)``, an :class:`attnkit.trace.Trace` with one call per layer
            (``weights [1, H, L, L]``) and the ``L`` tokens as the tokenizer spells them.

        Raises:
            ValueError: ``text`` gives no tokens.

        Example:

            >>> from attnkit.models.gpt import GPT, GPTConfig
            >>> from attnkit.models.llama_export import save_llama
            >>> from attnkit.training.corpus import train_tokenizer
            >>> config = GPTConfig(vocab_size=300, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
            ...                    num_key_value_heads=2, intermediate_size=32)
            >>> tokenizer = train_tokenizer(["the cat sat on the mat"] * 4, 300)
            >>> directory = save_llama(GPT(config), "tiny-gpt", tokenizer)   # what attnkit train writes
            >>> from attnkit.explain import GPTDirectory
            >>> trace, tokens = GPTDirectory(directory).trace("the cat sat")
            >>> tokens                                            # byte-level BPE: Ġ is a space
            ['the', 'Ġcat', 'Ġsat']
            >>> len(trace), trace[1]["weights"].shape             # 2 layers; [B, H, L, L]
            (2, torch.Size([1, 4, 3, 3]))
        """
        ids = self.tokenizer.encode(text).ids
        if not ids:
            raise ValueError(f"text {text!r} gives no tokens")
        with trace.record() as recorded, torch.no_grad():
            self.model(torch.tensor([ids]))
        return recorded, [self.tokenizer.id_to_token(i) for i in ids]


def checkpoint_steps(checkpoint, text: str, *, layer: int = 0, head: int = 0) -> list[Step]:
    """One head of one layer of a transformers checkpoint
    (:class:`attnkit.integrations.checkpoints.Checkpoint`, or a :class:`attnkit.explain.GPTDirectory`)
    on ``text``: the steps :func:`attnkit.attention` recorded, the mask the model applied drawn as
    its own step (a decoder's causal mask, a window).

    Args:
        checkpoint: anything with ``num_layers``, ``num_heads`` and ``trace(text)`` as those two
            have.
        text: one text.
        layer: ``0 <= layer < checkpoint.num_layers``.
        head: ``0 <= head < checkpoint.num_heads`` (a query head; with grouped-query attention
            its keys and values are those of the key/value head it reads).

    Returns:
        The steps for ``L`` tokens, ``queries``, ``keys``, ``values [L, D]``, ``scores``,
        ``scaled_scores`` (then where they apply ``capped_scores``, ``mask``,
        ``masked_scores`` or ``biased_scores``), ``weights [L, L]`` and ``heads [L, D]``.

    Raises:
        ValueError: ``layer`` or ``head`` is out of range for the model.

    Example:

        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.models.llama_export import save_llama
        >>> from attnkit.training.corpus import train_tokenizer
        >>> config = GPTConfig(vocab_size=300, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=32)
        >>> tokenizer = train_tokenizer(["the cat sat on the mat"] * 4, 300)
        >>> directory = save_llama(GPT(config), "tiny-gpt", tokenizer)   # what attnkit train writes
        >>> from attnkit.explain import GPTDirectory, checkpoint_steps
        >>> steps = checkpoint_steps(GPTDirectory(directory), "the cat sat", layer=1, head=3)
        >>> [step.name for step in steps]
        ['queries', 'keys', 'values', 'scores', 'scaled_scores', 'mask', 'masked_scores', 'weights', 'heads']
        >>> steps[1].meaning
        'its keys (key/value head 1, shared by 2 query heads): what each token offers to be found by'
        >>> steps[5].tensor                                       # causal: itself and before
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """
    if not 0 <= layer < checkpoint.num_layers:
        raise ValueError(f"layer must be in [0, {checkpoint.num_layers - 1}] for this model, got {layer}")
    if not 0 <= head < checkpoint.num_heads:
        raise ValueError(f"head must be in [0, {checkpoint.num_heads - 1}] for this model, got {head}")
    recorded, tokens = checkpoint.trace(text)
    call = recorded[layer]
    d = call["queries"].shape[-1]
    first = lambda name: call.head(name, head)[0]  # noqa: E731  (batch of one text)
    groups = call["queries"].shape[1] // call["keys"].shape[1]
    shared = f" (key/value head {head // groups}, shared by {groups} query heads)" if groups > 1 else ""
    steps = [
        Step("queries", first("queries"), f"head {head}'s queries: what each token looks for", tokens),
        Step("keys", first("keys"), f"its keys{shared}: what each token offers to be found by", tokens),
        Step("values", first("values"), "its values: what each token passes on when attended", tokens),
        Step("scores", first("scores"), "query . key for every pair of tokens", tokens, tokens),
        Step("scaled_scores", first("scaled_scores"), f"scores x the model's scale (1/sqrt({d}) unless it says "
             "otherwise)", tokens, tokens),
    ]
    if "capped_scores" in call.steps:
        steps.append(Step("capped_scores", first("capped_scores"),
                          "soft-capped: cap * tanh(score / cap) keeps every score within the cap", tokens, tokens))
    if "masked_scores" in call.steps:
        masked, allowed = first("masked_scores"), first("masked_scores") > float("-inf")
        if not bool(allowed.all()):
            steps.append(Step("mask", allowed, "True where a token may attend: the model's mask "
                              "(causal in a decoder: itself and earlier tokens)", tokens, tokens))
        before = steps[-1].tensor if bool(allowed.all()) else steps[-2].tensor
        if not torch.equal(masked.masked_fill(~allowed, 0), before.masked_fill(~allowed, 0)):
            steps.append(Step("biased_scores", masked, "plus the model's additive bias (T5: relative positions)"
                              + ("; -inf where a token may not attend" if not bool(allowed.all()) else ""),
                              tokens, tokens))
        elif not bool(allowed.all()):
            steps.append(Step("masked_scores", masked, "-inf where a token may not attend", tokens, tokens))
    steps += [
        Step("weights", first("weights"), "softmax of each row: how much each token attends to each other",
             tokens, tokens),
        Step("heads", first("output"), f"weights @ values: head {head}'s context vector for each token", tokens),
    ]
    return steps


def reading(weights: Tensor, tokens: Sequence[str]) -> list[str]:
    """Plain-language reading of a ``[L, L]`` weight matrix: whom each token attends most.

    Args:
        weights: ``[L, L]``, queries as rows.
        tokens: the ``L`` tokens (the first of equal weights wins).

    Returns:
        One line per token.

    Example:

        >>> import torch
        >>> from attnkit.explain import reading
        >>> reading(torch.tensor([[0.9, 0.1], [0.3, 0.7]]), ["the", "cat"])
        ["'the' attends most to 'the' (0.9000)", "'cat' attends most to 'cat' (0.7000)"]
    """
    lines = []
    for i, token in enumerate(tokens):
        row = weights[i]
        j = int(row.argmax())
        lines.append(f"'{token}' attends most to '{tokens[j]}' ({float(row[j]):.4f})")
    return lines


def render(steps: Sequence[Step]) -> str:
    """The walkthrough as text: each step's name, shape, meaning and values.

    Args:
        steps: the steps in order; one must be named ``"weights"`` (its ``rows`` label the
            closing reading).

    Returns:
        The text (what ``attnkit explain`` prints), ending with a plain-language reading of the
        weights (see :func:`attnkit.explain.reading`).

    Raises:
        ValueError: no step is named ``"weights"``.

    Example:

        >>> from attnkit.explain import render, toy_steps
        >>> print(render(toy_steps()))
        Step 1: inputs [6, 3]
          one embedding per token; here they serve as queries, keys and values
            Your     0.4300 0.1500 0.8900
        ...
        Step 4: weights [6, 6]
          softmax of each row: the share of attention each token pays to each other, summing to 1
                        Your journey  starts    with     one    step
            Your      0.2098  0.2006  0.1981  0.1242  0.1220  0.1452
        ...
        Reading the weights:
          'Your' attends most to 'Your' (0.2098)
          'journey' attends most to 'journey' (0.2379)
        ...
          'step' attends most to 'journey' (0.2184)
    """
    out = []
    for number, step in enumerate(steps, start=1):
        out.append(f"Step {number}: {step.name} {list(step.tensor.shape)}")
        out.append(f"  {step.meaning}")
        body = format_matrix(step.tensor, step.rows, step.cols)
        out.append("\n".join("    " + line for line in body.splitlines()))
        out.append("")
    weights = next((s for s in steps if s.name == "weights"), None)
    if weights is None:
        raise ValueError(f"steps: one must be named 'weights' (its rows label the reading); got {[s.name for s in steps]}")
    out.append("Reading the weights:")
    out.extend("  " + line for line in reading(weights.tensor, weights.rows or []))
    return "\n".join(out)
