"""GPU benchmark on a Llama-3-8B-shaped model with random bf16 weights (nothing to download).

  (a) single-stream decode tokens/s and its ratio to the memory-bandwidth limit: weight bytes
      per token over the measured device-to-device copy bandwidth (bytes read + written)
  (b) offline throughput: N requests of 512 prompt and 256 output tokens through HyperServe
  (c) the same workload through transformers.generate in static batches (a subset of requests:
      throughput is a rate, and a batch of the same size runs at the same rate)

    python benchmarks/gpu.py [--num-requests 1000] [--hf-requests 128] [--layers 32]
        [--quantization fp8] [--enforce-eager] [--attention-backend torch]

By default the engine runs as a user gets it on CUDA: Triton paged decode, decode steps replayed
from CUDA graphs, the KV pool sized by gpu_memory_utilization.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import LlamaConfig


def llama3_8b_config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    )


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    del src, dst
    return 2 * 2 * 2**30 / seconds


def workload(num: int, input_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(input_len)] for _ in range(num)]


def run_hyperserve(model_dir: str, args) -> dict:
    from hyperserve import LLM, SamplingParams
    from hyperserve.layers.quantization import weight_bytes as model_weight_bytes

    llm = LLM(model=model_dir, load_format="random", device="cuda", dtype="bfloat16", max_model_len=2048,
              kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, quantization=args.quantization,
              enforce_eager=args.enforce_eager, attention_backend=args.attention_backend)
    model = llm.engine.runner.model
    weight_bytes = model_weight_bytes(model)
    # the embedding table is gathered, not read whole, each step
    embed = model.model.embed_tokens.weight
    streamed_bytes = weight_bytes - embed.numel() * embed.element_size()
    setup = {"attention": type(model.attention_backend).__name__,
             "cuda_graphs": llm.engine.runner.decode_graphs is not None,
             "kv_blocks": llm.engine.kv_cache.pool.num_blocks}

    one = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([workload(1, 128, 128256)[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    out = llm.generate([workload(1, 128, 128256)[0]], one, use_tqdm=False)[0]
    m = out.metrics
    decode_tps = (args.decode_tokens - 1) / (m.finished_time - m.first_token_time)

    prompts = workload(args.num_requests, args.input_len, 128256)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {**setup, "weight_bytes": weight_bytes, "streamed_bytes": streamed_bytes, "decode_tps": decode_tps,
            "offline_seconds": elapsed, "offline_tps": args.num_requests * args.output_len / elapsed}


def run_transformers(config: LlamaConfig, args) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompts = workload(args.hf_requests, args.input_len, config.vocab_size)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        input_ids = torch.tensor(prompts[i : i + args.hf_batch_size], device="cuda")
        with torch.no_grad():
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"hf_seconds": elapsed, "hf_tps": args.hf_requests * args.output_len / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--hf-requests", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None, help="default: gpu_memory_utilization")
    parser.add_argument("--quantization", default=None, help="fp8: float8 weights")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--attention-backend", default="auto", help="auto (Triton on CUDA) or torch")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    config = llama3_8b_config(args.layers)
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        ours = run_hyperserve(model_dir, args)
    theirs = run_transformers(config, args) if args.hf_requests else {}
    limit_tps = bandwidth / ours["streamed_bytes"]
    result = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bandwidth / 1e9, "limit_tps": limit_tps,
              **ours, **theirs, "args": vars(args)}
    print(f"GPU: {result['gpu']}   copy bandwidth {bandwidth / 1e9:.0f} GB/s   "
          f"weights {ours['weight_bytes'] / 1e9:.2f} GB ({ours['streamed_bytes'] / 1e9:.2f} GB read per token)")
    print(f"engine: {ours['attention']}, CUDA graphs {'on' if ours['cuda_graphs'] else 'off'}, "
          f"weights {args.quantization or 'bfloat16'}, {ours['kv_blocks']} KV blocks")
    print(f"{'measure':<42}{'value':>12}")
    print(f"{'(a) single-stream decode tok/s':<42}{ours['decode_tps']:>12.1f}")
    print(f"{'    bandwidth limit tok/s':<42}{limit_tps:>12.1f}")
    print(f"{'    fraction of the limit':<42}{ours['decode_tps'] / limit_tps:>12.1%}")
    print(f"{'(b) HyperServe offline output tok/s':<42}{ours['offline_tps']:>12.1f}")
    if theirs:
        print(f"{'(c) transformers.generate output tok/s':<42}{theirs['hf_tps']:>12.1f}")
        print(f"{'    ratio':<42}{ours['offline_tps'] / theirs['hf_tps']:>12.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
