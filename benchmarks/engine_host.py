"""The engine's host work that a GPU waits for, timed on the CPU with a tiny random Llama (its
forward passes cost next to nothing, so the host work is what is left):

1. building a step's inputs (`ModelRunner._prepare`: token ids, positions, cache slots, attention
   metadata) for an eager forward pass, at the start of every step no CUDA graph replays (mixed
   prefill-and-decode steps above all): steps of an offline GPU run (1,000 requests of 512 + 256
   tokens, 16,384 tokens a step: 31 new prompts and the sequences decoding beside them) as the
   CUDA backend takes them, and a CPU server's step (a 512-token prompt and 15 decodes);
2. the scheduler and the engine's bookkeeping around a multi-step decode (448 sequences, 8 steps
   per schedule, as an offline H200 run decodes): between two schedules the GPU waits for them.

    python benchmarks/engine_host.py [--repeats 50]
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

from benchmarks.gpu import StepProfile  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
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


def multi_step_host_ms(model_dir: str, num_schedules: int = 16) -> dict[str, float]:
    """Mean host milliseconds per decode step of a multi-step decode at 448 sequences: scheduling,
    and the engine's work after the runner (outputs, stops, prefix-cache hashes)."""
    engine = LLM(model=model_dir, load_format="random", num_kv_blocks=20_000, block_size=BLOCK,
                 max_model_len=1024, max_num_seqs=512, max_num_batched_tokens=16_384,
                 num_scheduler_steps=8).engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=8 * num_schedules + 1, ignore_eos=True)
    for i in range(448):
        engine.add_request(str(i), [rng.randrange(10, 1000) for _ in range(64)], params, final_only=True)
    engine.step()  # the prompts
    profile = StepProfile(engine)
    for _ in range(num_schedules):
        engine.step()
    decode = profile.summary()["decode"]
    return {"schedule": decode["schedule_ms"], "engine": decode["engine_rest_ms"]}


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
        host = [multi_step_host_ms(model_dir) for _ in range(3)]
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
    print("\n| multi-step decode, 448 sequences, 8 steps a schedule | host ms per step, median of 3 runs |")
    print("|---|---|")
    for part in ("schedule", "engine"):
        print(f"| {part} | {statistics.median(h[part] for h in host):.3f} |")


if __name__ == "__main__":
    main()
