"""Multi-LoRA throughput on SmolLM2-135M: 64 requests, 16 at a time (max_num_seqs), spread over
1, 8 and 64 distinct adapters, against the same 64 on the base model; the first-token time of a
request whose adapter is cold (read from disk) and warm; memory per adapter.

Adapters are random rank-16 LoRA on every projection (q, k, v, o, gate, up, down) written in
PEFT's format: speed does not depend on what they learned. Default engine configuration plus
enable_lora and max_num_seqs=16: at most max_loras=8 adapters run at once and max_cpu_loras=32
stay in memory, so with 64 the tiers work (adapters evicted and read from disk again). Decode
steps run the fused int4 layers with each row's adapter; prefill chunks the PyTorch path.

    python benchmarks/lora.py [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from hyperserve import LLM, LoRARequest, SamplingParams  # noqa: E402

RANK = 16
PROMPTS = [f"Write a short note about topic number {i}: the history of bridges and tunnels." for i in range(64)]
CONCURRENCY = 16


def write_adapter(directory: Path, config, seed: int) -> None:
    """A random PEFT adapter for this model's shapes."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = config.hidden_size // config.num_attention_heads
    shapes = {"self_attn.q_proj": (config.hidden_size, config.num_attention_heads * head_dim),
              "self_attn.k_proj": (config.hidden_size, config.num_key_value_heads * head_dim),
              "self_attn.v_proj": (config.hidden_size, config.num_key_value_heads * head_dim),
              "self_attn.o_proj": (config.num_attention_heads * head_dim, config.hidden_size),
              "mlp.gate_proj": (config.hidden_size, config.intermediate_size),
              "mlp.up_proj": (config.hidden_size, config.intermediate_size),
              "mlp.down_proj": (config.intermediate_size, config.hidden_size)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(
        {"r": RANK, "lora_alpha": 2 * RANK, "target_modules": [n.split(".")[1] for n in shapes],
         "peft_type": "LORA"}))


def throughput(llm: LLM, loras: list[LoRARequest | None], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def decode_step_ms(llm: LLM, loras: list[LoRARequest | None]) -> float:
    """Median time of one fused decode step of len(loras) rows (context 100 each), each row with
    its adapter: the int4 layers only, no scheduling or sampling. It writes K/V into blocks 1-128,
    so the prefix cache is emptied first (no later request may read them)."""
    runner, manager = llm.engine.runner, llm.engine.lora
    llm.engine.kv_cache.pool.reset_cache()
    bs, rows = runner.block_size, len(loras)
    tables = torch.tensor([list(range(1 + 8 * i, 9 + 8 * i)) for i in range(rows)])
    positions = torch.full((rows,), 100)
    slots = tables[:, 100 // bs] * bs + 100 % bs
    inputs = (torch.randint(0, 1000, (rows,)), positions, slots, tables, positions + 1, runner.kv_caches)
    batch = None
    if any(loras):
        manager.set_rows(loras)
        batch = manager.batch
    times = []
    for _ in range(25):
        started = time.perf_counter()
        runner.fused_decode(*inputs, batch)
        times.append(time.perf_counter() - started)
    manager.clear()
    return sorted(times[5:])[10] * 1e3


def first_token_s(llm: LLM, lora: LoRARequest) -> float:
    started = time.perf_counter()
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=lora)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default="benchmarks/results/lora.json")
    args = parser.parse_args()
    print(cpu_header(os.cpu_count()))
    results: dict[str, float] = {}
    plain = LLM("smollm2-135m", max_num_seqs=CONCURRENCY)
    throughput(plain, [None] * len(PROMPTS), 8)
    results["base, LoRA disabled: tok/s"] = throughput(plain, [None] * len(PROMPTS), args.max_tokens)
    del plain
    llm = LLM("smollm2-135m", enable_lora=True, max_num_seqs=CONCURRENCY)
    with tempfile.TemporaryDirectory() as root:
        adapters = []
        for i in range(65):
            write_adapter(Path(root) / f"a{i}", llm.engine.hf_config, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, f"{root}/a{i}"))
        results["first token, cold adapter (read from disk): s"] = first_token_s(llm, adapters[64])
        results["first token, same adapter again: s"] = first_token_s(llm, adapters[64])
        for adapter in adapters[:8]:
            llm.engine.lora.adapter(adapter)  # loaded: the runs with 1 and 8 measure decoding, not disk reads
        throughput(llm, [None] * len(PROMPTS), 8)
        results["base, LoRA enabled: tok/s"] = throughput(llm, [None] * len(PROMPTS), args.max_tokens)
        for distinct in (1, 8, 64):
            loads = llm.engine.lora.num_loads
            loras = [adapters[i % distinct] for i in range(len(PROMPTS))]
            results[f"{distinct} adapters: tok/s"] = throughput(llm, loras, args.max_tokens)
            results[f"{distinct} adapters: loads from disk"] = llm.engine.lora.num_loads - loads
            if distinct == 1:  # its weights and the fused decode layers' copy of them
                results["memory per adapter: MB"] = llm.engine.lora.adapter(adapters[0]).num_bytes / 2**20
        for distinct in (0, 1, 8):
            loras = [adapters[i % distinct] if distinct else None for i in range(CONCURRENCY)]
            results[f"decode step of {CONCURRENCY} rows, {distinct} adapters: ms"] = decode_step_ms(llm, loras)
    base = results["base, LoRA enabled: tok/s"]
    for name, value in results.items():
        ratio = f"  ({value / base:.2f}x base)" if name.endswith("tok/s") else ""
        print(f"{name:<48}{value:>10.3f}{ratio}")
    Path(args.json).write_text(json.dumps({"machine": cpu_header(os.cpu_count()), "args": vars(args),
                                           "results": results}, indent=2))


if __name__ == "__main__":
    main()
