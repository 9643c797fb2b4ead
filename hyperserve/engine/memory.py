"""How big the KV pool is and how its layers share it, an engine's memory before it loads, sizing
the pool on CUDA from gpu_memory_utilization, and handing memory back after loading.

The pool gets what is left of utilization x the GPU's memory after the weights, the activations of
the largest step and what lives outside PyTorch's allocator (the CUDA context, cuBLAS workspaces).
The activations are measured, not estimated: one step of max_num_batched_tokens prefill tokens
runs with its logits and the sampler's sort, and the allocator's peak is read back. CUDA graphs,
captured later, take their memory from the same budget's headroom (their pool is a few MB per
bucket at decode sizes).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from hyperserve.config import EngineConfig
from hyperserve.layers.attention import AttentionMetadata, KVCache, PrefillSpan
from hyperserve.models import loader
from hyperserve.models.llama import LlamaForCausalLM, kv_layout
from hyperserve.models.registry import resolve_model

logger = logging.getLogger("hyperserve.memory")

CPU_KV_CACHE_BYTES = 4 * 2**30  # the CPU's KV pool unless kv_cache_memory_gb says otherwise


def num_kv_blocks(model: LlamaForCausalLM, config: EngineConfig, hf_config, max_model_len: int) -> int:
    """The pool's size: num_kv_blocks, or kv_cache_memory_gb, or on CUDA what
    gpu_memory_utilization leaves after the weights and a measured step, or 4 GB on the CPU."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_gb is not None:
        budget = int(cache.kv_cache_memory_gb * 2**30)
    elif config.model.device == "cuda":
        budget = cuda_kv_cache_budget(model, config, max_model_len)
    else:
        budget = CPU_KV_CACHE_BYTES
    # per rank, as the budget is
    heads = (model.tp.largest_kv_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads)
             if model.tp.size > 1 else None)
    per_block = loader.kv_bytes_per_token(hf_config, config.model.torch_dtype, cache.kv_cache_dtype,
                                          heads) * cache.block_size
    return budget // per_block


def kv_groups(model: LlamaForCausalLM, config: EngineConfig, num_blocks: int,
              reads_whole_blocks: bool) -> tuple[int, int | None, int | None]:
    """How the pool of num_blocks (blocks of every layer) is laid out: (blocks of the first
    group, the window its windowed layers release blocks behind, blocks of the windowed layers'
    own group). Sliding-window layers keep only what their window sees, so memory per sequence
    stays bounded; not where a disk tier (`reads_whole_blocks`) or a drafting model reads whole
    blocks of every layer. A model that also has full-attention layers (Gemma 3) gives its windowed
    layers a pool of their own, sized for max_num_seqs sequences each holding a window and a
    step's tokens, the full-attention layers the rest of the same memory."""
    cache, scheduler = config.cache, config.scheduler
    window = model.sliding_window
    if window is None or reads_whole_blocks or config.speculative.speculative_method in ("draft", "self"):
        return num_blocks, None, None
    if not model.interleaves_full_attention:
        return num_blocks, window, None
    num_windowed = sum(model.window_layers)
    num_full = len(model.window_layers) - num_windowed
    per_sequence = -(-(window + scheduler.max_num_batched_tokens) // cache.block_size) + 1
    num_window_blocks = min(scheduler.max_num_seqs * per_sequence, num_blocks)
    num_full_blocks = (num_blocks * (num_full + num_windowed) - num_window_blocks * num_windowed) // num_full
    logger.info("KV pool: %d blocks for %d full-attention layers, %d for %d sliding-window layers "
                "(window %d tokens)", num_full_blocks, num_full, num_window_blocks, num_windowed, window)
    return num_full_blocks, window, num_window_blocks


def estimate_memory_bytes(config: EngineConfig) -> int:
    """An engine's memory before it is loaded: its weight files (a quantized load holds about as
    much; float32 from a 4-bit file holds several times more) and its KV pool's budget."""
    cache = config.cache
    weights = 0
    if config.model.load_format != "random":
        source = resolve_model(config.model.model)
        files = [source.path] if source.gguf_file else [
            *source.directory.glob("*.safetensors"), *source.directory.glob("*.bin")]
        weights = sum(f.stat().st_size for f in files)
    if cache.num_kv_blocks is not None:
        hf_config = loader.load_config(resolve_model(config.model.model))
        kv = cache.num_kv_blocks * cache.block_size * loader.kv_bytes_per_token(
            hf_config, config.model.torch_dtype, cache.kv_cache_dtype)
    elif cache.kv_cache_memory_gb is not None:
        kv = int(cache.kv_cache_memory_gb * 2**30)
    else:
        kv = CPU_KV_CACHE_BYTES if config.model.device == "cpu" else 0  # CUDA: sized from what is free
    return weights + kv


@torch.inference_mode()
def profile_step(model: LlamaForCausalLM, config: EngineConfig, num_tokens: int, max_model_len: int) -> None:
    """The largest step the scheduler can send: num_tokens prompt tokens (as prompts of at most
    max_model_len, since one step holds chunks of several), logits for max_num_seqs rows, and the
    sampler's softmax and sort over them."""
    device, block_size = torch.device(config.model.device), config.cache.block_size
    hf = model.config
    heads, width, shared = kv_layout(hf)
    caches = [KVCache.allocate(-(-num_tokens // block_size), block_size, heads, width,
                               config.model.torch_dtype, config.cache.kv_cache_dtype, device, shared)
              for _ in range(hf.num_hidden_layers)]
    starts = range(0, num_tokens, max_model_len)
    spans = [PrefillSpan(start, min(start + max_model_len, num_tokens), None, None) for start in starts]
    positions = torch.cat([torch.arange(span.end - span.start, device=device) for span in spans])
    meta = AttentionMetadata(torch.arange(num_tokens, device=device), [], spans, model.sliding_window)
    hidden = model(torch.zeros_like(positions), positions, caches, meta)
    logits = model.compute_logits(hidden[-min(num_tokens, config.scheduler.max_num_seqs):])
    torch.softmax(logits, dim=-1).sort(dim=-1)


def cuda_kv_cache_budget(model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> int:
    """Bytes the KV pool may take on this GPU."""
    device = torch.device(config.model.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_step(model, config, config.scheduler.max_num_batched_tokens, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)  # weights + the step's activations
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    utilization = config.cache.gpu_memory_utilization
    budget = int(total * utilization) - peak - outside_torch
    logger.info("GPU memory %.1f GiB x %.2f: weights and peak activations %.2f GiB, outside PyTorch "
                "%.2f GiB, KV pool %.2f GiB", total / 2**30, utilization, peak / 2**30, outside_torch / 2**30,
                budget / 2**30)
    if budget <= 0:
        raise ValueError(f"no GPU memory is left for the KV pool at gpu_memory_utilization={utilization}: "
                         "raise it, lower max_num_batched_tokens, or quantize the weights "
                         "(quantization='fp8')")
    return budget


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the OS. Loading builds the model in float32 and
    quantizing frees those copies, but glibc keeps freed heap pages mapped: 250 MB of SmolLM2's
    1.1 GB after loading. A no-op where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
