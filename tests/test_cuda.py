"""attnkit on a CUDA device: skipped where there is none (the CI machine has none).

Every backend against the float64 oracle (computed on the CPU, written without attnkit), the
``auto`` policy's device rule (PyTorch's fused kernels wherever attnkit's were not measured),
dropout drawn from a CUDA generator (the same pattern as on the CPU for the same seed, the global
RNG untouched), layers against ``nn.MultiheadAttention`` on the same device, the GPT and the
transformers adapter against the same models on the CPU / transformers' eager attention, and
``torch.compile`` with a structured mask.

Tolerances follow the FlashAttention tests' rule: a backend's error against float64 is at most
twice the oracle's own error when it computes in the same dtype (on the CPU), plus a term
far below a dtype's resolution (1e-6 for float32, 1e-4 for half precision) for the cases where
the oracle's error happens to be tiny.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._backends import dropout as _dropout
from attnkit._backends import policy
from attnkit._call import make_call
from attnkit.core import attention_piece
from oracle import oracle_attention, pairwise_oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")
SLACK = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float64: 1e-12}
BACKENDS = ["auto", "reference", "torch", "tiled"]


def _inputs(q_len=40, k_len=40, heads=4, kv_heads=4, head_dim=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, q_len, head_dim, dtype=torch.float64, generator=g),
            torch.randn(batch, kv_heads, k_len, head_dim, dtype=torch.float64, generator=g),
            torch.randn(batch, kv_heads, k_len, head_dim + 4, dtype=torch.float64, generator=g))


def _cases():
    """(name, q_len, k_len, kv_heads, attnkit mask, dense bool mask for the oracle or None, causal)."""
    padding = masks.padding([30, 17])
    holes = torch.rand(2, 1, 40, 40, generator=torch.Generator().manual_seed(1)) < 0.7
    holes[0, 0, 3] = False  # a row with no key: zeros, never NaN
    bias = torch.randn(1, 4, 40, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return [
        ("none", 40, 40, 4, None, None, False),
        ("causal", 40, 40, 4, None, None, True),
        ("causal bottom-right", 12, 40, 2, None, None, True),
        ("causal() structured", 40, 40, 2, masks.causal(), masks.causal().dense(40, 40), False),
        ("sliding window", 40, 40, 2, masks.sliding_window(7), masks.sliding_window(7).dense(40, 40), False),
        ("documents", 40, 40, 4, masks.document([10, 25, 5]), masks.document([10, 25, 5]).dense(40, 40), False),
        ("padding & causal", 40, 40, 4, padding & masks.causal(), (padding & masks.causal()).dense(40, 40), False),
        ("dense bool with an empty row", 40, 40, 4, holes, holes, False),
        ("float bias", 40, 40, 4, bias, bias, False),
    ]


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_backend_matches_the_float64_oracle_on_cuda(case, backend, dtype):
    name, q_len, k_len, kv_heads, mask, dense, causal = case
    q, k, v = _inputs(q_len, k_len, kv_heads=kv_heads)
    expected, _ = oracle_attention(q, k, v, mask=dense, causal=causal)
    same_dtype, _ = oracle_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=dense, causal=causal, dtype=dtype)
    cuda_mask = mask.to(CUDA, dtype) if isinstance(mask, torch.Tensor) and mask.is_floating_point() else (
        mask.to(CUDA) if isinstance(mask, torch.Tensor) else mask)
    out = attnkit.attention(*(t.to(CUDA, dtype) for t in (q, k, v)), mask=cuda_mask, causal=causal, backend=backend)
    assert out.device.type == "cuda" and out.dtype == dtype
    error = (out.double().cpu() - expected).abs().max().item()
    budget = 2 * (same_dtype.double() - expected).abs().max().item()
    assert error <= budget + SLACK[dtype], f"{name}: error {error:.3g} > 2 x {budget / 2:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_the_float64_oracle_on_cuda(backend):
    """float64 on the device: gradients of a window & padding call equal the oracle's (1e-10: both
    float64, different summation orders over 40 keys)."""
    q, k, v = _inputs(kv_heads=2)
    mask = masks.sliding_window(9) & masks.padding([33, 40])
    grad = torch.randn(2, 4, 40, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = oracle_attention(*leaves, mask=mask.dense(40, 40))
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    ours = [t.to(CUDA).requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*ours, mask=mask, backend=backend)
    grads = torch.autograd.grad(out, ours, grad.to(CUDA))
    torch.testing.assert_close(out.cpu(), expected, atol=1e-10, rtol=0)
    for ours_grad, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours_grad.cpu(), theirs, atol=1e-10, rtol=0)


@pytest.mark.parametrize("mask", [None, masks.causal(), masks.sliding_window(64), masks.document([100, 156])],
                         ids=["none", "causal", "window", "documents"])
def test_auto_on_cuda_keeps_sdpa_for_what_it_runs_and_intervals_for_the_rest(mask):
    """SDPA's own kernels for no mask and plain causal; structured masks on FlexAttention, dropout on
    attnkit's Triton kernel (Flex has none); ``return_lse`` on an interval engine too."""
    q = torch.randn(1, 2, 256, 32, device=CUDA)

    def chosen(**options):
        settings = dict(mask=mask, causal=False, scale=None, dropout=0.0, generator=None, return_weights=False)
        return str(policy.choose(make_call(q, q, q, **{**settings, **options})))

    structured = mask is not None and not mask.is_causal
    assert chosen() == ("tiled:flex" if structured else "torch")
    assert chosen(dropout=0.1) == "tiled:triton"  # SDPA's dropout is not attnkit's pattern; no L x L weights
    assert chosen(causal=True) == ("tiled:flex" if structured else "torch")
    assert chosen(return_lse=True) == "tiled:flex"
    assert chosen(return_weights=True) == "torch"


def test_nan_propagates_on_cuda_as_in_the_reference_backend():
    q, k, v = (t.float().to(CUDA) for t in _inputs())
    k[0, 1, 5, 0] = float("nan")
    v[1, 2, 7, 3] = float("inf")
    mask = masks.sliding_window(4)
    expected = attnkit.attention(q, k, v, mask=mask, backend="reference")
    for backend in ("auto", "torch", "tiled"):
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        assert torch.equal(out.isnan(), expected.isnan()), backend
        assert torch.equal(out.isinf(), expected.isinf()), backend


def test_lse_on_cuda_matches_the_oracle():
    q, k, v = _inputs(kv_heads=2)
    mask = masks.sliding_window(5) & masks.padding([40, 0])  # the second sequence has no key at all
    out, lse = attnkit.attention(*(t.to(CUDA) for t in (q, k, v)), mask=mask, return_lse=True)
    allowed = mask.dense(40, 40)
    k_full = k.repeat_interleave(2, dim=1)
    scores = (q @ k_full.transpose(-1, -2)) / math.sqrt(16)
    expected = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse.cpu(), expected, atol=1e-10, rtol=0)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))


def _softcap_alibi_sinks_oracle(q, k, v, softcap, slopes, sinks):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    scores = scores - slopes[:, None, None] * (i - j).abs()
    scores = scores.masked_fill(j > i, float("-inf"))
    with_sink = torch.cat([scores, sinks[:, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    weights = with_sink.softmax(-1)[..., :-1]
    return weights @ v


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_alibi_and_sinks_on_cuda(backend):
    q, k, v = _inputs()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    expected = _softcap_alibi_sinks_oracle(q, k, v, 2.0, slopes, sinks)
    out = attnkit.attention(*(t.to(CUDA) for t in (q, k, v)), causal=True, softcap=2.0, alibi_slopes=slopes.to(CUDA),
                            sinks=sinks.to(CUDA), backend=backend)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-10, rtol=0)


def test_dropout_on_cuda_draws_the_cpu_pattern_and_leaves_the_global_rng_alone():
    """The pattern is a function of (seed, batch, head, row, key) whichever device computes it: the
    same seed drops the same weights on the CPU and on CUDA (read through the returned weights,
    exactly 0 where dropped); a CUDA generator leaves the global CUDA RNG as it was."""
    q, k, v = _inputs(kv_heads=2)
    seed = _dropout.draw_seed(torch.Generator().manual_seed(5))
    for backend in ("reference", "torch", "tiled"):
        _, on_cpu = attention_piece(q, k, v, seed=seed, dropout=0.3, return_weights=True, backend=backend)
        _, on_cuda = attention_piece(*(t.to(CUDA) for t in (q, k, v)), seed=seed.to(CUDA), dropout=0.3,
                                     return_weights=True, backend=backend)
        assert 0.2 < (on_cpu == 0).double().mean() < 0.4
        assert torch.equal(on_cuda.cpu() == 0, on_cpu == 0), backend
    state = torch.cuda.get_rng_state()
    g = torch.Generator(CUDA).manual_seed(7)
    first = attnkit.attention(*(t.to(CUDA) for t in (q, k, v)), dropout=0.3, generator=g)
    second = attnkit.attention(*(t.to(CUDA) for t in (q, k, v)), dropout=0.3, generator=torch.Generator(CUDA).manual_seed(7))
    assert torch.equal(first, second)
    assert torch.equal(torch.cuda.get_rng_state(), state)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_matches_torch_on_cuda(need_weights):
    from attnkit.nn import MultiHeadAttention

    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True).to(CUDA).eval()
    ours = MultiHeadAttention.from_torch(theirs)
    x = torch.randn(3, 10, 32, device=CUDA)
    ignore = torch.zeros(3, 10, dtype=torch.bool, device=CUDA)
    ignore[1, 7:] = True
    expected, expected_weights = theirs(x, x, x, key_padding_mask=ignore, need_weights=True,
                                        average_attn_weights=False)
    out = ours(x, mask=masks.from_torch_key_padding_mask(ignore), need_weights=need_weights)
    if need_weights:
        out, weights = out
        torch.testing.assert_close(weights, expected_weights, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_gpt_on_cuda_equals_the_cpu_and_trains():
    """The same weights on both devices: logits within 1e-4 (float32, O(1) activations through 2
    layers), the same greedy tokens from the cache, and a few training steps lower the loss."""
    from attnkit.models.generate import generate
    from attnkit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    model = GPT(config).eval()
    tokens = torch.randint(0, 64, (2, 24))
    expected = model(tokens)
    on_cuda = GPT(config).to(CUDA).eval()
    on_cuda.load_state_dict(model.state_dict())
    torch.testing.assert_close(on_cuda(tokens.to(CUDA)).cpu(), expected, atol=1e-4, rtol=0)
    prompts = [[1, 2, 3, 4, 5], [9, 8]]
    assert generate(on_cuda, prompts, 12) == generate(model, prompts, 12)

    on_cuda.train()
    optimizer = torch.optim.AdamW(on_cuda.parameters(), lr=3e-3)
    batch = torch.randint(0, 64, (4, 33), device=CUDA)
    losses = []
    for _ in range(20):
        logits = on_cuda(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_compiled_structured_mask_on_cuda_equals_eager():
    q, k, v = (t.float().to(CUDA) for t in _inputs(256, 256, kv_heads=2))
    mask = masks.sliding_window(32)

    def call(q, k, v):
        return attnkit.attention(q, k, v, mask=mask)

    compiled = torch.compile(call, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), call(q, k, v), atol=1e-5, rtol=0)


def test_transformers_llama_and_mistral_on_cuda_match_eager():
    """transformers' eager attention on the same device is the reference (tolerances as in
    test_integration_transformers: 1e-4 on logits, identical greedy tokens)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from attnkit.integrations import transformers as integration

    integration.register()
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, max_position_embeddings=128)
    for model in (transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
                  transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=5, **common))):
        model = model.to(CUDA).eval()
        ids = torch.randint(1, 100, (2, 20), device=CUDA)
        attention_mask = torch.ones_like(ids)
        attention_mask[1, :6] = 0  # left padding
        results = {}
        for implementation in ("eager", "attnkit"):
            model.set_attn_implementation(implementation)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=attention_mask).logits
            tokens = model.generate(ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False,
                                    pad_token_id=0)
            results[implementation] = logits, tokens
        real = attention_mask.bool()
        torch.testing.assert_close(results["attnkit"][0][real], results["eager"][0][real], atol=1e-4, rtol=0)
        assert torch.equal(results["attnkit"][1], results["eager"][1])


def test_ring_and_ulysses_run_on_nccl(tmp_path):
    """The distributed code is device-agnostic: the same calls on NCCL with CUDA tensors. With one
    GPU this is a world of one rank (its own keys, no peer): NCCL refuses two ranks on one device
    ("Duplicate GPU detected", NCCL 2.28.9 on an H100); several GPUs were not at hand."""
    import torch.distributed as dist

    from attnkit.distributed import ring_attention, ulysses_attention

    if not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        q, k, v = (t.float().to(CUDA) for t in _inputs(kv_heads=2))
        grad = torch.randn(2, 4, 40, 20, device=CUDA)
        mask = masks.sliding_window(9) & masks.padding([40, 31])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = attnkit.attention(*leaves, mask=mask)
        expected_grads = torch.autograd.grad(expected, leaves, grad)
        for parallel in (ring_attention, ulysses_attention):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = parallel(*leaves, mask=mask)
            grads = torch.autograd.grad(out, leaves, grad)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
            for ours, theirs in zip(grads, expected_grads):
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    finally:
        dist.destroy_process_group()


# -- structured masks on the GPU engines (FlexAttention, attnkit's Triton kernel) ---------------------

ENGINES = ["auto", "flex", "triton"]


def _engine_call(engine, q, k, v, **options):
    """``attnkit.attention`` as ``"auto"`` runs it, or on the tiled backend with one engine forced."""
    from attnkit._backends.tiled_plan import tuning

    if engine == "auto":
        return attnkit.attention(q, k, v, **options)
    with tuning(kernel=engine):
        return attnkit.attention(q, k, v, backend="tiled", **options)


def _every_mask(q_len, k_len, batch):
    """Every kind of attnkit.masks, per-sequence ones included, at these lengths (k_len >= q_len)."""
    ids = torch.tensor([[0] * 30 + [1] * 40 + [2] * (k_len - 70), [5] * 90 + [6] * (k_len - 90)])[:batch]
    return {
        "causal": masks.causal(),
        "window": masks.sliding_window(33),
        "window (left, right)": masks.sliding_window(20, 7),
        "documents & causal": masks.document([50, 0, 61, k_len - 111]) & masks.causal(),
        "documents by ids": masks.document(ids=ids),
        "prefix-LM per sequence": masks.prefix_lm([9, 70][:batch]),
        "padding per sequence": masks.padding([k_len, 0][:batch]),  # the second sequence: no key at all
        "first keys | window": masks.first_keys(4) | masks.sliding_window(16),
        "key ranges": masks.key_ranges(torch.arange(q_len) // 2, torch.arange(q_len) // 2 + 25),
        "varlen & causal": masks.varlen([40, q_len - 40], [50, k_len - 50]) & masks.causal(),
    }


_MATRIX_MASKS = list(_every_mask(130, 130, 2))


@pytest.mark.parametrize("name", _MATRIX_MASKS)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_every_mask_on_the_gpu_engines_matches_the_float64_oracle(name, engine, dtype, kv_heads):
    """Output, lse and gradients of every mask kind, L = 130 (not a multiple of any block size) and
    D = 64, against float64 with FlashAttention's rule (twice the error of the same computation in
    that dtype, on the CPU, plus a term below the dtype's resolution)."""
    q_len = k_len = 130
    mask = _every_mask(q_len, k_len, 2)[name]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, q_len, 64, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, kv_heads, k_len, 64, dtype=torch.float64, generator=g) for _ in range(2))
    grad = torch.randn(2, 4, q_len, 64, dtype=torch.float64, generator=g)
    allowed = mask.dense(q_len, k_len, ndim=4)

    def reference(dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out, _ = oracle_attention(*leaves, mask=allowed, dtype=dt)
        return out, torch.autograd.grad(out, leaves, grad.to(dt))

    expected, expected_grads = reference(torch.float64)
    same, same_grads = reference(dtype)
    ours = [t.to(CUDA, dtype).requires_grad_() for t in (q, k, v)]
    out, lse = _engine_call(engine, *ours, mask=mask, return_lse=True)
    grads = torch.autograd.grad(out, ours, grad.to(CUDA, dtype))
    assert out.dtype == dtype and not out.isnan().any()
    for got, want, baseline in zip((out, *grads), (expected, *expected_grads), (same, *same_grads)):
        error = (got.double().cpu() - want).abs().max().item()
        budget = 2 * (baseline.double() - want).abs().max().item()
        assert error <= budget + 10 * SLACK[dtype], f"{name}, {engine}: error {error:.3g} > 2 x {budget / 2:.3g}"
    empty = ~allowed.any(-1).expand(2, 4, q_len)
    assert torch.isneginf(lse.cpu()[empty]).all() and (out.cpu()[empty] == 0).all()
    rounded_q, rounded_k = (t.to(dtype).double() for t in (q, k))  # the lse of the inputs it was given
    scores = (rounded_q @ rounded_k.repeat_interleave(4 // kv_heads, dim=1).transpose(-1, -2)) / 8
    expected_lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    finite = ~empty
    torch.testing.assert_close(lse.double().cpu()[finite], expected_lse[finite], atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine", ["flex", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_128_on_the_gpu_engines_matches_the_float64_oracle(engine, dtype):
    """D = 128 in half precision: the tile sizes measured fastest on an H100 (benchmarks/triton_blocks.py),
    output and gradients against float64 with the 2x rule, lengths no multiple of a block."""
    g = torch.Generator().manual_seed(12)
    q, k, v, grad = (torch.randn(1, 4, 300, 128, dtype=torch.float64, generator=g) for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    mask = masks.document([90, 210]) & masks.sliding_window(70)
    allowed = mask.dense(300, 300, ndim=4)

    def reference(dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out, _ = oracle_attention(*leaves, mask=allowed, dtype=dt)
        return (out, *torch.autograd.grad(out, leaves, grad.to(dt)))

    expected, same = reference(torch.float64), reference(dtype)
    ours = [t.to(CUDA, dtype).requires_grad_() for t in (q, k, v)]
    out = _engine_call(engine, *ours, mask=mask)
    got = (out, *torch.autograd.grad(out, ours, grad.to(CUDA, dtype)))
    for name, mine, want, baseline in zip(("out", "dq", "dk", "dv"), got, expected, same):
        error = (mine.double().cpu() - want).abs().max().item()
        budget = 2 * (baseline.double() - want).abs().max().item()
        assert error <= budget + 10 * SLACK[dtype], f"{engine} {name}: error {error:.3g} > 2 x {budget / 2:.3g}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_alibi_and_sinks_on_the_gpu_engines(engine, dtype):
    q, k, v = _inputs(150, 150, kv_heads=2, head_dim=32)
    v = v[..., :32]
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    k_full, v_full = (t.repeat_interleave(2, dim=1) for t in (k, v))
    expected = _softcap_alibi_sinks_oracle(q, k_full, v_full, 2.0, slopes, sinks)
    baseline = _softcap_alibi_sinks_oracle(*(t.to(dtype).double() for t in (q, k_full, v_full)), 2.0, slopes, sinks)
    out = _engine_call(engine, *(t.to(CUDA, dtype) for t in (q, k, v)), mask=masks.causal(), softcap=2.0,
                       alibi_slopes=slopes.float().to(CUDA), sinks=sinks.to(CUDA, dtype))
    error = (out.double().cpu() - expected).abs().max().item()
    budget = 2 * (baseline - expected).abs().max().item()
    assert error <= 2 * budget + 10 * SLACK[dtype], (engine, error, budget)


def test_dropout_with_a_structured_mask_on_cuda_draws_the_cpu_pattern():
    """Dropout on CUDA runs attnkit's Triton kernel (Flex has none) with the (seed, position) pattern
    of every other path: the same zeros as the CPU's kernels for the same generator seed."""
    q, k, _ = (t.float() for t in _inputs(96, 96, kv_heads=2))
    v = torch.eye(96).expand(2, 2, 96, 96)  # the outputs are the dropped-out weights
    mask = masks.document([40, 56]) & masks.causal()
    call = make_call(*(t.to(CUDA) for t in (q, k, v)), mask=mask, causal=False, scale=None, dropout=0.3,
                     generator=None, return_weights=False)
    assert str(policy.choose(call)) == "tiled:triton"
    on_cpu = attnkit.attention(q, k, v, mask=mask, dropout=0.3, generator=torch.Generator().manual_seed(3))
    on_cuda = attnkit.attention(*(t.to(CUDA) for t in (q, k, v)), mask=mask, dropout=0.3,
                                generator=torch.Generator(CUDA).manual_seed(3))
    seed_cpu = _dropout.draw_seed(torch.Generator().manual_seed(3))
    seed_cuda = _dropout.draw_seed(torch.Generator(CUDA).manual_seed(3), CUDA)
    if int(seed_cpu) == int(seed_cuda.cpu()):  # the generators agree: the whole pattern must too
        assert torch.equal(on_cuda.cpu() == 0, on_cpu == 0)
    piece_cpu = attention_piece(q, k, v, seed=seed_cpu, mask=mask, dropout=0.3)
    piece_cuda = attention_piece(*(t.to(CUDA) for t in (q, k, v)), seed=seed_cpu.to(CUDA), mask=mask, dropout=0.3)
    assert torch.equal(piece_cuda.cpu() == 0, piece_cpu == 0)
    torch.testing.assert_close(piece_cuda.cpu(), piece_cpu, atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_nan_and_inf_on_the_gpu_engines_propagate_as_in_the_reference_backend(engine):
    q, k, v = (t.float().to(CUDA) for t in _inputs(64, 64, head_dim=16))
    k[0, 1, 5, 0] = float("nan")
    v[1, 2, 7, 3] = float("inf")  # inside a block that other rows do not attend
    mask = masks.sliding_window(4)
    expected = attnkit.attention(q, k, v, mask=mask, backend="reference")
    out = _engine_call(engine, q, k, v, mask=mask)
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_row_of_minus_inf_scores_gives_the_reference_gradients_on_the_gpu_engines(engine):
    """A row whose attended scores are all -inf (an inf in its query) beside an attended NaN value:
    its output holds that NaN (0 x NaN), and its keys' gradients are NaN only where 0 meets the
    query's inf, as the reference backend gives (the CPU kernel's row term spread the NaN to every
    feature until a soak found it; test_native checks the CPU)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(4))
    k[0, 1, :, 15] = k[0, 1, :, 15].abs() + 0.5
    q[0, 1, 40, 15] = float("-inf")  # every score of row 40 is -inf: it weighs its keys 39 and 40 by 0
    v[0, 1, 40, 17] = float("nan")  # key 40: attended by row 40 alone
    mask = masks.document([39, 2, 23]) & masks.causal()
    results = []
    for run in (lambda *t: attnkit.attention(*t, mask=mask, backend="reference"),
                lambda *t: _engine_call(engine, *t, mask=mask)):
        leaves = [t.to(CUDA).requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        out.backward(grad_out.to(CUDA))
        results.append([out.detach().cpu()] + [t.grad.cpu() for t in leaves])
    for name, want, got in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), name
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4, msg=name)


def test_a_forward_on_the_triton_kernel_does_not_synchronise():
    """Once a mask's block structure is cached (the first call builds it), a forward on attnkit's
    Triton kernel reads nothing back from the device (the kernel keeps masked-out NaN and inf out
    itself), so a model's layers queue up without draining the GPU."""
    from attnkit._backends.tiled_plan import tuning

    q, k, v = (torch.randn(1, 4, 512, 64, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    mask = masks.sliding_window(64)
    with torch.no_grad(), tuning(kernel="triton"):
        expected = attnkit.attention(q, k, v, mask=mask, backend="tiled")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out, expected)


def test_structured_masks_on_cuda_build_no_lq_by_lk_tensor():
    """O(L) extra memory forward and backward: at L = 16384, bf16, a window call's peak stays far below
    one L x L bool mask (256 MiB), on both engines."""
    length = 16384
    q, k, v = (torch.randn(1, 4, length, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for engine in ENGINES:
        _engine_call(engine, q, k, v, mask=masks.sliding_window(256)).sum().backward()  # compiled, warm
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _engine_call(engine, q, k, v, mask=masks.sliding_window(256)).sum().backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra < 64 * 2**20, (engine, extra / 2**20)


def test_flex_route_does_not_recompile_when_mask_values_change():
    """Window sizes, document boundaries and padding lengths are data: 20 varied calls of one shape
    compile nothing after the first."""
    from torch._dynamo.utils import counters

    q = torch.randn(1, 4, 512, 64, device=CUDA, dtype=torch.bfloat16)
    attnkit.attention(q, q, q, mask=masks.sliding_window(64))
    attnkit.attention(q, q, q, mask=masks.document([100, 412]) & masks.causal())
    before = counters["stats"]["unique_graphs"]
    for i in range(10):
        attnkit.attention(q, q, q, mask=masks.sliding_window(32 + 16 * i))
        attnkit.attention(q, q, q, mask=masks.document([50 + 31 * i, 462 - 31 * i]) & masks.causal())
    assert counters["stats"]["unique_graphs"] == before


def test_a_decoding_step_stays_on_sdpa():
    q = torch.randn(2, 4, 1, 64, device=CUDA)
    k = torch.randn(2, 4, 300, 64, device=CUDA)
    call = make_call(q, k, k, mask=masks.sliding_window(64), causal=False, scale=None, dropout=0.0, generator=None,
                     return_weights=False)
    assert str(policy.choose(call)) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_step_by_plain_ops_reads_nothing_and_follows_the_definition(dtype, monkeypatch):
    """``fused.DECODE_STEP_DEVICES = {"cuda"}`` (what ``benchmarks/transformers.py``'s
    ``attnkit_decode_step`` measures): a decoding step with a per-sequence padding mask, GQA, a
    masked-out NaN key and value and an attended inf value runs with no synchronisation and gives
    the CPU's result of the same definition (NaN and inf where it has them)."""
    from attnkit._backends import fused

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 1, 64, generator=g)
    k, v = (torch.randn(3, 2, 200, 64, generator=g) for _ in range(2))
    k[1, 0, 150, 5], v[1, 1, 160, 7], v[0, 1, 10, 3] = float("nan"), float("nan"), float("inf")
    mask = masks.padding(torch.tensor([200, 120, 33]))
    monkeypatch.setattr(fused, "DECODE_STEP_DEVICES", frozenset({"cpu", "cuda"}))
    expected = attnkit.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, backend="torch")
    on_gpu = [t.to(CUDA, dtype) for t in (q, k, v)]
    attnkit.attention(*on_gpu, mask=mask, backend="torch")  # the mask's dense row, kept per mask object
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = attnkit.attention(*on_gpu, mask=mask, backend="torch")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = out.cpu()
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
    assert out[0].isinf().any() and out[1].isfinite().all()  # the attended inf; the padding's NaN left out
    finite = expected.isfinite()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(out[finite].float(), expected[finite].float(), **tolerance)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss", "mistral"])
def test_transformers_models_with_softcap_sinks_and_windows_run_the_gpu_route(name):
    """Gemma 2 (soft-capping, alternating windows), GPT-OSS (sinks) and Mistral (windows) on CUDA
    with ``attn_implementation="attnkit"``: the interval engines run (no SDPA call with a mask), and
    logits and greedy tokens equal transformers' eager attention on the same device."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    import torch.nn.functional as F

    from attnkit.integrations import transformers as integration
    from test_integration_transformers import _tiny

    integration.register()
    model = _tiny(name).to(CUDA).eval()
    ids = torch.randint(1, 100, (2, 40), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    results = {}
    for implementation in ("eager", "attnkit"):
        model.set_attn_implementation(implementation)
        masked_sdpa = []
        real = F.scaled_dot_product_attention

        def spy(*args, **kwargs):
            masked_sdpa.append(kwargs.get("attn_mask") is not None)
            return real(*args, **kwargs)

        F.scaled_dot_product_attention = spy
        try:
            with torch.no_grad():
                logits = model(input_ids=ids).logits
        finally:
            F.scaled_dot_product_attention = real
        if implementation == "attnkit":
            assert not any(masked_sdpa), "a structured mask reached SDPA as a dense mask"
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        results[implementation] = logits, tokens
    torch.testing.assert_close(results["attnkit"][0], results["eager"][0], atol=1e-4, rtol=0)
    assert torch.equal(results["attnkit"][1], results["eager"][1])


def _infinite_input_case(case, device):
    """(q, k, v, mask, sinks) in float32 on ``device``: ``"masked-out key of inf"``, a padding key
    no row attends, so every output stays finite while a backward multiplying whole blocks would
    put ``0 x inf`` into ``dQ``; ``"row of -inf scores, sinks"``, a query of -inf against keys whose
    first feature is positive, so its keys' gradients are ``0 x inf`` (NaN) and, sinks in the
    normaliser, its lse is finite."""
    q, k, v = (t.float() for t in _inputs(64, 64, heads=4, kv_heads=2, head_dim=16))
    mask, sinks = masks.sliding_window(6) & masks.padding([60, 64]), None
    if case == "masked-out key of inf":
        k[0, 1, 62, 3] = float("inf")
    else:
        k[..., 0] = k[..., 0].abs() + 0.1
        q[1, 2, 30] = 0.0
        q[1, 2, 30, 0] = float("-inf")
        sinks = torch.tensor([0.5, -0.3, 1.0, 0.0])
    return (*(t.to(device) for t in (q, k, v)), mask, None if sinks is None else sinks.to(device))


def _gradients_follow_the_definition(case, device, context):
    q, k, v, mask, sinks = _infinite_input_case(case, device)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with context:
        out = attnkit.attention(*inputs, mask=mask, sinks=sinks, backend="tiled")
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    grads = torch.autograd.grad(out, inputs, up)
    allowed = mask.dense(64, 64, ndim=4).cpu()
    oracle_inputs = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want = pairwise_oracle(*oracle_inputs, 0.25, allowed, None if sinks is None else sinks.cpu().double())[0]
    want_grads = torch.autograd.grad(want, oracle_inputs, up.cpu().double())
    assert torch.isfinite(want).all(), "the case is meant to keep the output finite"
    assert not all(torch.isfinite(g).all() for g in want_grads[1:]) or case == "masked-out key of inf"
    for got, expected, name in zip((out, *grads), (want, *want_grads), ("output", "dq", "dk", "dv")):
        got = got.detach().cpu().double()
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(got), test(expected)), (case, name, test.__name__)
        finite = torch.isfinite(expected)
        torch.testing.assert_close(got[finite], expected[finite], atol=1e-4, rtol=1e-4, msg=f"{case}: {name}")


@pytest.mark.parametrize("engine", ["flex", "triton"])
@pytest.mark.parametrize("case", ["masked-out key of inf", "row of -inf scores, sinks"])
def test_gradients_on_the_gpu_engines_follow_the_definition_where_the_output_shows_nothing(engine, case):
    """An infinite input whose mark is only in the gradients: FlexAttention's backward multiplies
    whole blocks (``0 x inf`` of a masked-out key reaches ``dQ``) and, with sinks, a row of all -inf
    scores has a finite lse, so the forward's check of its output cannot see either; the route
    redoes such a call pairwise whenever gradients will flow and an input is not finite."""
    from attnkit._backends.tiled_plan import tuning

    _gradients_follow_the_definition(case, CUDA, tuning(kernel=engine))


@pytest.mark.parametrize("engine", ["flex", "triton"])
def test_gradient_penalties_on_the_gpu_engines_match_the_reference(engine):
    """create_graph=True then another backward on CUDA: FlexAttention's backward has no derivative,
    so its engine's output takes second_order's node (the reference formula, recomputed, is
    differentiated); the Triton kernel's op recomputes densely. Against float64 on the CPU."""
    from attnkit._backends.tiled_plan import tuning

    q, k, v = (t.float() for t in _inputs(48, 48, kv_heads=2, head_dim=16))
    v = v[..., :16].contiguous()
    mask = masks.sliding_window(8) & masks.padding([48, 30])

    def second_order(device, dtype, context):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        with context:
            out = attnkit.attention(*leaves, mask=mask, backend="tiled")
        first = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in first), leaves)

    got = second_order(CUDA, torch.float32, tuning(kernel=engine))
    expected = second_order("cpu", torch.float64, tuning(kernel="dense"))
    for a, b in zip(got, expected):
        assert b.abs().max() > 0
        torch.testing.assert_close(a.cpu().double(), b, atol=2e-3, rtol=2e-3)
