"""Text generation with a :class:`~attnkit.models.gpt.GPT` and its KV cache.

Prompts of different lengths run as one batch, **left-padded**: each row's rotary positions
start at its own first real token and a key-padding mask hides the pad keys, so every row
computes exactly what it would alone. The prompt runs once (prefill), then one token a step
reads the cache; bottom-right causal alignment makes the step's query the last row::

    prompt lengths 3 and 5, left-padded to 5        decode step (Lq = 1, Lk = 6)
    row 0:  p p a b c     keys 0, 1 hidden           row 0: . . # # # #
    row 1:  a b c d e                                row 1: # # # # # #

Sampling: ``temperature=0`` is greedy (argmax); otherwise logits / temperature, then top-k,
then top-p (nucleus), drawn with ``torch.multinomial`` from ``generator``, never the global RNG.
A temperature so small that logits / temperature overflows float32 (e.g. ``1e-45``) is greedy
too: sampling tends to the argmax as the temperature goes to 0, and the division would give inf.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from .gpt import GPT


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None, max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def _token_dtype(token: object) -> str | None:
    """The dtype of ``token`` when it is no integer token id, else None. A float id (``1.5``) would be
    truncated to another token and a bool is no id, so both are refused rather than converted."""
    if isinstance(token, Tensor):
        dtype = token.dtype
        return None if not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool) else str(dtype)
    dtype = getattr(token, "dtype", None)  # a NumPy scalar: np.bool_ has __index__ in older NumPy
    if isinstance(token, bool) or (dtype is not None and getattr(dtype, "kind", "i") not in "iu"):
        return str(dtype or type(token).__name__)
    try:
        operator.index(token)
    except TypeError:
        return type(token).__name__
    return None


def _check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    for row, prompt in enumerate(prompts):
        for token in prompt:
            dtype = _token_dtype(token)
            if dtype is not None:
                raise TypeError(f"prompts must hold integer token ids, got {dtype} ({token!r}) in prompt {row}")


def _check_pad(pad_token_id: object, vocab_size: int) -> None:
    if isinstance(pad_token_id, Tensor) or _token_dtype(pad_token_id) is not None \
            or not 0 <= operator.index(pad_token_id) < vocab_size:
        raise ValueError(f"pad_token_id must be an int in [0, {vocab_size}) (the model's vocabulary), "
                         f"got {pad_token_id!r}")


def next_token(logits: Tensor, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row from ``logits [B, vocab]`` -> ``[B]``. A temperature so small that
    ``logits / temperature`` overflows is greedy (the limit of sampling as the temperature goes to 0).

    Args:
        logits: ``[B, vocab]`` next-token logits; ``-inf`` bans a token.
        temperature: 0 for greedy (argmax), else the softmax temperature.
        top_k: sample among the ``top_k`` most likely tokens only (None: all).
        top_p: sample among the smallest set of most likely tokens holding ``top_p`` of the
            probability (nucleus sampling; None: all).
        generator: the ``torch.Generator`` to sample from (None: torch's default one).

    Returns:
        ``[B]`` int64 token ids.

    The arguments are not checked here (:func:`attnkit.models.generate.generate` checks them).

    Example:

    >>> import torch
    >>> from attnkit.models.generate import next_token
    >>> logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    >>> next_token(logits)
    tensor([1, 0])
    >>> generator = torch.Generator().manual_seed(0)
    >>> next_token(logits, temperature=1.0, top_k=1, generator=generator)  # top-1 is the argmax
    tensor([1, 0])
    >>> banned = torch.tensor([[0.0, float("-inf"), 0.0]]).expand(100, 3)
    >>> bool((next_token(banned, temperature=1.0, generator=generator) != 1).all())
    True
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    greedy = logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    overflow = (scaled.isinf() & logits.isfinite()).any(dim=-1)  # [B]; -inf logits (banned tokens) are no overflow
    if bool(overflow.all()):
        return greedy
    # A row that overflows would give softmax inf - inf = NaN: it is drawn on harmless logits, then replaced.
    logits = scaled.masked_fill(overflow[:, None], 0.0)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the
        # first token is always kept).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(overflow, greedy, sampled)


@torch.no_grad()
def generate(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Continue each prompt (a list of integer token ids, at least one) by up to ``max_new_tokens``.

    Returns the new tokens of each prompt; a row stops after ``eos_token_id`` (included).
    ``pad_token_id`` (a token of the vocabulary) fills the left padding and the rows that stopped.
    A float or bool token id is a TypeError; a ``pad_token_id`` outside the vocabulary a ValueError.

    Args:
        model: the :class:`attnkit.models.gpt.GPT` (put in eval mode while generating, then back).
        prompts: ``B`` lists of token ids, of any lengths (they run as one left-padded batch).
        max_new_tokens: the most tokens to add to each prompt (>= 0).
        temperature, top_k, top_p, generator: sampling, as
            :func:`attnkit.models.generate.next_token` (``temperature=0``: greedy).
        eos_token_id: a row stops after generating it; None: every row runs ``max_new_tokens``.
        pad_token_id: the id that fills the padding (it is masked out, so any id does).

    Returns:
        ``B`` lists of new token ids (the prompts not included).

    Raises:
        ValueError: a sampling argument is out of range, ``prompts`` is empty or holds an empty
            prompt or an id outside the vocabulary, or ``pad_token_id`` is outside it.
        TypeError: a token id is not an integer.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import GPT, GPTConfig
    >>> from attnkit.models.generate import generate
    >>> _ = torch.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32))
    >>> prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    >>> new = generate(model, prompts, max_new_tokens=4)
    >>> [len(tokens) for tokens in new]
    [4, 4]
    >>> new == [generate(model, [prompt], 4)[0] for prompt in prompts]  # as if each ran alone
    True
    >>> generate(model, [[1, 2, 3]], 4, eos_token_id=new[0][0]) == [new[0][:1]]  # stops at eos
    True
    >>> sample = lambda: generate(model, prompts, 4, temperature=0.8, top_k=10,
    ...                           generator=torch.Generator().manual_seed(0))
    >>> sample() == sample()  # the generator alone decides the draws
    True
    >>> generate(model, [[1, 2.5]], 4)
    Traceback (most recent call last):
    ...
    TypeError: prompts must hold integer token ids, got float (2.5) in prompt 0
    """
    _check_sampling(temperature, top_k, top_p, max_new_tokens)
    if isinstance(prompts, Tensor) or not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty lists of token ids")
    _check_prompts(prompts)
    _check_pad(pad_token_id, model.config.vocab_size)
    pad_token_id = operator.index(pad_token_id)
    device = model.lm_head.weight.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    pads = width - lengths                                                       # [B]
    tokens = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
    if int(tokens.min()) < 0 or int(tokens.max()) >= model.config.vocab_size:
        raise ValueError(f"prompts hold token ids outside [0, {model.config.vocab_size})")

    was_training = model.training
    model.eval()
    cache = model.new_cache(len(prompts), width + max_new_tokens)
    padded = bool(pads.any())

    def key_mask(k_len: int) -> Tensor | None:  # [B, 1, 1, Lk]: True = a real token
        return (torch.arange(k_len, device=device) >= pads[:, None])[:, None, None] if padded else None

    positions = (torch.arange(width, device=device) - pads[:, None]).clamp(min=0)
    logits = model(tokens, positions=positions, mask=key_mask(width), cache=cache)[:, -1]
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        chosen = next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        for row in (~done).nonzero().flatten().tolist():
            out[row].append(int(chosen[row]))
        if eos_token_id is not None:
            done |= chosen == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        chosen = chosen.masked_fill(done, pad_token_id)
        logits = model(chosen[:, None], positions=(lengths + step)[:, None],
                       mask=key_mask(width + step + 1), cache=cache)[:, -1]
    model.train(was_training)
    return out


def generate_text(model: GPT, tokenizer, texts: Sequence[str], max_new_tokens: int, **sampling) -> list[str]:
    """:func:`attnkit.models.generate.generate` on texts with a ``tokenizers.Tokenizer``; returns
    prompt + continuation. An empty text starts from the model's ``bos_token_id``.

    Args:
        model: the :class:`attnkit.models.gpt.GPT`, its vocabulary the tokenizer's.
        tokenizer: a ``tokenizers.Tokenizer`` (e.g. from ``attnkit.training.corpus.train_tokenizer``).
        texts: the prompts.
        max_new_tokens: the most tokens to add to each.
        sampling: keywords of :func:`attnkit.models.generate.generate`; ``eos_token_id`` defaults
            to the model's.

    Returns:
        One decoded ``str`` per text: the prompt's tokens and the new ones.

    Raises:
        ValueError: a text is empty and the model has no ``bos_token_id``; or as
            :func:`attnkit.models.generate.generate`.

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import GPT, GPTConfig
    >>> from attnkit.models.generate import generate_text
    >>> from attnkit.training.corpus import train_tokenizer
    >>> tokenizer = train_tokenizer(["the cat sat on the mat", "the dog sat on the log"], vocab_size=300)
    >>> model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
    ...                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))
    >>> texts = generate_text(model, tokenizer, ["the cat", "a dog sat"], max_new_tokens=5)
    >>> [text.startswith(prompt) for text, prompt in zip(texts, ["the cat", "a dog sat"])]
    [True, True]
    >>> generate_text(model, tokenizer, [""], max_new_tokens=5)
    Traceback (most recent call last):
    ...
    ValueError: an empty prompt needs a model with a bos_token_id
    """
    _check_sampling(sampling.get("temperature", 0.0), sampling.get("top_k"), sampling.get("top_p"), max_new_tokens)
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        if not ids:
            if model.config.bos_token_id is None:
                raise ValueError("an empty prompt needs a model with a bos_token_id")
            ids = [model.config.bos_token_id]
        prompts.append(ids)
    sampling.setdefault("eos_token_id", model.config.eos_token_id)
    new = generate(model, prompts, max_new_tokens, **sampling)
    return [tokenizer.decode(p + n) for p, n in zip(prompts, new)]
