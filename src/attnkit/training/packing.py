"""Documents packed into fixed-length rows, with the labels that keep them apart.

Each document of ``n`` tokens gives ``n - 1`` (input, target) pairs. The pairs of all documents
are laid end to end and cut into rows of ``length``; a row therefore holds pieces of several
documents (a long one continues in the next row). ``doc_ids`` label the pieces, so the model
runs with ``masks.document(ids=doc_ids) & causal`` and positions restarting per piece
(:func:`attnkit.models.gpt.document_positions`): no token attends across documents and no
position is padding, except in the very last row::

    row 0:  a a a a b b | c c      ids 0 0 0 0 1 1 2 2   (b and c are whole documents)
    row 1:  c c c d d d | - -      ids 2 2 2 3 3 3 . .   (the end: padding, target -100)

The alternative, one document per row padded to the longest, is :func:`attnkit.training.pad_documents` (the
benchmark's baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE = -100  # targets the loss skips (F.cross_entropy's ignore_index)


@dataclass
class Rows:
    """``inputs``, ``targets`` and ``doc_ids``, each ``[N, length]`` int64 (``len(rows)`` is ``N``):
    the input tokens, the next tokens to predict (``-100`` where nothing is, skipped by the loss)
    and each token's document label. Made by :func:`attnkit.training.pack_documents` and
    :func:`attnkit.training.pad_documents`.

    Example:

        >>> import torch
        >>> from attnkit.training import Rows
        >>> rows = Rows(inputs=torch.tensor([[5, 6, 7]]), targets=torch.tensor([[6, 7, -100]]),
        ...             doc_ids=torch.tensor([[0, 0, 1]]))
        >>> len(rows), rows.real_tokens
        (1, 2)
    """

    inputs: Tensor
    targets: Tensor
    doc_ids: Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def select(self, index: Tensor) -> "Rows":
        """The rows at ``index`` (an index tensor, a slice or an int list, as tensor indexing takes):
        a new :class:`attnkit.training.Rows` of the same three tensors indexed alike.

        Example:

            >>> import torch
            >>> from attnkit.training import pack_documents
            >>> rows = pack_documents([[5, 6, 7, 8, 9], [1, 2, 3], [4, 4]], 4)
            >>> rows.select(torch.tensor([1])).inputs
            tensor([[1, 2, 4, 0]])
            >>> len(rows.select(slice(0, 1)))
            1
        """
        return Rows(self.inputs[index], self.targets[index], self.doc_ids[index])

    @property
    def real_tokens(self) -> int:
        """The number of targets the loss counts (those that are not ``-100``), an int.

        Example:

            >>> from attnkit.training import pack_documents
            >>> pack_documents([[5, 6, 7, 8, 9], [1, 2, 3], [4, 4]], 4).real_tokens  # 4 + 2 + 1 pairs
            7
        """
        return int((self.targets != IGNORE).sum())


def pack_documents(documents: list[list[int]], length: int, *, pad_token_id: int = 0) -> Rows:
    """Pack token lists into rows of ``length`` (see the module docstring).

    Args:
        documents: token ids, one list a document (documents of fewer than two tokens are
            dropped: they predict nothing).
        length: the row length.
        pad_token_id: the input token of the last row's padding (its targets are ``-100``).

    Returns:
        :class:`attnkit.training.Rows` ``[N, length]``; the padding is labelled as a document of
        its own (the number of documents kept).

    Raises:
        ValueError: ``length`` is not an int >= 1, or no document has two tokens.

    Example:

        >>> from attnkit.training import pack_documents
        >>> rows = pack_documents([[5, 6, 7, 8, 9], [1, 2, 3], [4, 4]], 4)
        >>> rows.inputs
        tensor([[5, 6, 7, 8],
                [1, 2, 4, 0]])
        >>> rows.targets
        tensor([[   6,    7,    8,    9],
                [   2,    3,    4, -100]])
        >>> rows.doc_ids
        tensor([[0, 0, 0, 0],
                [1, 1, 2, 3]])
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    kept = [doc for doc in documents if len(doc) >= 2]
    if not kept:
        raise ValueError("no document has two tokens or more: nothing to predict")
    inputs = torch.cat([torch.tensor(doc[:-1]) for doc in kept])
    targets = torch.cat([torch.tensor(doc[1:]) for doc in kept])
    ids = torch.repeat_interleave(torch.arange(len(kept)), torch.tensor([len(doc) - 1 for doc in kept]))
    pad = -inputs.numel() % length
    inputs = torch.cat([inputs, torch.full((pad,), pad_token_id)]).view(-1, length)
    targets = torch.cat([targets, torch.full((pad,), IGNORE)]).view(-1, length)
    ids = torch.cat([ids, torch.full((pad,), len(kept))]).view(-1, length)  # the padding: a document of its own
    return Rows(inputs, targets, ids)


def pad_documents(documents: list[list[int]], length: int, *, pad_token_id: int = 0) -> Rows:
    """One document per row, cut at ``length`` pairs and right-padded to the longest row (the
    padded targets are ``-100``; ``doc_ids`` is 0 for the document, 1 for the padding).

    Args:
        documents: token ids, one list a document (those of fewer than two tokens are dropped;
            at least one must remain).
        length: the most (input, target) pairs a row takes of a document.
        pad_token_id: the input token of the padding.

    Returns:
        :class:`attnkit.training.Rows` ``[documents, longest]``.

    Raises:
        ValueError: no document has two tokens, or ``length`` is below 1.

    Example:

        >>> from attnkit.training import pad_documents
        >>> rows = pad_documents([[5, 6, 7, 8, 9], [1, 2, 3]], 3)  # the first is cut at 3 pairs
        >>> rows.inputs
        tensor([[5, 6, 7],
                [1, 2, 0]])
        >>> rows.targets
        tensor([[   6,    7,    8],
                [   2,    3, -100]])
        >>> rows.doc_ids
        tensor([[0, 0, 0],
                [0, 0, 1]])
    """
    if length < 1:
        raise ValueError(f"length must be at least 1 (input, target) pair, got {length}")
    pieces = [doc[: length + 1] for doc in documents if len(doc) >= 2]
    if not pieces:
        raise ValueError(f"documents: none of the {len(documents)} has two tokens (an input and its target)")
    width = max(len(piece) - 1 for piece in pieces)
    inputs = torch.full((len(pieces), width), pad_token_id)
    targets = torch.full((len(pieces), width), IGNORE)
    ids = torch.ones(len(pieces), width, dtype=torch.long)
    for row, piece in enumerate(pieces):
        n = len(piece) - 1
        inputs[row, :n], targets[row, :n], ids[row, :n] = torch.tensor(piece[:-1]), torch.tensor(piece[1:]), 0
    return Rows(inputs, targets, ids)


def batch_order(num_rows: int, batch_size: int, step: int, seed: int) -> Tensor:
    """The rows of training step ``step``: epochs of a seeded permutation, a pure function of
    ``(step, seed)`` so a resumed run reads exactly the rows an uninterrupted one would.

    Args:
        num_rows: the rows to draw from.
        batch_size: rows a step.
        step: the training step (0 first).
        seed: the run's seed.

    Returns:
        ``[batch_size]`` int64 row indices (an epoch's rows are each read once; a batch may
        span two epochs).

    Example:

        >>> from attnkit.training import batch_order
        >>> batch_order(5, 3, step=0, seed=0), batch_order(5, 3, step=1, seed=0)
        (tensor([4, 0, 1]), tensor([3, 2, 0]))
        >>> batch_order(5, 3, step=1, seed=0).tolist() == batch_order(5, 3, step=1, seed=0).tolist()
        True
    """
    start = step * batch_size
    picked = []
    while len(picked) < batch_size:
        epoch, offset = divmod(start + len(picked), num_rows)
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        picked += order[offset: offset + batch_size - len(picked)].tolist()
    return torch.tensor(picked)
