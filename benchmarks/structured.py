"""Structured output's cost: 16 concurrent requests, half constrained by a JSON schema, against
the same 16 unconstrained; and the time to compile a schema, first and cached.

Every request decodes exactly --max-tokens tokens (the free ones ignore EOS; the schema asks for a
list long enough not to finish first), so both runs do the same work and the difference is the
grammar's: masks computed per step (overlapped with the forward pass), applied in the sampler, and
the matchers advanced. Default engine configuration (int4 for SmolLM2's GGUF on the CPU).

    python benchmarks/structured.py [--max-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from hyperserve import LLM  # noqa: E402
from hyperserve.engine.structured_output import GrammarCompiler  # noqa: E402
from hyperserve.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402

SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 20, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20}, "email": {"type": "string", "format": "email"},
        "role": {"enum": ["engineer", "designer", "manager", "analyst"]}},
    "required": ["name", "age", "city", "email", "role"]}}}, "required": ["people"]}
PROMPTS = [f"List {n} employees of a company with their name, age, city, e-mail and role, as JSON."
           for n in range(20, 36)]


def run(llm: LLM, constrained: int, max_tokens: int) -> dict:
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, ignore_eos=i >= constrained,
                             structured_outputs=StructuredOutputs(json=SCHEMA) if i < constrained else None)
              for i in range(len(prompts))]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed}


def compile_times(llm: LLM) -> dict:
    engine = llm.engine
    fresh = GrammarCompiler(engine.tokenizer, engine.hf_config.vocab_size, engine.grammars.eos_token_id)
    started = time.perf_counter()
    fresh.llg_tokenizer  # noqa: B018 (built once per engine)
    tokenizer_s = time.perf_counter() - started
    constraint = StructuredOutputs(json={**SCHEMA, "title": "fresh"})
    started = time.perf_counter()
    fresh.grammar(constraint)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(100):
        fresh.grammar(constraint)
    cached_s = (time.perf_counter() - started) / 100
    grammar = fresh.grammar(constraint)
    rows = [(fresh.grammar(constraint), []) for _ in range(8)]
    started = time.perf_counter()
    for _ in range(20):
        fresh.start_masks(rows).result()
    masks_s = (time.perf_counter() - started) / 20
    del grammar
    return {"tokenizer_ms": tokenizer_s * 1e3, "first_compile_ms": first_s * 1e3, "cached_ms": cached_s * 1e3,
            "masks_8_rows_ms": masks_s * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="medians of this many alternating runs")
    parser.add_argument("--json", default="benchmarks/results/structured.json")
    args = parser.parse_args()
    print(cpu_header(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))))
    llm = LLM("smollm2-135m")
    run(llm, 8, 8)  # warm up: kernels, the grammar compiler's tokenizer, the schema
    runs: dict[str, list[dict]] = {"16 free": [], "8 JSON schema + 8 free": []}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds} ...", flush=True)
        runs["16 free"].append(run(llm, 0, args.max_tokens))
        runs["8 JSON schema + 8 free"].append(run(llm, 8, args.max_tokens))
    results = {name: {"output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                      "tokens": rs[0]["tokens"]} for name, rs in runs.items()}
    base = results["16 free"]["output_tok_s"]
    print(f"\n{'16 concurrent requests':<26}{'output tok/s':>14}{'tokens':>8}{'vs free':>9}")
    for name, r in results.items():
        print(f"{name:<26}{r['output_tok_s']:>14.1f}{r['tokens']:>8}{r['output_tok_s'] / base:>9.3f}")
    compile_ = compile_times(llm)
    print(f"\nllguidance tokenizer (once per engine): {compile_['tokenizer_ms']:.0f} ms; schema compile: first "
          f"{compile_['first_compile_ms']:.1f} ms, cached {compile_['cached_ms']:.3f} ms; masks for 8 rows "
          f"{compile_['masks_8_rows_ms']:.2f} ms")
    with open(args.json, "w") as f:
        json.dump({"machine": cpu_header(os.cpu_count()), "args": vars(args), "results": results,
                   "compile": compile_}, f, indent=2)


if __name__ == "__main__":
    main()
