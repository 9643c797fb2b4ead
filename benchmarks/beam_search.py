"""What beam search costs: HyperServe's LLM.beam_search (default configuration: int4, the prefix
cache, every prompt's beams of a round in one batch) against transformers' generate(num_beams=...)
on the same SmolLM2-135M-Instruct weights in float32 (its KV cache reordered as beams move), and
against HyperServe's greedy decoding of the same tokens, for a few prompts at once.

Both searches follow the same rules (tests/test_beam_search.py checks them against each other on
float32 weights); int4 rounds differently from float32, so their answers may differ here. Times are
the fastest of --rounds, each run alternating with the other (a shared VM drifts between minutes).

    python benchmarks/beam_search.py [--widths 2 4 8] [--max-tokens 64] [--prompts 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from hyperserve import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from hyperserve.models.registry import resolve_model  # noqa: E402

PROMPTS = ["The recipe for bread calls for", "Lighthouse keepers on the northern islands kept",
           "In 1969, the first", "The three primary colors are", "A good night's sleep helps",
           "The river flows from the mountains", "My favourite programming language is", "Once upon a time"]


def timed(function, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model("smollm2-135m")
    llm = LLM(max_model_len=1024)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                 dtype=torch.float32).eval()
    prompts = [tokenizer(text).input_ids for text in PROMPTS[: args.prompts]]
    print(f"SmolLM2-135M-Instruct, {len(prompts)} prompts, up to {args.max_tokens} tokens each. "
          f"{cpu_header(torch.get_num_threads())}")
    print("\n| beam width | HyperServe s | transformers s | transformers / HyperServe "
          "| HyperServe greedy s |")
    print("|---|---|---|---|---|")
    for width in args.widths:
        params = BeamSearchParams(width, args.max_tokens)
        best = {"ours": float("inf"), "hf": float("inf"), "greedy": float("inf")}
        for _ in range(args.rounds):
            best["ours"] = min(best["ours"], timed(llm.beam_search, prompts, params, use_tqdm=False)[0])
            greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
            best["greedy"] = min(best["greedy"], timed(llm.generate, prompts, greedy, use_tqdm=False)[0])
            hf = 0.0
            for prompt in prompts:  # one at a time: transformers pads a batch, which changes its answers
                with torch.no_grad():
                    hf += timed(model.generate, torch.tensor([prompt]), num_beams=width,
                                num_return_sequences=width, do_sample=False, max_new_tokens=args.max_tokens,
                                early_stopping=False)[0]
            best["hf"] = min(best["hf"], hf)
        print(f"| {width} | {best['ours']:.2f} | {best['hf']:.2f} | {best['hf'] / best['ours']:.2f} | "
              f"{best['greedy']:.2f} |", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
