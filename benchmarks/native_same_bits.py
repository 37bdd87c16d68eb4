"""Do two builds of the native kernel compute the same bits?

    python benchmarks/native_same_bits.py OLD_DIR NEW_DIR

``OLD_DIR`` and ``NEW_DIR`` are kernel caches (``ATTNKIT_NATIVE_DIR``), each holding one built
library, e.g. the committed source and a changed one (a refactoring must change no bit)::

    ATTNKIT_NATIVE_DIR=/tmp/native_new python -m attnkit.kernel      # this checkout's source
    # the committed source: a checkout of HEAD built the same way into /tmp/native_old

A process can load only one library registering the kernel's ops, so each build runs the same
calls in its own child process (the library loaded directly from its directory, after checking
its bytes against its build record: the two builds' sources hash to different names). The parent
compares out, lse and dq, dk, dv of every call with ``torch.equal`` on their bits (int32 views:
NaN for NaN, -0 for -0). The calls cover windows, documents, causal + padding, two-range masks
(a window with attention sinks), GQA, dropout drawn from a generator, soft-capping, ALiBi, the lse
asked for, rows with no key, NaN and inf inputs, odd lengths, head dims 16/64/128 and tile sizes
other than the tables'; raw ops (``native.interval_forward``/``interval_backward``) and
``attnkit.attention(..., backend="tiled")`` with autograd. Exit status 0 when every result is
equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def _load_build(directory: Path) -> Path:
    """Load the one library of ``directory`` into this process as the kernel (its record checked)."""
    from attnkit._backends.native import building, loading

    libraries = sorted(directory.glob("interval_attention-*.so"))
    if len(libraries) != 1:
        raise SystemExit(f"{directory}: expected one built library, found {[p.name for p in libraries]}")
    library = libraries[0]
    record = building.read_record(library)
    if record is None or record.get("sha256") != building.file_digest(library):
        raise SystemExit(f"{library} does not match its build record")
    torch.ops.load_library(str(library))
    state = loading._library
    state.loaded, state.why_not, state.path, state.wide = True, "", library, building.wide()
    return library


def _bounds(kind: str, batch: int, q_len: int, k_len: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo, hi`` ``[1 or B, Lq]`` of a mask kind (bottom-right positions ``p = i + Lk - Lq``)."""
    pos = torch.arange(q_len) + (k_len - q_len)
    if kind == "window":
        lo, hi = pos - 37, pos + 1
    elif kind == "documents":  # documents of random lengths, the same in queries and keys
        edges = torch.cumsum(torch.randint(5, 60, (batch, k_len), generator=g), 1)
        doc = torch.searchsorted(edges, pos.expand(batch, -1).contiguous(), right=True)
        starts = torch.cat([torch.zeros(batch, 1, dtype=torch.long), edges], 1).gather(1, doc)
        return starts.clamp(max=k_len), pos.expand(batch, -1) + 1
    elif kind == "causal_padding":  # causal, then each sequence's keys cut at its length
        lengths = torch.randint(k_len // 2, k_len + 1, (batch, 1), generator=g)
        return torch.zeros(batch, q_len, dtype=torch.long), torch.minimum(pos + 1, lengths)
    elif kind == "random":  # any interval, some empty, some past the keys
        lo = torch.randint(-5, k_len, (batch, q_len), generator=g)
        return lo, lo + torch.randint(0, k_len, (batch, q_len), generator=g)
    else:
        raise ValueError(kind)
    return lo[None], hi[None]


# (mask, B, H, Hkv, Lq, Lk, D, Dv, dropout, softcap, alibi, scale, block/chunk override, poison)
RAW_CASES = [
    ("window", 2, 4, 4, 300, 300, 64, 64, 0.0, None, False, None, None, ""),
    ("window", 1, 8, 2, 257, 257, 128, 128, 0.1, None, False, None, None, ""),
    ("documents", 2, 4, 1, 200, 200, 16, 16, 0.0, 30.0, False, None, None, ""),
    ("documents", 2, 6, 3, 333, 333, 64, 48, 0.2, None, True, None, None, ""),
    ("causal_padding", 3, 4, 2, 129, 131, 64, 64, 0.0, None, True, None, None, ""),
    ("causal_padding", 2, 2, 2, 513, 513, 128, 128, 0.3, 5.0, True, None, None, ""),
    ("random", 2, 4, 4, 181, 181, 16, 16, 0.5, 2.0, True, 0.7, (32, 37), "nan_inf"),
    ("random", 2, 4, 2, 150, 170, 64, 80, 0.0, 50.0, False, 3e37, (33, 17), "nan_inf"),
    ("random", 1, 3, 1, 97, 211, 128, 64, 0.1, None, False, None, (64, 1000), "inf_value"),
    ("window", 2, 4, 4, 1031, 1031, 64, 64, 0.0, None, False, None, None, ""),
    ("causal_padding", 1, 4, 4, 2100, 2100, 64, 64, 0.0, None, False, None, None, ""),  # keys copied together
    ("random", 2, 2, 2, 45, 45, 16, 16, 0.0, None, False, None, (40, 9), "no_key"),
]


def _raw_results() -> list[tuple[str, list[torch.Tensor]]]:
    from attnkit._backends import dropout as dropout_hash
    from attnkit._backends import native

    results = []
    for case, (kind, B, H, Hkv, Lq, Lk, D, Dv, p, cap, alibi, scale, tiles, poison) in enumerate(RAW_CASES):
        g = torch.Generator().manual_seed(1000 + case)
        q = torch.randn(B, H, Lq, D, generator=g)
        k = torch.randn(B, Hkv, Lk, D, generator=g)
        v = torch.randn(B, Hkv, Lk, Dv, generator=g)
        if case % 3 == 1:  # rows outer to heads, as a model's projections give ([B, L, H, D] viewed)
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        lo, hi = _bounds(kind, B, Lq, Lk, g)
        if poison in ("nan_inf", "inf_value"):
            k[0, 0, 5, 3] = float("inf")
            v[-1, -1, 7, 1] = float("-inf")
        if poison == "nan_inf":
            q[-1, 1, 7, 0] = float("nan")
        if poison == "no_key":
            lo, hi = lo.clone(), hi.clone()
            lo[:, 3], hi[:, 3] = 10, 10  # a row with no key
            lo[:, 20:40], hi[:, 20:40] = Lk + 5, Lk + 9  # rows past the keys
        slopes = torch.rand(B, H, generator=g) if alibi else None
        seed = int(dropout_hash.draw_seed(torch.Generator().manual_seed(case))) if p else 0
        options = dict(dropout=p, seed=seed, softcap=cap, alibi_slopes=slopes)
        block, chunk = tiles or (None, None)
        scale = scale if scale is not None else D ** -0.5
        out, lse = native.interval_forward(q, k, v, lo, hi, scale, block=block, chunk=chunk, **options)
        grad_out = torch.randn(out.shape, generator=g)
        grad_lse = torch.randn(lse.shape, generator=g) if case % 2 else None
        grads = native.interval_backward(grad_out, q, k, v, out, lse, lo, hi, scale, grad_lse=grad_lse,
                                         block=block, chunk=chunk, **options)
        label = f"raw {case:2d} {kind} B{B} H{H}/{Hkv} Lq{Lq} Lk{Lk} D{D}/{Dv} p{p} cap{cap} alibi{alibi} {poison}"
        results.append((label, [out, lse, *grads]))
    return results


def _api_results() -> list[tuple[str, list[torch.Tensor]]]:
    import attnkit
    from attnkit import masks

    results = []
    cases = [
        ("window+sinks", masks.sliding_window(40) | masks.first_keys(4), 2, 4, 2, 301, 64, 0.0, None),
        ("window+sinks dropout", masks.sliding_window(64) | masks.first_keys(3), 1, 4, 4, 257, 128, 0.1, None),
        ("causal&padding", masks.causal() & masks.padding(torch.tensor([190, 77])), 2, 4, 1, 190, 16, 0.0, 20.0),
        ("documents", masks.document([50, 91, 60]), 1, 6, 2, 201, 64, 0.2, None),
        ("window", masks.sliding_window(33), 2, 2, 2, 129, 64, 0.0, 8.0),
    ]
    for case, (name, mask, B, H, Hkv, L, D, p, cap) in enumerate(cases):
        g = torch.Generator().manual_seed(2000 + case)
        q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
        k = torch.randn(B, Hkv, L, D, generator=g, requires_grad=True)
        v = torch.randn(B, Hkv, L, D, generator=g, requires_grad=True)
        slopes = torch.rand(H, generator=g) if case % 2 else None
        out, lse = attnkit.attention(q, k, v, mask=mask, backend="tiled", return_lse=True, dropout=p,
                                     generator=torch.Generator().manual_seed(7 + case), softcap=cap,
                                     alibi_slopes=slopes)
        loss = (out * torch.randn(out.shape, generator=g)).sum() + (lse * torch.randn(lse.shape, generator=g)).sum()
        loss.backward()
        results.append((f"api {case:2d} {name} B{B} H{H}/{Hkv} L{L} D{D} p{p} cap{cap}",
                        [out.detach(), lse.detach(), q.grad, k.grad, v.grad]))
    return results


def child(directory: str, output: str) -> None:
    library = _load_build(Path(directory))
    torch.save({"library": str(library), "results": _raw_results() + _api_results()}, output)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def main(old: str, new: str) -> int:
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, directory in (("old", old), ("new", new)):
            output = Path(scratch) / f"{name}.pt"
            env = {**os.environ, "ATTNKIT_NATIVE_DIR": directory}
            done = subprocess.run([sys.executable, __file__, "--child", directory, str(output)], env=env,
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"{name} build ({directory}) failed:\n{done.stderr[-3000:]}")
                return 1
            runs[name] = torch.load(output)
    print(f"old: {runs['old']['library']}\nnew: {runs['new']['library']}")
    different = 0
    for (label, ours), (label_new, theirs) in zip(runs["old"]["results"], runs["new"]["results"]):
        assert label == label_new
        verdicts = []
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, theirs):
            same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
            different += not same
            nonfinite = int((~a.isfinite()).sum())
            note = f" ({nonfinite} non-finite)" if nonfinite else ""
            verdicts.append(f"{what} {'same' if same else 'DIFFERENT'}{note}")
        print(f"{label}: {', '.join(verdicts)}")
    total = sum(len(r) for _, r in runs["old"]["results"])
    print(f"{total - different} of {total} tensors bit-identical" + ("" if different else ": the same bits"))
    return 1 if different else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3:
        sys.exit(main(sys.argv[1], sys.argv[2]))
    else:
        print(__doc__)
        sys.exit(2)
