"""attnkit's native CPU kernel for structured masks: build it, and ask whether it runs.

The kernel makes structured masks (causal, sliding windows, packed documents, padding, ...) run
block-sparse at close to the machine's matrix-multiply rate, forward and backward, on CPU tensors
in float32, or bfloat16 / float16 computed in float32. It is compiled once, on your machine, with its C++ compiler::

    attnkit build-kernel            # or: python -m attnkit.kernel

(``make test``/``make demo`` run it). Without it everything still works, on PyTorch's kernels.
The build is verified in a separate process before it is used; see
``attnkit._backends.native`` for where it lives and how it is checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._backends import native

__all__ = ["build", "available", "status", "release_memory", "add_arguments", "run", "main"]


def build(*, verbose: bool = False, force: bool = False) -> Path:
    """Compile, verify and install the kernel for this torch (a no-op when it is there); returns its
    path. Raises ``RuntimeError`` saying why when this machine cannot build it.

    Args:
        verbose: print the compiler command.
        force: rebuild even when a verified build exists.

    Returns:
        The path of the installed shared library (``.so``).

    Raises:
        RuntimeError: this machine cannot build or verify it (no C++ compiler, an unsupported
            CPU); the message says why.
        OSError: the cache directory cannot be written.

    A build takes about half a minute; ``attnkit build-kernel`` runs it from the shell. After
    it, :func:`attnkit.kernel.available` is True in every new process.

    Example:

        Whether a build is in place, and whether it loads (asks only: builds nothing):

        >>> from attnkit import kernel
        >>> kernel.status()
        'attnkit native kernel: ...'
        >>> kernel.available() == kernel.status().startswith("attnkit native kernel: loaded from")
        True
    """
    return native.build(verbose=verbose, force=force)


def available() -> bool:
    """Whether the kernel is loaded in this process (loading it on the first ask).

    False where it was never built (see :func:`attnkit.kernel.build`), does not match this
    torch or this CPU, or is turned off; :func:`attnkit.kernel.status` says which. Never
    raises and never builds.

    Example:

        >>> from attnkit import kernel
        >>> loaded = kernel.available()            # True once ``attnkit build-kernel`` has run
        >>> loaded == kernel.status().startswith("attnkit native kernel: loaded from")
        True
    """
    return native.available()


def status() -> str:
    """One line: where the loaded kernel comes from, or why it is not used.

    Returns:
        ``"attnkit native kernel: loaded from <path>"``, or
        ``"attnkit native kernel: not used: <reason>"``.

    Example:

        >>> from attnkit import kernel
        >>> print(kernel.status())
        attnkit native kernel: ...
    """
    if native.available():
        return f"attnkit native kernel: loaded from {native.loaded_from()}"
    return f"attnkit native kernel: not used: {native.why_unavailable()}"


def release_memory() -> int:
    """Give back to the system the output memory the kernel keeps; returns the bytes released.

    Outputs and gradients of 32 MiB or more are whole memory mappings, whose pages fault in one by
    one on first touch (~7 ms per 32 MiB, a tenth of a windowed forward at L = 16384). When such a
    tensor is freed the kernel keeps its mapping (at most 256 MiB in all, the most recently freed)
    and hands it to the next output of the same size: a training step reuses its output and
    gradients. Call this to return that memory, e.g. before measuring a process's memory or when a
    long run moves on to other work.

    Returns:
        The number of bytes given back (0 when nothing was kept, or the kernel is not loaded).

    Example:

        >>> from attnkit import kernel
        >>> released = kernel.release_memory()     # whatever the kernel kept, returned
        >>> kernel.release_memory()                # nothing left to give back
        0
    """
    return native.release_kept_memory()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The build command's options (``attnkit build-kernel`` and ``python -m attnkit.kernel``).

    Adds ``--strict``, ``--force``, ``--verbose`` and ``--status`` to ``parser``, in place; the
    parsed arguments are what :func:`attnkit.kernel.run` takes.

    Example:

        >>> import argparse
        >>> from attnkit import kernel
        >>> parser = argparse.ArgumentParser(prog="build-kernel")
        >>> kernel.add_arguments(parser)
        >>> parser.parse_args(["--status", "--strict"])
        Namespace(strict=True, force=False, verbose=False, status=True)
    """
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernel cannot be built or loaded")
    parser.add_argument("--force", action="store_true", help="rebuild even when a verified build exists")
    parser.add_argument("--verbose", action="store_true", help="print the compiler command")
    parser.add_argument("--status", action="store_true", help="only say whether the kernel is used, and why not")


def run(args: argparse.Namespace) -> int:
    """Build (or with ``--status`` only report). Exit status 0 with a note when this machine cannot
    build or run the kernel (an install without a compiler still works), 1 then with ``--strict``.

    Args:
        args: parsed by a parser that :func:`attnkit.kernel.add_arguments` set up.

    Returns:
        The exit status, 0 (or 1 with ``--strict`` when the kernel cannot be built or loaded).
        What went wrong is printed on stderr; the kernel's path (or status) on stdout.

    Example:

        >>> import argparse
        >>> from attnkit import kernel
        >>> parser = argparse.ArgumentParser()
        >>> kernel.add_arguments(parser)
        >>> kernel.run(parser.parse_args(["--status"]))
        attnkit native kernel: ...
        0
    """
    if args.status:
        print(status())
        return 0 if available() or not args.strict else 1
    try:
        path = build(verbose=args.verbose, force=args.force)
    except (RuntimeError, OSError) as error:  # no compiler, unsupported CPU, unwritable cache
        print(f"{error}\nattnkit: structured masks will run on PyTorch's kernels instead.", file=sys.stderr)
        return 1 if args.strict else 0
    if not available():
        print(f"attnkit native kernel built at {path} but not loadable: {native.why_unavailable()}", file=sys.stderr)
        return 1 if args.strict else 0
    print(f"attnkit native kernel: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m attnkit.kernel``: the build command.

    Args:
        argv: the options (see :func:`attnkit.kernel.add_arguments`); default ``sys.argv[1:]``.

    Returns:
        The exit status, as :func:`attnkit.kernel.run` gives it. A bad option exits through
        argparse (``SystemExit`` with status 2).

    Example:

        >>> from attnkit import kernel
        >>> kernel.main(["--status"])              # reports only; without it, builds
        attnkit native kernel: ...
        0
    """
    parser = argparse.ArgumentParser(prog="attnkit build-kernel", description="Build attnkit's native CPU kernel.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
