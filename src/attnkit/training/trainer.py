"""Train a :class:`~attnkit.models.gpt.GPT` on the Python Language Reference, nanoGPT style.

::

    sections -> train / validation -> byte-level BPE -> documents packed into rows    corpus, packing
    for step in range(steps):
        rows = batch_order(step, seed)                     (a pure function: resumable)
        loss = cross_entropy(GPT(inputs, mask=document(ids), positions=per document), targets)
        backward, clip the gradient norm, AdamW with warm-up + cosine learning rate
        every eval_interval: validation loss;  every checkpoint_interval: checkpoint
    export the model as a Hugging Face Llama directory, print a sample

Everything random comes from the seed: the model's initial weights (drawn inside
``torch.random.fork_rng``, so the caller's global RNG is left as it was), the row order, and a
``torch.Generator`` for attention dropout whose state the checkpoint keeps. Resuming from a
checkpoint continues bit for bit (tested) on the same machine and thread count.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from ..masks import document
from ..models.generate import generate_text
from ..models.gpt import GPT, GPTConfig, document_positions, language_model_loss
from ..models.llama_export import save_llama
from ..cli import MAX_LEARNING_RATE
from . import checkpoint, corpus
from .packing import Rows, batch_order, pack_documents


@dataclass
class TrainConfig:
    """What :func:`attnkit.training.train` does; the defaults finish in a few minutes on 2 CPU cores.

    The run (``steps``, ``batch_size`` rows of ``seq_len`` tokens a step, ``seed``), the AdamW
    schedule (:func:`attnkit.training.learning_rate`), evaluation and checkpoint intervals, the
    tokenizer's ``vocab_size``, the model's sizes (:meth:`attnkit.training.TrainConfig.model_config`),
    ``max_documents`` (only the first sections of the corpus) and ``sample_tokens`` (the sample's
    length, 0: none).

    Raises:
        ValueError: a count that is not an int >= 1 (``warmup_steps`` and ``sample_tokens``:
            >= 0), a learning rate or ``grad_clip`` that is not > 0, or a learning rate above the
            command line's bound (``attnkit.cli.MAX_LEARNING_RATE``).

    Example:

        >>> from attnkit.training import TrainConfig
        >>> config = TrainConfig(out="tiny-gpt", steps=2, seq_len=16, hidden_size=16, num_layers=1)
        >>> config.batch_size, config.learning_rate, config.num_heads
        (16, 0.003, 4)
        >>> TrainConfig(steps=0)
        Traceback (most recent call last):
            ...
        ValueError: steps must be an int >= 1, got 0
    """

    out: str = "attnkit-gpt"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_rows: int = 32
    checkpoint_interval: int = 100
    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 352
    attention_dropout: float = 0.0
    max_documents: int | None = None  # use only the first N sections (tests)
    sample_tokens: int = 80

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "warmup_steps", "eval_interval", "eval_rows",
                     "checkpoint_interval", "vocab_size", "sample_tokens"):
            value, least = getattr(self, name), 0 if name in ("warmup_steps", "sample_tokens") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        for name in ("learning_rate", "min_learning_rate", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("learning_rate", "min_learning_rate"):  # the CLI's bound: AdamW would overflow far above
            if not getattr(self, name) <= MAX_LEARNING_RATE:
                raise ValueError(f"{name} must be at most {MAX_LEARNING_RATE:g}, got {getattr(self, name)!r}")

    def model_config(self, vocab_size: int, eos: int) -> GPTConfig:
        """The :class:`attnkit.models.gpt.GPTConfig` of the model to train: this config's sizes, the
        tokenizer's ``vocab_size``, ``eos`` (the ``<|endoftext|>`` id) as the first and last token,
        room for ``max(seq_len, 256)`` positions.

        Raises:
            ValueError: sizes the model refuses (see :class:`attnkit.models.gpt.GPTConfig`).

        Example:

            >>> from attnkit.training import TrainConfig
            >>> config = TrainConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
            >>> model = config.model_config(vocab_size=300, eos=0)
            >>> model.vocab_size, model.num_hidden_layers, model.head_dim, model.max_position_embeddings
            (300, 1, 16, 256)
        """
        return GPTConfig(vocab_size=vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                         num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                         intermediate_size=self.intermediate_size, max_position_embeddings=max(self.seq_len, 256),
                         attention_dropout=self.attention_dropout, bos_token_id=eos, eos_token_id=eos)


@dataclass
class TrainResult:
    """What :func:`attnkit.training.train` returns: the trained ``model`` (eval mode) and its
    ``tokenizer``, ``losses`` and ``evals`` (``(step, loss)`` pairs: the training loss of every step,
    the validation loss every ``eval_interval`` steps and at the end), ``tokens_per_second`` (real
    tokens over the time spent in steps), ``model_dir`` (the Hugging Face Llama export) and
    ``sample`` (text generated from ``"The "``).

    Example:

        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training import TrainResult
        >>> result = TrainResult(GPT(GPTConfig(hidden_size=16, num_hidden_layers=1)), tokenizer=None)
        >>> result.losses, result.evals, result.model_dir, result.sample  # train fills them in
        ([], [], None, '')
    """

    model: GPT
    tokenizer: object
    losses: list[tuple[int, float]] = field(default_factory=list)       # (step, training loss)
    evals: list[tuple[int, float]] = field(default_factory=list)        # (step, validation loss)
    tokens_per_second: float = 0.0
    model_dir: Path | None = None
    sample: str = ""


# Settings that do not change what a step computes (steps stretches the schedule: resuming with the
# same steps is what continues bit for bit).
_MAY_CHANGE = ("steps", "out", "eval_interval", "checkpoint_interval", "sample_tokens")


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``learning_rate``, then a cosine down to ``min_learning_rate``.

    Args:
        step: the training step (0 first).
        config: the :class:`attnkit.training.TrainConfig` (``learning_rate``,
            ``min_learning_rate``, ``warmup_steps``, ``steps``).

    Returns:
        The step's learning rate, a float (``min_learning_rate`` from step ``steps`` on).

    Example:

        >>> from attnkit.training import TrainConfig, learning_rate
        >>> config = TrainConfig(steps=100, warmup_steps=10, learning_rate=1e-3, min_learning_rate=1e-4)
        >>> [round(learning_rate(step, config), 6) for step in (0, 9, 10, 55, 100)]
        [0.0001, 0.001, 0.001, 0.00055, 0.0001]
    """
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.min_learning_rate + cosine * (config.learning_rate - config.min_learning_rate)


def row_loss(model: GPT, rows: Rows, generator: torch.Generator | None = None):
    """Mean next-token loss of packed rows (document mask, positions restarting per document).

    Args:
        model: a :class:`attnkit.models.gpt.GPT`.
        rows: :class:`attnkit.training.Rows` ``[N, T]`` (from :func:`attnkit.training.pack_documents`).
        generator: the attention dropout's generator (None: the global RNG).

    Returns:
        The loss, a scalar tensor (differentiable), over the targets that are not ``-100``.

    Example:

        An untrained model scores about ``ln(vocab_size)``:

        >>> import math, torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training import pack_documents
        >>> model = GPT(GPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))  # untrained
        >>> documents = torch.randint(1, 64, (6, 10), generator=torch.Generator().manual_seed(0)).tolist()
        >>> rows = pack_documents(documents, 16)
        >>> from attnkit.training.trainer import row_loss
        >>> loss = row_loss(model, rows)
        >>> loss.shape, loss.requires_grad, abs(loss.item() - math.log(64)) < 0.1
        (torch.Size([]), True, True)
    """
    logits = model(rows.inputs, mask=document(ids=rows.doc_ids), positions=document_positions(rows.doc_ids),
                   generator=generator)
    return language_model_loss(logits, rows.targets)


@torch.no_grad()
def evaluate(model: GPT, rows: Rows, batch_size: int) -> float:
    """Validation loss, weighted by each batch's real tokens.

    Args:
        model: a :class:`attnkit.models.gpt.GPT` (run in eval mode, its mode restored after).
        rows: the validation :class:`attnkit.training.Rows`.
        batch_size: rows a forward pass.

    Returns:
        The mean loss over every real token, a float (0.0 for no rows).

    Example:

        >>> import math, torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training import pack_documents
        >>> model = GPT(GPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))  # untrained
        >>> documents = torch.randint(1, 64, (6, 10), generator=torch.Generator().manual_seed(0)).tolist()
        >>> rows = pack_documents(documents, 16)
        >>> from attnkit.training import evaluate
        >>> loss = evaluate(model, rows, batch_size=2)
        >>> isinstance(loss, float), abs(loss - math.log(64)) < 0.1
        (True, True)
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows.select(slice(start, start + batch_size))
        total += float(row_loss(model, batch)) * batch.real_tokens
        count += batch.real_tokens
    model.train(was_training)
    return total / max(count, 1)


class Progress:
    """One status line on ``stream``: redrawn in place on a terminal, a line per report otherwise.

    ``total``: the run's steps; ``stream``: a text stream, or None (nothing is written). The clock
    starts at construction.

    Example:

        >>> import io
        >>> from attnkit.training.trainer import Progress
        >>> log = io.StringIO()  # not a terminal: only forced reports are written
        >>> progress = Progress(10, log)
        >>> progress.update(5, 2.5, 1234.0, force=True)
        >>> print(log.getvalue(), end="")
        step     5/10 [##########..........] loss 2.500 | 1,234 tok/s | ...s
    """

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total, self.stream = total, stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.started = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_second: float, note: str = "", *, force: bool = False) -> None:
        """Report ``step`` of ``total`` with its ``loss``, the speed and the time so far, then
        ``note``. On a terminal the line is redrawn in place (``force``: and kept, a new line
        after it); on another stream only forced reports are written, a line each.

        Example:

            >>> import io
            >>> from attnkit.training.trainer import Progress
            >>> log = io.StringIO()
            >>> progress = Progress(4, log)
            >>> progress.update(1, 3.0, 100.0)  # not forced: not written to a file
            >>> progress.update(4, 2.0, 100.0, " | validation 2.100", force=True)
            >>> print(log.getvalue(), end="")
            step     4/4 [####################] loss 2.000 | 100 tok/s | ...s | validation 2.100
        """
        if self.stream is None or not (self.tty or force):
            return
        filled = 20 * step // self.total
        line = (f"step {step:>5}/{self.total} [{'#' * filled}{'.' * (20 - filled)}] loss {loss:.3f} "
                f"| {tokens_per_second:,.0f} tok/s | {time.perf_counter() - self.started:.0f}s{note}")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        if self.tty and force:
            self.stream.write("\n")
        self.stream.flush()


def prepare_data(config: TrainConfig, tokenizer=None):
    """``(tokenizer, train rows, validation rows)``; the tokenizer is trained unless given.

    The corpus's sections (the first ``max_documents``), split by
    :func:`attnkit.training.corpus.split_documents`, encoded and packed into rows of ``seq_len``
    (:func:`attnkit.training.pack_documents`); the validation rows are cut to ``eval_rows``.

    Args:
        config: the :class:`attnkit.training.TrainConfig`.
        tokenizer: a ``tokenizers.Tokenizer`` (a resumed run's), or None to train one of
            ``vocab_size`` tokens on the training documents.

    Raises:
        ValueError: ``seq_len`` is longer than the training documents' tokens (one row would hold
            them all, the rest padding).

    Example:

        >>> from attnkit.training import TrainConfig
        >>> from attnkit.training.trainer import prepare_data
        >>> config = TrainConfig(seq_len=16, vocab_size=260, max_documents=6, eval_rows=2)
        >>> tokenizer, train_rows, validation_rows = prepare_data(config)
        >>> tokenizer.get_vocab_size(), train_rows.inputs.shape[1], validation_rows.inputs.shape
        (260, 16, torch.Size([2, 16]))
    """
    sections = corpus.python_reference_sections()
    if config.max_documents is not None:
        sections = sections[: config.max_documents]
    train_docs, val_docs = corpus.split_documents(sections)
    if not val_docs:  # tiny runs: hold out the last document
        train_docs, val_docs = train_docs[:-1], train_docs[-1:]
    if tokenizer is None:
        tokenizer = corpus.train_tokenizer(train_docs, config.vocab_size)
    marker = tokenizer.token_to_id(corpus.END_OF_TEXT)
    train_encoded = corpus.encode_documents(tokenizer, train_docs)
    # A row longer than the whole training text is padding and nothing else, and packing would build
    # it: `--seq-len 1000000000` had three [10**9] tensors made and the process killed for memory.
    pairs = sum(max(len(doc) - 1, 0) for doc in train_encoded)
    if config.seq_len > pairs:
        raise ValueError(f"seq_len {config.seq_len:,} is longer than the {pairs:,} training tokens of these "
                         f"{len(train_docs)} documents: each row would be mostly padding")
    train_rows = pack_documents(train_encoded, config.seq_len, pad_token_id=marker)
    val_rows = pack_documents(corpus.encode_documents(tokenizer, val_docs), config.seq_len, pad_token_id=marker)
    return tokenizer, train_rows, val_rows.select(slice(0, config.eval_rows))


def train(config: TrainConfig, *, resume: bool = False, until: int | None = None,
          log: TextIO | None = None, quiet: bool = False) -> TrainResult:
    """Train (or resume) as ``config`` says; writes checkpoints to ``out/checkpoint`` and the
    final model, in Hugging Face Llama format, to ``out/model``.

    ``until`` stops after that step (with a checkpoint) as if interrupted there: the schedule
    still runs to ``config.steps``, and ``resume=True`` later continues exactly. Progress goes to
    ``log`` (default stderr) unless ``quiet``.

    Args:
        config: the :class:`attnkit.training.TrainConfig`.
        resume: continue from the checkpoint in ``out/checkpoint``.
        until: stop after this step, or None (``config.steps``).
        log: where progress goes (default stderr).
        quiet: print nothing.

    Returns:
        A :class:`attnkit.training.TrainResult`.

    Raises:
        ValueError: ``out`` is a file; on ``resume``, a checkpoint trained with other settings
            (only ``steps``, ``out``, ``eval_interval``, ``checkpoint_interval`` and
            ``sample_tokens`` may change) or a damaged one.
        FileNotFoundError: ``resume`` with no checkpoint in ``out/checkpoint``.

    Example:

        Two steps of a tiny model, interrupted after the first and resumed:

        >>> import os
        >>> from attnkit.training import TrainConfig, train
        >>> config = TrainConfig(out="tiny-gpt", steps=2, batch_size=2, seq_len=16, warmup_steps=1,
        ...                      vocab_size=260, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
        ...                      intermediate_size=32, max_documents=6, eval_rows=2, sample_tokens=0)
        >>> first = train(config, until=1, quiet=True)
        >>> result = train(config, resume=True, quiet=True)
        >>> [step for step, _ in result.losses], [step for step, _ in result.evals]
        ([1, 2], [2])
        >>> sorted(os.listdir("tiny-gpt")), sorted(os.listdir("tiny-gpt/model"))
        (['checkpoint', 'model'], ['config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'])
    """
    log = None if quiet else (log or sys.stderr)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} is a file; give a directory")
    checkpoint_dir = out / "checkpoint"
    tokenizer = None
    if resume:
        # Located once, so the state, the tokenizer and the tensors all come from the same save.
        source = checkpoint.find_checkpoint(checkpoint_dir)
        saved = checkpoint.read_state(source, steps=config.steps)["train_config"]
        differing = sorted(key for key, value in asdict(config).items()
                           if key not in _MAY_CHANGE and saved.get(key) != value)
        if differing:
            raise ValueError(f"resume: the checkpoint in {str(checkpoint_dir)!r} was trained with other settings "
                             f"({', '.join(differing)}); only {', '.join(_MAY_CHANGE)} may change")
        tokenizer = checkpoint.read_tokenizer(source)
    tokenizer, train_rows, val_rows = prepare_data(config, tokenizer)
    eos = tokenizer.token_to_id(corpus.END_OF_TEXT)
    model_config = config.model_config(tokenizer.get_vocab_size(), eos)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = GPT(model_config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.learning_rate, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(config.seed)
    result = TrainResult(model, tokenizer)
    start = 0
    if resume:
        record = checkpoint.load_checkpoint(source, model=model, optimizer=optimizer, generator=generator,
                                            steps=config.steps)
        start = record["step"]
        result.losses = [tuple(x) for x in record["losses"]]
        result.evals = [tuple(x) for x in record["evals"]]

    if log is not None:
        print(f"training a {model.num_parameters() / 1e6:.2f}M-parameter GPT on {len(train_rows)} rows x "
              f"{config.seq_len} tokens ({train_rows.real_tokens:,} real) for {config.steps} steps"
              + (f", resuming at step {start}" if start else ""), file=log)
    progress = Progress(config.steps, log)
    tokens, elapsed, loss_value = 0, 0.0, float("nan")

    def save(step: int) -> None:
        state = {"step": step, "train_config": asdict(config), "model_config": model_config.to_dict(),
                 "losses": result.losses, "evals": result.evals}
        checkpoint.save_checkpoint(checkpoint_dir, model=model, optimizer=optimizer, generator=generator,
                                   state=state, tokenizer=tokenizer)

    last = config.steps if until is None else min(until, config.steps)
    for step in range(start, last):
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        batch = train_rows.select(batch_order(len(train_rows), config.batch_size, step, config.seed))
        loss = row_loss(model, batch, generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        result.losses.append((step + 1, loss_value))
        elapsed += time.perf_counter() - began
        tokens += batch.real_tokens
        done = step + 1
        note, report = "", False
        if done % config.eval_interval == 0 or done == config.steps:
            result.evals.append((done, evaluate(model, val_rows, config.batch_size)))
            note, report = f" | validation {result.evals[-1][1]:.3f}", True
        progress.update(done, loss_value, tokens / elapsed, note, force=report)
        if done % config.checkpoint_interval == 0 or done == last:
            save(done)
    result.tokens_per_second = tokens / elapsed if elapsed else 0.0
    model.eval()
    result.model_dir = save_llama(model, out / "model", tokenizer)
    if config.sample_tokens:
        result.sample = generate_text(model, tokenizer, ["The "], config.sample_tokens, temperature=0.8, top_k=40,
                                      generator=torch.Generator().manual_seed(config.seed))[0]
    return result
