#!/usr/bin/env bash
# Every GPU check in one call, for a machine with CUDA and PyTorch already installed; all parts
# take about 8 minutes on an H100, so that they fit a 15-minute device lease with its start-up:
#   bash scripts/gpu_checks.sh [OUTDIR]            # every part
#   PARTS="sweep single" bash scripts/gpu_checks.sh OUTDIR   # some of them
#   WHEELS=DIR bash scripts/gpu_checks.sh OUTDIR   # first install the wheels that
#                                                   # scripts/gpu_wheels.sh downloaded into DIR
# Parts, in order:
#   tests    the CUDA-parametrised correctness tests: the Triton kernels natively, the engine against
#            transformers with Triton decode and CUDA graphs, fp8 weights, KV blocks moved between
#            engines (disaggregated prefill), tensor parallelism over NCCL where there are two GPUs
#            (TESTS names other test paths);
#   sweep    benchmarks/gpu_kernels.py: the decode GEMV against cuBLAS at one row, its tiles swept
#            per Llama-3-8B projection, each shape's winner written to OUTDIR/gemv-tiles.json;
#   folds    benchmarks/gpu_kernels.py --folds: each projection's GEMV with the layer's norm, SwiGLU
#            or residual add folded in (layers/gemv_decode.py) against those as kernels of their own;
#   attention benchmarks/gpu_kernels.py --attention: the paged decode attention with bfloat16 and
#            fp8 caches, from one long sequence to an offline run's 512 (ATTENTION_ARGS narrows the sweep);
#   gemm     benchmarks/gpu_kernels.py --gemm: the projections at offline decode batches (256-512 rows)
#            through cuBLAS, cuBLASLt and a Triton GEMM;
#   rotary   benchmarks/gpu_kernels.py --rotary: the fused rotary + K/V write from 1 to 16,384 tokens, a
#            program per token and head against one per token;
#   prefill  benchmarks/gpu_kernels.py --prefill: one layer's prefill attention for a step's spans, the
#            portable backend's SDPA per span against the Triton kernel's one launch, its tiles swept;
#   single   benchmarks/gpu.py single-stream decode on the Llama-3-8B shape (random weights),
#            bfloat16, 8 steps per schedule: as shipped, with the layers' modules in place of their
#            six fused kernels (layers/gemv_decode.py), then with the sweep's GEMV tiles where the
#            sweep ran;
#   single-fp8  the same with fp8 weights (with the sweep's tiles, the top GPU kernels);
#   offline  benchmarks/gpu.py offline, 1,000 requests (512 in, 256 out), bfloat16, 8 decode steps
#            per schedule, wide batches (512 sequences, 16,384 tokens a step), against transformers,
#            with the top GPU kernels;
#   offline-fp8kv  the same with an fp8 KV cache (half the K/V bytes), its kernels too;
#   fp8      the same offline run with fp8 weights, 300 requests;
#   serve    `hyperserve serve` loaded by `hyperserve bench` at concurrency 1, 16 and 64 (not by default).
# JSON and one log per part go to OUTDIR; the server's log and each level's JSON to SERVING_DIR.
# Each part stops after its own timeout, so one that hangs leaves the rest.
set -uo pipefail
OUTDIR=${1:-bench-results}
SERVING_DIR=${SERVING_DIR:-$OUTDIR/serving}
PARTS=${PARTS:-tests sweep single single-fp8 offline offline-fp8kv fp8}
mkdir -p "$OUTDIR" "$SERVING_DIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
PY=${PYTHON:-python3}
# our other dependencies as wheels (scripts/gpu_wheels.sh), for a box with no registry
if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/hyperserve-site \
        "$WHEELS"/*.whl || exit
    export PYTHONPATH=/tmp/hyperserve-site:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# every import the parts need, first: a missing package fails here in seconds, not in each part
$PY -c 'import torch, transformers, triton, hyperserve.server.app, hyperserve.bench.run
print(torch.__version__, transformers.__version__, triton.__version__)' || exit
rc=0
part() { [[ " $PARTS " == *" $1 "* ]]; }
bench() {  # bench NAME TIMEOUT ARGS...: one benchmarks/gpu.py run; its progress bars are left out of the log
    local name=$1 limit=$2
    shift 2
    echo "== benchmarks/gpu.py $*" | tee -a "$OUTDIR/gpu-bench.log"
    timeout "$limit" $PY benchmarks/gpu.py --out-dir "$SERVING_DIR" --json "$OUTDIR/$name.json" "$@" \
        2>"$OUTDIR/$name.err" | tee -a "$OUTDIR/gpu-bench.log" \
        | grep -E "GPU:|engine:|tok/s|fraction|ratio|^\|"
    local status=${PIPESTATUS[0]}
    tail -n 5 "$OUTDIR/$name.err" | grep -v "it/s\|req/s" >>"$OUTDIR/gpu-bench.log"  # a failure's traceback
    rm -f "$OUTDIR/$name.err"
    rc=$(( rc || status ))
}
if part tests; then
    # -v: each test's outcome as it ends, so a run its timeout cuts still says which failed
    timeout "${TESTS_TIMEOUT:-240}" $PY -m pytest -v -rfE -p no:cacheprovider --durations=5 -m gpu \
        ${TESTS:-tests/models tests/engine tests/layers tests/distributed} 2>&1 \
        | tee "$OUTDIR/gpu-tests.log" | tail -n 25
    rc=$(( rc || PIPESTATUS[0] ))
fi
TILES=$OUTDIR/gemv-tiles.json
if part sweep; then
    timeout 150 $PY benchmarks/gpu_kernels.py --shapes qkv o gate_up down --rows 1 --tiles-json "$TILES" \
        --json "$OUTDIR/gpu-kernels.json" 2>&1 | tee "$OUTDIR/gpu-kernels.log" | tail -n 25
    rc=$(( rc || PIPESTATUS[0] ))
fi
if part folds; then
    timeout 90 $PY benchmarks/gpu_kernels.py --folds --shapes qkv o gate_up down --rows 1 \
        --json "$OUTDIR/gpu-folds.json" 2>&1 | tee "$OUTDIR/gpu-folds.log" | tail -n 20
    rc=$(( rc || PIPESTATUS[0] ))
fi
if part attention; then
    timeout 120 $PY benchmarks/gpu_kernels.py --attention --kv-cache-dtype auto fp8 ${ATTENTION_ARGS:-} \
        --json "$OUTDIR/gpu-attention.json" 2>&1 | tee "$OUTDIR/gpu-attention.log" | tail -n 80
    rc=$(( rc || PIPESTATUS[0] ))
fi
if part gemm; then
    timeout 120 $PY benchmarks/gpu_kernels.py --gemm --shapes qkv o gate_up down --rows 256 448 512 \
        --json "$OUTDIR/gpu-gemm.json" 2>&1 | tee "$OUTDIR/gpu-gemm.log" | tail -n 60
    rc=$(( rc || PIPESTATUS[0] ))
fi
if part rotary; then
    timeout 90 $PY benchmarks/gpu_kernels.py --rotary --kv-cache-dtype auto fp8 \
        --json "$OUTDIR/gpu-rotary.json" 2>&1 | tee "$OUTDIR/gpu-rotary.log" | tail -n 25
    rc=$(( rc || PIPESTATUS[0] ))
fi
if part prefill; then
    timeout 150 $PY benchmarks/gpu_kernels.py --prefill --kv-cache-dtype auto fp8 \
        --json "$OUTDIR/gpu-prefill.json" 2>&1 | tee "$OUTDIR/gpu-prefill.log" | tail -n 80
    rc=$(( rc || PIPESTATUS[0] ))
fi
SINGLE="--num-requests 0 --hf-requests 0 --num-scheduler-steps 8 --decode-tokens 512"
WIDE="--max-num-seqs 512 --max-num-batched-tokens 16384"
if part single; then
    bench gpu-single 75 $SINGLE
    bench gpu-single-unfused 75 $SINGLE --unfused-layers
    [ -s "$TILES" ] && bench gpu-single-swept 75 $SINGLE --gemv-tiles "$TILES"
fi
if part single-fp8; then
    bench gpu-single-fp8 75 $SINGLE --quantization fp8
    [ -s "$TILES" ] && bench gpu-single-fp8-swept 90 $SINGLE --quantization fp8 --gemv-tiles "$TILES" \
        --kernel-table
fi
if part offline; then
    bench gpu 200 --kernel-table --num-scheduler-steps 8 $WIDE ${GPU_BENCH_ARGS:-}
fi
if part offline-fp8kv; then
    bench gpu-fp8kv 120 --kv-cache-dtype fp8 --num-scheduler-steps 8 $WIDE --hf-requests 0 --kernel-table
fi
if part fp8; then
    bench gpu-fp8 120 --quantization fp8 --num-scheduler-steps 8 $WIDE --hf-requests 0 --num-requests 300
fi
if part serve; then
    bench gpu-serve 240 --no-offline --hf-requests 0 --serve-concurrency 1 16 64
fi
exit $rc
