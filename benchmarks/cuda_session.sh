#!/usr/bin/env bash
# What a session with a lent GPU runs, in one command (device time is short): the CUDA tests, then
# the GPU benchmarks, each under its own time limit so that one stage overrunning still leaves the
# others' results. Logs go to $OUT (the device tool's folder) or out/cuda-session.
#
#   bash benchmarks/cuda_session.sh tests bench blocks     # stages, in order
#   STAGE_SECONDS_tests=240 bash benchmarks/cuda_session.sh tests
#
# Stages: tests (tests/test_cuda.py on 8 processes: STAGE_SECONDS_tests for all but the two large
# oracle grids, then STAGE_SECONDS_grids for those), kernel (the Triton kernel's own oracle tests,
# compiled: tests/test_triton_kernel.py and the Triton cases of tests/test_nonfinite.py; the cases of
# the latest changes first, under STAGE_SECONDS_kernel_first), bench (benchmarks/gpu.py at L = 32768),
# blocks (benchmarks/triton_blocks.py), overhead (benchmarks/gpu_overhead.py), models (benchmarks/transformers.py, Mistral-style, bf16,
# L = 16384; models-long: L = 65536; models-train: a training step at 16384; models-others: Gemma 2,
# soft-capping, and GPT-OSS, sinks, at 16384 against flex_attention and eager, which transformers
# offers them where it refuses sdpa; STAGE_SECONDS_models_long etc.),
# decode (generate() of a Llama-style model at batch 1 and 8, beside attnkit_unchecked: attnkit
# with the check of SDPA's output skipped, a read of the device per layer, which may be why attnkit
# trailed sdpa by 0.7 ms a token at batch 1 and 2.5 at batch 8 in the third session, and
# attnkit_decode_step: the steps by plain ops that read nothing, fused.DECODE_STEP_DEVICES; --profile then
# counts each one's device reads, synchronisations and kernel launches in one generate()).
# It uses the python3 found on the PATH with attnkit from src/ (no install: the GPU machine's own
# torch, triton and transformers).
#
# The next lent session (about 9 minutes of stages in 15 of device time): the Triton kernels changed
# without a GPU since the third H100 session (one masked loop, the hull of the rows' ranges, fewer
# instructions a block, scores rounded as the definition's: docs/performance.md, the eighteenth
# session), so first their compiled oracle tests, then their times, then the CUDA tests, then
# decoding and L = 65536:
#   STAGE_SECONDS_kernel_first=60 STAGE_SECONDS_kernel=60 STAGE_SECONDS_blocks=120 \
#   STAGE_SECONDS_tests=100 STAGE_SECONDS_grids=60 STAGE_SECONDS_decode=60 STAGE_SECONDS_models_long=100 \
#   bash benchmarks/cuda_session.sh kernel blocks tests decode models-long
set -u
out=${OUT:-out/cuda-session}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python=${PYTHON:-python3}

limit() {  # seconds for a stage: STAGE_SECONDS_<stage> or the default given
    local name="STAGE_SECONDS_$1"
    echo "${!name:-$2}"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    "$python" -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -1
    nproc
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

for stage in "$@"; do
    began=$(date +%s)
    case $stage in
    tests)
        # every function but the two large oracle grids first (the third session's 150 s ran out
        # before them when they came in file order), then the grids under their own limit
        grids="test_every_mask_on_the_gpu_engines_matches_the_float64_oracle or test_every_backend_matches_the_float64_oracle_on_cuda"
        timeout "$(limit tests 150)" "$python" -m pytest tests/test_cuda.py -k "not ($grids)" -v -n 8 \
            -p no:cacheprovider --timeout 120 --durations 20 --tb=short -o addopts="-ra" >"$out/tests.log" 2>&1
        echo "== tests (all but the grids): exit $? after $(($(date +%s) - began)) s"
        timeout "$(limit grids 120)" "$python" -m pytest tests/test_cuda.py -k "$grids" -v -n 8 \
            -p no:cacheprovider --timeout 120 --durations 20 --tb=short -o addopts="-ra" >"$out/grids.log" 2>&1
        ;;
    kernel)
        # first the cases of the kernels' changes made without a GPU (the eighteenth session: scores as
        # rounded products, the max over raw products, the hull of the rows' ranges, one masked loop; the
        # nineteenth: the forward's TMA loads), so that a stage cut short still reports them; then the
        # whole files
        first="beyond_float32 or scale_of_zero or between_the_rows or tma_loads"
        timeout "$(limit kernel_first 60)" "$python" -m pytest tests/test_triton_kernel.py -k "$first" -v -n 8 \
            -p no:cacheprovider --tb=short -o addopts="-ra" >"$out/kernel-first.log" 2>&1
        echo "== kernel (the changed cases): exit $? after $(($(date +%s) - began)) s"
        timeout "$(limit kernel 200)" "$python" -m pytest tests/test_triton_kernel.py tests/test_nonfinite.py -k \
            "not test_nan_and_inf_propagate and not ($first)" -v -n 8 -p no:cacheprovider --durations 20 \
            --tb=short -o addopts="-ra" >"$out/kernel.log" 2>&1
        ;;
    bench)
        timeout "$(limit bench 140)" "$python" benchmarks/gpu.py --lengths 32768 --repeats 5 >"$out/gpu.txt" 2>&1
        ;;
    blocks)
        timeout "$(limit blocks 70)" "$python" benchmarks/triton_blocks.py --repeats 10 >"$out/blocks.txt" 2>&1
        ;;
    overhead)
        timeout "$(limit overhead 50)" "$python" benchmarks/gpu_overhead.py >"$out/overhead.txt" 2>&1
        ;;
    models | models-long | models-train)
        # flex_attention last and 60 s a process: in the third session its process at L = 16384 had
        # not ended after 140 and 180 s, which took the whole stage
        case $stage in
        models) extra="--lengths 16384" ;;
        models-long) extra="--lengths 65536 --repeats 3" ;;
        models-train) extra="--lengths 16384 --train" ;;
        esac
        # shellcheck disable=SC2086  # $extra is several arguments
        timeout "$(limit "${stage//-/_}" 150)" "$python" benchmarks/transformers.py --device cuda --dtype bfloat16 \
            --hidden 2048 --heads 16 --kv-heads 4 --intermediate 7168 --window 1024 \
            --implementations attnkit sdpa flex_attention --repeats 5 --timeout 60 $extra >>"$out/models.txt" 2>&1
        ;;
    models-others)
        for model in gemma2 gpt-oss; do
            timeout "$(limit models_others 150)" "$python" benchmarks/transformers.py --device cuda --dtype bfloat16 \
                --model "$model" --hidden 2048 --heads 16 --kv-heads 4 --intermediate 7168 --window 1024 \
                --lengths 16384 --implementations attnkit flex_attention eager --repeats 3 --timeout 60 \
                >>"$out/models.txt" 2>&1
        done
        ;;
    decode)
        for batch in 1 8; do
            timeout "$(limit decode 80)" "$python" benchmarks/transformers.py --device cuda --dtype bfloat16 --model llama \
                --layers 8 --hidden 2048 --heads 16 --kv-heads 4 --intermediate 5632 --generate 512 128 \
                --batch "$batch" --implementations attnkit attnkit_unchecked attnkit_decode_step sdpa --interleaved 3 --profile \
                >>"$out/decode.txt" 2>&1
        done
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
    esac
    status=$?
    echo "== $stage: exit $status after $(($(date +%s) - began)) s"
done
# the end of each log, for the device tool's output tail
for log in "$out"/kernel-first.log "$out"/kernel.log "$out"/tests.log "$out"/grids.log "$out"/gpu.txt \
    "$out"/blocks.txt "$out"/overhead.txt "$out"/models.txt "$out"/decode.txt; do
    [ -f "$log" ] && { echo "== $log"; tail -n 25 "$log"; }
done
exit 0
