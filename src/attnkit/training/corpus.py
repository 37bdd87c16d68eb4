"""The training text and its tokenizer.

The corpus is the Python Language Reference as it ships inside every CPython installation
(``pydoc_data.topics``, what ``help("for")`` prints): about 460 KB of English prose with code
examples, split into ~200 sections of very different lengths (tens of characters to 25 KB), which
makes it a natural test of document packing. Why this one: it is on every machine attnkit runs on
(no download, no package to trust), it is real prose written for people, and its licence (the
PSF License Agreement for the Python documentation) allows using and redistributing it. Its
content follows the Python version, so trained numbers differ slightly between versions.

The tokenizer is a byte-level BPE (GPT-2's scheme) trained with the ``tokenizers`` library,
with one special token, ``<|endoftext|>``, that starts and ends every document.
"""

from __future__ import annotations

import hashlib
import re

from .._optional import require

END_OF_TEXT = "<|endoftext|>"
# A heading: a line underlined with ===, *** or --- after a blank line.
_HEADING = re.compile(r"\n\n(?=[^\n]+\n[=*\-]{3,}\n)")


def python_reference_sections() -> list[str]:
    """The Language Reference's sections, in a fixed order (by topic name), duplicates dropped.

    Returns:
        A list of non-empty strings (about 200; how many, and their text, follow the Python
        version).

    Example:

        >>> from attnkit.training.corpus import python_reference_sections
        >>> sections = python_reference_sections()
        >>> len(sections) > 100, len(set(sections)) == len(sections), all(sections)
        (True, True, True)
        >>> sections == python_reference_sections()  # the same order every time
        True
    """
    from pydoc_data.topics import topics

    seen, sections = set(), []
    for name in sorted(topics):
        for part in _HEADING.split(topics[name]):
            part = part.strip()
            if part and part not in seen:
                seen.add(part)
                sections.append(part)
    return sections


def split_documents(documents: list[str], every: int = 10) -> tuple[list[str], list[str]]:
    """``(train, validation)``: every ``every``-th document (chosen by a hash of its text, so the
    split does not move when documents are added) is held out for evaluation.

    Args:
        documents: the texts.
        every: about one in ``every`` is held out.

    Returns:
        ``(train, validation)``, two lists keeping the documents' order.

    Example:

        >>> from attnkit.training.corpus import split_documents
        >>> train, validation = split_documents([f"document {i}" for i in range(20)])
        >>> len(train), validation
        (17, ['document 6', 'document 7', 'document 10'])
    """
    train, validation = [], []
    for document in documents:
        digest = int(hashlib.sha256(document.encode("utf-8")).hexdigest()[:8], 16)
        (validation if digest % every == 0 else train).append(document)
    return train, validation


def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` tokens (``<|endoftext|>`` is
    id 0); deterministic for the same documents and size.

    Args:
        documents: the texts to learn the merges from.
        vocab_size: the number of tokens, at least 258; fewer if the texts run out of merges.

    Raises:
        ValueError: ``vocab_size`` below 258.
        ImportError: ``tokenizers`` is not installed (naming the extra to install).

    Example:

        >>> from attnkit.training.corpus import train_tokenizer
        >>> tokenizer = train_tokenizer(["for item in items: pass", "while True: break"], 260)
        >>> tokenizer.get_vocab_size(), tokenizer.token_to_id("<|endoftext|>")
        (260, 0)
        >>> tokenizer.decode(tokenizer.encode("for x in items").ids)
        'for x in items'
    """
    tokenizers = require("tokenizers", "training the tokenizer", extra="models")
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes, <|endoftext|> and one merge), got {vocab_size}")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(documents, trainer, length=len(documents))
    return tokenizer


def encode_documents(tokenizer, documents: list[str]) -> list[list[int]]:
    """Each document as ``[<|endoftext|>, tokens..., <|endoftext|>]``: the model learns to start
    a text from the marker and to end one with it.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` knowing ``<|endoftext|>`` (from
            :func:`attnkit.training.corpus.train_tokenizer`).
        documents: the texts.

    Returns:
        One list of token ids a document.

    Example:

        >>> from attnkit.training.corpus import encode_documents, train_tokenizer
        >>> tokenizer = train_tokenizer(["for item in items: pass", "while True: break"], 260)
        >>> first, second = encode_documents(tokenizer, ["for x in items: pass", "break"])
        >>> first[0], first[-1], tokenizer.decode(first)  # <|endoftext|> is id 0
        (0, 0, 'for x in items: pass')
    """
    marker = tokenizer.token_to_id(END_OF_TEXT)
    return [[marker, *encoding.ids, marker] for encoding in tokenizer.encode_batch(documents)]
