"""``python -m attnkit._backends.native``: build the native kernel (an install step, see the
package docstring). Exits 0 with a note when this machine cannot build or run it, so that an
install without a compiler still works (the tiled backend then uses PyTorch's kernel)."""

from __future__ import annotations

import sys

from . import available, build, why_unavailable


def main() -> int:
    strict = "--strict" in sys.argv[1:]
    try:
        path = build(verbose="--verbose" in sys.argv[1:])
    except (RuntimeError, OSError) as error:  # no compiler, unsupported CPU, unwritable cache
        print(f"{error}\nattnkit: the tiled backend will use PyTorch's fused kernel instead.", file=sys.stderr)
        return 1 if strict else 0
    if not available():
        print(f"attnkit native kernel built at {path} but not loadable: {why_unavailable()}", file=sys.stderr)
        return 1 if strict else 0
    print(f"attnkit native kernel: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
