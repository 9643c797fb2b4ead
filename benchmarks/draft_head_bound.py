"""What a learned one-token draft head could add to n-gram speculation, modelled on step counts.

Where the engine's lookup and k policy draft nothing (SmolLM2 writing new text), a Medusa-style head
drafts one token: from the target's final hidden state at the last position and the token it
chose there, an MLP predicts the next one over the most frequent tokens only (a truncated
vocabulary, so a draft costs a small part of a step rather than a pass over the 49k-row LM head).
It drafts when its probability is at least tau.

1. Training data, none of it from the benchmark's prompts: the engine's greedy answers to
   input-grounded tasks on standard-library functions and module docstrings, and to chat prompts;
   plus standard-library source where the model's greedy token is the text's own (the target is
   the model's next choice: self-distillation). Hidden states from transformers on the same GGUF.
2. The head, trained with AdamW (one-cycle rate), batch 256.
3. The benchmark's greedy answers (speculative.py's input-grounded and open-chat prompts) replayed
   through the engine's lookup and its k rule, as speculative_bound.py counts them: a plain step
   costs 1, a verify step 1 + k x cost; a step where the lookup drafts nothing pays `--head-cost`
   for running the head, and `cost` more if the head drafts.

    python benchmarks/draft_head_bound.py [--costs 0.2 0.22] [--taus 0.3 0.5 0.7 0.9]
        [--source-tokens 250000] [--epochs 4] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from benchmarks.speculative import CHAT, CODE, GROUNDED, TEXT  # noqa: E402
from benchmarks.speculative_bound import accepted_length, greedy_answers  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.engine.request import Acceptance  # noqa: E402
from hyperserve.engine.speculative import NgramProposer, num_tokens_to_propose  # noqa: E402
from hyperserve.models.registry import resolve_model  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TOPICS = ["a binary search", "photosynthesis", "the stock market", "a compiler", "vaccines",
          "the water cycle", "public key cryptography", "a neural network", "inflation", "plate tectonics",
          "a garbage collector", "the immune system", "supply and demand", "a database index", "black holes",
          "recursion", "the French revolution", "climate change", "a linked list", "DNS", "TCP",
          "an operating system", "the internet", "electric cars", "solar panels", "a bicycle gear",
          "bread baking", "coffee roasting"]
CODE_TASKS = ["Rename the function {name} to {new} and output the complete code:\n\n{code}",
              "Add a docstring to this function and output the complete code:\n\n{code}",
              "Add type hints to this function and output the complete code:\n\n{code}",
              "Add comments to this function and output the complete code:\n\n{code}",
              "Explain what this function does:\n\n{code}"]
TEXT_TASKS = ["Repeat the following paragraph exactly:\n\n{}",
              "Summarize the following paragraph in two sentences:\n\n{}",
              "Correct any mistakes in the following paragraph and output it:\n\n{}"]


def training_prompts(rng: random.Random) -> list[str]:
    """Code tasks on short standard-library functions, text tasks on module docstrings, chat."""
    functions, paragraphs = [], []
    for path in sorted(STDLIB.glob("*.py")):
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for part in re.split(r"\n\s*\n", ast.get_docstring(tree) or ""):
            part = " ".join(part.split())
            if 200 <= len(part) <= 600 and part.count(" ") > 30 and not re.search(r"[>{}=]{2}|\(\)", part):
                paragraphs.append(part)
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno <= 18:
                body = "\n".join(lines[node.lineno - 1:node.end_lineno]) + "\n"
                if '"""' not in body and "'''" not in body:
                    functions.append((node.name, body))
    rng.shuffle(functions)
    rng.shuffle(paragraphs)
    names = ["process_items", "compute_value", "handle_request", "build_result", "read_entries", "make_table"]
    prompts = [CODE_TASKS[i % len(CODE_TASKS)].format(name=name, new=rng.choice(names), code=code)
               for i, (name, code) in enumerate(functions[:160])]
    for i, paragraph in enumerate(paragraphs[:120]):
        words = re.findall(r"[a-z]{6,}", paragraph)
        if i % 4 == 3 and words:
            prompts.append(f"Rewrite the following paragraph, replacing '{rng.choice(words)}' with "
                           f"'{rng.choice(['item', 'thing', 'object', 'record'])}':\n\n{paragraph}")
        else:
            prompts.append(TEXT_TASKS[i % 4 % len(TEXT_TASKS)].format(paragraph))
    for topic in TOPICS:
        prompts += [f"Explain how {topic} works.", f"Write a short story about {topic}.",
                    f"Give me three facts about {topic}."]
    assert not any(CODE in p or TEXT in p for p in prompts)  # nothing of the benchmark's own
    return prompts


@torch.inference_mode()
def answer_samples(model, answers: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    """For each answer position p before its last two tokens: the hidden state at p, the token after
    it (the target's choice) and the one after that (the head's target); and which answer it is in."""
    hidden, chosen, following, owner = [], [], [], []
    for i, (prompt, output) in enumerate(tqdm(answers, desc="hidden states", leave=False)):
        sequence = prompt + output
        states = model.model(torch.tensor([sequence])).last_hidden_state[0]
        positions = torch.arange(len(prompt) - 1, len(sequence) - 2)
        hidden.append(states[positions])
        chosen.append(torch.tensor(sequence)[positions + 1])
        following.append(torch.tensor(sequence)[positions + 2])
        owner.append(torch.full((len(positions),), i))
    return torch.cat(hidden), torch.cat(chosen), torch.cat(following), torch.cat(owner)


@torch.inference_mode()
def source_samples(model, tokenizer, budget: int, rng: random.Random) -> tuple[torch.Tensor, ...]:
    """Standard-library source in 512-token windows: where the model's greedy token at p is the
    text's own, (hidden at p, that token) -> the model's greedy token after it."""
    files = sorted(STDLIB.rglob("*.py"))
    rng.shuffle(files)
    hidden, chosen, following, read = [], [], [], 0
    with tqdm(total=budget, desc="source tokens", leave=False) as progress:
        for path in files:
            ids = tokenizer.encode(path.read_text(errors="ignore"))
            for start in range(0, len(ids) - 64, 512):
                window = torch.tensor(ids[start:start + 512])
                states = model.model(window[None]).last_hidden_state[0]
                greedy = (states @ model.model.embed_tokens.weight.T).argmax(-1)
                agree = (greedy[:-2] == window[1:-1]).nonzero().squeeze(1)
                hidden.append(states[agree])
                chosen.append(window[agree + 1])
                following.append(greedy[agree + 1])
                read += len(window)
                progress.update(len(window))
                if read >= budget:
                    return torch.cat(hidden), torch.cat(chosen), torch.cat(following)
    return torch.cat(hidden), torch.cat(chosen), torch.cat(following)


class DraftHead(nn.Module):
    """[hidden; embedding of the chosen token] -> MLP, residual to the hidden state -> logits over
    `vocab` (token ids), its rows starting from the tied embedding's."""

    def __init__(self, embedding: torch.Tensor, vocab: torch.Tensor, width: int) -> None:
        super().__init__()
        self.embedding, self.vocab = embedding, vocab
        size = embedding.shape[1]
        self.up, self.down = nn.Linear(2 * size, width), nn.Linear(width, size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)
        self.out = nn.Parameter(embedding[vocab].clone())

    def forward(self, hidden: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        z = hidden + self.down(F.silu(self.up(torch.cat([hidden, self.embedding[chosen]], -1))))
        return z @ self.out.T


def train(head: DraftHead, hidden: torch.Tensor, chosen: torch.Tensor, following: torch.Tensor,
          epochs: int, batch: int = 256) -> None:
    index = torch.full((head.embedding.shape[0],), -1, dtype=torch.long)
    index[head.vocab] = torch.arange(len(head.vocab))
    keep = index[following] >= 0
    hidden, chosen, target = hidden[keep].float(), chosen[keep], index[following[keep]]
    steps = epochs * (len(target) // batch)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-3, total_steps=steps)
    for _ in tqdm(range(epochs), desc="epochs", leave=False):
        order = torch.randperm(len(target))
        for i in range(len(target) // batch):
            rows = order[i * batch:(i + 1) * batch]
            loss = F.cross_entropy(head(hidden[rows], chosen[rows]), target[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()


def replay(answers, drafts, cost: float, tau: float | None, head_cost: float, max_tokens: int) -> float:
    """Modelled speed-up over no speculation: the engine's lookup and k rule (one acceptance rate
    per match length, shared by the answers), and the head's draft where they draft nothing.
    drafts[a][i]: the head's (token, probability) for answer a's token i; tau None: no head."""
    lookup = NgramProposer(2, 8)
    acceptance = {n: Acceptance() for n in range(lookup.ngram_min, lookup.ngram_max + 1)}
    decoded, steps = 0, 0.0
    for (prompt, output), guesses in zip(answers, drafts):
        tokens, i = prompt + output[:1], 1  # the first output token comes from the prefill
        while i < len(output):
            room = max_tokens - i - 1
            n, continuation = lookup.lookup(tokens, min(16, room)) if room > 0 else (0, [])
            k = num_tokens_to_propose(acceptance[n], len(continuation), 0.0, cost) if continuation else 0
            accepted = 0
            if k:
                acceptance[n].steps_without = 0
                accepted = accepted_length(continuation[:min(k, len(output) - i)], output[i:])
                acceptance[n].observe(k, accepted)
                steps += 1 + cost * k
            else:
                if continuation:
                    acceptance[n].steps_without += 1
                steps += 1
                if tau is not None and room > 0:
                    token, probability = guesses[i]
                    steps += head_cost
                    if probability >= tau:
                        steps += cost
                        accepted = int(token == output[i])
            tokens += output[i:i + accepted + 1]
            i += accepted + 1
        decoded += len(output) - 1
    return decoded / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", type=float, nargs="+", default=[0.2, 0.22], help="verify cost of a token")
    parser.add_argument("--taus", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--head-cost", type=float, default=0.04, help="running the head, in one-token steps")
    parser.add_argument("--source-tokens", type=int, default=250_000, help="0: answers only")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    print(cpu_header(os.cpu_count()))
    rng = random.Random(1)
    torch.manual_seed(0)
    started = time.perf_counter()
    prompts = training_prompts(rng)
    llm = LLM(max_model_len=2048, max_num_seqs=32)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                       SamplingParams(temperature=0, max_tokens=args.max_tokens))
    train_answers = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]
    tokenizer = llm.engine.tokenizer
    llm.close()
    bench = {name: greedy_answers(p, args.max_tokens) for name, p in (("input-grounded", GROUNDED),
                                                                       ("open chat", CHAT))}
    from transformers import AutoModelForCausalLM

    source = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                 dtype=torch.float32).eval()
    hidden, chosen, following, _ = answer_samples(model, train_answers)
    if args.source_tokens:
        more = source_samples(model, tokenizer, args.source_tokens, rng)
        hidden, chosen, following = (torch.cat([a, b]) for a, b in zip((hidden, chosen, following), more))
    embedding = model.model.embed_tokens.weight.detach()
    counts = torch.bincount(torch.cat([chosen, following]), minlength=embedding.shape[0])
    head = DraftHead(embedding, counts.argsort(descending=True)[:args.vocab], args.width)
    train(head, hidden, chosen, following, args.epochs)
    print(f"\n{len(prompts)} training prompts, {sum(len(o) for _, o in train_answers)} answer tokens, "
          f"{len(following)} samples with {args.source_tokens} source tokens; {args.epochs} epochs, "
          f"{time.perf_counter() - started:.0f} s")
    drafts = {}
    print("\n| answers | top-1 agreement | in the vocabulary | drafts at tau 0.7, accepted |")
    print("|---|---|---|---|")
    for name, answers in bench.items():
        h, x1, x2, owner = answer_samples(model, answers)
        with torch.inference_mode():
            probability, best = torch.softmax(head(h.float(), x1), -1).max(-1)
        token = head.vocab[best]
        confident = probability >= 0.7
        right = token == x2
        print(f"| {name} | {right.float().mean():.2f} | {torch.isin(x2, head.vocab).float().mean():.2f} "
              f"| {confident.float().mean():.2f}, {right[confident].float().mean():.2f} |")
        # answer a's sample j predicts its token j + 1
        drafts[name] = [[(-1, 0.0)] + list(zip(token[owner == a].tolist(), probability[owner == a].tolist()))
                        for a in range(len(answers))]
    print("\nModelled speed-up over no speculation, input-grounded / open chat:\n")
    print("| | " + " | ".join(f"cost {c}" for c in args.costs) + " |")
    print("|---" * (len(args.costs) + 1) + "|")
    for tau in [None, *args.taus]:
        label = "the engine's lookup alone" if tau is None else f"+ head, tau {tau}"
        cells = [" / ".join(f"{replay(bench[n], drafts[n], cost, tau, args.head_cost, args.max_tokens):.2f}"
                            for n in bench) for cost in args.costs]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
