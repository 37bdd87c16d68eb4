"""The work of each spawned rank in test_distributed.py (a module the spawned processes import).

Every rank builds the same whole inputs from the same seed, runs the single-process
``attnkit.attention`` on them (the reference) and the sequence-parallel call on its shard, and
compares its shard of the reference. Inputs are float64: ring attention merges the same terms in a
different order (per-piece softmax, then an lse merge), which moves results by a few ulp of the
values (|out| <= ~3, so ~1e-15 each, L <= 40 terms: < 1e-13); 1e-10 leaves room for that and
nothing else, where a missing or doubled key piece, a wrong mask shift or a wrong dropout position
moves results by 1e-2 or more.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

import attnkit
from attnkit import masks
from attnkit.distributed import attention_fn, ring_attention, sequence_parallel, shard, traffic, ulysses_attention
from attnkit.distributed import ulysses as _ulysses
from attnkit.models.gpt import GPT, GPTConfig

TOLERANCE = dict(atol=1e-10, rtol=0)
METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}


def main(rank: int, world: int, init_file: str, job: str, readme_port: int | None = None) -> None:
    torch.set_num_threads(1)  # P processes share the test machine's cores
    # a deadlock (ranks waiting on messages never posted) fails the test instead of hanging it; no
    # wait takes more than a second or two here
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        JOBS[job](rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if readme_port is not None:
        _readme(rank, world, readme_port)


def _readme(rank: int, world: int, port: int) -> None:
    """The README's ``torchrun --nproc-per-node 2`` example, with the environment torchrun sets."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python torchrun\n(.*?)^```", readme, flags=re.S | re.M)
    assert len(blocks) == 1, "the README has one torchrun example"
    exec(compile(blocks[0], "README.md torchrun example", "exec"), {"__name__": "__main__"})


def _inputs(length: int, heads: int, kv_heads: int, seed: int = 0, batch: int = 2, dim: int = 8):
    generator = torch.Generator().manual_seed(seed)
    make = lambda h, d: torch.randn(batch, h, length, d, dtype=torch.float64, generator=generator)  # noqa: E731
    return make(heads, dim), make(kv_heads, dim), make(kv_heads, dim + 2)  # Dv != Dk


def _mask_cases(length: int) -> list[tuple[str, object, bool]]:
    ids = torch.tensor([[0] * 7 + [1] * (length - 12) + [2] * 5, [0] * (length - 3) + [1] * 3])
    return [
        ("none", None, False),
        ("causal", None, True),
        ("window", masks.sliding_window(4), False),
        ("window both sides", masks.sliding_window(3, 2), False),
        ("documents", masks.document(ids=ids), True),
        ("padding", masks.padding([length, length - 6]) & masks.causal(), False),
        ("window + first keys", (masks.sliding_window(3) | masks.first_keys(2)) & masks.causal(), False),
    ]


def _check(rank, world, method, layout, lengths, heads, kv_heads, name, mask, causal, dropout=0.0, **options):
    """Output, lse and the gradients of query, key and value against the single-process call
    (``options``: more arguments of the sequence-parallel call)."""
    q, k, v = (t.requires_grad_() for t in _inputs(sum(lengths), heads, kv_heads))
    extra = dict(dropout=dropout, generator=torch.Generator().manual_seed(7)) if dropout else {}
    out, lse = attnkit.attention(q, k, v, mask=mask, causal=causal, return_lse=True, **extra)
    weight = torch.linspace(-1, 1, lse.shape[-1], dtype=lse.dtype)  # the lse's gradient matters too
    (out.square().sum() + (torch.where(lse.isfinite(), lse, 0) * weight).sum()).backward()
    mine = lambda t, dim=-2: shard(t.detach(), rank, world, layout=layout, lengths=lengths, dim=dim)  # noqa: E731
    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    generator = torch.Generator().manual_seed(7)
    extra = dict(dropout=dropout, generator=generator) if dropout else {}
    got, got_lse = METHODS[method](ql, kl, vl, mask=mask, causal=causal, layout=layout, return_lse=True, **extra,
                                   **options)
    if dropout:  # the generator advanced as one process's does (one seed drawn per call)
        single_generator = torch.Generator().manual_seed(7)
        attnkit._backends.dropout.draw_seed(single_generator)
        assert torch.equal(generator.get_state(), single_generator.get_state())
    my_weight = mine(weight, -1)
    (got.square().sum() + (torch.where(got_lse.isfinite(), got_lse, 0) * my_weight).sum()).backward()
    where = f"rank {rank}/{world} {method} {layout} {lengths} {name} dropout={dropout} {options}"
    torch.testing.assert_close(got, mine(out), **TOLERANCE, msg=lambda m: f"{where} output: {m}")
    torch.testing.assert_close(got_lse, mine(lse, -1), **TOLERANCE, msg=lambda m: f"{where} lse: {m}")
    for label, local, whole in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        torch.testing.assert_close(local.grad, mine(whole.grad), **TOLERANCE, msg=lambda m: f"{where} {label}: {m}")


def _every_mask(rank, world, layouts_lengths, heads, kv_heads, dropout_cases=slice(1, 3)):
    for layout, lengths in layouts_lengths:
        for method in METHODS:
            for name, mask, causal in _mask_cases(sum(lengths)):
                _check(rank, world, method, layout, lengths, heads, kv_heads, name, mask, causal)
            for name, mask, causal in _mask_cases(sum(lengths))[dropout_cases]:
                _check(rank, world, method, layout, lengths, heads, kv_heads, name, mask, causal, dropout=0.3)


def _grouped(rank, world, layouts_lengths, heads, kv_heads, head_groups, dropout_cases=slice(1, 3)):
    """Ulysses run by groups of heads (``head_groups``: an explicit count, or None for the default
    with the threshold lowered so that it picks the most groups): every mask, dropout, the same
    results as one process."""
    for layout, lengths in layouts_lengths:
        for name, mask, causal in _mask_cases(sum(lengths)):
            _check(rank, world, "ulysses", layout, lengths, heads, kv_heads, name, mask, causal, head_groups=head_groups)
        for name, mask, causal in _mask_cases(sum(lengths))[dropout_cases]:
            _check(rank, world, "ulysses", layout, lengths, heads, kv_heads, name, mask, causal, dropout=0.3,
                   head_groups=head_groups)


def _default_groups(rank, world):
    """The default group count is the most groups of whole key/value heads (threshold lowered)."""
    saved = _ulysses.MIN_GROUP_PAIRS
    _ulysses.MIN_GROUP_PAIRS = 1
    try:
        _grouped(rank, world, [("contiguous", [9, 12, 7, 12][:world])], heads=2 * world, kv_heads=2 * world,
                 head_groups=None, dropout_cases=slice(1, 2))
    finally:
        _ulysses.MIN_GROUP_PAIRS = saved


def _ulysses_traffic(rank, world):
    """Forward bytes do not depend on the groups (the theory: the other ranks' share of the rank's
    heads of q, k, v in, its shard of the other ranks' heads of the output out); the backward
    exchanges q, k, v, the output and dO to head layout and dq, dk, dv back, counted too."""
    lengths = [7 + 3 * r for r in range(world)]
    q, k, v = _inputs(sum(lengths), 4 * world, 2 * world, dim=8)  # Dv = 10
    mine = [shard(t, rank, world, lengths=lengths) for t in (q, k, v)]
    batch, heads, kv_heads, size, dk, dv = 2, 4, 2, 8, 8, 10  # per rank; float64
    others, n = sum(lengths) - lengths[rank], lengths[rank]
    forward = batch * size * (others * (heads * dk + kv_heads * (dk + dv)) + (world - 1) * n * heads * dv)
    backward = batch * size * (others * (heads * (dk + 2 * dv) + kv_heads * (dk + dv))
                               + (world - 1) * n * (heads * dk + kv_heads * (dk + dv)))
    for groups in (1, 2):
        with torch.no_grad(), traffic() as record:
            ulysses_attention(*mine, causal=True, head_groups=groups)
        assert record.bytes_received == forward, (rank, groups, record, forward)
        ql, kl, vl = (t.clone().requires_grad_() for t in mine)
        out = ulysses_attention(ql, kl, vl, causal=True, head_groups=groups)
        with traffic() as record:
            out.sum().backward()
        assert record.bytes_received == backward, (rank, groups, record, backward)


def _traffic(rank, world):
    """The mask decides what is received: bytes of the forward pass, counted exactly."""
    batch, kv_heads, dk, dv, size = 2, 2, 8, 10, 8  # float64
    length = 12 * world
    q, k, v = _inputs(length, 4, kv_heads)
    ql, kl, vl = (shard(t, rank, world) for t in (q, k, v))
    per_key = batch * kv_heads * (dk + dv) * size
    with torch.no_grad():
        with traffic() as record:
            ring_attention(ql, kl, vl)
        assert record.bytes_received == (world - 1) * 12 * per_key, record  # (P-1)/P of K and V
        with traffic() as record:
            ring_attention(ql, kl, vl, mask=masks.sliding_window(4))  # 3 keys back: the neighbour's last 3
        assert record.bytes_received == (3 * per_key if rank > 0 else 0), (rank, record)
        assert record.units == (2 if rank > 0 else 1), (rank, record)
        with traffic() as record:  # documents that never cross a shard boundary: nothing to send
            ring_attention(ql, kl, vl, mask=masks.document([12] * world) & masks.causal())
        assert record.bytes_received == 0 and record.messages == 0 and record.units == 1, (rank, record)
        with traffic() as record:  # causal: only earlier ranks' shards
            ring_attention(ql, kl, vl, causal=True)
        assert record.bytes_received == rank * 12 * per_key, (rank, record)


def _errors(rank, world):
    # a gradient penalty: the ring and Ulysses have no second order, and say so (the ring's
    # error named attnkit's backward op and its missing autograd formula)
    for method in (ring_attention, ulysses_attention):
        q, k, v = (shard(t, rank, world).requires_grad_() for t in _inputs(8 * world, 2 * world, 2 * world))
        out = method(q, k, v, mask=attnkit.masks.sliding_window(5))
        first = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
        try:
            (out.sum() + sum(g.square().sum() for g in first)).backward()
        except RuntimeError as error:
            assert "differentiate twice" in str(error), error
        else:
            raise AssertionError(f"{method.__name__} gave a second-order gradient it does not compute")
    q, k, v = (shard(t, rank, world) for t in _inputs(8 * world, 4, 1))
    try:
        ulysses_attention(q, k, v)
    except ValueError as error:
        assert "key/value heads (1)" in str(error) and str(tuple(k.shape)) in str(error), error
    else:
        raise AssertionError("ulysses_attention accepted 1 key/value head over 2 ranks")
    try:
        ring_attention(q, k, v, mask=torch.ones(8 * world, 8 * world, dtype=torch.bool))
    except TypeError as error:
        assert "structured mask" in str(error), error
    else:
        raise AssertionError("ring_attention accepted a dense mask")
    q, k, v = (shard(t, rank, world) for t in _inputs(8 * world, 4 * world, 2 * world))
    for bad, error, words in ((0, ValueError, "got 0"), (2.5, TypeError, "float 2.5"), (True, TypeError, "bool True"),
                              (3, ValueError, f"{2 * world} // {world} = 2 (a group holds whole key/value heads), got 3")):
        try:
            ulysses_attention(q, k, v, head_groups=bad)
        except error as e:
            assert "head_groups" in str(e) and words in str(e), e
        else:
            raise AssertionError(f"ulysses_attention accepted head_groups={bad!r}")
    try:  # ranks that disagree would exchange different groups: every rank refuses
        ulysses_attention(q, k, v, head_groups=1 + rank % 2)
    except ValueError as e:
        assert "head_groups must be the same on every rank" in str(e) and "[1, 2" in str(e), e
    else:
        raise AssertionError("ulysses_attention accepted different head_groups on different ranks")
    try:
        ulysses_attention(q, k, v, backend="torch")
    except ValueError as e:
        assert "backend 'torch' returns no lse" in str(e) and "['tiled']" in str(e), e
    else:
        raise AssertionError("ulysses_attention accepted a backend without the lse")


class _TinyLM(torch.nn.Module):
    """A small pre-norm causal LM on attnkit.nn (GQA, attention dropout), to train sharded."""

    def __init__(self, vocab: int = 16, dim: int = 16, layers: int = 2, length: int = 32) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.positions = torch.nn.Embedding(length, dim)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict(dict(
                norm1=torch.nn.LayerNorm(dim), norm2=torch.nn.LayerNorm(dim),
                attn=attnkit.nn.MultiHeadAttention(dim, 4, num_kv_heads=2, causal=True, dropout=0.1),
                mlp=torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)))))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, *, positions):
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = x + block["attn"](block["norm1"](x))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(x)


def _train(rank, world, method, layout, steps=20, gpt=False):
    """Losses of ``steps`` AdamW steps, one process and sequence-parallel, from the same seeds: the
    small LM here through ``sequence_parallel`` (attnkit.nn's route), or attnkit's GPT (issue 15)
    through ``set_attention_fn(attention_fn(...))``."""
    length, vocab = 32, 16
    # counting sequences from random starts: learnable, so the losses fall and the check has teeth
    starts = torch.randint(0, vocab, (steps, 2, 1), generator=torch.Generator().manual_seed(3))
    data = (starts + torch.arange(length + 1)) % vocab
    positions = torch.arange(length)

    def run(parallel: bool) -> list[float]:
        torch.manual_seed(0)  # the same weights and the same dropout seeds (global RNG) on every rank
        if gpt:
            config = GPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=length,
                               attention_dropout=0.1)
            model = GPT(config).double()
            if parallel:
                model.set_attention_fn(attention_fn(method, layout=layout))
        else:
            model = _TinyLM(vocab, length=length).double()
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for batch in data:
            inputs, targets = batch[:, :-1], batch[:, 1:]
            if parallel:
                mine = lambda t: shard(t, rank, world, layout=layout, dim=-1)  # noqa: E731
                if gpt:
                    logits = model(mine(inputs), positions=mine(positions))
                else:
                    with sequence_parallel(method, layout=layout):
                        logits = model(mine(inputs), positions=mine(positions))
                # this rank's share of the mean over every token; summed over ranks below
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine(targets).flatten(),
                                                         reduction="sum") / targets.numel()
            else:
                logits = model(inputs, positions=positions)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad()
            loss.backward()
            total = loss.detach().clone()
            if parallel:
                dist.all_reduce(total)
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            optimizer.step()
            losses.append(total.item())
        return losses

    single, parallel = run(False), run(True)
    assert max(abs(a - b) for a, b in zip(single, parallel)) < 1e-9, (method, layout, single, parallel)
    assert single[-1] < single[0] - 0.2, single  # it trains


def _two_ranks(rank, world):
    _errors(rank, world)
    _traffic(rank, world)
    _every_mask(rank, world, [("contiguous", [17, 23]), ("zigzag", [21, 19])], heads=4, kv_heads=2)
    # by groups of heads: GQA (2 key/value heads a rank, 2 query heads each), and uneven groups
    # (3 key/value heads a rank in 2 groups: 2 + 1)
    _grouped(rank, world, [("contiguous", [17, 23]), ("zigzag", [21, 19])], heads=8, kv_heads=4, head_groups=2)
    _grouped(rank, world, [("contiguous", [23, 17])], heads=6, kv_heads=6, head_groups=2, dropout_cases=slice(1, 2))
    _default_groups(rank, world)
    _ulysses_traffic(rank, world)
    _train(rank, world, "ring", "zigzag", gpt=True)  # the check: attnkit's GPT, 20 steps, 2 ranks
    _train(rank, world, "ulysses", "contiguous", steps=5)


def _half_precision(rank, world):
    """bf16 and fp16 shards: within twice the error of the single-process call in the same dtype,
    both against float64 (FlashAttention's rule, as everywhere in attnkit's tests)."""
    q, k, v = _inputs(64, 8, 4)
    reference = shard(attnkit.attention(q, k, v, causal=True), rank, world, layout="zigzag")
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in (q, k, v)]
        single = shard(attnkit.attention(*low, causal=True), rank, world, layout="zigzag")
        for method in METHODS:
            got, lse = METHODS[method](*(shard(t, rank, world, layout="zigzag") for t in low), causal=True,
                                       layout="zigzag", return_lse=True)
            assert got.dtype == dtype and lse.dtype == torch.float32, (got.dtype, lse.dtype)
            error, single_error = ((t.double() - reference).abs().max().item() for t in (got, single))
            assert error <= 2 * single_error + 1e-6, (method, dtype, error, single_error)
            # under autocast, float32 shards run as the same shards in its dtype do (as attnkit.attention
            # and SDPA under autocast): same dtype, same bits, gradients back in float32
            shards = [shard(t.float(), rank, world, layout="zigzag").requires_grad_() for t in (q, k, v)]
            with torch.autocast("cpu", dtype=dtype):
                cast = METHODS[method](*shards, causal=True, layout="zigzag")
            assert cast.dtype == dtype and torch.equal(cast, got), (method, dtype, cast.dtype)
            cast.float().sum().backward()
            assert all(t.grad.dtype == torch.float32 and t.grad.isfinite().all() for t in shards), method


def _subgroup_and_empty_shard(rank, world):
    """A group of two of the four ranks (ranks 1 and 3: group ranks 0 and 1), and a rank whose shard
    is empty (lengths [9, 0, 14, 7] on the whole world)."""
    group = dist.new_group([1, 3])  # every rank takes part in creating it
    if rank in (1, 3):
        q, k, v = _inputs(24, 4, 2)
        me = [1, 3].index(rank)
        for method in METHODS:
            got = METHODS[method](*(shard(t, me, 2, layout="zigzag") for t in (q, k, v)), causal=True,
                                  layout="zigzag", group=group)
            expected = shard(attnkit.attention(q, k, v, causal=True), me, 2, layout="zigzag")
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"{method} in a subgroup: {m}")
    dist.barrier()
    for name, mask, causal in _mask_cases(30)[1:3]:
        _check(rank, world, "ring", "contiguous", [9, 0, 14, 7], 4, 2, name, mask, causal)


def _four_ranks(rank, world):
    _subgroup_and_empty_shard(rank, world)
    _half_precision(rank, world)
    _traffic(rank, world)
    # contiguous shards are checked on two ranks; here the zigzag layout with uneven shards
    _every_mask(rank, world, [("zigzag", [9, 12, 7, 12])], heads=8, kv_heads=4, dropout_cases=slice(1, 2))
    _grouped(rank, world, [("zigzag", [9, 12, 7, 12])], heads=16, kv_heads=8, head_groups=2)
    _default_groups(rank, world)
    _ulysses_traffic(rank, world)


def _blocks(rank, world):
    """The ring streamed in blocks (``block_size``): messages of 1 to 12 keys, kernel calls of 2 to 6
    rows, on uneven shards that no block size divides, with windows narrower and wider than a
    block, a message that ends one piece and starts the next (zigzag), dropout and GQA; the same
    results as one process. A wrong cut (a key sent twice or not at all, a call's ranges shifted
    to the wrong key, a gradient sent home to the wrong place, dropout at the wrong position)
    moves them by far more than the tolerance."""
    cases = _mask_cases(31) + [("window 7 > block", masks.sliding_window(7), False),
                               ("window both sides 9", masks.sliding_window(4, 5), False)]
    # the forward streams 4 * block_size keys a message, the backward block_size
    for layout, lengths, block_size in (("contiguous", [9, 13, 9], 2), ("zigzag", [11, 7, 13], 3),
                                        ("contiguous", [12, 12, 7], 1)):
        for name, mask, causal in cases:
            _check(rank, world, "ring", layout, lengths, 4, 2, name, mask, causal, block_size=block_size)
        for name, mask, causal in cases[1:3]:
            _check(rank, world, "ring", layout, lengths, 4, 2, name, mask, causal, dropout=0.3, block_size=block_size)
    records = []
    for block_size in (2, None):  # bytes do not change, messages do
        q, k, v = (shard(t, rank, world).requires_grad_() for t in _inputs(30, 4, 2))
        with traffic() as record:
            ring_attention(q, k, v, block_size=block_size).sum().backward()
        records.append(record)
    blocked, whole = records
    assert blocked.bytes_received == whole.bytes_received > 0, (blocked, whole)
    # from each of the 2 other ranks, 10 keys: forward 2 messages of <= 8 keys, backward 5 of 2 and
    # their 5 gradients home; whole: one message of each kind
    assert (blocked.messages, whole.messages) == (2 * (2 + 5 + 5), 2 * 3), (blocked, whole)
    q, k, v = (shard(t, rank, world) for t in _inputs(30, 4, 2))
    for bad, error in ((0, ValueError), (2.5, TypeError), (True, TypeError)):
        try:
            ring_attention(q, k, v, block_size=bad)
        except error as e:
            assert "block_size" in str(e), e
        else:
            raise AssertionError(f"ring_attention accepted block_size={bad!r}")
    try:  # ranks that disagree would cut messages differently: every rank refuses
        ring_attention(q, k, v, block_size=4 + rank)
    except ValueError as e:
        assert "block_size must be the same on every rank" in str(e), e
    else:
        raise AssertionError("ring_attention accepted different block sizes on different ranks")


JOBS = {"two": _two_ranks, "four": _four_ranks, "blocks": _blocks}
