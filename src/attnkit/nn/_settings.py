"""The attention settings a layer keeps, checked whenever they are assigned."""

from __future__ import annotations

from . import _checks


class AttentionSettings:
    """``causal`` (the default of ``forward(causal=...)``), ``dropout`` and ``backend`` as checked
    attributes: assigning a bad value (``layer.backend = "nonsense"``) raises and leaves the
    layer as it was, instead of failing later, inside some forward call."""

    _causal: bool
    _dropout: float
    _backend: str

    @property
    def causal(self) -> bool:
        """Query ``i`` sees only keys ``j <= i + Lk - Lq`` unless a call says otherwise."""
        return self._causal

    @causal.setter
    def causal(self, value: bool) -> None:
        self._causal = _checks.boolean("causal", value)

    @property
    def dropout(self) -> float:
        """Dropout probability on the attention weights, in training mode only."""
        return self._dropout

    @dropout.setter
    def dropout(self, value: float) -> None:
        self._dropout = _checks.dropout_probability(value)

    @property
    def backend(self) -> str:
        """The :func:`attnkit.attention` backend every call of the layer runs on."""
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._backend = _checks.backend_name(value)
