#!/usr/bin/env bash
# Wheels for a GPU machine that has CUDA PyTorch, Triton and transformers' own needs but no package
# registry (an air-gapped box, or a lent accelerator): our other dependencies, at the versions this
# checkout's .venv holds, for CPython 3.12 on x86-64 Linux. Download here, copy the folder over,
# then there, before scripts/gpu_checks.sh:
#   pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#
#   bash scripts/gpu_wheels.sh [DIR]        (default .whl; about 40 MB)
set -euo pipefail
DIR=${1:-.whl}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
# Not in an image with PyTorch, transformers and the scientific stack; transformers and its hub
# client are carried too, at the versions our tests are run with (the hub's 2.x needs httpx2;
# fastapi imports opentelemetry-api).
PACKAGES="fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
gguf google-re2 llguidance usearch numkong uvicorn python-multipart redis jsonschema referencing rpds-py
jsonschema-specifications transformers tokenizers huggingface-hub httpx2 httpcore2 truststore idna
opentelemetry-api"
PLATFORMS=""
for tag in manylinux_2_{5,17,24,26,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS="$PLATFORMS --platform $tag"
done
mkdir -p "$DIR"
for name in $PACKAGES; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $PLATFORMS -d "$DIR" "$name==$version"
done
ls "$DIR"
