"""Record the named intermediates of every attention call, for any model built from attnkit.

For example::

    with attnkit.trace.record() as trace:
        model(x)                       # or attnkit.attention(q, k, v), or encoder.encode(text)
    call = trace.layers[2]             # the third attnkit layer that ran
    call["weights"]                    # [B, H, Lq, Lk]
    call.head("scores", 5)             # [B, Lq, Lk] of head 5

Steps, in order (those that apply): ``queries``, ``keys``, ``values`` (per head), ``scores``
(query . key), ``scaled_scores``, ``masked_scores``, ``weights`` (softmax), ``dropped_weights``,
``output`` (per-head context = ``heads`` in layers), ``concatenated``, ``projected``.

While recording, attention runs on the readable ``"reference"`` backend (the only one that
exposes its intermediates), so results may differ from the fused path by float rounding.
Recording is off by default and costs nothing when off; it is skipped inside torch.compile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from . import _steps

__all__ = ["record", "Trace", "TracedCall"]

STEP_ORDER = ("queries", "keys", "values", "scores", "scaled_scores", "masked_scores", "weights",
              "dropped_weights", "output", "heads", "concatenated", "projected")


@dataclass
class TracedCall:
    """One attention call: its steps, and which layer made it.

    ``layer`` numbers the attnkit layers in the order they first ran (for an encoder: its
    depth); ``None`` for a direct call of :func:`attnkit.attention`.

    A :class:`attnkit.trace.Trace` makes these; index one by step name (``call["weights"]``)
    for that step's tensor. A missing step raises ``KeyError`` listing the steps recorded.

    Args:
        index: the call's position among all calls of the recording (0 for the first).
        layer: the attnkit layer that made the call, numbered as above, or ``None``.
        module: that layer (an ``nn.Module``), or ``None`` for a direct call.
        steps: the recorded tensors by step name. Per-head steps are ``[B, H, ...]``:
            ``queries [B, H, Lq, D]``, ``keys``/``values [B, Hkv, Lk, D]``, ``scores``,
            ``scaled_scores``, ``masked_scores``, ``weights [B, H, Lq, Lk]``, ``output
            [B, H, Lq, Dv]``; a layer's ``inputs``, ``concatenated`` and ``projected`` are
            ``[B, L, E]``.

    Example:

        >>> import torch
        >>> import attnkit
        >>> q = k = v = torch.ones(1, 2, 3, 4)                 # [B, H, L, D]
        >>> with attnkit.trace.record() as trace:
        ...     out = attnkit.attention(q, k, v, causal=True)
        >>> call = trace[0]
        >>> call.index, call.layer, call.module
        (0, None, None)
        >>> call["weights"].shape                              # [B, H, Lq, Lk]
        torch.Size([1, 2, 3, 3])
        >>> call["weights"][0, 0]
        tensor([[1.0000, 0.0000, 0.0000],
                [0.5000, 0.5000, 0.0000],
                [0.3333, 0.3333, 0.3333]])
        >>> call["dropped_weights"]
        Traceback (most recent call last):
        ...
        KeyError: "step 'dropped_weights' was not recorded in this call; recorded: [...]"
    """

    index: int
    layer: int | None
    module: object | None
    steps: dict[str, Tensor]

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.steps[name]
        except KeyError:
            raise KeyError(f"step {name!r} was not recorded in this call; recorded: {self.names}") from None

    @property
    def names(self) -> list[str]:
        """The recorded step names, in computation order (see the module docstring); names outside
        that list come last.

        Example:

            >>> import torch
            >>> import attnkit
            >>> x = torch.ones(1, 1, 2, 4)                         # [B, H, L, D]
            >>> with attnkit.trace.record() as trace:
            ...     out = attnkit.attention(x, x, x)
            >>> trace[0].names
            ['queries', 'keys', 'values', 'scores', 'scaled_scores', 'weights', 'output']
        """
        return sorted(self.steps, key=lambda n: STEP_ORDER.index(n) if n in STEP_ORDER else len(STEP_ORDER))

    def head(self, name: str, head: int) -> Tensor:
        """Step ``name`` of one head: index the head dim of a ``[B, H, ...]`` step. Key/value
        steps with fewer heads (GQA) are indexed by the key/value head that query head reads.

        Args:
            name: a recorded step with a head dim (``"weights"``, ``"scores"``, ``"keys"``...).
            head: the query head, ``0 <= head < H``.

        Returns:
            The step without its head dim, ``[B, ...]`` (e.g. ``weights [B, Lq, Lk]``).

        Raises:
            KeyError: ``name`` was not recorded in this call.
            ValueError: the step has no head dim (fewer than 4 dims, e.g. ``projected``).
            IndexError: ``head`` is out of range.

        Example:

            >>> import torch
            >>> import attnkit
            >>> q = torch.ones(1, 4, 3, 8)                         # 4 query heads
            >>> kv = torch.ones(1, 2, 3, 8)                        # 2 key/value heads (GQA)
            >>> with attnkit.trace.record() as trace:
            ...     out = attnkit.attention(q, kv, kv)
            >>> call = trace[0]
            >>> call.head("weights", 3).shape                      # [B, Lq, Lk]
            torch.Size([1, 3, 3])
            >>> torch.equal(call.head("keys", 3), kv[:, 1])        # query head 3 reads key/value head 1
            True
            >>> call.head("weights", 4)
            Traceback (most recent call last):
            ...
            IndexError: head 4 out of range: this call has 4 heads
        """
        tensor = self[name]
        if tensor.dim() < 4:
            raise ValueError(f"step {name!r} has shape {tuple(tensor.shape)}: no head dim to index")
        heads = self.steps["queries"].shape[1] if "queries" in self.steps else tensor.shape[1]
        if not 0 <= head < heads:
            raise IndexError(f"head {head} out of range: this call has {heads} heads")
        return tensor[:, head // (heads // tensor.shape[1])]


class Trace:
    """All attention calls recorded inside :func:`attnkit.trace.record`, in the order they ran.

    :func:`attnkit.trace.record` makes it. It is a sequence of
    :class:`attnkit.trace.TracedCall`: ``len(trace)``, ``trace[i]`` and ``for call in trace``
    see every call, :attr:`attnkit.trace.Trace.layers` only those of attnkit layers. It is
    live: calls made later inside the same ``with`` block appear too.

    Example:

        >>> import torch
        >>> import attnkit
        >>> x = torch.ones(2, 3, 4)                            # [H, L, D]
        >>> with attnkit.trace.record() as trace:
        ...     first = attnkit.attention(x, x, x)
        ...     second = attnkit.attention(x, x, x, causal=True)
        >>> len(trace), [call.index for call in trace]
        (2, [0, 1])
        >>> "masked_scores" in trace[1].names
        True
    """

    def __init__(self, recorder: _steps.Recorder) -> None:
        self._recorder = recorder

    @property
    def calls(self) -> list[TracedCall]:
        """Every recorded call, direct :func:`attnkit.attention` calls and layers' alike, in order.

        Example:

            >>> import torch
            >>> import attnkit
            >>> x = torch.ones(1, 3, 4)                            # [B, L, D]
            >>> with attnkit.trace.record() as trace:
            ...     out = attnkit.attention(x, x, x)
            >>> [(call.index, call.layer) for call in trace.calls]
            [(0, None)]
        """
        layer_of: dict[int, int] = {}
        calls = []
        for index, group in enumerate(self._recorder.groups):
            layer = None
            if group.owner is not None:
                layer = layer_of.setdefault(id(group.owner), len(layer_of))
            calls.append(TracedCall(index, layer, group.owner, group.steps))
        return calls

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[TracedCall]:
        return iter(self.calls)

    def __getitem__(self, index: int) -> TracedCall:
        return self.calls[index]

    @property
    def layers(self) -> list[TracedCall]:
        """The calls made by attnkit layers (not by direct ``attention()`` calls), in order;
        ``trace.layers[i].layer`` numbers the layers in the order they first ran.

        Example:

            >>> import torch
            >>> import attnkit
            >>> first, second = attnkit.nn.MultiHeadAttention(8, 2), attnkit.nn.MultiHeadAttention(8, 2)
            >>> x = torch.zeros(1, 5, 8)                           # [B, L, E]
            >>> with attnkit.trace.record() as trace:
            ...     y = second(first(x))
            ...     w = attnkit.attention(x, x, x)                 # a direct call: not a layer
            >>> len(trace), len(trace.layers)
            (3, 2)
            >>> [call.layer for call in trace.layers], trace.layers[1].module is second
            ([0, 1], True)
            >>> trace.layers[0]["weights"].shape                   # [B, H, L, L]
            torch.Size([1, 2, 5, 5])
        """
        return [c for c in self.calls if c.layer is not None]


@contextmanager
def record() -> Iterator[Trace]:
    """Record every attention call made inside the block (nested recordings: the innermost wins).

    Use it as ``with attnkit.trace.record() as trace:``; it yields an
    :class:`attnkit.trace.Trace` of the calls (:class:`attnkit.trace.TracedCall`), whose
    tensors are kept after the block. Inside, attention runs on the ``"reference"`` backend
    (see the module docstring).

    Example:

        >>> import torch
        >>> import attnkit
        >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])        # [B, L, D]: two tokens
        >>> with attnkit.trace.record() as trace:
        ...     out = attnkit.attention(x, x, x, scale=1.0)
        >>> trace[0]["scores"]                                 # query . key
        tensor([[[1., 0.],
                 [0., 1.]]])
        >>> trace[0]["weights"]                                # softmax of each row
        tensor([[[0.7311, 0.2689],
                 [0.2689, 0.7311]]])
    """
    with _steps.recording() as recorder:
        yield Trace(recorder)
