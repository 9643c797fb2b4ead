#!/usr/bin/env bash
# Every GPU check in one call, for a machine with CUDA and PyTorch already installed:
#   bash scripts/gpu_checks.sh [OUTDIR]
# 1. the CUDA-parametrised correctness tests: the Triton kernels natively, the engine against
#    transformers with Triton decode and CUDA graphs, fp8 weights, KV blocks moved between engines
#    (disaggregated prefill), and tensor parallelism over NCCL where there are two GPUs;
# 2. benchmarks/gpu.py on the Llama-3-8B shape (random weights): bfloat16 with 8 decode steps per
#    schedule and wide batches (512 sequences, 16,384 tokens a step) against transformers (with the
#    top GPU kernels); the same with one step per schedule; `hyperserve serve` loaded by
#    `hyperserve bench` at concurrency 1, 16 and 64; fp8 weights.
# JSON and one log per part go to OUTDIR; the server's log and each level's JSON to SERVING_DIR.
# Each part stops after TESTS_TIMEOUT / BENCH_TIMEOUT seconds, so one that hangs leaves the rest.
set -uo pipefail
OUTDIR=${1:-bench-results}
SERVING_DIR=${SERVING_DIR:-$OUTDIR/serving}
mkdir -p "$OUTDIR" "$SERVING_DIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)'
timeout "${TESTS_TIMEOUT:-600}" $PY -m pytest -q -rfE -p no:cacheprovider --durations=5 -m gpu \
    tests/models tests/engine tests/layers tests/distributed 2>&1 | tee "$OUTDIR/gpu-tests.log" | tail -n 25
rc=${PIPESTATUS[0]}
bench() {  # bench NAME ARGS...: one benchmarks/gpu.py run; its progress bars are left out of the log
    local name=$1
    shift
    echo "== benchmarks/gpu.py $*" | tee -a "$OUTDIR/gpu-bench.log"
    timeout "${BENCH_TIMEOUT:-900}" $PY benchmarks/gpu.py --out-dir "$SERVING_DIR" --json "$OUTDIR/$name.json" "$@" \
        2>"$OUTDIR/$name.err" | tee -a "$OUTDIR/gpu-bench.log"
    local status=${PIPESTATUS[0]}
    tail -n 5 "$OUTDIR/$name.err" | grep -v "it/s\|req/s" >>"$OUTDIR/gpu-bench.log"  # a failure's traceback
    rm -f "$OUTDIR/$name.err"
    rc=$(( rc || status ))
}
WIDE="--max-num-seqs 512 --max-num-batched-tokens 16384"
bench gpu --kernel-table --num-scheduler-steps 8 $WIDE ${GPU_BENCH_ARGS:-}
bench gpu-1step --num-scheduler-steps 1 $WIDE --hf-requests 0 ${GPU_BENCH_ARGS:-}
bench gpu-serve --no-offline --hf-requests 0 --serve-concurrency 1 16 64
bench gpu-fp8 --quantization fp8 --num-scheduler-steps 8 $WIDE --hf-requests 0 --num-requests 300 ${GPU_BENCH_ARGS:-}
exit $rc
