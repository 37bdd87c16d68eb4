"""The native kernel's register tiles alone, their data in L1 (L2 for long key spans), against the
core's FMA peak.

    python benchmarks/native_tiles.py                 # W = 32, 64, 128 keys
    python benchmarks/native_tiles.py --keys 64 256

``native_tiles.cpp`` includes ``csrc/tiles.h`` and is compiled with the kernel's own flags
(``building.flags()``: the 256-bit build, or the 512-bit one on an AVX-512 CPU), so it times the
tiles the kernel runs: the forward's scores (S = K Qt) and values (Ot += V P) products and the
backward's product over rows (dK += dS^T Q, dV += P^T dO, which writes W key rows of D) for W keys
against one group of 32 rows, D = 64, one thread, best of 15 runs of ~0.1 s; ``fma_peak.c``'s
one-thread peak beside them (not measured where a tile beats it: the machine was busy). A tile far
below the peak limits every call; one near it leaves the rest of a call's time to the softmax and
data movement (``native_kernel.py`` times whole calls).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from attnkit._backends.native import building  # noqa: E402
from common import describe_machine, fma_peak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[32, 64, 128], help="keys W per call")
    args = parser.parse_args()
    compiler = building.compiler() or shutil.which("g++")
    if compiler is None:
        sys.exit("no C++ compiler")
    flags = [flag for flag in building.flags() if flag not in ("-fPIC", "-shared")]
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "native_tiles"
        source = Path(__file__).with_name("native_tiles.cpp")
        built = subprocess.run([compiler, *flags, f"-I{building.SOURCE_DIR}", str(source), "-o", str(program)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"native_tiles.cpp did not build:\n{built.stderr[-2000:]}")
        ran = subprocess.run([str(program), *map(str, args.keys)], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak, how = fma_peak(1)
    rows = [line.split() for line in ran.stdout.splitlines() if line.strip()]
    fastest = max((float(rate) for row in rows for rate in row[1:]), default=0.0)
    if peak is not None and fastest > peak:  # a busy machine slowed fma_peak's runs more than the tiles'
        peak, how = None, f"not measured: fma_peak.c read {peak:.0f} GFLOP/s ({how}), a tile {fastest:.0f}"
    share = (lambda rate: f"{float(rate) / peak:.0%}") if peak else (lambda rate: "n/a")
    print(f"# register tiles alone in L1, 32 rows, D = 64, one thread ({describe_machine()}; "
          f"{'512' if building.wide() else '256'}-bit build); best of 15 runs\n")
    print("| keys W | scores GFLOP/s | / FMA peak | values GFLOP/s | / FMA peak | rows product GFLOP/s | / FMA peak |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for keys, *rates in rows:
        print(f"| {keys} | " + " | ".join(f"{float(rate):.0f} | {share(rate)}" for rate in rates) + " |")
    print(f"\nFMA peak: {f'{peak:.0f} GFLOP/s ({how})' if peak else how}")


if __name__ == "__main__":
    main()
