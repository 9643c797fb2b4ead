"""Mixture-of-experts decode and prefill: HyperServe against transformers on the same random weights.

A Qwen3-MoE of a chosen shape (default: 12 layers, hidden 1024, 16 experts of width 512, 2 a token,
vocabulary 32k: 0.35B parameters, 0.1B active a token) is saved once with random weights; each
system then decodes 128 tokens after a 32-token prompt (1 stream, and 8 at once for HyperServe)
and prefills one 512-token prompt. Greedy, ignore_eos; medians of --rounds.

    python benchmarks/moe.py [--rounds 3] [--configs float32 int4] [--experts 16 --top-k 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402

DECODE_TOKENS, PROMPT, LONG_PROMPT = 128, 32, 512


def save_model(path: str, args) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=args.layers,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=args.experts,
                            num_experts_per_tok=args.top_k, moe_intermediate_size=512, norm_topk_prob=True,
                            max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02)
    model.save_pretrained(path)
    return config


_drawn = 0


def prompts(n: int, length: int) -> list[list[int]]:
    """n prompts never drawn before: no run finds another's in the prefix cache."""
    global _drawn
    _drawn += 1
    g = torch.Generator().manual_seed(_drawn)
    return [torch.randint(100, 30000, (length,), generator=g).tolist() for _ in range(n)]


def hyperserve_rates(path: str, quantization: str | None, rounds: int) -> dict[str, float]:
    llm = LLM(model=path, quantization=quantization, max_model_len=1024, kv_cache_memory_gb=0.5,
              max_num_batched_tokens=LONG_PROMPT)
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    rates: dict[str, list[float]] = {"decode 1": [], "decode 8": [], "prefill": []}
    llm.generate(prompts(1, PROMPT), params, use_tqdm=False)  # warm-up
    for _ in range(rounds):
        for streams in (1, 8):
            start = time.perf_counter()
            outputs = llm.generate(prompts(streams, PROMPT), params, use_tqdm=False)
            rates[f"decode {streams}"].append(sum(len(o.outputs[0].token_ids) for o in outputs)
                                              / (time.perf_counter() - start))
        start = time.perf_counter()
        llm.generate(prompts(1, LONG_PROMPT), SamplingParams(max_tokens=1), use_tqdm=False)
        rates["prefill"].append(LONG_PROMPT / (time.perf_counter() - start))
    return {key: statistics.median(values) for key, values in rates.items()}


def transformers_rates(path: str, rounds: int) -> dict[str, float]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decode, prefill = [], []
    with torch.no_grad():
        model.generate(torch.tensor(prompts(1, PROMPT)), max_new_tokens=4, do_sample=False)  # warm-up
        for _ in range(rounds):
            start = time.perf_counter()
            model.generate(torch.tensor(prompts(1, PROMPT)), max_new_tokens=DECODE_TOKENS,
                           min_new_tokens=DECODE_TOKENS, do_sample=False)
            decode.append(DECODE_TOKENS / (time.perf_counter() - start))
            start = time.perf_counter()
            model(torch.tensor(prompts(1, LONG_PROMPT)))
            prefill.append(LONG_PROMPT / (time.perf_counter() - start))
    return {"decode 1": statistics.median(decode), "decode 8": float("nan"), "prefill": statistics.median(prefill)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=["float32", "int4"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()
    flags = cpu_flags()
    header = (f"CPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
              f"{os.cpu_count()} cores, {torch.get_num_threads()} threads")
    print(header)
    with tempfile.TemporaryDirectory() as path:
        config = save_model(path, args)
        total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
        expert = 3 * config.hidden_size * config.moe_intermediate_size
        active = total - config.num_hidden_layers * expert * (config.num_experts - config.num_experts_per_tok)
        rows = {"transformers (float32)": transformers_rates(path, args.rounds)}
        for name in args.configs:
            rows[f"HyperServe {name}"] = hyperserve_rates(path, None if name == "float32" else name, args.rounds)
    baseline = rows["transformers (float32)"]
    print(f"\n{header}\nQwen3-MoE, random weights: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_experts} experts of width {config.moe_intermediate_size}, "
          f"{config.num_experts_per_tok} a token: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active a token\n")
    print("| system | decode tok/s, 1 stream | decode tok/s, 8 streams | prefill 512 tok/s |")
    print("|---|---|---|---|")
    for name, rate in rows.items():
        ratio = "" if rate is baseline else f" ({rate['decode 1'] / baseline['decode 1']:.2f}x)"
        print(f"| {name} | {rate['decode 1']:.1f}{ratio} | {rate['decode 8']:.1f} | {rate['prefill']:.0f} |")


if __name__ == "__main__":
    main()
