"""KV memory of one long sequence on Gemma 3 270M, whose local layers keep only their window.

Prefills a prompt of each --lengths tokens (random token ids) in one engine and reads, at the
end of the prefill, the blocks the sequence holds in each KV group: the 3 global layers' (every
position) and the 15 local layers' (the 512-token window and one step's tokens). "Untrimmed" is
what the same sequence held before, every layer keeping every position. Also prints how many
tokens of context the default pool (4 GB on the CPU) holds for full-attention layers.

    python benchmarks/kv_memory.py [--lengths 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--json", default="benchmarks/results/kv_memory.json")
    args = parser.parse_args()

    import torch

    from hyperserve.engine.engine import LLMEngine
    from hyperserve.models import loader
    from hyperserve.sampling_params import SamplingParams

    print(cpu_header(torch.get_num_threads()))
    engine = LLMEngine.from_kwargs(model=args.model, max_model_len=max(args.lengths) + 16)
    kv, model = engine.kv_cache, engine.runner.model
    hf, config = engine.hf_config, engine.config
    per_token_layer = loader.kv_bytes_per_token(hf, config.model.torch_dtype,
                                                config.cache.kv_cache_dtype) // hf.num_hidden_layers
    num_windowed = sum(model.window_layers) if len(kv.groups) > 1 else 0
    layers = [len(model.window_layers) - num_windowed, num_windowed][: len(kv.groups)]
    block_bytes = [n * per_token_layer * kv.block_size for n in layers]
    print(f"{args.model}: {len(model.window_layers)} layers, groups {layers} layers, window {model.sliding_window}, "
          f"pool blocks {[g.pool.num_blocks for g in kv.groups]} "
          f"({kv.groups[0].pool.num_blocks * kv.block_size} tokens of full context)\n")
    rows = []
    print(f"{'prompt tokens':>14}{'held blocks':>16}{'KV MiB':>10}{'untrimmed MiB':>15}{'ratio':>8}")
    for length in args.lengths:
        prompt = torch.randint(10, 200, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        request_id = f"r{length}"
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        request = engine.scheduler.requests[request_id]
        while request.num_computed_tokens < length:
            engine.step()
        held = [len(g.held(g.tables[request_id])) for g in kv.groups]
        used = sum(h * b for h, b in zip(held, block_bytes))
        untrimmed = kv.num_blocks_for(length) * kv.block_size * per_token_layer * len(model.window_layers)
        while engine.has_unfinished_requests():
            engine.step()
        rows.append({"prompt_tokens": length, "held_blocks": held, "kv_bytes": used, "untrimmed_bytes": untrimmed})
        print(f"{length:>14}{str(held):>16}{used / 2**20:>10.1f}{untrimmed / 2**20:>15.1f}{untrimmed / used:>8.1f}")
    Path(args.json).write_text(json.dumps({"machine": cpu_header(torch.get_num_threads()), "args": vars(args),
                                           "date": time.strftime("%Y-%m-%d"), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
