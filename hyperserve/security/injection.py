"""Prompt-injection detection: a logistic-regression head on all-MiniLM-L6-v2 sentence embeddings
(trained by scripts/train_injection_classifier.py on data/prompt_injection.jsonl, shipped as
injection_classifier.npz), plus a few patterns for the blatant cases. A message is flagged when
either says so."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyperserve.common.embedder import Embedder

WEIGHTS = Path(__file__).with_name("injection_classifier.npz")

PATTERNS = re.compile(
    r"ignore (?:all |any )?(?:the )?(?:previous|prior|above|earlier) (?:instructions|rules|prompts?)"
    r"|disregard (?:all |everything |the )?(?:previous|prior|above)"
    r"|(?:reveal|print|show|repeat|output) (?:me )?(?:your|the) (?:system|initial|hidden|original) "
    r"(?:prompt|instructions)"
    r"|you are now (?:DAN|in developer mode|jailbroken)|developer mode (?:is )?enabled|system override",
    re.IGNORECASE,
)

# The baseline the classifier must beat: flag any text with one of these words.
KEYWORDS = ("ignore", "instructions", "system prompt", "disregard", "jailbreak", "override", "pretend", "reveal")


def keyword_baseline(text: str) -> bool:
    lowered = text.lower()
    return any(k in lowered for k in KEYWORDS)


@dataclass
class InjectionVerdict:
    flagged: bool
    probability: float
    pattern: str | None


class InjectionDetector:
    def __init__(self, embedder: Embedder, weights: Path = WEIGHTS) -> None:
        data = np.load(weights)
        self.embedder = embedder
        self.coef, self.bias = data["coef"].astype(np.float32), float(data["bias"])

    def probabilities(self, texts: list[str]) -> np.ndarray:
        logits = self.embedder.embed(texts) @ self.coef + self.bias
        return 1 / (1 + np.exp(-logits))

    def judge(self, text: str, probability: float, threshold: float = 0.5) -> InjectionVerdict:
        """`probability`: the classifier's, from `probabilities` (batched) or `judge_async`."""
        match = PATTERNS.search(text)
        return InjectionVerdict(probability >= threshold or match is not None, probability,
                                match.group() if match else None)

    async def judge_async(self, text: str, threshold: float = 0.5) -> InjectionVerdict:
        embedding = (await self.embedder.embed_async([text]))[0]
        probability = float(1 / (1 + np.exp(-(embedding @ self.coef + self.bias))))
        return self.judge(text, probability, threshold)
