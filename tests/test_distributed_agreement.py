"""Ranks that disagree on a sequence-parallel call all raise the same clear error, before any exchange.

Real gloo processes (2 and 3 ranks, spawned as in test_distributed.py); each job runs every case
of tests/distributed_agreement_workers.py: one setting different on one rank at a time (dtype,
batch, heads, key/value heads, head sizes, mask kind and parameters, causal, layout, scale,
dropout, block_size, head_groups, return_lse, ring on one rank and Ulysses on another), for ring
and Ulysses; a rank refusing its own arguments; and matching calls between them that still equal
single-process attention. Each rank writes what it raised to a file; the test compares the ranks.
"""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_agreement_workers as workers

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

DEADLINE = 150  # seconds for the job; it takes about 10 on an idle machine (process start is most of it)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[int, list[dict[str, list[str]]]]:
    """One job of 3 processes: the 3-rank cases on the whole world, then the 2-rank ones on a
    subgroup of ranks 1 and 2. Returns, per number of ranks, each rank's outcomes by case."""
    tmp_path, world = tmp_path_factory.mktemp("agreement"), 3
    context = mp.start_processes(workers.main, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
                                 join=False, start_method="spawn")
    start = time.monotonic()
    try:
        while not context.join(timeout=1):  # raises as soon as a rank fails (and ends the others)
            if time.monotonic() - start > DEADLINE:
                raise AssertionError(f"the {world}-rank job did not finish in {DEADLINE} s (a hang)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    return {n: [json.loads((tmp_path / f"w{n}_rank{r}.json").read_text()) for r in range(n)] for n in (2, 3)}


def _ranks_text(values: dict[int, str]) -> str:
    """What the message lists: ranks with the same value together, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return ", ".join(f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))} {value}"
                     for value, ranks in groups.items())


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_all_raise_the_same_error(outcomes, world):
    """2 ranks: a subgroup (ranks 1 and 2 of 3), so group ranks, not global ones, are reported."""
    outcomes = outcomes[world]
    cases = workers.cases(world)
    assert all(set(o) == {c["label"] for c in cases} for o in outcomes), "a rank skipped cases"
    seen = set()
    for case in cases:
        label, odd = case["label"], case["odd_rank"]
        got = [o[label] for o in outcomes]
        if case["kind"] == "match":
            assert all(kind == "ok" for kind, _ in got), (label, got)
            continue
        if case["kind"] == "refusal":
            assert got[odd][0] == case["error"] and all(w in got[odd][1] for w in case["expect"]), (label, got)
            others = [g for r, g in enumerate(got) if r != odd]
            assert all(g == others[0] for g in others), (label, got)
            kind, message = others[0]
            assert kind == "ValueError" and f"rank {odd} refused its arguments" in message, (label, message)
            assert got[odd][1] in message, (label, message)  # the refusing rank's own words
            continue
        # every rank raised the same ValueError naming the setting and what each rank had
        assert all(g == got[0] for g in got), (label, got)
        kind, message = got[0]
        assert kind == "ValueError", (label, got[0])
        prefix = "sequence-parallel attention" if case["setting"] == "method" else f"{case['method']}_attention"
        assert message.startswith(f"{prefix}: the ranks disagree on {case['setting']}: "), (label, message)
        assert f"{case['setting']} must be the same on every rank" in message, (label, message)
        assert all(w in message for w in case["expect"]), (label, message, case["expect"])
        assert f"rank {odd} " in message, (label, message)
        seen.add((case["method"], case["setting"]))
    # the exact message, once
    dtype = next(c for c in cases if c["kind"] == "mismatch" and c["setting"] == "dtype" and c["method"] == "ring")
    shown = {r: "torch.float32" if r == dtype["odd_rank"] else "torch.float64" for r in range(world)}
    assert outcomes[0][dtype["label"]][1] == (f"ring_attention: the ranks disagree on dtype: {_ranks_text(shown)}; "
                                              "dtype must be the same on every rank")
    for method in ("ring", "ulysses"):
        for setting in ("dtype", "batch size", "query heads", "key/value heads", "query/key head size",
                        "value head size", "mask", "causal", "layout", "scale", "dropout"):
            assert (method, setting) in seen
    assert {("ring", "block_size"), ("ulysses", "head_groups"), ("ulysses", "return_lse")} <= seen


def test_canonical_mask_description():
    """Masks are compared by class, repr and the tensors they hold, without addresses or caches."""
    from attnkit import masks
    from attnkit.distributed.agreement import _by_value, _ranks, mask_fact

    ids = workers._doc_ids(24, 5)
    assert mask_fact(masks.document(ids=ids)) == mask_fact(masks.document(ids=ids.clone()))
    assert mask_fact(masks.document(ids=ids))[1] == mask_fact(masks.document(ids=workers._doc_ids(24, 6)))[1]
    assert mask_fact(masks.document(ids=ids))[2] != mask_fact(masks.document(ids=workers._doc_ids(24, 6)))[2]
    window = masks.sliding_window(3) & masks.causal()
    window._cache = object()  # private attributes are not compared
    assert mask_fact(window) == mask_fact(masks.sliding_window(3) & masks.causal())
    assert mask_fact(masks.sliding_window(3))[2] != mask_fact(masks.sliding_window(3, 0))[2]
    assert _ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7,8" and _ranks([3]) == "rank 3"
    assert _by_value({0: "a", 1: "b", 2: "a"}) == "ranks 0,2 a, rank 1 b"
