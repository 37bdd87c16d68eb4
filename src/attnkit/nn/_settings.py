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
        """Query ``i`` sees only keys ``j <= i + Lk - Lq`` unless a call says otherwise.

        Assigning anything but a bool raises TypeError.

        Example:

            >>> import attnkit
            >>> layer = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4)
            >>> layer.causal
            False
            >>> layer.causal = True
            >>> layer.causal
            True
        """
        return self._causal

    @causal.setter
    def causal(self, value: bool) -> None:
        self._causal = _checks.boolean("causal", value)

    @property
    def dropout(self) -> float:
        """Dropout probability on the attention weights, in training mode only.

        Assigning anything but a float in ``[0, 1)`` raises ValueError and keeps the old value.

        Example:

            >>> import attnkit
            >>> layer = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4, dropout=0.1)
            >>> layer.dropout
            0.1
            >>> layer.dropout = 1.5
            Traceback (most recent call last):
                ...
            ValueError: dropout must be a float in [0, 1), got 1.5
            >>> layer.dropout
            0.1
        """
        return self._dropout

    @dropout.setter
    def dropout(self, value: float) -> None:
        self._dropout = _checks.dropout_probability(value)

    @property
    def backend(self) -> str:
        """The :func:`attnkit.attention` backend every call of the layer runs on.

        One of :func:`attnkit.backends`; any other name raises ValueError on assignment.

        Example:

            >>> import attnkit
            >>> head = attnkit.nn.SelfAttention(d_in=3, d_qk=2)
            >>> head.backend
            'auto'
            >>> head.backend = "reference"
            >>> head.backend = "nonsense"
            Traceback (most recent call last):
                ...
            ValueError: unknown backend 'nonsense'; available: ('auto', 'reference', 'torch', 'tiled'...)
        """
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._backend = _checks.backend_name(value)
