"""Sequence-parallel attention across processes on ``torch.distributed``: ring and Ulysses.

Each rank holds a shard of one long sequence (:func:`attnkit.distributed.shard`, layouts ``"contiguous"`` and
``"zigzag"``) and calls :func:`attnkit.distributed.ring_attention` or
:func:`attnkit.distributed.ulysses_attention` with it; the result
is its shard of :func:`attnkit.attention` on the whole sequence (output, lse, gradients, dropout
pattern). The structured mask decides the traffic: a key/value shard no local query attends is
neither sent nor computed. :func:`attnkit.distributed.sequence_parallel` routes ``attnkit.nn`` layers through them.
Before any exchange the ranks check that they agree on the call (:mod:`attnkit.distributed.agreement`: dtype, shapes,
mask, ``causal``, layout, scale, dropout, block sizes; one small ``all_gather``): ranks that
disagree all raise the same ``ValueError`` instead of exchanging mismatched messages.
One code path for every backend of ``torch.distributed`` (tested on gloo, CPU; NCCL untested).
"""

from .comm import Traffic, traffic
from .layout import LAYOUTS, even_lengths, shard, unshard
from .parallel import attention_fn, sequence_parallel
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "ulysses_attention", "sequence_parallel", "attention_fn", "shard", "unshard", "even_lengths",
           "traffic", "Traffic", "LAYOUTS"]
