"""How fast n-gram speculation could be, by what one more token costs a step (the verify cost).

Runs benchmarks/speculative.py's greedy prompts (input-grounded and open chat) once per verify
cost, with the engine's verify cost fixed at that value (so it picks k per proposal as it would on
hardware where a row costs that much), and counts the steps: a plain decode step costs 1 and a
verify step of k drafts 1 + k * cost. The modelled speed-up is decode tokens over that sum. Greedy
output is deterministic, so the counts are exact and free of a shared VM's noise; what it leaves
out is the host work per step, and a real step's cost is only roughly linear in its rows
(BENCHMARKS.md, sixteenth step: 2 to 5 rows cost 1.2, 1.4, 1.8 and 2.2 one-row steps here).

The `oracle k` columns bound what any choice of k can reach with the same lookup: the greedy
answers are decoded once without speculation, and each proposal then drafts exactly the tokens of
its continuation that the target would accept (up to num_speculative_tokens), none where it would
accept none. Where even that stays under 2x at a CPU's verify cost, no k policy reaches 2x there.
The `any occurrence` columns bound a better choice of match as well: each proposal takes, of every
earlier occurrence of the last ngram_min tokens, the continuation the target accepts furthest.

    python benchmarks/speculative_bound.py [--costs 0.05 0.1 0.2 0.3] [--max-tokens 256]
        [--options '{"num_tokens": 4, "ngram_max": 4}']   # other speculative settings, same costs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from benchmarks.speculative import CHAT, GROUNDED  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.config import SpeculativeConfig  # noqa: E402
from hyperserve.engine.speculative import NgramProposer  # noqa: E402


def modelled_speedup(llm: LLM, prompts: list[str], max_tokens: int, cost: float) -> tuple[float, float]:
    """(modelled speed-up over no speculation, tokens per verify step) for these prompts."""
    stats = llm.engine.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    decoded = sum(len(llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0].outputs[0].token_ids) - 1
                  for p in prompts)
    steps, drafted, accepted = (now - then for now, then in zip(
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
    plain = decoded - steps - accepted  # every other token took a step of its own
    return decoded / (plain + steps + cost * drafted), (steps + accepted) / max(steps, 1)


def greedy_answers(prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of each prompt, decoded without speculation."""
    llm = LLM(max_model_len=2048, kv_cache_memory_gb=0.5)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0] for p in prompts]
    llm.close()
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]


def oracle_speedup(answers: list[tuple[list[int], list[int]]], cost: float, options: dict,
                   any_occurrence: bool = False) -> float:
    """Modelled speed-up when each proposal drafts exactly what the target accepts of it: of the
    lookup's continuation, or (`any_occurrence`) of the best of all earlier occurrences' ones."""
    config = SpeculativeConfig(speculative_method="ngram")
    proposer = NgramProposer(options.get("ngram_min", config.ngram_min), options.get("ngram_max", config.ngram_max))
    limit = options.get("num_tokens", config.num_speculative_tokens)
    decoded, steps = 0, 0.0
    for prompt, output in answers:
        tokens, i = prompt + output[:1], 1  # the first output token comes from the prefill
        while i < len(output):
            if any_occurrence:
                continuations = continuations_of(tokens, proposer.ngram_min, limit)
            else:
                continuations = [proposer.lookup(tokens, limit)[1]]
            room = len(output) - i - 1
            accepted = max((accepted_length(c[:room], output[i:]) for c in continuations), default=0)
            steps += 1 + cost * accepted
            tokens += output[i:i + accepted + 1]
            i += accepted + 1
        decoded += len(output) - 1
    return decoded / steps


def continuations_of(tokens: list[int], n: int, k: int) -> list[list[int]]:
    """The k tokens after every earlier occurrence of the last n tokens."""
    suffix = tokens[-n:]
    return [tokens[s + n:s + n + k] for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]


def accepted_length(draft: list[int], target: list[int]) -> int:
    """How many of the draft's first tokens the target's own tokens confirm."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.2, 0.3])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--options", default="{}", help="speculative settings (JSON) besides method and verify_cost")
    args = parser.parse_args()
    options = json.loads(args.options)
    print(cpu_header(os.cpu_count()))
    print(f"n-gram speculation {options or '(defaults)'}, greedy, up to {args.max_tokens} tokens, stopping at EOS")
    answers = {name: greedy_answers(prompts, args.max_tokens) for name, prompts in (("grounded", GROUNDED),
                                                                                     ("chat", CHAT))}
    print("| verify cost | input-grounded | tokens a verify step | oracle k | any occurrence | open chat "
          "| tokens a verify step | oracle k | any occurrence |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cost in args.costs:
        llm = LLM(max_model_len=2048, kv_cache_memory_gb=0.5,
                  speculative={"method": "ngram", "verify_cost": cost, **options})
        grounded = modelled_speedup(llm, GROUNDED, args.max_tokens, cost)
        chat = modelled_speedup(llm, CHAT, args.max_tokens, cost)
        llm.close()
        oracle = {name: oracle_speedup(answers[name], cost, options) for name in answers}
        anywhere = {name: oracle_speedup(answers[name], cost, options, any_occurrence=True) for name in answers}
        print(f"| {cost:.2f} | {grounded[0]:.2f}x | {grounded[1]:.2f} | {oracle['grounded']:.2f}x "
              f"| {anywhere['grounded']:.2f}x | {chat[0]:.2f}x | {chat[1]:.2f} | {oracle['chat']:.2f}x "
              f"| {anywhere['chat']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
