#!/usr/bin/env bash
# Every GPU check in one call, for a machine with CUDA and PyTorch already installed:
#   bash scripts/gpu_checks.sh [OUTDIR]
# 1. the CUDA-parametrised correctness tests: the Triton kernels natively, the engine against
#    transformers with Triton decode and CUDA graphs, fp8 weights, KV blocks moved between engines
#    (disaggregated prefill), and tensor parallelism over NCCL where there are two GPUs;
# 2. benchmarks/gpu.py (Llama-3-8B-shaped, random bf16 weights), then again with fp8 weights
#    (without the transformers baseline, which the first run measured); JSON goes to OUTDIR.
set -uo pipefail
OUTDIR=${1:-bench-results}
mkdir -p "$OUTDIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
$PY -m pytest -q -p no:cacheprovider -m gpu tests/models tests/engine tests/layers tests/distributed 2>&1 | tee "$OUTDIR/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
$PY benchmarks/gpu.py --json "$OUTDIR/gpu.json" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}
$PY benchmarks/gpu.py --quantization fp8 --hf-requests 0 --json "$OUTDIR/gpu-fp8.json" ${GPU_BENCH_ARGS:-} 2>&1 \
    | tee "$OUTDIR/gpu-bench-fp8.log"
exit $(( tests_rc || bench_rc || PIPESTATUS[0] ))
