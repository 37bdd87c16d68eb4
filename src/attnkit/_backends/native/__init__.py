"""attnkit's own CPU kernel for interval masks (``interval_attention.cpp``): build and load.

The tiled backend runs this kernel, forward and backward, when it is built and applies (float32
CPU tensors, a structured mask, no dense tensor mask; dropout included), and PyTorch's kernels
block by block otherwise (:mod:`..kernels`); both give the same output, log-sum-exp and gradients
up to float rounding (with dropout, each draws its own pattern). Building is an install step,
never a first-call cost: ``make`` runs ``python -m attnkit._backends.native`` once, which
compiles the source with the system C++ compiler against the installed torch into a cache
directory named after a hash of everything the binary depends on (source, torch version and ABI,
flags), so a changed source or torch is simply not found and the fallback runs until the next
build. Nothing is ever compiled implicitly.

Requirements: x86-64 with AVX2 and FMA (the flags it is compiled with), and a torch that exports
the BLAS ``sgemm_`` it multiplies with (the official x86 builds link MKL). ``ATTNKIT_NATIVE=0``
turns it off; ``ATTNKIT_NATIVE_DIR`` moves the cache (default ``~/.cache/attnkit/native``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("interval_attention.cpp")

#: (query rows per block, keys per chunk of the running softmax) by the mean number of keys a
#: row attends, smallest first (benchmarks/masks.py shapes, L = 16384, 2 threads): a 512 window
#: (span 543 per 32 rows, one chunk; 64-row blocks were as fast, 128 8% slower); 8 documents,
#: ~2300 keys per row (64 rows 4% faster than 32); causal + padding, ~7700 keys per row (128 x
#: 512 7% faster than 32 x 1024). A chunk's scores (rows x keys floats, <= 256 KiB) stay in L2.
TILES = ((1024, (32, 1024)), (4096, (64, 1024)), (float("inf"), (128, 512)))

#: The backward's tiles, the same way (its chunk holds two score buffers: weights and their
#: gradients). Median of 3 at L = 16384: the window and the documents within 4% from 16 x 1024 to
#: 128 x 128 (32 x 1024 best on the window, 0.29 s); causal + padding 128 x 128 to 256 x 128
#: (3.6-3.7 s) against 4.1-4.3 s for 32-64 row blocks, whose dK, dV products add rank-32 updates.
BACKWARD_TILES = ((4096, (32, 1024)), (float("inf"), (128, 128)))
#: With fewer (sequence, kv head) pairs than this many per thread, the backward also splits rows
#: (each part adds into its own dK, dV copy). Window 512, L = 16384, 8 query heads, 2 threads:
#: one kv head 0.35 s unsplit, 0.28 s in 2-4 parts, 0.29 in 8; eight kv heads 0.29 s unsplit,
#: 0.33-0.45 s in 2-8 parts (zeroing and summing the copies).
PARTS_PER_THREAD = 2

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]

_loaded: bool | None = None
_why_not = ""
_enabled = True


@contextmanager
def turned_off() -> Iterator[None]:
    """Inside the ``with``, the tiled backend runs PyTorch's kernel even where this one applies
    (tests run the tiled suite both ways; benchmarks compare them)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


def _cache_dir() -> Path:
    if os.environ.get("ATTNKIT_NATIVE_DIR"):
        return Path(os.environ["ATTNKIT_NATIVE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attnkit" / "native"


def library_path() -> Path:
    """Where the built kernel for this source, torch and Python lives."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
                 sys.implementation.cache_tag.encode(), " ".join(FLAGS).encode()):
        digest.update(part)
    return _cache_dir() / f"interval_attention-{digest.hexdigest()[:16]}.so"


def _cpu_supported() -> str:
    """Empty when this machine can run the kernel, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs x86-64, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"needs AVX2, the CPU offers {torch.backends.cpu.get_cpu_capability()}"
    return ""


def build(verbose: bool = False) -> Path:
    """Compile the kernel into the cache (a no-op when it is there); raises ``RuntimeError`` with
    the compiler's output when the build fails."""
    target = library_path()
    if target.exists():
        return target
    why = _cpu_supported()
    if why:
        raise RuntimeError(f"attnkit native kernel: {why}")
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("attnkit native kernel: no C++ compiler found (set CXX)")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        command = [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *(f"-I{path}" for path in cpp_extension.include_paths()), str(SOURCE), "-o", str(partial),
                   f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}"]
        if verbose:
            print(" ".join(command))
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"attnkit native kernel: compiling failed:\n{result.stderr[-4000:]}")
        partial.replace(target)  # atomic: a concurrent loader sees the whole file or none
    return target


def available() -> bool:
    """Whether the built kernel is loaded (loading it on the first ask)."""
    global _loaded, _why_not
    if _loaded is None:
        _loaded = False
        if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
            _why_not = "turned off by ATTNKIT_NATIVE=0"
        elif why := _cpu_supported():
            _why_not = why
        elif not (path := library_path()).exists():
            _why_not = f"not built (run: {sys.executable} -m attnkit._backends.native)"
        else:
            try:
                torch.ops.load_library(str(path))
                _loaded = True
            except (OSError, RuntimeError) as error:  # e.g. a torch without sgemm_: use the fallback
                _why_not = f"could not load {path}: {error}"
    return _loaded


def why_unavailable() -> str:
    """Why :func:`available` is False (empty when it is True)."""
    return "" if available() else _why_not


def applies(query: Tensor, key: Tensor, value: Tensor, has_tensor_mask: bool) -> bool:
    """The kernel serves this call: float32 CPU tensors, no dense tensor mask."""
    return (_enabled and not has_tensor_mask and query.device.type == "cpu"
            and all(t.dtype == torch.float32 for t in (query, key, value)) and available())


def _by_mean_keys(table: tuple, lo: Tensor, hi: Tensor) -> tuple[int, int]:
    """The ``(block, chunk)`` of ``table`` for the mean number of keys the rows attend."""
    mean_keys = float((hi - lo).clamp(min=0).float().mean()) if lo.numel() else 0.0
    return next(sizes for below, sizes in table if mean_keys < below)


def tiles(lo: Tensor, hi: Tensor) -> tuple[int, int]:
    """``(block, chunk)`` of the forward for rows attending ``[lo, hi)`` (see ``TILES``)."""
    return _by_mean_keys(TILES, lo, hi)


def computed_fraction(lo: Tensor, hi: Tensor, k_len: int) -> float:
    """Share of the ``Lq x Lk`` (query, key) pairs that :func:`interval_forward` multiplies for
    rows attending ``[lo, hi)`` (``[S, Lq]``, mean over the S sequences): every row of a block
    over the span of the block's intervals. Cheap (a few vector ops), so ``"auto"`` can ask."""
    if lo.numel() == 0 or k_len == 0:
        return 0.0
    # "auto" asks this on every call: a dozen vector ops over [S, Lq], about 30 us at Lq = 128
    block, _ = tiles(lo, hi)
    lo, hi = lo.clamp(0, k_len), hi.clamp(0, k_len)
    empty = lo >= hi
    first, last = lo.masked_fill(empty, k_len), hi.masked_fill(empty, 0)  # empty rows span nothing
    sequences, rows = lo.shape
    blocks = -(-rows // block)
    first = torch.nn.functional.pad(first, (0, blocks * block - rows), value=k_len)
    last = torch.nn.functional.pad(last, (0, blocks * block - rows), value=0)
    span = (last.view(sequences, blocks, block).amax(-1) - first.view(sequences, blocks, block).amin(-1)).clamp(min=0)
    pairs = int(span[:, :-1].sum()) * block + int(span[:, -1].sum()) * (rows - block * (blocks - 1))
    return pairs / (lo.numel() * k_len)


def backward_tiles(lo: Tensor, hi: Tensor) -> tuple[int, int]:
    """``(block, chunk)`` of the backward for rows attending ``[lo, hi)`` (see ``BACKWARD_TILES``)."""
    return _by_mean_keys(BACKWARD_TILES, lo, hi)


def interval_forward(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, scale: float,
                     block: int | None = None, chunk: int | None = None, dropout: float = 0.0,
                     seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(output [B, H, Lq, Dv], lse [B, H, Lq])`` of attention where row ``i`` of sequence ``b``
    attends keys ``lo[s, i] <= j < hi[s, i]`` (``s = b``, or 0 when ``lo`` has one row).

    ``query [B, H, Lq, D]``, ``key [B, Hkv, Lk, D]``, ``value [B, Hkv, Lk, Dv]`` with H a multiple
    of Hkv (GQA); rows with no key give zeros and lse ``-inf``. ``block`` (query rows computed
    together) and ``chunk`` (keys per step of the running softmax) default to :func:`tiles`.
    ``dropout`` drops each weight with that probability (and scales the kept ones by
    ``1 / (1 - dropout)``); which ones is a function of ``seed`` and the (sequence, head, row,
    key) position alone, so :func:`interval_backward` with the same seed sees the same pattern.
    The lse is the one before dropout."""
    if block is None or chunk is None:
        default_block, default_chunk = tiles(lo, hi)
        block, chunk = block or default_block, chunk or default_chunk
    if not available():
        raise RuntimeError(f"attnkit native kernel unavailable: {why_unavailable()}")
    query, key, value = _blas_rows(query, key, value)
    return torch.ops.attnkit.interval_forward(query, key, value, lo, hi, scale, block, chunk, dropout, seed)


def interval_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                      lo: Tensor, hi: Tensor, scale: float, grad_lse: Tensor | None = None,
                      block: int | None = None, chunk: int | None = None, parts: int | None = None,
                      dropout: float = 0.0, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`interval_forward` (same shapes as its inputs) from
    ``grad_out [B, H, Lq, Dv]`` and, when the lse was used too, ``grad_lse [B, H, Lq]``; ``out`` and
    ``lse`` are the forward's, ``dropout`` and ``seed`` too. ``parts`` cuts each (sequence, kv
    head)'s rows into that many pieces computed in parallel (default: enough for the threads when
    there are few heads)."""
    if block is None or chunk is None:
        default_block, default_chunk = backward_tiles(lo, hi)
        block, chunk = block or default_block, chunk or default_chunk
    if parts is None:
        pairs = query.shape[0] * key.shape[1]
        parts = max(1, min(-(-PARTS_PER_THREAD * torch.get_num_threads() // max(pairs, 1)),
                           -(-query.shape[2] // block)))
    if not available():
        raise RuntimeError(f"attnkit native kernel unavailable: {why_unavailable()}")
    # dL/dS = P * (f dP - delta), delta_i = sum_d dO_id O_id - dL/dlse_i (FlashAttention's D term;
    # f the dropout factors, whose sum over a row's f * P * dP is dO_i . O_i all the same)
    delta = torch.einsum("...d,...d->...", grad_out, out)  # a batched matmul: no [.., Dv] temporary
    if grad_lse is not None:
        delta = delta - grad_lse
    grad_out, query, key, value = _blas_rows(grad_out, query, key, value)
    return torch.ops.attnkit.interval_backward(grad_out, query, key, value, lse, delta, lo, hi, scale, block, chunk,
                                               parts, dropout, seed)


def _blas_rows(*tensors: Tensor) -> tuple[Tensor, ...]:
    """BLAS reads rows at a stride >= the row length. A size-1 dim may carry any stride (and
    ``.contiguous()`` keeps it), so such rare layouts are copied with fresh strides."""
    return tuple(t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1]
                 else t.clone(memory_format=torch.contiguous_format) for t in tensors)
