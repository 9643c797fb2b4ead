"""Drafting the tokens a grammar forces (jump-forward decoding): single-stream decode speed of
constrained requests with `speculative_forced_tokens` on (the default) and off.

A JSON schema forces its keys and punctuation, a tool call its opening and the function's name
once it is known, a regex its literal text. With the option on, those tokens are drafted and
verified in one step (a row each) instead of one step each. Both engines are loaded at once and
each request runs on each in turn, --rounds times (a shared VM drifts within minutes); greedy, so
the answers must be the same, and they are checked. Decode time: first token to the last.

    python benchmarks/forced_tokens.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from benchmarks.structured import SCHEMA as EMPLOYEES  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.sampling_params import StructuredOutputs  # noqa: E402
from hyperserve.server import tools  # noqa: E402
from hyperserve.server.protocol import Tool  # noqa: E402

PERSON = {"type": "object", "required": ["name", "age", "city", "hobbies"], "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 20},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}
VERDICT = r"Verdict: (yes|no)\. Confidence: \d{1,2} ?%\. Reason: [a-z ]{5,60}\."
TOOLS = [Tool.model_validate({"type": "function", "function": {
    "name": name, "description": description, "parameters": {"type": "object", "required": list(properties),
                                                             "properties": properties}}})
    for name, description, properties in [
        ("get_weather", "The current weather in a city", {"city": {"type": "string", "maxLength": 40},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}}),
        ("get_time", "The time in a timezone", {"tz": {"type": "string", "maxLength": 40}})]]
WORKLOADS = [  # (name, question, constraint)
    ("JSON: a person", "Describe a fictional person as JSON.", StructuredOutputs(json=json.dumps(PERSON))),
    ("JSON: 20+ employees", "List 20 employees of a company with their name, age, city, e-mail and role, as JSON.",
     StructuredOutputs(json=json.dumps(EMPLOYEES))),
    ("tool call (hermes)", "What is the weather in Paris?", tools.tool_constraint(TOOLS, "required", False)),
    ("tool call (qwen3_coder XML)", "What is the weather in Paris?",
     tools.tool_constraint(TOOLS, "required", False, tools.FORMATS["qwen3_coder"])),
    ("regex", "Is water wet?", StructuredOutputs(regex=VERDICT)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--json", default="benchmarks/results/forced_tokens.json")
    args = parser.parse_args()
    engines = {on: LLM(max_model_len=2048, kv_cache_memory_gb=0.5, speculative_forced_tokens=on)
               for on in (False, True)}
    for llm in engines.values():
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    times = {(name, on): [] for name, _, _ in WORKLOADS for on in engines}
    answers, drafts = {}, {}
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds} ...", flush=True)
        for name, question, constraint in WORKLOADS:
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)
            for on, llm in engines.items():
                out = llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0]
                times[(name, on)].append(out.metrics.finished_time - out.metrics.first_token_time)
                answers[(name, on)] = out.outputs[0].token_ids
                drafts[(name, on)] = (out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens)
    for llm in engines.values():
        llm.close()
    print(f"\n{cpu_header(os.cpu_count())}; greedy, one request at a time, medians of {args.rounds} rounds\n")
    print("| constrained request | output tokens | decode ms, one token a step | forced drafts | speedup "
          "| forced tokens drafted / accepted | same answer |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name, _, _ in WORKLOADS:
        off, on = (statistics.median(times[(name, flag)]) * 1000 for flag in (False, True))
        same = answers[(name, False)] == answers[(name, True)]
        drafted, accepted = drafts[(name, True)]
        print(f"| {name} | {len(answers[(name, True)])} | {off:.0f} | {on:.0f} | **{off / on:.2f}x** | "
              f"{drafted} / {accepted} | {'yes' if same else 'NO'} |")
        results[name] = {"tokens": len(answers[(name, True)]), "off_ms": off, "on_ms": on, "drafted": drafted,
                         "accepted": accepted, "same": same}
    with open(args.json, "w") as f:
        json.dump({"machine": cpu_header(os.cpu_count()), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
