"""What ``backend="auto"`` runs: the one policy, in one place.

Two halves, both returning names from one vocabulary: a **backend** (``"torch"``, ``"tiled"``, ...,
the registry of :mod:`attnkit._backends`) and, for the tiled backend, the **kernel** its op runs
(:data:`.interval_inputs.KERNELS`: ``"native"``, ``"blocks"``, ``"dense"``, ``"triton"``, ``"flex"``).

:func:`choose` returns a :class:`Route` from what is known before any data is read (it is traced by
``torch.compile``), in order:

0. **CUDA** has its own rule (:func:`_cuda_route`): SDPA where it applies as it is, the interval
   engines (FlexAttention, attnkit's Triton kernel) for everything it has no kernel for.
1. ``return_lse``: the tiled backend (it returns it).
2. **Device first**: on any other device type where attnkit's own kernels were not measured,
   PyTorch's fused kernels (``"torch"``).
3. ``return_weights``: ``"torch"``'s materialised path of fused ops (weights are ``Lq x Lk`` anyway).
4. Plain causal (``causal=True`` or ``masks.causal()``, nothing else; over one query row the call
   holds neither): square, the tiled backend on attnkit's native kernel from 128 x 128, where it
   beat SDPA's causal path at every length measured, forward and training, float32 and half
   precision; without the native kernel, or below 128 x 128, that path; other shapes, the tiled
   backend.
5. A decoding step (one query row) with a structured mask: ``"torch"`` with the mask's one dense
   row per sequence.
6. A structured mask, soft-capping, ALiBi or sinks (SDPA has none of these), or dropout where
   attnkit's native kernel runs: the tiled backend with its kernel left to :func:`kernel_for`, or
   named (the native kernel) where only the call's backward brings it in: bfloat16 on a CPU with
   AVX512-BF16 and no AMX, whose forward stays with PyTorch's kernels (rules 4 and 7 likewise).
7. No mask at all, from a number of pairs by dtype (float32: 1024 x 1024, 512 x 512 where a
   backward will run; half precision from 128 x 128, bfloat16 forward from 512 x 512) and head sizes
   up to 128, where attnkit's native kernel runs: the tiled backend on it (it beat SDPA's unmasked
   path there).
8. Else ``"torch"``.

:func:`kernel_for` runs inside the op (``attnkit::interval_attention``, :mod:`.interval_op`), on the
real row bounds, once per call: the forward op returns the kernel it ran and the backward runs the
same one. Compiled graphs hold the op, so compiled and eager calls make the same choice on the same
data, and no ``Lq x Lk`` mask is built unless the dense kernel is the one chosen.

The thresholds below were measured with ``benchmarks/masks.py --threshold`` and the causal
comparisons of ``benchmarks/masks.py`` / ``benchmarks/train.py``; docs/performance.md ("What
``auto`` runs, and the measurements behind it") holds every figure and the machines they came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _torch_private
from .._call import AttentionCall
from . import native
from .engines import GpuEngines, flex_supports, triton_supports
from .interval_inputs import IntervalInputs
from .tiled_plan import Problem, visited_fraction

#: Device types where attnkit's kernels (the tiled backend) were measured against PyTorch's.
MEASURED_DEVICES = frozenset({"cpu"})

#: PyTorch's kernel block by block against its fused kernel over the dense mask: below 512 x 512
#: pairs the dense kernel always won; above, block by block wins where it visits at most this share
#: of the pairs (docs/performance.md).
AUTO_MIN_PAIRS = 512 * 512
AUTO_MAX_VISITED = ((1024 * 1024, 0.3), (float("inf"), 0.6))  # (pairs below, visited share at most)
#: attnkit's native kernel against the fused dense kernel: from 128 x 128 pairs, whatever share of
#: the pairs the mask keeps (0.55-0.78x the dense kernel's time with 98-100% of them, 2026-11-27;
#: until then it lost from ~94%, and `NATIVE_MAX_COMPUTED` = 0.9 sent such masks to the dense kernel).
NATIVE_MIN_PAIRS = 128 * 128
#: No mask at all: attnkit's native kernel against SDPA's unmasked path through ``attention()``
#: (2026-11-27, AMD EPYC, AVX2 build, 2 threads), the pairs from which the kernel runs, by dtype and
#: whether a backward will run. float32: 0.83-0.93x SDPA's time from 1024 x 1024 (D = 32 and 64,
#: GQA, 1 and 2 threads), level at D = 128 (0.95-1.00x); at 512 x 512 training 0.83-0.87x but the
#: forward level (0.93-1.13x over runs, benchmarks/sdpa.py); below, the op's fixed cost lost
#: (1.15-1.47x at 128 and 256 keys). Half precision, where the kernel serves it (SDPA converts too):
#: training 0.26-0.45x from 128 keys, float16 forward 0.58-0.68x from 128; bfloat16 forward 1.23x at
#: 128, 1.06x at 256, 0.78-0.81x from 512.
NATIVE_UNMASKED_MIN_PAIRS = {  # (dtype, a backward will run) -> pairs
    (torch.float32, False): 1024 * 1024, (torch.float32, True): 512 * 512,
    (torch.bfloat16, False): 512 * 512, (torch.bfloat16, True): 128 * 128,
    (torch.float16, False): 128 * 128, (torch.float16, True): 128 * 128,
}
#: On a CPU with AMX (the kernel's bfloat16 forward on the tiles, SDPA's on oneDNN's AMX kernels) the
#: unmasked bfloat16 forward from 1024 x 1024: 1.21x / 1.27x SDPA's time at 256 / 512 keys, 0.85-0.88x
#: from 1024 (Xeon, H = 8, D = 64, 2 threads, 2026-11-27); the other entries held there (bf16
#: training 0.71-0.79x at 256-512 keys, 0.90-1.08x from 1024; fp16 forward 0.85-0.98x from 256).
NATIVE_UNMASKED_MIN_PAIRS_AMX = {**NATIVE_UNMASKED_MIN_PAIRS, (torch.bfloat16, False): 1024 * 1024}
NATIVE_UNMASKED_MAX_HEAD_DIM = 128
#: Half precision runs the kernel where it serves it (CPUs without half-precision matrix units, or
#: with AMX, and with AVX512-BF16 but no AMX when a backward will run: see
#: :func:`.native.serves_half_precision`): SDPA's bf16 / fp16 backward took 4.8x / 8x
#: the kernel's time (causal, L = 4096, AVX2) and its forward is no faster at any length measured
#: (with AMX: the kernel's causal forward 0.91x SDPA's time at L = 8192); structured
#: masks in half precision always run the kernel, whose alternatives are the same SDPA kernels, per
#: block or dense (docs/performance.md).


@dataclass(frozen=True)
class Route:
    """What runs a call: a registered ``backend`` and, for the tiled backend, its ``kernel`` (one of
    :data:`.interval_inputs.KERNELS`, or ``""``: chosen inside the op from the row bounds by
    :func:`kernel_for`, among every kernel when ``dense_allowed``, else among the sparse ones)."""

    backend: str
    kernel: str = ""
    dense_allowed: bool = False

    def __str__(self) -> str:
        return self.backend + (f":{self.kernel}" if self.kernel else "")


_TORCH = Route("torch")
_TILED = Route("tiled")
_TILED_CHOOSES = Route("tiled", dense_allowed=True)
_TILED_NATIVE = Route("tiled", kernel="native")


def choose(call: AttentionCall) -> Route:
    """What ``"auto"`` runs for ``call`` (see the module docstring). Traceable."""
    if call.query.device.type == "cuda":
        return _cuda_route(call)
    if call.return_lse:
        return _TILED
    if call.query.device.type not in MEASURED_DEVICES or call.return_weights:
        return _TORCH
    if _plain_causal(call) and not call.modifies_scores and call.dropout == 0:
        # masks.causal() and causal=True are one rule (over one query row, a decoding step, the call
        # holds neither: make_call drops them, and SDPA runs with no mask). Square: the native kernel
        # where it beat SDPA's causal path, else that path, GQA included, never the op's dense
        # kernel, which builds the L x L mask. Otherwise (a chunk of rows after a cache) the op.
        if call.q_len == call.k_len:
            pairs = call.q_len * call.k_len
            served = _native_serves(call.query.device.type, call.query.dtype, False, call.needs_grad)
            native_faster = NATIVE_MIN_PAIRS <= pairs and served
            return _tiled(call) if native_faster else _TORCH
        return _TILED_CHOOSES
    if call.q_len == 1 and call.structure is not None and not call.modifies_scores and call.dropout == 0:
        # A decoding step: its mask's dense form is one row of keys per sequence, [B, 1, 1, Lk], what
        # transformers' own SDPA path builds at every step (a third of the op's planning time).
        return _TORCH
    if call.structure is not None or call.modifies_scores:
        return _tiled(call)  # soft-capping, ALiBi and sinks: SDPA has none of them
    if call.dropout > 0 and _native_serves(call.query.device.type, call.query.dtype, call.mask is not None,
                                           call.needs_grad):
        # SDPA has no fused CPU kernel with dropout (its math path materialises every weight): the
        # native kernel took 0.02-0.77x its time from 32 x 32 pairs (docs/performance.md).
        return _tiled(call)
    if call.mask is not None or call.causal or call.q_len == 1:
        return _TORCH  # a dense mask (causal or not), or a decoding step over every key: SDPA as it is
    table = NATIVE_UNMASKED_MIN_PAIRS_AMX if _native_matrix_units() else NATIVE_UNMASKED_MIN_PAIRS
    unmasked_from = table.get((call.query.dtype, call.needs_grad))
    if (unmasked_from is not None
            and call.q_len * call.k_len >= unmasked_from
            and max(call.query.shape[-1], call.value.shape[-1]) <= NATIVE_UNMASKED_MAX_HEAD_DIM
            and _native_serves(call.query.device.type, call.query.dtype, False, call.needs_grad)):
        return _TILED_NATIVE  # no mask: the kernel over every key (its dense alternative would build a mask)
    return _TORCH


def _plain_causal(call: AttentionCall) -> bool:
    """``causal=True`` or ``masks.causal()`` and no other mask (one rule, however it was given)."""
    return call.mask is None and (call.structure.is_causal if call.structure is not None else call.causal)


def _cuda_route(call: AttentionCall) -> Route:
    """On CUDA: SDPA's kernels wherever they apply as they are (no mask, plain causal, a decoding
    step, a dense tensor mask, weights asked for); every structured mask, soft-capping, ALiBi, sinks
    and ``return_lse`` on a kernel that reads the rows' intervals (no ``Lq x Lk`` tensor): attnkit's
    Triton kernel for half-precision calls that need no gradient, FlexAttention with a block mask
    built from the intervals for the rest, and the Triton kernel where Flex cannot run the call
    (dropout: Flex has none; head sizes Flex does not compile). Measured on an H100 (bf16, L =
    32768, D = 128; docs/performance.md, "The second H100 session"): a forward through attnkit took
    2.00 / 3.32 / 12.13 ms on the Triton kernel against 2.34 / 3.51 / 11.54 on the Flex engine
    (window 1024, 8 documents, causal + padding: the one where Flex won, by 5%), but the Triton
    backward is slower (training 9.5-58.7 ms against 5.4-36.6). The third session: the window's
    forward through attnkit 1.66 ms on the Triton kernel, 1.70 on the Flex engine, and the Triton
    kernel 7-23% faster since (its NaN/inf pass gated; "The third H100 session"); its backward 4.2
    ms against Flex's ~3. Float32 stays on Flex: the Triton kernel's IEEE float32 products run on
    the FMA units."""
    interval_only = call.return_lse or call.modifies_scores or (call.structure is not None and not _plain_causal(call))
    if call.return_weights or call.mask is not None:
        return _TILED if call.return_lse else _TORCH  # weights are Lq x Lk; a dense mask already is
    if call.q_len == 1 and not call.return_lse and not call.modifies_scores and call.dropout == 0:
        return _TORCH  # a decoding step: the mask's one row per sequence on SDPA
    if not interval_only and call.dropout == 0:
        return _TORCH  # no mask or plain causal: SDPA's own kernels
    engines = _gpu_engines()
    forward_only = not call.needs_grad and call.query.dtype in (torch.float16, torch.bfloat16)
    if call.dropout == 0 and engines.flex and flex_supports(call.query, call.key, call.value) \
            and not (forward_only and engines.triton):
        return Route("tiled", "flex")
    if engines.triton and triton_supports(call.query):
        return Route("tiled", "triton")
    return _TILED if call.return_lse else _TORCH


@_torch_private.assume_constant_result
def _gpu_engines() -> GpuEngines:
    """Process state (triton importable, FlexAttention present), read once per trace."""
    return GpuEngines.find()


@_torch_private.assume_constant_result
def _native_serves(device_type: str, dtype: torch.dtype, has_mask: bool, needs_grad: bool = False) -> bool:
    """Process state (the kernel loaded, not turned off), read once per trace."""
    return native.serves(device_type, dtype, has_mask, needs_grad)


def _tiled(call: AttentionCall) -> Route:
    """The tiled backend with the op's own choice of kernel, or with the native kernel named where
    only the call's backward brings it in (:func:`_native_for_training_only`)."""
    return _TILED_NATIVE if _native_for_training_only(call) else _TILED_CHOOSES


def _native_for_training_only(call: AttentionCall) -> bool:
    """The call needs gradients, and the native kernel serves its dtype only so (half precision on a
    CPU with AVX512-BF16 and no AMX: :func:`.native.serves_half_precision`), so the route names the
    kernel: the op, which sees no ``requires_grad``, would choose PyTorch's kernels."""
    device_type, dtype, has_mask = call.query.device.type, call.query.dtype, call.mask is not None
    return (call.needs_grad and not _native_serves(device_type, dtype, has_mask)
            and _native_serves(device_type, dtype, has_mask, True))


@_torch_private.assume_constant_result
def _native_matrix_units() -> bool:
    """Process state (the kernel's bfloat16 products on AMX tiles), read once per trace."""
    return native.matrix_units_available()


def kernel_for(inputs: IntervalInputs) -> str:
    """Which kernel the interval op runs (:data:`.interval_inputs.KERNELS`): the record's own
    ``kernel`` when it names one; on CUDA attnkit's Triton kernel where it runs; else ``"native"``, ``"blocks"`` (PyTorch's kernel block by block)
    or ``"dense"`` (PyTorch's fused kernel over every key, the mask as a tensor; never when
    ``sparse_only``), from the row bounds. The native kernel computes soft-capping and ALiBi itself;
    elsewhere they run on plain ops per block (``"blocks"``; dense, per sequence, where short or
    dense). Dropout in a piece of a larger call (a ``seed`` with offsets) runs wherever plain dropout
    does: every kernel takes the offsets."""
    if inputs.kernel:
        return inputs.kernel
    query, key, value, lo, hi, bias = inputs.query, inputs.key, inputs.value, inputs.lo, inputs.hi, inputs.bias
    if query.device.type == "cuda" and bias is None and GpuEngines.find().triton and triton_supports(query):
        return "triton"  # attnkit's interval kernel on the GPU (an explicit backend="tiled", return_lse)
    if native.applies(query, key, value, bias is not None):
        # from 128 x 128 the native kernel beat the dense kernel (SDPA over the mask as a tensor)
        # whatever share of the pairs the mask keeps, in every dtype: see NATIVE_MIN_PAIRS
        short = query.shape[2] * key.shape[2] < NATIVE_MIN_PAIRS
        return "dense" if short and not (inputs.sparse_only or inputs.dropout > 0) else "native"
    if query.device.type == "cpu" and query.dtype == torch.float32 and bias is None:
        native.hint_if_not_built()
    if (inputs.sparse_only or inputs.dropout > 0 or inputs.softcap is not None
            or inputs.alibi_slopes is not None):
        return "blocks"
    pairs = query.shape[2] * key.shape[2]
    if pairs < AUTO_MIN_PAIRS or (inputs.causal_only and bias is None and query.shape[2] == key.shape[2]):
        return "dense"  # short; or SDPA's own causal path, which skips the same blocks 15-55% faster
    limit = next(share for below, share in AUTO_MAX_VISITED if pairs < below)
    problem = Problem(lo.cpu(), hi.cpu(), query.shape[2], key.shape[2], query.shape[0], bias is not None)
    return "blocks" if visited_fraction(problem) <= limit else "dense"
