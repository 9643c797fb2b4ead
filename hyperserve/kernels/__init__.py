"""Native CPU kernels (cpu_ops.cpp and the headers it includes), compiled once per source and PyTorch version.

`make install` builds them (`python -m hyperserve.kernels`); a process that finds no build
compiles it on first use (~30 s, logged) into HYPERSERVE_KERNEL_CACHE (default
~/.cache/hyperserve/kernels), keyed by a hash of the source and the torch version, so later runs
load the shared library in milliseconds. Where no compiler is found, `available()` is False and
callers keep their PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("hyperserve.kernels")

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
HEADERS = [Path(__file__).with_name(name) for name in (  # what SOURCE includes from here
    "decode_layer.h", "isa.h", "lora.h", "paged_attention.h", "quantized_matmul.h", "step_team.h")]
CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]  # OpenMP: at::parallel_for is inline; links torch's libgomp


def build_directory() -> Path:
    root = Path(os.environ.get("HYPERSERVE_KERNEL_CACHE", Path.home() / ".cache" / "hyperserve" / "kernels"))
    sources = b"".join(path.read_bytes() for path in [SOURCE, *HEADERS])
    key = hashlib.sha256(sources + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()
    return root / key[:16]


@functools.cache
def available() -> bool:
    """Whether torch.ops.hyperserve is loaded (building it first if needed)."""
    try:
        _load()
    except Exception as error:  # no compiler, headers or ninja: the PyTorch path stays
        logger.warning("native CPU kernels unavailable, using PyTorch's: %s", error)
        return False
    return True


def _load() -> None:
    directory = build_directory()
    library = directory / "hyperserve_cpu_ops.so"
    if not library.exists():
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        logger.info("compiling the native CPU kernels once into %s", directory)
        start = time.perf_counter()
        cpp_extension.load(name="hyperserve_cpu_ops", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False)
        logger.info("compiled the native CPU kernels in %.0f s", time.perf_counter() - start)
    else:
        torch.ops.load_library(str(library))
    _register_fakes()


@functools.cache
def _register_fakes() -> None:
    """Shapes for torch.compile, which traces the ops without running them."""

    @torch.library.register_fake("hyperserve::quantized_linear")
    def _(x, weight, format, isa=""):
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("hyperserve::dequantize")
    def _(weight, in_features, format, channels=None):
        rows = weight.shape[0] if channels is None else channels.shape[0]
        return weight.new_empty((rows, in_features), dtype=torch.float32)

    @torch.library.register_fake("hyperserve::decode_layer")
    def _(hidden, weights, cos, signed_sin, key_cache, value_cache, slots, block_tables, lengths, block_size,
          num_heads, num_kv_heads, eps, scale, lora, lora_rows, sliding_window=0, gelu=False):
        return None

    @torch.library.register_fake("hyperserve::decode_layers")
    def _(hidden, weights, cos, signed_sin, key_caches, value_caches, slots, block_tables, lengths, block_size,
          num_heads, num_kv_heads, eps, scale):
        return None

    @torch.library.register_fake("hyperserve::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)


def isa() -> str:
    """The instruction set the kernels picked for this CPU: avx512_vnni, avx2 or portable."""
    return torch.ops.hyperserve.isa() if available() else "none"

