"""The AVX2-only CPU class (no AVX-512, no native bfloat16: many AMD cloud VMs and laptops) for
real, on any x86-64 machine: the kernel and fused-layer tests again inside qemu-user emulating a
Haswell. Its CPUID lists AVX2, FMA and F16C and no AVX-512, so PyTorch and our kernels choose their
AVX2 code, and the first AVX-512 instruction anything runs stops the process (SIGILL). What it
cannot show is speed (BENCHMARKS.md's AVX2 figures are measured natively). On an AVX-512 CPU every
fused-layer test also runs natively on the AVX2 paths, at native speed. On an AVX2-only CPU the plain
test run is all of this, natively, so both are skipped there."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hyperserve import kernels
from hyperserve.layers.quantization import hardware_cpu_flags

QEMU = shutil.which("qemu-x86_64")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the AVX2 paths are x86-64's"),
    pytest.mark.skipif(not kernels.available(), reason="the native CPU kernels could not be built here"),
]

# Which code paths the process takes, then the tests, in one process (starting PyTorch in the
# emulator takes ~15 s).
EMULATED = """
import sys
import pytest
from hyperserve import kernels
from hyperserve.layers.quantization import cpu_flags
import torch
kernels.available()
capability = torch.backends.cpu.get_cpu_capability()
print("paths:", kernels.isa(), capability, "avx512_bf16" in cpu_flags(), flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


# Emulation runs 50-70x slower than the CPU it runs on: all the fused-layer tests took 4-8 minutes
# there on a 2-core Intel VM, pushing `make test` to 25. So the emulator runs every kernel test
# and, of the fused-layer tests, variants that between them reach each path (both int4 layouts,
# int8 rows, head sizes 16 and 64, the long-context spans, a verify step's tiles, a sliding window,
# GPT-OSS's sinks and biases, LoRA, a bfloat16 cache, batching and caching, the bounds check);
# their numbers on every variant are checked natively with the AVX2 paths forced (the test after
# this one).
EMULATED_FUSED = [f"tests/layers/test_fused_decode.py::{name}[{variant}]" for name, variants in {
    "test_fused_decode_matches_the_pytorch_layers_in_float32":
        ("rows-llama-4-2-64", "interleaved-llama-3-1-192", "interleaved-qwen3_moe-4-2-64"),
    "test_attention_over_contexts_of_several_spans_matches_the_pytorch_layers": ("interleaved",),
    "test_a_sliding_window_and_gemmas_layers_match_the_pytorch_layers":
        ("rows-gemma3-int8-16", "interleaved-gemma3-int4-16"),
    "test_rows_of_one_sequence_attend_together_with_the_same_bits_as_alone": ("one-kv-head-interleaved",),
    "test_fused_decode_applies_each_rows_lora_adapter_as_the_pytorch_layers_do": ("gemma3-int8",),
    "test_fused_decode_reads_a_bfloat16_cache": ("rows",),
    "test_gpt_oss_layers_match_the_pytorch_layers": ("int8-64",),  # sinks, biases, the clamped SwiGLU
    "test_greedy_generation_is_the_same_batched_or_alone": ("interleaved-llama",),
    "test_where_every_step_is_fused_a_request_is_the_same_cached_chunked_or_batched": ("llama",),
    "test_a_slot_or_block_outside_the_cache_is_refused_before_anything_is_written": ("decode_layers",),
}.items() for variant in variants]
AVX2_PATHS = "paths: avx2 AVX2 False"  # our AVX2 kernels, PyTorch's, no bfloat16 instructions


def run_pytest(prefix: list[str], env: dict[str, str], tests: list[str]) -> str:
    """EMULATED's output over these tests, run by `prefix` (the emulator, or nothing)."""
    caps = ("HYPERSERVE_MAX_ISA", "ATEN_CPU_CAPABILITY")
    env = {k: v for k, v in os.environ.items() if k not in caps} | env | {"HF_HUB_OFFLINE": "1"}
    result = subprocess.run([*prefix, sys.executable, "-c", EMULATED, *tests], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]  # a test not found fails too
    assert " passed" in output and " failed" not in output
    return output


@pytest.mark.skipif(QEMU is None, reason="needs qemu-user (make test installs it)")
@pytest.mark.skipif("avx512f" not in hardware_cpu_flags(),
                    reason="this CPU is of the AVX2-only class: every test here runs on it natively")
def test_kernels_and_fused_layers_pass_on_an_avx2_only_cpu():
    output = run_pytest([QEMU, "-cpu", "Haswell"], {}, ["tests/kernels/test_cpu_ops.py", *EMULATED_FUSED])
    assert AVX2_PATHS in output


@pytest.mark.skipif(kernels.isa() != "avx512_vnni",
                    reason="this CPU runs the AVX2 paths in the plain test run")
def test_every_fused_layer_test_passes_on_the_avx2_paths():
    output = run_pytest([], {"HYPERSERVE_MAX_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"},
                        ["tests/layers/test_fused_decode.py"])
    assert AVX2_PATHS in output
