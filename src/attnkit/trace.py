"""Record the named intermediates of every attention call, for any model built from attnkit.

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
        """The recorded step names, in computation order."""
        return sorted(self.steps, key=lambda n: STEP_ORDER.index(n) if n in STEP_ORDER else len(STEP_ORDER))

    def head(self, name: str, head: int) -> Tensor:
        """Step ``name`` of one head: index the head dim of a ``[B, H, ...]`` step. Key/value
        steps with fewer heads (GQA) are indexed by the key/value head that query head reads."""
        tensor = self[name]
        if tensor.dim() < 4:
            raise ValueError(f"step {name!r} has shape {tuple(tensor.shape)}: no head dim to index")
        heads = self.steps["queries"].shape[1] if "queries" in self.steps else tensor.shape[1]
        if not 0 <= head < heads:
            raise IndexError(f"head {head} out of range: this call has {heads} heads")
        return tensor[:, head // (heads // tensor.shape[1])]


class Trace:
    """All attention calls recorded inside :func:`record`, in the order they ran."""

    def __init__(self, recorder: _steps.Recorder) -> None:
        self._recorder = recorder

    @property
    def calls(self) -> list[TracedCall]:
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
        """The calls made by attnkit layers (not by direct ``attention()`` calls)."""
        return [c for c in self.calls if c.layer is not None]


@contextmanager
def record() -> Iterator[Trace]:
    """Record every attention call made inside the block (nested recordings: the innermost wins)."""
    with _steps.recording() as recorder:
        yield Trace(recorder)
