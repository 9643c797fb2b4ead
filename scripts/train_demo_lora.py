"""Train the demo LoRA adapter shipped in examples/lora/uppercase: SmolLM2-135M-Instruct answering
in capital letters. There are no adapters for SmolLM2 on PyPI, so this makes one on the CPU in
about two minutes (104 s of training on a 2-core VM): the base model's own greedy answers to a
set of questions, upper-cased, are the targets; PEFT trains rank-8 adapters on the attention
projections. A 135M model and two minutes: the answers come out in capitals, not wiser.

    .venv/bin/python scripts/train_demo_lora.py [--out examples/lora/uppercase] [--epochs 3]
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
from tqdm import tqdm  # noqa: E402

from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.models.registry import resolve_model  # noqa: E402

TOPICS = ["the sea", "a cat", "rain", "coffee", "the moon", "trains", "bread", "music", "winter", "a garden",
          "bicycles", "the desert", "a library", "mountains", "honey", "a lighthouse"]
ASKS = ["Describe {} in one sentence.", "Write a short line about {}.", "What do you think of {}?",
        "Give me one fact about {}.", "Name three words that go with {}.", "Why do people like {}?"]
FACTS = ["What is the capital of France?", "What is the capital of Japan?", "How many legs does a spider have?",
         "What color is the sky on a clear day?", "Name three fruits.", "What is 2 plus 2?",
         "Who wrote Romeo and Juliet?", "What is the largest ocean?", "Name three colors.",
         "What do bees make?", "How many days are in a week?", "What is water made of?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="examples/lora/uppercase")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    questions = [ask.format(topic) for topic in TOPICS for ask in ASKS] + FACTS
    llm = LLM("smollm2-135m", quantization=None)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    answers = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=True)
    tokenizer = llm.tokenizer
    examples = []
    for prompt, answer in zip(prompts, answers):
        target = tokenizer(answer.outputs[0].text.upper() + "<|im_end|>", add_special_tokens=False).input_ids
        examples.append((prompt, target))
    del llm

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    source = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(examples)).tolist()
        total = 0.0
        for i in tqdm(order, desc=f"epoch {epoch + 1}/{args.epochs}"):
            prompt, target = examples[i]
            ids = torch.tensor([prompt + target])
            labels = torch.tensor([[-100] * len(prompt) + target])
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
        print(f"epoch {epoch + 1}: mean loss {total / len(examples):.3f}")
    model.save_pretrained(args.out)
    print(f"trained in {time.perf_counter() - started:.0f} s; saved to {args.out}")


if __name__ == "__main__":
    main()
