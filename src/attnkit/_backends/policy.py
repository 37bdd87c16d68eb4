"""What ``backend="auto"`` runs: the one policy, in one place.

Two halves. :func:`choose` picks the backend from what is known before any data is read (it is
traced by ``torch.compile``), in order:

1. ``return_lse``: the backend that returns it (``"tiled"``).
2. **Device first**: on a device type where attnkit's own kernels were not measured (anything but
   the CPU today), PyTorch's fused kernels (``"torch"``): attnkit never routes a call to code whose
   speed nobody measured there.
3. ``return_weights``: ``"torch"``'s materialised path of fused ops (weights are ``Lq x Lk`` anyway).
4. Plain causal (``causal=True`` or ``masks.causal()``, nothing else; over one query row the call
   holds neither): square, attnkit's native kernel from 128 x 128 (with its AVX2 build, only below
   4096 x 4096 where a backward will run), where it beat SDPA's causal path, else that path; other
   shapes, the interval op.
5. A decoding step (one query row) with a structured mask: ``"torch"`` with the mask's one dense
   row per sequence.
6. A structured mask, soft-capping, ALiBi or sinks (SDPA has none of these), or dropout where
   attnkit's native kernel runs: the interval op with its kernel left to :func:`kernel_for`.
7. Else ``"torch"``.

:func:`kernel_for` runs inside the op (``attnkit::interval_attention``, :mod:`.interval_op`), on the
real row bounds: attnkit's native kernel, PyTorch's kernel block by block, or PyTorch's fused
kernel on the dense form of the mask (what ``"torch"`` would run), by the thresholds below,
measured with ``benchmarks/masks.py --threshold``. Compiled graphs hold the op, so compiled and
eager calls make the same choice on the same data, and no ``Lq x Lk`` mask is built unless the
dense kernel is the one chosen.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _torch_private
from .._call import AttentionCall
from . import dropout as _dropout
from . import native
from .tiled_plan import Problem, visited_fraction

#: Device types where attnkit's kernels (the tiled backend) were measured against PyTorch's.
MEASURED_DEVICES = frozenset({"cpu"})

#: With PyTorch's kernel block by block (benchmarks/masks.py --threshold, B=1, H=8, D=64, fp32, 2 CPU
#: threads): below 512 x 512 pairs the fused dense kernel always won; at 512 x 512 tiled won where it
#: computed <= 30% of the pairs (window, documents: 0.56-0.75x the time) and lost at 50% (1.2x);
#: from 1024 x 1024 it won at 50% too (0.47-0.82x).
AUTO_MIN_PAIRS = 512 * 512
AUTO_MAX_VISITED = ((1024 * 1024, 0.3), (float("inf"), 0.6))  # (pairs below, visited share at most)
#: With attnkit's native kernel (``--threshold --dense-side``, 64 to 16384): from 128 x 128 pairs
#: tiled took 0.10-0.93x the fused dense kernel's time on every mask where the kernel multiplies
#: <= 91% of the pairs (windows, documents, causal + padding, prefix-LM, a symmetric half-length
#: window, padding alone, a causal chunk of the last rows) and tied at 94% (1.00x); at 64 x 64
#: the differences were microseconds either way (0.80-1.36x over two runs). The share is the
#: kernel's own (each block over its rows' key span, :func:`native.computed_fraction`), which
#: needs no plan.
#: A plain causal mask (forward) it ran in 0.61-0.97x SDPA's own causal path up to 4096 x 4096,
#: 0.96-1.00x at 8192 and 16384; forward + backward (GQA and not, D = 16 to 128, 1 and 2 threads)
#: in 0.53-0.94x SDPA's time from 128 to 2048, 1.06x at 4096: SDPA keeps it from 4096 x 4096 when
#: a backward will run. A forward alone (since the kernel gathers a model layout's key and value
#: rows, 2026-11-25, AVX-512 machine): 0.80-0.91x at 4096-16384 with 8 query / 2 kv heads, D = 64,
#: model layout, 1 and 2 threads; 0.82-0.95x with 8 / 8 heads contiguous; D = 128 (4 heads)
#: 0.96-0.98x on 2 threads, 0.98-1.09x on one: the native kernel serves every length.
#: With the backward's products on register tiles (2026-11-26, an AMD Zen 5), forward + backward
#: at 2048, 4096 and 8192 (8 heads, D = 64, 2 threads) in the AVX-512 build: 0.35x, 0.38x, 0.40x
#: SDPA's time; the AVX2 build there, with sgemm: 0.76x, 0.85x, 0.88x (its tiles were level with
#: that sgemm), where the earlier machine gave 1.06x at 4096: the cap at 4096 holds for the AVX2
#: build only.
NATIVE_MIN_PAIRS = 128 * 128
NATIVE_MAX_COMPUTED = 0.9
NATIVE_CAUSAL_MAX_PAIRS = 4096 * 4096


def choose(call: AttentionCall) -> str:
    """What ``"auto"`` runs for ``call`` (see the module docstring): ``"torch"``, ``"tiled"``, or
    ``"interval"`` (the tiled backend's op with its kernel chosen at run time). Traceable."""
    if call.return_lse:
        return "tiled"
    if call.query.device.type not in MEASURED_DEVICES or call.return_weights:
        return "torch"
    plain_causal = call.mask is None and (call.structure.is_causal if call.structure is not None else call.causal)
    if plain_causal and not call.modifies_scores and call.dropout == 0:
        # masks.causal() and causal=True are one rule (over one query row, a decoding step, the call
        # holds neither: make_call drops them, and SDPA runs with no mask). Square: the native kernel
        # where it beat SDPA's causal path, else that path, GQA included, never the op's dense
        # kernel, which builds the L x L mask (L = 8192, 8 query / 2 kv heads: 3.9 s against 1.0 s).
        # Otherwise (a chunk of rows after a cache) the op, on the rows' spans.
        if call.q_len == call.k_len:
            pairs = call.q_len * call.k_len
            native_faster = (NATIVE_MIN_PAIRS <= pairs
                             and (pairs < NATIVE_CAUSAL_MAX_PAIRS or not call.needs_grad or _native_wide())
                             and _native_serves(call.query.device.type, call.query.dtype, False))
            return "interval" if native_faster else "torch"
        return "interval"
    if call.q_len == 1 and call.structure is not None and not call.modifies_scores and call.dropout == 0:
        # A decoding step: its mask's dense form is one row of keys per sequence, [B, 1, 1, Lk], what
        # transformers' own SDPA path builds at every step; the call with it (packed GQA) took ~0.33
        # ms where the op's planning and per-block calls took 1.1 ms (transformers' sdpa: 0.26 ms;
        # 2 sequences, left padding, ~1100 keys, 8 query / 2 kv heads, one thread).
        return "torch"
    if call.structure is not None or call.modifies_scores:
        return "interval"  # soft-capping, ALiBi and sinks: SDPA has none of them
    if call.dropout > 0 and _native_serves(call.query.device.type, call.query.dtype, call.mask is not None):
        # SDPA has no fused CPU kernel with dropout (its math path materialises every weight): the
        # native kernel took 0.64-0.77x its time at 32 x 32 pairs, 0.35-0.44x at 64 x 64 and
        # 0.02-0.13x at 4096 x 4096, on the sweep's masks and with no mask at all
        # (``--threshold --dropout 0.1``).
        return "interval"
    return "torch"


@_torch_private.assume_constant_result
def _native_wide() -> bool:
    """Process state (which build of the kernel is loaded), read once per trace."""
    return native.wide()


@_torch_private.assume_constant_result
def _native_serves(device_type: str, dtype: torch.dtype, has_mask: bool) -> bool:
    """Process state (the kernel loaded, not turned off), read once per trace."""
    return native.serves(device_type, dtype, has_mask)


def kernel_for(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None,
               dropout: float, causal_only: bool, sparse_only: bool, softcap: float | None = None,
               alibi: Tensor | None = None, seed: Tensor | None = None) -> str:
    """Which kernel the interval op runs: ``"native"``, ``"blocks"`` (PyTorch's kernel block by
    block) or ``"dense"`` (PyTorch's fused kernel over every key, the mask as a tensor).
    ``sparse_only`` (an explicit ``backend="tiled"``) leaves out the dense kernel. The native
    kernel computes soft-capping and ALiBi itself; elsewhere they run on plain ops per block
    (``"blocks"``; dense, per sequence, where short or dense). Dropout in a piece of a larger call
    (a ``seed`` with offsets) runs wherever plain dropout does: every kernel takes the offsets."""
    if native.applies(query, key, value, bias is not None):
        if sparse_only or dropout > 0:
            return "native"
        pairs = query.shape[2] * key.shape[2]
        if pairs < NATIVE_MIN_PAIRS:
            return "dense"
        if causal_only and query.shape[2] == key.shape[2]:
            # choose() sends square causal calls here only where the native kernel beat SDPA's causal
            # path; the alternative here would be the dense kernel with an L x L mask (return_lse)
            return "native"
        computed = sum(native.computed_fraction(lo[:, r], hi[:, r], key.shape[2]) for r in range(lo.shape[1]))
        return "native" if computed <= NATIVE_MAX_COMPUTED else "dense"
    if query.device.type == "cpu" and query.dtype == torch.float32 and bias is None:
        native.hint_if_not_built()
    if sparse_only or dropout > 0 or softcap is not None or alibi is not None:
        return "blocks"
    pairs = query.shape[2] * key.shape[2]
    if pairs < AUTO_MIN_PAIRS or (causal_only and bias is None and query.shape[2] == key.shape[2]):
        return "dense"  # short; or SDPA's own causal path, which skips the same blocks 15-55% faster
    limit = next(share for below, share in AUTO_MAX_VISITED if pairs < below)
    problem = Problem(lo.cpu(), hi.cpu(), query.shape[2], key.shape[2], query.shape[0], bias is not None)
    return "blocks" if visited_fraction(problem) <= limit else "dense"
