#!/usr/bin/env bash
# Every GPU check in one call, for a machine with CUDA and PyTorch already installed:
#   bash scripts/gpu_checks.sh [OUTDIR]
# 1. the CUDA-parametrised correctness tests: the Triton kernels natively, the engine against
#    transformers with Triton decode and CUDA graphs, fp8 weights, KV blocks moved between engines
#    (disaggregated prefill), and tensor parallelism over NCCL where there are two GPUs;
# 2. benchmarks/gpu.py on the Llama-3-8B shape (random weights): bfloat16 against transformers
#    (with the top GPU kernels), fp8 weights, `hyperserve serve` loaded by `hyperserve bench` at
#    concurrency 1, 16 and 64, and bfloat16 in wider batches (512 sequences, 16384 tokens a step:
#    what the KV pool holds of this workload).
# JSON and one log per part go to OUTDIR; the server's log and each level's JSON to SERVING_DIR.
set -uo pipefail
OUTDIR=${1:-bench-results}
SERVING_DIR=${SERVING_DIR:-$OUTDIR/serving}
mkdir -p "$OUTDIR" "$SERVING_DIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)'
$PY -m pytest -q -p no:cacheprovider -m gpu tests/models tests/engine tests/layers tests/distributed 2>&1 \
    | tee "$OUTDIR/gpu-tests.log" | tail -n 15
rc=${PIPESTATUS[0]}
bench() {  # bench NAME ARGS...: one benchmarks/gpu.py run; its progress bars are left out of the log
    local name=$1
    shift
    echo "== benchmarks/gpu.py $*" | tee -a "$OUTDIR/gpu-bench.log"
    $PY benchmarks/gpu.py --out-dir "$SERVING_DIR" --json "$OUTDIR/$name.json" "$@" 2>/dev/null \
        | tee -a "$OUTDIR/gpu-bench.log"
    rc=$(( rc || PIPESTATUS[0] ))
}
bench gpu --kernel-table ${GPU_BENCH_ARGS:-}
bench gpu-fp8 --quantization fp8 --hf-requests 0 ${GPU_BENCH_ARGS:-}
bench gpu-serve --no-offline --hf-requests 0 --serve-concurrency 1 16 64
bench gpu-wide --max-num-seqs 512 --max-num-batched-tokens 16384 --hf-requests 0 ${GPU_BENCH_ARGS:-}
exit $rc
