#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server from the llama-cpp-python sdist on PyPI (the one
# registry every machine here reaches), for benchmarks/cpu_vs_llamacpp.py. Native CPU flags, as a
# llama.cpp user would build it, except AMX: ggml's AMX kernels died with SIGILL (in ldtilecfg) on
# our AMX VMs although a plain AMX program runs there; AMX only speeds up llama.cpp's prefill of
# some types, never its decode. LLAMA_CPP_AMX=1 keeps it. LLAMA_CPP_ISA=avx2 builds for AVX2 + FMA
# only (no AVX-512, no AMX), as on AVX2-only CPUs, to compare that code path on an AVX-512 machine.
# Idempotent: prints the bin directory, building only when needed.
#
#   bash scripts/build_llama_cpp.sh [VERSION]      (default 0.3.36; binaries under build/llama.cpp/)
set -euo pipefail
VERSION="${1:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
AMX="${LLAMA_CPP_AMX:-0}"
ISA="${LLAMA_CPP_ISA:-native}"
DEST="$ROOT/build/llama.cpp/$VERSION-amx$AMX"
[[ "$ISA" == native ]] || DEST="$ROOT/build/llama.cpp/$VERSION-$ISA"
BIN="$DEST/build/bin"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
if [[ -x "$BIN/llama-bench" && -x "$BIN/llama-server" ]]; then
    echo "$BIN"; exit 0
fi
mkdir -p "$DEST"
"$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST" >&2
tar -xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST" --strip-components=3 \
    "llama_cpp_python-$VERSION/vendor/llama.cpp"
echo "building llama.cpp $VERSION (llama-bench, llama-server) for $ISA CPU flags ..." >&2
NO_AMX=""
[[ "$AMX" == 1 ]] || NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* outrank -march=native
case "$ISA" in
    native) FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                 -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
    *) echo "LLAMA_CPP_ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release "${FLAGS[@]}" -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$DEST/build" -j "$(nproc)" --target llama-bench llama-server >&2
echo "$BIN"
