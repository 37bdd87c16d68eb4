"""Building attnkit's native kernel: compile, verify in a separate process, record.

Building is an install step (``attnkit build-kernel``, ``python -m attnkit.kernel``, run by
``make``), never a first-call cost: nothing is compiled implicitly. The system C++ compiler
compiles the kernel's one translation unit, ``csrc/ops.cpp`` (which includes the other files of
``csrc/``, one idea each), against the installed torch into a cache directory (default
``~/.cache/attnkit/native``; ``ATTNKIT_NATIVE_DIR`` moves it), under a name hashed from everything
the binary depends on: every source file of ``csrc/`` (names and bytes), the torch build (version,
git revision, C++ ABI, debug), the Python ABI tag and the flags. A changed header, unit or torch is
simply not found, and the tiled backend uses PyTorch's kernels until the next build.

Before a library is installed in the cache it is loaded in a **separate Python process**
(:mod:`.probe`), which checks the ops it registers and runs them once against a float64 formula.
Only then is it moved into place, next to a record (``<library>.json``) holding its SHA-256, its
size, the compiler that built it and the torch build. :mod:`.loading` loads nothing whose bytes do
not match its record, so a truncated, corrupted or foreign file never reaches this process. The
record's compiler is part of the key: a build with another compiler (``CXX``) is not a no-op.

Requirements: x86-64 with AVX2, FMA and F16C (the flags below; AVX-512 is used where the CPU has it); the
kernel computes its products itself (no BLAS).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ... import _torch_private
from ..._json import loads_untrusted

#: The kernel's sources: headers and units, one idea each (see ``csrc/ops.cpp``).
SOURCE_DIR = Path(__file__).with_name("csrc")
#: The one translation unit compiled (it includes the headers; one unit keeps the build's time).
UNIT = SOURCE_DIR / "ops.cpp"
SOURCE_SUFFIXES = (".h", ".cpp")


def sources() -> list[Path]:
    """Every source file of the kernel (all headers and units, sorted): all of them name the build.
    Empty when the sources are not installed (then :func:`build` says so; nothing is found to load)."""
    if not SOURCE_DIR.is_dir():
        return []
    return sorted(path for path in SOURCE_DIR.iterdir() if path.suffix in SOURCE_SUFFIXES and path.is_file())


def sources_digest() -> str:
    """SHA-256 over every source file's name and bytes: a change to any header or unit (or a file
    added, removed or renamed) is another build."""
    digest = hashlib.sha256()
    for path in sources():
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()

# -ffp-contract=off: GCC would otherwise fuse a * b - c into one FMA in C++ (its default there is
# "fast"), skipping the rounding of a * b that the forward made: the backward's weights
# exp(scale * s - lse) must round as the forward's did (huge scores make the difference 0 vs 1).
# The kernel asks for FMA explicitly where it wants one.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
#: Where the CPU has AVX-512 (torch's own detection, the one that picks its kernels): the products
#: and row loops then run in 512-bit vectors (the 16-lane traits of ``csrc/lanes.h``, chosen by
#: ``__AVX512F__``, which ``csrc/tiles.h`` and ``csrc/softmax.h`` take), with the same results.
#: The flags are part of the library's name, so a CPU without AVX-512 never finds such a build.
AVX512_FLAGS = ["-mavx512f"]


def wide() -> bool:
    """Whether this machine gets the AVX-512 build: an AVX-512 CPU, unless ``ATTNKIT_NATIVE_AVX512=0``
    (which keeps the 256-bit build, e.g. to compare the two)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and os.environ.get("ATTNKIT_NATIVE_AVX512") != "0"


def flags() -> list[str]:
    """The compiler flags for this machine (:data:`FLAGS`, plus :data:`AVX512_FLAGS` where :func:`wide`,
    plus :func:`tile_shape_flags`)."""
    return (FLAGS + AVX512_FLAGS if wide() else FLAGS) + tile_shape_flags()


def tile_shape_flags() -> list[str]:
    """``ATTNKIT_NATIVE_TILES=KxF`` builds register tiles of K keys (features) by, in the backward's
    products over rows, F vectors of features, instead of ``csrc/lanes.h``'s choice: for tests, which
    check that every tile shape gives the same bits. Unset (the normal case): no flags."""
    given = os.environ.get("ATTNKIT_NATIVE_TILES", "")
    if not given:
        return []
    keys, _, vectors = given.partition("x")
    if not (keys.isdigit() and vectors.isdigit() and 1 <= int(keys) <= 6 and 1 <= int(vectors) <= 4):
        raise ValueError(f"ATTNKIT_NATIVE_TILES: expected KxF with 1 <= K <= 6 and 1 <= F <= 4, got {given!r}")
    return [f"-DATTNKIT_TILE_KEYS={int(keys)}", f"-DATTNKIT_TILE_FEATURE_VECTORS={int(vectors)}"]


def cache_dir() -> Path:
    """Where built kernels live: ``$ATTNKIT_NATIVE_DIR``, else ``$XDG_CACHE_HOME/attnkit/native``
    (``~/.cache/attnkit/native``)."""
    if os.environ.get("ATTNKIT_NATIVE_DIR"):
        return Path(os.environ["ATTNKIT_NATIVE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attnkit" / "native"


def torch_build() -> str:
    """The torch build the kernel is compiled against: a different one needs another binary."""
    return " ".join((torch.__version__, str(torch.version.git_version), f"cxx11abi={_torch_private.cxx11_abi()}",
                     f"debug={torch.version.debug}", sys.implementation.cache_tag))


def library_path() -> Path:
    """Where the built kernel for this source, torch build and flags lives."""
    digest = hashlib.sha256()
    for part in (sources_digest().encode(), torch_build().encode(), " ".join(flags()).encode()):
        digest.update(part)
    return cache_dir() / f"interval_attention-{digest.hexdigest()[:16]}.so"


def record_path(library: Path) -> Path:
    """The build record next to ``library``."""
    return library.with_suffix(".json")


def file_digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def read_record(library: Path) -> dict | None:
    """The record of ``library``, or None when there is none or it cannot be read."""
    try:
        record = loads_untrusted(record_path(library).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def cpu_supported() -> str:
    """Empty when this machine can run the kernel, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs x86-64, this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"needs AVX2, the CPU offers {capability}"
    return ""


def compiler() -> str | None:
    """The C++ compiler a build uses: ``$CXX``, else ``c++`` or ``g++`` on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def compiler_identity(command: str) -> str:
    """The compiler's path and first ``--version`` line (a build with another compiler is another build)."""
    try:
        result = subprocess.run([command, "--version"], capture_output=True, text=True, check=False, timeout=60)
    except OSError as error:
        raise RuntimeError(f"attnkit native kernel: cannot run the compiler {command!r}: {error}") from None
    first = (result.stdout.strip().splitlines() or ["unknown version"])[0]
    return f"{shutil.which(command) or command}: {first}"


def probe(library: Path) -> str:
    """Load ``library`` in a separate Python process and run its ops once; empty when it works,
    else what went wrong (a crash, a missing op, a wrong result)."""
    try:
        result = subprocess.run([sys.executable, "-m", "attnkit._backends.native.probe", str(library)],
                                capture_output=True, text=True, check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"the probe process failed: {error}"
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return f"the probe process failed ({detail})"
    return ""


def write_record(library: Path, compiler_used: str, target: Path | None = None) -> None:
    """Write ``library``'s record (its digest is taken now), as ``target``'s record when given."""
    record = {"sha256": file_digest(library), "size": library.stat().st_size, "compiler": compiler_used,
              "torch": torch_build(), "source_sha256": sources_digest()}
    record_path(target or library).write_text(json.dumps(record, indent=1) + "\n")


def build(verbose: bool = False, force: bool = False) -> Path:
    """Compile, probe and record the kernel (a no-op when this source, torch build and compiler
    already have a verified build, unless ``force``); returns the library's path. Raises
    ``RuntimeError`` saying why when it cannot (no compiler, CPU, compile error, failed probe) and
    ``OSError`` when the cache is not writable."""
    why = cpu_supported()
    if why:
        raise RuntimeError(f"attnkit native kernel: {why}")
    if not UNIT.is_file():
        raise RuntimeError(f"attnkit native kernel: its sources are not installed ({UNIT} is missing)")
    command = compiler()
    if command is None:
        raise RuntimeError("attnkit native kernel: no C++ compiler found (install g++, or set CXX)")
    identity = compiler_identity(command)
    target = library_path()
    record = read_record(target)
    if (not force and target.exists() and record is not None and record.get("compiler") == identity
            and record.get("sha256") == file_digest(target)):
        return target
    from torch.utils import cpp_extension

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        arguments = [command, *flags(), f"-D_GLIBCXX_USE_CXX11_ABI={int(_torch_private.cxx11_abi())}",
                     *(f"-I{path}" for path in cpp_extension.include_paths()), f"-I{SOURCE_DIR}", str(UNIT), "-o",
                     str(partial),
                     f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}"]
        if verbose:
            print(" ".join(arguments))
        result = subprocess.run(arguments, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"attnkit native kernel: compiling failed:\n{result.stderr[-4000:]}")
        failure = probe(partial)
        if failure:
            raise RuntimeError(f"attnkit native kernel: the built library does not work: {failure}")
        write_record(partial, identity, target=partial)
        # The record first, then the library, each atomically: a loader sees a library only once
        # its record is there (a stale record for an old file fails the digest check: never loaded).
        record_path(partial).replace(record_path(target))
        partial.replace(target)
    return target
