"""Host time to build a step's inputs (`ModelRunner._prepare`: token ids, positions, cache slots,
attention metadata) for an eager forward pass, which the GPU waits for at the start of every step
that no CUDA graph replays: mixed prefill-and-decode steps above all.

Steps of an offline GPU run (1,000 requests of 512 + 256 tokens, 16,384 tokens a step: 31 new
prompts and the sequences decoding beside them), as the CUDA backend takes them (one PrefillBatch
for the prompts); a CPU server's step (a 512-token prompt and 15 decodes). The model is a tiny
random Llama on the CPU: only the host work is timed.

    python benchmarks/step_inputs.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig  # noqa: E402

from hyperserve import LLM  # noqa: E402
from hyperserve.engine.model_runner import SeqChunk  # noqa: E402
from hyperserve.layers.attention import TorchPagedAttention, TritonPagedAttention  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402

BLOCK = 16


def step(num_prompts: int, prompt_len: int, num_decodes: int, context: int, seed: int = 0) -> list[SeqChunk]:
    """New prompts, then decodes at about `context` tokens, each with a scattered block table."""
    rng = random.Random(seed)

    def table(tokens: int) -> list[int]:
        return rng.sample(range(100_000), -(-tokens // BLOCK))

    prompts = [SeqChunk([rng.randrange(1000) for _ in range(prompt_len)], 0, table(prompt_len), 1)
               for _ in range(num_prompts)]
    decodes = [SeqChunk([rng.randrange(1000)], context + i % 256, table(context + 256), 1)
               for i in range(num_decodes)]
    return prompts + decodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as model_dir:
        LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2).save_pretrained(model_dir)
        runner = LLM(model=model_dir, load_format="random", num_kv_blocks=64, block_size=BLOCK,
                     max_model_len=1024).engine.runner  # its pool is never used: only tables are built
    gpu, cpu = TritonPagedAttention(), TorchPagedAttention()
    cases = [("offline GPU step: 32 prompts of 512, 300 decodes", step(32, 512, 300, 600), gpu),
             ("offline GPU step: 31 prompts of 512, 480 decodes", step(31, 512, 480, 600), gpu),
             ("CPU server step: a prompt of 512, 15 decodes", step(1, 512, 15, 300), cpu)]
    flags = cpu_flags()
    print(f"CPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
          f"{os.cpu_count()} cores")
    print("\n| step | tokens | host ms, median | min |\n|---|---|---|---|")
    for name, chunks, backend in cases:
        times = []
        for _ in range(args.repeats + 3):
            started = time.perf_counter()
            runner._prepare(chunks, None, backend)
            times.append(time.perf_counter() - started)
        times = times[3:]
        tokens = sum(len(c.token_ids) for c in chunks)
        print(f"| {name} | {tokens:,} | {1e3 * statistics.median(times):.2f} | {1e3 * min(times):.2f} |")


if __name__ == "__main__":
    main()
