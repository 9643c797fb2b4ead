"""Decode and prefill of other architectures' shapes: HyperServe against transformers on the same
random weights.

A model of one of SHAPES is saved once with random weights: `qwen3-0.6b` (Qwen3-0.6B's shape:
28 layers, hidden 1024, 16 query and 8 K/V heads of 128, QK norms, vocabulary 152k, tied),
`qwen2.5-0.5b` (Qwen2.5-0.5B's: 24 layers, hidden 896, 14 query and 2 K/V heads of 64, biases on q,
k and v, vocabulary 152k, tied),
`qwen3-moe` (12 layers, hidden 1024, 16 experts of width 512, 2 a token, vocabulary 32k: 0.40B
parameters, 0.13B active a token), `gemma2-2b-8l` (8 of Gemma 2 2B's 26 layers: hidden 2304, 8
query and 4 K/V heads of 256, capped scores and logits, vocabulary 32k in place of 256k) or
`deepseek-v2-lite-4l` (4 of DeepSeek-V2-Lite's 27 layers, the first dense: its latent attention,
16 of its 64 experts of width 1408, 6 a token, 2 shared; vocabulary 32k in place of 102k) or
`gpt-oss-20b-4l` (4 of gpt-oss-20b's 24 layers, a 128-token window in every other one: hidden
2880, 64 query and 8 K/V heads of 64 with attention sinks, 8 of its 32 experts of width 2880, 4 a
token as in the model, so a token reads as much; vocabulary 32k in place of 201k). Each
system then decodes 128 tokens after a 32-token prompt (1 stream, and 8 at once for HyperServe)
and prefills one 512-token prompt; every prompt is new (no prefix-cache hits). Greedy, ignore_eos;
medians of --rounds. `int4-layers` is int4 with the native decode layers turned off: the
layer-by-layer PyTorch path, for comparison (DeepSeek runs that path in int4 anyway). With
--long-context N, each also decodes 32 tokens after an N-token prompt (its prefill timed apart and
taken off). `mxfp4` rounds the MLPs' weights to MXFP4 (GPT-OSS's experts as published), the
rest to Q8_0; `mxfp4-layers` is its layer-by-layer path.

    python benchmarks/architectures.py --shape qwen3-0.6b [--rounds 3] [--configs float32 int4 int4-layers]
    python benchmarks/architectures.py --shape qwen2.5-0.5b --configs int4 int4-layers
    python benchmarks/architectures.py --shape qwen3-moe
    python benchmarks/architectures.py --shape gemma2-2b-8l
    python benchmarks/architectures.py --shape deepseek-v2-lite-4l --configs float32 int4 --long-context 2000
    python benchmarks/architectures.py --shape gpt-oss-20b-4l --configs float32 int4 --long-context 2000

`--write-gguf PATH` writes the shape (GPT-OSS's only) as llama.cpp's converter would, MXFP4 experts
and Q8_0 matrices, with SmolLM2's tokenizer (so a vocabulary of 49k), for
benchmarks/cpu_vs_llamacpp.py --model PATH, and exits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DeepseekV2Config,
    Gemma2Config,
    GptOssConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.layers.fused_decode import FusedDecode  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402

DECODE_TOKENS, PROMPT, LONG_PROMPT, LONG_DECODE = 128, 32, 512, 32
SHAPES = {
    "qwen3-0.6b": lambda: Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                      num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=2048, tie_word_embeddings=True),
    "qwen2.5-0.5b": lambda: Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                        max_position_embeddings=2048, tie_word_embeddings=True),
    "qwen3-moe": lambda: Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                                        num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                                        head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                                        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False),
    "gemma2-2b-8l": lambda: Gemma2Config(
        vocab_size=32000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, max_position_embeddings=2048),
    "deepseek-v2-lite-4l": lambda: DeepseekV2Config(
        vocab_size=32000, hidden_size=2048, intermediate_size=10944, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16,
        num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, first_k_dense_replace=1,
        max_position_embeddings=2048, tie_word_embeddings=False),
    "gpt-oss-20b-4l": lambda: GptOssConfig(
        vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=4096, tie_word_embeddings=False),
}


def random_model(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02)
    return model


def save_model(path: str, shape: str) -> PretrainedConfig:
    config = SHAPES[shape]()
    random_model(config).save_pretrained(path)
    return config


def write_gguf(shape: str, path: str) -> None:
    """A GPT-OSS shape as llama.cpp writes it (tests/models/test_gpt_oss.py's writer), its
    vocabulary SmolLM2's tokenizer's."""
    from hyperserve.models.registry import resolve_model
    from tests.models.test_gpt_oss import write_gguf as write_gpt_oss_gguf

    if not shape.startswith("gpt-oss"):
        raise SystemExit("--write-gguf writes GPT-OSS shapes only")
    config = SHAPES[shape]()
    config.vocab_size = 49152
    write_gpt_oss_gguf(random_model(config), path, resolve_model("smollm2-135m").path, dense="Q8_0")
    print(f"wrote {path}")


_drawn = 0


def prompts(n: int, length: int) -> list[list[int]]:
    """n prompts never drawn before: no run finds another's in the prefix cache."""
    global _drawn
    _drawn += 1
    g = torch.Generator().manual_seed(_drawn)
    return [torch.randint(100, 30000, (length,), generator=g).tolist() for _ in range(n)]


def long_context_rate(generate, context: int) -> float:
    """Decode tok/s after a `context`-token prompt: the time of 1 + LONG_DECODE tokens less that of
    the prompt's prefill and first token, each on a new prompt."""
    start = time.perf_counter()
    generate(prompts(1, context), 1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    generate(prompts(1, context), 1 + LONG_DECODE)
    return LONG_DECODE / (time.perf_counter() - start - first)


def hyperserve_rates(path: str, config_name: str, rounds: int, context: int) -> dict[str, float]:
    method, _, layers = config_name.partition("-")
    quantization = None if method == "float32" else method
    layer_by_layer = layers == "layers"
    unsupported = FusedDecode.unsupported
    if layer_by_layer:
        FusedDecode.unsupported = staticmethod(lambda model, caches: "asked for the layer-by-layer path")
    try:
        llm = LLM(model=path, quantization=quantization, max_model_len=max(1024, context + 2 * LONG_DECODE),
                  kv_cache_memory_gb=0.5, max_num_batched_tokens=LONG_PROMPT)
    finally:
        FusedDecode.unsupported = unsupported
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
        if context:
            rates.setdefault("decode long", []).append(long_context_rate(
                lambda ids, n: llm.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                            use_tqdm=False), context))
    return {key: statistics.median(values) for key, values in rates.items()}


def transformers_rates(path: str, rounds: int, context: int) -> dict[str, float]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decode, prefill, long = [], [], []
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
            if context:
                long.append(long_context_rate(lambda ids, n: model.generate(
                    torch.tensor(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False), context))
    rates = {"decode 1": statistics.median(decode), "decode 8": float("nan"), "prefill": statistics.median(prefill)}
    return rates | ({"decode long": statistics.median(long)} if context else {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe")
    parser.add_argument("--configs", nargs="+", default=["float32", "int4", "int4-layers"],
                        choices=["float32", "int4", "int4-layers", "mxfp4", "mxfp4-layers"])
    parser.add_argument("--long-context", type=int, default=0,
                        help="also decode after a prompt this long (0: not)")
    parser.add_argument("--write-gguf", default=None, help="write the shape as a GGUF here and exit")
    args = parser.parse_args()
    if args.write_gguf:
        write_gguf(args.shape, args.write_gguf)
        return
    flags = cpu_flags()
    header = (f"CPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
              f"{os.cpu_count()} cores, {torch.get_num_threads()} threads")
    print(header)
    with tempfile.TemporaryDirectory() as path:
        config = save_model(path, args.shape)
        total = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
        active = total
        if args.shape in ("qwen3-moe", "deepseek-v2-lite-4l", "gpt-oss-20b-4l"):
            width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
            experts = getattr(config, "num_local_experts", None) or config.num_experts
            sparse_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
            active -= sparse_layers * 3 * config.hidden_size * width * (experts - config.num_experts_per_tok)
        rows = {"transformers (float32)": transformers_rates(path, args.rounds, args.long_context)}
        for name in args.configs:
            rows[f"HyperServe {name}"] = hyperserve_rates(path, name, args.rounds, args.long_context)
    baseline = rows["transformers (float32)"]
    print(f"\n{header}\n{args.shape}, random weights: {total / 1e9:.2f}B parameters, "
          f"{active / 1e9:.2f}B active a token\n")
    long = f" decode tok/s after {args.long_context} |" if args.long_context else ""
    print(f"| system | decode tok/s, 1 stream | decode tok/s, 8 streams | prefill 512 tok/s |{long}")
    print("|---|---|---|---|" + ("---|" if long else ""))
    for name, rate in rows.items():
        ratio = "" if rate is baseline else f" ({rate['decode 1'] / baseline['decode 1']:.2f}x)"
        cells = f"| {name} | {rate['decode 1']:.1f}{ratio} | {rate['decode 8']:.1f} | {rate['prefill']:.0f} |"
        if long:
            long_ratio = "" if rate is baseline else f" ({rate['decode long'] / baseline['decode long']:.2f}x)"
            cells += f" {rate['decode long']:.1f}{long_ratio} |"
        print(cells)


if __name__ == "__main__":
    main()
