"""The work of each spawned rank in test_distributed_agreement.py (a module the spawned processes import).

Each rank runs the same list of cases (:func:`cases`). A **mismatch** case gives one rank (the
"odd" one) one different setting; every rank records what its call raised, and the parent test
checks that every rank raised the same ``ValueError`` naming the setting and each rank's value. A
**refusal** case gives the odd rank an argument its own checks refuse: it raises its own error,
the others a ``ValueError`` naming it. Between them, **matching** calls must still work (no
message left in flight by a refused call) and equal single-process ``attnkit.attention``.

A rank whose outcome is not of the expected kind (no error, another type) raises at once, so the
job fails fast (the parent kills the other ranks) instead of running on with desynchronised ranks.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist

import attnkit
from attnkit import masks
from attnkit.distributed import attention_fn, ring_attention, shard, ulysses_attention

METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}
TOLERANCE = 1e-10  # float64; the ring's lse merge moves results by a few ulp


def base(world: int) -> dict:
    return dict(dtype=torch.float64, batch=2, heads=2 * world, kv_heads=world, dk=8, dv=10, length=8 * world,
                mask=None, causal=False, layout="contiguous", scale=None, dropout=0.0, options={})


def _doc_ids(length: int, cut: int) -> torch.Tensor:
    """``[2, length]`` document ids (more than 16: the mask's repr shows only their shape)."""
    first = torch.tensor([0] * cut + [1] * (length - cut))
    return torch.stack([first, torch.zeros(length, dtype=torch.int64)])


def cases(world: int) -> list[dict]:
    """Every case: ``label``, ``kind`` (mismatch / refusal / match), ``method``, ``setting`` (the name
    the message must give), ``same`` (every rank's settings over :func:`base`), ``odd`` (the odd
    rank's settings over those), ``expect`` (more text the message must hold)."""
    L = 8 * world
    mismatches = [  # (setting, same, odd, expect)
        ("dtype", {}, dict(dtype=torch.float32), ["torch.float64", "torch.float32"]),
        ("batch size", {}, dict(batch=1), []),
        ("query heads", {}, dict(heads=4 * world), [str(2 * world), str(4 * world)]),
        ("key/value heads", {}, dict(kv_heads=2 * world), []),
        ("query/key head size", {}, dict(dk=16), [" 8", " 16"]),
        ("value head size", {}, dict(dv=12), [" 10", " 12"]),
        ("mask", dict(mask=masks.sliding_window(4)), dict(mask=masks.document([L // 2, L - L // 2])),
         ["sliding_window(4)", f"document([{L // 2}, {L - L // 2}])"]),
        ("mask", {}, dict(mask=masks.causal()), ["None", "causal()"]),
        ("mask", dict(mask=masks.sliding_window(4)), dict(mask=masks.sliding_window(5)),
         ["sliding_window(4)", "sliding_window(5)"]),
        ("mask", dict(mask=masks.sliding_window(3, 2)), dict(mask=masks.sliding_window(3, 1)), []),
        ("mask", dict(mask=masks.document([L // 2, L - L // 2])),
         dict(mask=masks.document([L // 2 - 1, L - L // 2 + 1])),
         [f"[{L // 2 - 1}, {L - L // 2 + 1}]"]),
        # the same repr (more than 16 ids show only their shape): told apart by the ids themselves
        ("mask", dict(mask=masks.document(ids=_doc_ids(L, 5))), dict(mask=masks.document(ids=_doc_ids(L, 6))),
         ["[contents "]),
        ("mask", dict(mask=masks.padding([L, L - 3]) & masks.causal()),
         dict(mask=masks.padding([L, L - 4]) & masks.causal()), []),
        ("causal", {}, dict(causal=True), ["False", "True"]),
        ("causal", dict(mask=masks.sliding_window(4)), dict(mask=masks.sliding_window(4), causal=True), []),
        ("layout", {}, dict(layout="zigzag"), ["'contiguous'", "'zigzag'"]),
        ("scale", {}, dict(scale=0.25), ["0.25", "0.35355339"]),
        ("dropout", {}, dict(dropout=0.1), ["0.0", "0.1"]),
        ("dropout", dict(dropout=0.1), dict(dropout=0.2), []),
    ]
    result = []
    for method in METHODS:
        for setting, same, odd, expect in mismatches:
            result.append(dict(kind="mismatch", method=method, setting=setting, same=same, odd=odd, expect=expect))
    ring_only = [("block_size", dict(options=dict(block_size=4)), dict(options=dict(block_size=5)),
                  ["block_size must be the same on every rank"]),
                 ("block_size", {}, dict(options=dict(block_size=4)), ["None", " 4"])]
    for setting, same, odd, expect in ring_only:
        result.append(dict(kind="mismatch", method="ring", setting=setting, same=same, odd=odd, expect=expect))
    grouped = dict(heads=2 * world, kv_heads=2 * world)
    ulysses_only = [("head_groups", dict(grouped, options=dict(head_groups=1)), dict(options=dict(head_groups=2)),
                     ["head_groups must be the same on every rank"]),
                    ("head_groups", grouped, dict(options=dict(head_groups=2)), ["None", " 2"]),
                    ("return_lse", {}, dict(options=dict(return_lse=True)), ["False", "True"])]
    for setting, same, odd, expect in ulysses_only:
        result.append(dict(kind="mismatch", method="ulysses", setting=setting, same=same, odd=odd, expect=expect))
    result.append(dict(kind="mismatch", method="ring", setting="method", same={}, odd=dict(method="ulysses"),
                       expect=["ring_attention", "ulysses_attention", "sequence-parallel attention:"]))
    # a rank whose own checks refuse its arguments: it raises its error, the others name it
    dense = torch.ones(L, L, dtype=torch.bool)
    result += [
        dict(kind="refusal", method="ring", setting=None, same={}, odd=dict(mask=dense), error="TypeError",
             expect=["structured mask"]),
        dict(kind="refusal", method="ulysses", setting=None, same={}, odd=dict(options=dict(head_groups=0)),
             error="ValueError", expect=["head_groups must be a positive number"]),
        dict(kind="refusal", method="ulysses", setting=None, same={}, odd=dict(options=dict(backend="torch")),
             error="ValueError", expect=["returns no lse"]),
        dict(kind="refusal", method="fn:ring", setting=None, same={}, odd=dict(options=dict(softcap=30.0)),
             error="ValueError", expect=["does not take softcap"]),
    ]
    # a matching call after every few others: it still works (nothing left in flight)
    matches = [dict(), dict(mask=masks.sliding_window(4), layout="zigzag"), dict(causal=True, dropout=0.3),
               dict(mask=masks.document(ids=_doc_ids(L, 5)), heads=2 * world, kv_heads=2 * world)]
    placed = []
    for index, case in enumerate(result):
        placed.append(case)
        if index % 5 == 4:
            for method in ("ring", "ulysses", "fn:ulysses"):
                placed.append(dict(kind="match", method=method, setting=None, same=matches[(index // 5) % len(matches)],
                                   odd={}, expect=[]))
    for index, case in enumerate(placed):
        case["label"] = f"{index:03d} {case['kind']} {case['method']} {case['setting']}"
        case["odd_rank"] = 1 + index % (world - 1)  # with 3 ranks: the middle one or the last one
    return placed


def _inputs(p: dict, rank: int, world: int):
    generator = torch.Generator().manual_seed(0)
    make = lambda h, d: torch.randn(p["batch"], h, p["length"], d, dtype=torch.float64,  # noqa: E731
                                    generator=generator).to(p["dtype"])
    whole = make(p["heads"], p["dk"]), make(p["kv_heads"], p["dk"]), make(p["kv_heads"], p["dv"])
    return whole, [shard(t, rank, world, layout=p["layout"]) for t in whole]


def _call(p: dict, rank: int, world: int, group, grad: bool = False):
    (q, k, v), mine = _inputs(p, rank, world)
    options = dict(p["options"])
    method = p.get("method_override") or p["method"]
    extra = dict(dropout=p["dropout"], generator=torch.Generator().manual_seed(7)) if p["dropout"] else {}
    if grad:
        mine = [t.requires_grad_() for t in mine]
    common = dict(mask=p["mask"], causal=p["causal"], scale=p["scale"], **extra)
    if method.startswith("fn:"):
        got = attention_fn(method[3:], layout=p["layout"], group=group)(*mine, **common, **options)
    else:
        got = METHODS[method](*mine, layout=p["layout"], group=group, **common, **options)
    return (q, k, v), mine, got


def _check_match(p: dict, rank: int, world: int, group) -> float:
    """The call equals single-process attention (output and gradients), in one all_gather of
    agreement.SLOTS numbers (no other all_gather)."""
    from attnkit.distributed import agreement

    gathers = []
    real = dist.all_gather

    def counting(tensors, tensor, *args, **kwargs):
        gathers.append(tensor.numel())
        return real(tensors, tensor, *args, **kwargs)

    dist.all_gather = counting
    try:
        (q, k, v), mine, got = _call(p, rank, world, group, grad=True)
    finally:
        dist.all_gather = real
    assert gathers == [agreement.SLOTS], gathers
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    extra = dict(dropout=p["dropout"], generator=torch.Generator().manual_seed(7)) if p["dropout"] else {}
    expected = attnkit.attention(*whole, mask=p["mask"], causal=p["causal"], scale=p["scale"], **extra)
    expected.square().sum().backward()
    got.square().sum().backward()
    mine_of = lambda t: shard(t.detach(), rank, world, layout=p["layout"])  # noqa: E731
    # not torch.testing.assert_close: under torch.distributed it imports DTensor and sympy (~8 s a rank)
    errors = [(got - mine_of(expected)).abs().max().item()]
    errors += [(local.grad - mine_of(full.grad)).abs().max().item() for local, full in zip(mine, whole)]
    assert max(errors) <= TOLERANCE, (p, errors)
    return max(errors)


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Every case of :func:`cases` on the whole world, then (with 3 processes) every case of 2 ranks
    on a subgroup of ranks 1 and 2 (one job: process start is most of the time). Each rank writes
    its outcomes to ``out_dir/w{ranks}_rank{group rank}.json``."""
    torch.set_num_threads(1)
    # a rank left waiting (the behaviour this guards against) fails the job instead of hanging it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        _cases(rank, world, None, out_dir)
        if world == 3:
            pair = dist.new_group([1, 2])  # every rank takes part in creating it
            if rank in (1, 2):
                _cases(rank - 1, 2, pair, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _cases(rank: int, world: int, group, out_dir: str) -> None:
    outcomes: dict[str, list[str]] = {}
    out = Path(out_dir) / f"w{world}_rank{rank}.json"
    try:
        for case in cases(world):
            p = base(world)
            p.update(case["same"])
            p["method"] = case["method"]
            if rank == case["odd_rank"]:
                odd = dict(case["odd"])
                if "method" in odd:
                    p["method_override"] = odd.pop("method")
                options = {**p["options"], **odd.pop("options", {})}
                p.update(odd)
                p["options"] = options
            if case["kind"] == "match":
                error = _check_match(p, rank, world, group)
                outcomes[case["label"]] = ["ok", f"{error:.3g}"]
            else:
                try:
                    _call(p, rank, world, group)
                except Exception as e:  # noqa: BLE001 - recorded and compared by the parent
                    outcomes[case["label"]] = [type(e).__name__, str(e)]
                else:
                    outcomes[case["label"]] = ["no error", ""]
                expected = case.get("error") if case["kind"] == "refusal" and rank == case["odd_rank"] else "ValueError"
                if outcomes[case["label"]][0] != expected:
                    raise AssertionError(f"rank {rank}/{world} {case['label']}: expected {expected}, got "
                                         f"{outcomes[case['label']]}")
    finally:
        out.write_text(json.dumps(outcomes))
