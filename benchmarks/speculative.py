"""Speculative decoding, single stream on SmolLM2-135M: tokens/s with each method vs none.

Four workloads of greedy requests, run one at a time:
  (a) input-grounded: rewrite, extract or continue a given text or code (output repeats input)
  (b) open chat
  (c) templated extraction: one instruction, a different sentence each time (answers alike)
  (d) asked again: each prompt of (a) and (b) right after its first ask (a retry, an agent's loop)
n-gram lookups also search earlier requests' answers (OutputHistory). (a) and (b) forget them
before each prompt, so they measure what a request's own text gives, as earlier steps did; (c)
keeps them within a round; (d) measures the second ask only.
Every method has its own engine, all loaded at once, and each prompt runs on each of them in turn,
for --rounds rounds: a shared VM's drift (10-20% within minutes) then falls on every method alike,
where a run of one method after another measured it. Decode tokens/s counts output tokens after
the first over the time from the first token to the last, so prefill time (the same for all) is
left out. --ignore-eos keeps every answer going to --max-tokens; past its answer SmolLM2 goes on
to invent a new conversation, which is no longer input-grounded, so --no-ignore-eos (stop where
the model stops) measures the grounded workload as users get it. The last column is the share of
accepted drafts that came from earlier answers (/metrics' by-source counts).

    python benchmarks/speculative.py [--max-tokens 128] [--num-tokens N] [--rounds 2] [--no-ignore-eos]
        [--methods none ngram ngram-own self self:27 prediction ngram+prediction] [--workloads a b c d]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODE = '''def parse_config(path):
    with open(path) as f:
        lines = f.readlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
'''
TEXT = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin covers seven "
        "million square kilometres, of which five and a half million are covered by the rainforest. The "
        "region includes territory belonging to nine nations. The majority of the forest is contained "
        "within Brazil, with 60% of "
        "the rainforest, followed by Peru with 13%, and Colombia with 10%.")

PEOPLE = ["Maria Lopez is 34 and lives in Madrid.", "John Smith, 51, moved to Toronto last year.",
          "Aiko Tanaka (27) works in Osaka.", "Pierre Dubois is a 45-year-old teacher from Lyon.",
          "Fatima Khan, aged 38, lives in Lahore.", "Lars Jensen is 29 and lives in Copenhagen.",
          "Olga Ivanova, 62, retired to Sochi.", "Ken Adams is 40; he lives in Denver."]
EXTRACT = [f"Extract the person's name, age and city from this sentence as a JSON object with keys name, age "
           f"and city:\n\n{person}" for person in PEOPLE]
GROUNDED = [
    f"Rename the function parse_config to load_settings and output the complete code:\n\n{CODE}",
    f"Add a docstring to this function and output the complete code:\n\n{CODE}",
    f"Repeat the following paragraph exactly:\n\n{TEXT}",
    f"Rewrite the following paragraph, replacing 'rainforest' with 'jungle':\n\n{TEXT}",
]
CHAT = [
    "Tell me a short story about a robot who learns to paint.",
    "What are the benefits of regular exercise?",
    "Explain how a hash table works.",
    "Give me three tips for learning a new language.",
]


def engine(method: str, num_tokens: int | None):
    from hyperserve import LLM, SamplingParams

    speculative = None
    method = method.removesuffix("+prediction")
    if method not in ("none", "prediction"):
        name, _, layers = method.partition(":")
        speculative = {"method": name.removesuffix("-own"),
                       **({"num_tokens": num_tokens} if num_tokens else {}),
                       **({"num_layers": int(layers)} if layers else {}),
                       **({"history_tokens": 0} if name == "ngram-own" else {})}  # own text only
    llm = LLM(max_model_len=2048, kv_cache_memory_gb=0.5, speculative=speculative)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm


WORKLOADS = {"(a) input-grounded": (GROUNDED, "fresh"), "(b) open chat": (CHAT, "fresh"),
             "(c) templated extract": (EXTRACT, "kept"), "(d) asked again": (GROUNDED + CHAT, "again")}


def forget_answers(llm) -> None:
    history = getattr(llm.engine.speculator.proposer, "history", None)
    if history is not None:
        history.clear()


def run(methods: list[str], workloads: dict[str, tuple[list[str], str]], max_tokens: int,
        num_tokens: int | None, rounds: int, ignore_eos: bool) -> dict:
    from hyperserve import SamplingParams

    engines = {method: engine(method, num_tokens) for method in methods}
    plain = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    # tokens, s, drafted, accepted, steps, accepted from earlier answers
    totals = {(m, w): [0, 0.0, 0, 0, 0, 0] for m in methods for w in workloads}
    for round_ in range(rounds):
        print(f"round {round_ + 1}/{rounds} ...", flush=True)
        for workload, (prompts, answers) in workloads.items():
            for llm in engines.values():
                forget_answers(llm)
            for prompt in prompts:
                for method, llm in engines.items():
                    params = plain
                    if method.endswith("prediction"):  # the text the prompt gives, as the expected answer
                        given = next((t for t in (CODE, TEXT) if t in prompt), None)
                        params = replace(plain, prediction=given)
                    if answers == "fresh":
                        forget_answers(llm)
                    elif answers == "again":
                        llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
                    spec = llm.engine.scheduler.spec_stats
                    steps, from_history = spec.num_drafts, spec.by_source.get("history", [0, 0])[1]
                    out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
                    m, total = out.metrics, totals[(method, workload)]
                    total[0] += len(out.outputs[0].token_ids) - 1
                    total[1] += m.finished_time - m.first_token_time
                    total[2] += m.num_draft_tokens
                    total[3] += m.num_accepted_tokens
                    total[4] += spec.num_drafts - steps
                    total[5] += spec.by_source.get("history", [0, 0])[1] - from_history
    # what the engine timed at start: one more token in a step, relative to a one-token step
    results = {method: {"verify_cost": engines[method].engine.speculator.verify_cost} for method in methods}
    for (method, workload), (tokens, seconds, drafted, accepted, steps, from_history) in totals.items():
        results[method][workload] = {
            "output_tokens": tokens,
            "decode_tps": tokens / seconds,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / steps if steps else None,
            "draft_tokens": drafted,
            "from_history": from_history / accepted if accepted else None,  # of the accepted drafts
        }
    for llm in engines.values():
        llm.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-tokens", type=int, default=None,
                        help="draft tokens per step at most (default: the method's, 16 for ngram, 4 else)")
    parser.add_argument("--methods", nargs="+", default=["none", "ngram", "self", "self:27"],
                        help="none, ngram, ngram-own (no earlier answers), self or self:N (the target's "
                             "first N layers draft); prediction (input-grounded prompts predict the text "
                             "they give, as OpenAI's Predicted Outputs) or METHOD+prediction")
    parser.add_argument("--rounds", type=int, default=2, help="each prompt on each method this many times")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="go on to --max-tokens past the model's end of answer (default)")
    parser.add_argument("--workloads", nargs="+", default=["a", "b", "c", "d"], choices=["a", "b", "c", "d"])
    parser.add_argument("--json", default="benchmarks/results/speculative.json")
    args = parser.parse_args()
    workloads = {name: WORKLOADS[name] for name in WORKLOADS if name[1] in args.workloads}
    results = run(args.methods, workloads, args.max_tokens, args.num_tokens, args.rounds, args.ignore_eos)
    from benchmarks.cpu_vs_llamacpp import cpu_header

    print(f"\n{cpu_header(os.cpu_count())}; {args.rounds} alternating rounds, ignore_eos={args.ignore_eos}")

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    print("verify cost (one more token in a step / a one-token step), timed at start: "
          + ", ".join(f"{method} {fmt(r['verify_cost'], '.2f')}" for method, r in results.items()
                      if method != "none"))
    print(f"{'workload':<24}{'method':<18}{'decode tok/s':>14}{'speedup':>9}{'accept rate':>13}"
          f"{'mean len':>10}{'from earlier answers':>22}")
    for workload in workloads:
        base = results["none"][workload]["decode_tps"] if "none" in results else None
        for method, by_workload in results.items():
            r = by_workload[workload]
            speedup = r["decode_tps"] / base if base else None
            print(f"{workload:<24}{method:<18}{r['decode_tps']:>14.1f}{fmt(speedup, '.2f'):>9}"
                  f"{fmt(r['acceptance_rate'], '.2f'):>13}{fmt(r['mean_accepted_length'], '.2f'):>10}"
                  f"{fmt(r['from_history'], '.0%'):>22}")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
