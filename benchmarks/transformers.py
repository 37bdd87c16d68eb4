"""A transformers decoder on attnkit vs transformers' own attention implementations.

The same random weights (seed 0) run with ``attn_implementation`` = ``"attnkit"``, ``"sdpa"``,
``"eager"``, ``"flex_attention"`` (where it runs on this machine) and ``"noop"``: an attention
function that returns the values unchanged (reshaped to the query heads) with no mask built,
the limit no attention implementation can beat. ``"attnkit_unchecked"`` (measurement only) is
``"attnkit"`` with the check of SDPA's output for NaN and inf (on CUDA a read of the device per
layer) skipped: what that check costs a decoding step; ``"attnkit_decode_step"`` (measurement only)
runs attnkit's decoding steps by plain ops that read nothing back (``_backends/decode_step.py``),
what ``fused.DECODE_STEP_DEVICES`` would give. ``forward time - noop time`` is what attention
costs; its share of the forward is ``1 - noop / time``. Below each length's table, the floor: the
attention's useful flops at a square matmul's rate measured in the same run, the least time any
exact attention can take on this machine, and the share of the forward that leaves.

Each (implementation, length) runs in a fresh process (peak memory is per process): one warm-up
forward, then ``--repeats`` timed ones under ``torch.no_grad()``, median reported; the extra
peak memory is the process's peak resident set minus its resident set before the first forward
(the model and inputs already built), so it counts masks, scores and activations.

    python benchmarks/transformers.py                                    # Mistral-style, L = 4096 8192
    python benchmarks/transformers.py --lengths 16384 --repeats 1        # the issue's main size
    python benchmarks/transformers.py --lengths 131072 --repeats 1 --memory-limit 20  # the others fail
    python benchmarks/transformers.py --model llama --lengths 8192       # full causal
    python benchmarks/transformers.py --model llama --generate 2048 128  # generate() with the cache
    python benchmarks/transformers.py --model llama --generate 2048 128 --implementations attnkit sdpa --interleaved 8
    python benchmarks/transformers.py --device cuda --dtype bfloat16 --hidden 2048 --heads 16 --kv-heads 4 \
        --intermediate 7168 --window 1024 --lengths 16384 65536 --implementations attnkit flex_attention sdpa
    python benchmarks/transformers.py --device cuda --dtype bfloat16 --train ...         # one training step
    python benchmarks/transformers.py --device cuda --model gemma2 ... / --model gpt-oss ...  # softcap / sinks

``--interleaved ROUNDS``: one process and one model instead, the implementations taking turns on it
(``set_attn_implementation``, the order reversed every other round) for ROUNDS rounds, each round
one run of each: separate processes drift apart by more than a few per cent on a shared machine,
turns in one process do not. Reports the median time of each and, per round, each one against
``sdpa``; no memory figures. With ``--profile`` it then runs each once more under
``torch.profiler`` and prints, per run, the host's reads of the device (``aten::_local_scalar_dense``:
``.item()``, ``.tolist()``, ``bool()`` of a tensor, each a synchronisation on a GPU), the kernel
launches and the ATen ops: where a GPU's time goes that no timing shows.

Model (the issue's): 4 layers, hidden 512, intermediate 1792, 8 heads, 2 kv heads, head dim 64,
window 512 (Mistral) or full causal (Llama), fp32, batch 1, no LM head (the base model). ``--model
gemma2`` (soft-capping, alternating sliding and full layers) and ``--model gpt-oss`` (sinks,
alternating layers, a small mixture of experts) run the same sizes. ``--device cuda``: times are
taken after ``torch.cuda.synchronize()``, the extra peak is the CUDA allocator's peak over what the
model and inputs hold; ``--dtype`` casts the model; ``--train`` times a forward and backward (the
mean square of the last hidden state); ``--batch`` sets the batch (generate() too).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# This file is named like the library it measures: its own folder goes last on the import path,
# or `import transformers` would import this script (common.py is still found there).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE] + [_HERE]

IMPLEMENTATIONS = ("attnkit", "sdpa", "eager", "flex_attention", "noop", "attnkit_unchecked", "attnkit_decode_step")
MEASUREMENT_ONLY = ("attnkit_unchecked", "attnkit_decode_step")  # run when named, not by default


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _register_noop() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def noop_attention(module, query, key, value, attention_mask, **kwargs):
        groups = query.shape[1] // value.shape[1]
        out = value[:, :, None].expand(-1, -1, groups, -1, -1).reshape(query.shape[0], query.shape[1], -1,
                                                                        value.shape[-1])
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("noop", noop_attention)
    AttentionMaskInterface.register("noop", lambda *args, **kwargs: None)

    from attnkit._backends import fused
    from attnkit.integrations.transformers import attnkit_attention_forward, attnkit_mask

    def unchecked_attention(*args, **kwargs):
        # A measurement of what the check of SDPA's output costs (on CUDA a read of the device per
        # layer): "attnkit" with that check answering "no NaN or inf to chase". Not a mode attnkit
        # has; a NaN input could then reach its output as SDPA leaves it.
        checked = fused._may_differ_from_definition
        fused._may_differ_from_definition = lambda output: False
        try:
            return attnkit_attention_forward(*args, **kwargs)
        finally:
            fused._may_differ_from_definition = checked

    AttentionInterface.register("attnkit_unchecked", unchecked_attention)
    AttentionMaskInterface.register("attnkit_unchecked", attnkit_mask)

    def decode_step_attention(module, query, *args, **kwargs):
        # "attnkit" with its decoding steps on _backends/decode_step.py on this device (plain ops
        # that give the definition, no read of the device): whether that beats SDPA plus the check's
        # read decides fused.DECODE_STEP_DEVICES, empty until a GPU has measured it.
        devices = fused.DECODE_STEP_DEVICES
        fused.DECODE_STEP_DEVICES = frozenset({query.device.type})
        try:
            return attnkit_attention_forward(module, query, *args, **kwargs)
        finally:
            fused.DECODE_STEP_DEVICES = devices

    AttentionInterface.register("attnkit_decode_step", decode_step_attention)
    AttentionMaskInterface.register("attnkit_decode_step", attnkit_mask)


def _model(kind: str, implementation: str, args):
    import torch
    import transformers

    import attnkit.integrations.transformers  # noqa: F401  registers "attnkit"

    _register_noop()
    torch.manual_seed(0)
    common = dict(vocab_size=1000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=max(args.lengths + [sum(args.generate or [0])]) + 16)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)]
    if kind == "mistral":
        config = transformers.MistralConfig(sliding_window=args.window, **common)
    elif kind == "gemma2":
        config = transformers.Gemma2Config(sliding_window=args.window, head_dim=args.hidden // args.heads,
                                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                           layer_types=alternating, **common)
    elif kind == "gpt-oss":
        config = transformers.GptOssConfig(sliding_window=args.window, head_dim=args.hidden // args.heads,
                                           num_local_experts=4, num_experts_per_tok=2, layer_types=alternating,
                                           **common)
    else:
        config = transformers.LlamaConfig(**common)
    config._attn_implementation = implementation
    cls = {"mistral": (transformers.MistralModel, transformers.MistralForCausalLM),
           "gemma2": (transformers.Gemma2Model, transformers.Gemma2ForCausalLM),
           "gpt-oss": (transformers.GptOssModel, transformers.GptOssForCausalLM),
           "llama": (transformers.LlamaModel, transformers.LlamaForCausalLM)}[kind][1 if args.generate else 0]
    model = cls(config).to(device=args.device, dtype=getattr(torch, args.dtype))
    return model.train() if args.train else model.eval()


def _runner(model, length: int, args):
    """The timed call: the model's forward over ``length`` random tokens, or ``generate()``."""
    import torch

    ids = torch.randint(0, 1000, (args.batch, length), device=args.device)
    if args.generate:
        prompt, new = args.generate
        # token 0 is the pad token generate() is given: a random prompt holding one (87% of 2048-token
        # prompts drawn from 0-999 do) becomes a padded sequence with holes, a dense mask every step
        ids = torch.randint(1, 1000, (args.batch, prompt), device=args.device)

        def run():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            return _synchronized(args, out[:, prompt:])
    elif args.train:
        def run():
            model.zero_grad(set_to_none=True)
            hidden = model(input_ids=ids).last_hidden_state
            hidden.float().square().mean().backward()
            return _synchronized(args, hidden.detach())
    else:
        def run():
            return _synchronized(args, model(input_ids=ids).last_hidden_state)
    return run


def _synchronized(args, result):
    """``result`` once the device has finished computing it (CUDA runs asynchronously)."""
    if args.device == "cuda":
        import torch

        torch.cuda.synchronize()
    return result


def _child(args) -> None:
    """Run one (implementation, length) and print a JSON line."""
    import torch
    from common import native_library_loaded

    torch.set_num_threads(args.threads)
    if args.memory_limit:  # fail with an allocation error instead of waking the kernel's OOM killer
        limit = int(args.memory_limit * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    implementation, length = args.child
    length = int(length)
    model = _model(args.model, implementation, args)
    model.set_attn_implementation(implementation)
    run = _runner(model, length, args)
    before = _rss_bytes()
    if args.device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    result = None
    with torch.set_grad_enabled(args.train):
        for i in range(args.repeats + (1 if args.warmup else 0)):
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            if i == 0:
                first = elapsed  # compiles (FlexAttention, Triton) land here
            if i >= (1 if args.warmup else 0):
                times.append(elapsed)
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary = float(result.float().abs().mean()) if result.is_floating_point() else result[0].tolist()
    print(json.dumps({"time": statistics.median(times), "times": times, "first": first, "extra_peak": peak - before,
                      "summary": summary, "kernel": native_library_loaded()}))


def _interleaved(args) -> None:
    """``--interleaved``: the implementations take turns on one model in this process."""
    import torch

    torch.set_num_threads(args.threads)
    names = args.implementations
    model = _model(args.model, names[0], args)
    for length in args.lengths:
        run = _runner(model, length, args)
        times: dict[str, list[float]] = {name: [] for name in names}
        with torch.set_grad_enabled(args.train):
            for name in names:  # one warm-up each
                model.set_attn_implementation(name)
                run()
            for round_ in range(args.interleaved):
                for name in (names if round_ % 2 == 0 else names[::-1]):
                    model.set_attn_implementation(name)
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
        print(f"| {length} | " + " | ".join(f"{statistics.median(times[n]):.3f}" for n in names) + " |")
        if args.profile:
            _profiled(model, run, names)
        if "sdpa" in names:
            for name in (n for n in names if n != "sdpa"):
                ratios = [s / t for s, t in zip(times["sdpa"], times[name])]
                faster = sum(r > 1 for r in ratios)
                print(f"\n{name} vs sdpa at L = {length}, round by round: "
                      + ", ".join(f"{r:.2f}x" for r in ratios)
                      + f"; median {statistics.median(ratios):.2f}x, faster in {faster} of {len(ratios)} rounds")


def _profiled(model, run, names) -> None:
    """One more run of each implementation under ``torch.profiler``: its counts of device reads,
    kernel launches and ATen ops (``--profile``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    print("\n| implementation | device reads (_local_scalar_dense) | stream / device syncs | kernel launches "
          "| ATen ops |\n|---|---:|---:|---:|---:|")
    for name in names:
        model.set_attn_implementation(name)
        with profile(activities=activities) as prof:
            run()
        counts: dict[str, int] = {}
        for event in prof.events():
            counts[event.name] = counts.get(event.name, 0) + 1
        reads = counts.get("aten::_local_scalar_dense", 0)
        syncs = sum(n for key, n in counts.items() if key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
        launches = sum(n for key, n in counts.items() if key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                                 "cudaLaunchKernelExC"))
        aten = sum(n for key, n in counts.items() if key.startswith("aten::"))
        print(f"| {name} | {reads} | {syncs} | {launches} | {aten} |")


def _measure(implementation: str, length: int, args) -> dict:
    command = [sys.executable, __file__, "--child", implementation, str(length)] + args.passthrough
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {args.timeout} s"}
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        why = "killed (out of memory?)" if done.returncode < 0 else (lines[-1] if lines else f"exit {done.returncode}")
        return {"error": why[:160]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if args.device == "cpu" and implementation.startswith("attnkit"):
        import attnkit  # noqa: F401  (the library this run's attnkit would load)
        from common import native_library_loaded

        # a child started after an edit of the kernel's sources runs PyTorch's kernels (masks.py
        # stops on the same check)
        if result.get("kernel", "") != native_library_loaded():
            return {"error": f"ran with native kernel {result.get('kernel') or 'none'}, not "
                             f"{native_library_loaded() or 'none'} (its sources or cache changed during the run)"}
    return result


def _matmul_rate(threads: int) -> float:
    """GFLOP/s of common.square_matmul on this machine now (median of 7)."""
    import torch
    from common import median_times, square_matmul

    torch.set_num_threads(threads)
    flops, matmul = square_matmul()
    return flops / median_times({"matmul": matmul}, repeats=7)["matmul"] / 1e9


def _attention_gflop(kind: str, length: int, args) -> float:
    """The useful work of the model's attention in one forward: 4 * head_dim flops per attended
    (query, key) pair, head and layer (the products q.k and p.v), with transformers' masks
    (causal; Mistral's window: query i sees keys i - window + 1 .. i)."""
    window = args.window if kind == "mistral" else length
    pairs = sum(min(i + 1, window) for i in range(length))
    return 4 * (args.hidden // args.heads) * pairs * args.heads * args.layers / 1e9


def _model_gflop(length: int, args) -> float:
    """The no-op forward's work: the projections and the SwiGLU feed-forward, 2 flops per
    multiply-add (norms, rotary and the embedding lookup are a rounding error)."""
    head_dim = args.hidden // args.heads
    per_token = (2 * args.hidden * args.heads * head_dim + 2 * args.hidden * args.kv_heads * head_dim
                 + 3 * args.hidden * args.intermediate)
    return 2 * per_token * length * args.layers / 1e9


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mistral", "llama", "gemma2", "gpt-oss"), default="mistral")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--train", action="store_true", help="time a forward and backward instead of a forward")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS,
                        default=[name for name in IMPLEMENTATIONS if name not in MEASUREMENT_ONLY])
    parser.add_argument("--generate", type=int, nargs=2, metavar=("PROMPT", "NEW"), default=None,
                        help="time generate() with the cache instead of one forward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1792)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (implementation, length)")
    parser.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                        help="address-space limit of each measured process (an allocation beyond it fails)")
    parser.add_argument("--profile", action="store_true",
                        help="with --interleaved: count device reads, kernel launches and ATen ops of one run each")
    parser.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                        help="one process, the implementations taking turns on one model for ROUNDS rounds")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    args.passthrough = [a for a in sys.argv[1:]]
    if args.generate:
        args.lengths = [args.generate[0]]
    import torch
    import transformers

    what = (f"generate(), prompt {args.generate[0]}, {args.generate[1]} new tokens" if args.generate
            else "forward + backward" if args.train else "forward")
    shape = (f"{args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads, "
             f"{args.kv_heads} kv heads" + (", full causal" if args.model == "llama" else f", window {args.window}"))
    how = (f"one process, implementations taking turns, median of {args.interleaved} rounds (s)" if args.interleaved
           else f"median of {args.repeats}")
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.threads} threads, cpu"
    print(f"# {args.model}-style decoder ({shape}), {what}, {args.dtype}, batch {args.batch} "
          f"(torch {torch.__version__}, transformers {transformers.__version__}, {where}); {how}\n")
    if args.interleaved:
        print("| L | " + " | ".join(args.implementations) + " |")
        print("|---:|" + "---:|" * len(args.implementations))
        _interleaved(args)
        return
    print("| L | implementation | time (s) | vs sdpa | attention share (1 - noop/time) | extra peak (GiB) |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in args.lengths:
        results = {}
        order = args.implementations if length % 2 == 0 else args.implementations[::-1]
        for implementation in order:
            began = time.perf_counter()
            results[implementation] = _measure(implementation, length, args)
            r = results[implementation]
            # one line on stderr as each process ends, so a run cut short by a time limit still reports
            print(f"{implementation} at {length}: " + (f"fails: {r['error']}" if "error" in r else
                  f"median {r['time']:.3f} s, first call {r['first']:.1f} s") +
                  f", process {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
        noop = results.get("noop", {}).get("time")
        sdpa = results.get("sdpa", {}).get("time")
        for implementation in args.implementations:
            r = results[implementation]
            if "error" in r:
                print(f"| {length} | {implementation} | fails: {r['error']} | | | |")
                continue
            ratio = f"{sdpa / r['time']:.2f}x" if sdpa else ""
            share = f"{1 - noop / r['time']:.1%}" if noop and implementation != "noop" else ""
            print(f"| {length} | {implementation} | {r['time']:.2f} | {ratio} | {share} | {_gib(r['extra_peak'])} |",
                  flush=True)
        if noop and not args.generate and args.device == "cpu" and not args.train:
            rate = _matmul_rate(args.threads)
            attention, rest = _attention_gflop(args.model, length, args), _model_gflop(length, args)
            floor = attention / rate
            needed = attention / (0.05 / 0.95 * noop)
            print(f"\nfloor at L = {length}: attention's useful work is {attention:.1f} GFLOP, the rest of the "
                  f"forward's {rest:.1f} GFLOP ({attention / (attention + rest):.1%} of the work). The no-op forward ran "
                  f"at {rest / noop:.0f} GFLOP/s, a square matmul at {rate:.0f} GFLOP/s (measured after it); at that "
                  f"rate attention takes at least {floor:.3f} s, {floor / (noop + floor):.1%} of this forward. "
                  f"Attention at 5% would need {needed:.0f} GFLOP/s, {needed / rate:.1f}x that matmul and "
                  f"{needed / (rest / noop):.1f}x the model's own linear layers.\n")
        if args.generate:
            tokens = {k: v["summary"] for k, v in results.items() if "summary" in v and k != "noop"}
            same = len({json.dumps(t) for t in tokens.values()}) <= 1
            print(f"\n(generated tokens identical across {sorted(tokens)}: {same})")


if __name__ == "__main__":
    main()
