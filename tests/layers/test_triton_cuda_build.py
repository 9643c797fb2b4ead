"""The layers' Triton kernels build for a Hopper GPU (sm_90) on this machine, and the variants the
engine runs keep their values in registers: a kernel that CUDA's compiler rejects (where Triton's
interpreter, which the other kernel tests use on the CPU, is lenient) or that spills fails here,
without a GPU (scripts/cuda_compile_check.py, with the ptxas that Triton's wheel carries)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_triton

ROOT = Path(__file__).resolve().parents[2]


@needs_triton
def test_the_decode_kernels_build_for_hopper_without_spills():
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # built, not interpreted
    run = subprocess.run([sys.executable, "scripts/cuda_compile_check.py", "--no-spills", "--engine-only",
                          "--kernels", "gemv", "gemv-folds", "rotary", "elementwise"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    built = [line for line in run.stdout.splitlines() if re.search(r" (yes|no) +\d+ +\d+$", line)]
    assert len(built) == 40  # a row a variant: 24 GEMVs (8 folded), 12 rotary + K/V writes, 4 elementwise
