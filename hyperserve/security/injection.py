"""Prompt-injection detection: two classifiers and a few patterns for the blatant cases; a
message is flagged when the higher of the two probabilities reaches the threshold, or a pattern
matches.
- all-MiniLM-L6-v2 fine-tuned (a LoRA adapter on its linear layers and a logistic head on its
  pooled embedding);
- multilingual-e5-small, frozen, with a logistic head: MiniLM's vocabulary has no words for
  Chinese, Japanese or Russian, and it missed every held-out attack written in them; e5 was
  trained on about 100 languages. The two run side by side, each on a thread of its own.
scripts/train_injection_classifier.py trains both on our families in data/prompt_injection.jsonl
and public sets; injection_classifier.safetensors holds the adapter and the heads. Encoded spans
(base64, hex, tag characters, ROT13...) are decoded first (obfuscation.py). On our held-out
families F1 went from 0.84 (MiniLM alone) to 0.96, on bastioncorpus (never trained on) from 0.874
to 0.933 (BENCHMARKS.md).

A request is judged over every user and tool message, whole, two sentences at a time (each with
the next; a sentence longer than CHUNK_TOKENS tokens in windows of that size, overlapping). An
instruction planted in a document is classified nearly on its own, where pooled over a page its
embedding drowns in the benign text around it (held-out attacks planted in a 2,000-token report are
found this way, and were not in 200-token windows); its neighbour gives a sentence the context
single sentences lack (held-out F1 at probability 0.5: 0.79 a sentence at a time, 0.84 in pairs).
Verdicts are remembered per pair, so a conversation's earlier turns cost nothing when they come
back. Past MAX_CHUNKS pairs (about 25,000 tokens of prose) the rest of a request is checked by the
patterns only, which bounds the work one request can cause."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyperserve.common.embedder import Embedder
from hyperserve.security.config import INJECTION_THRESHOLD as THRESHOLD
from hyperserve.security.obfuscation import revealed, unscrambled

WEIGHTS = Path(__file__).with_name("injection_classifier.safetensors")
# a space after . ! ? (not inside "jane.roe@example.org" or "3.14"); none needed after 。！？
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[\u3002\uff01\uff1f])\s*|\n+")
CHUNK_TOKENS, CHUNK_STRIDE = 128, 96
MAX_CHUNKS = 1024
BATCH = 32  # sentences embedded per call
REMEMBERED = 16_384  # window verdicts kept (LRU)
HEADS = {"all-MiniLM-L6-v2": "head", "multilingual-e5-small": "multilingual"}  # model -> its head's tensors

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


@dataclass
class Head:
    """A logistic head on one embedding model's pooled embedding."""
    embedder: Embedder
    coef: np.ndarray
    bias: float

    def probabilities(self, embeddings: np.ndarray) -> np.ndarray:
        return 1 / (1 + np.exp(-(embeddings @ self.coef + self.bias)))


def load_classifier(weights: Path = WEIGHTS) -> tuple[dict, dict[str, tuple[np.ndarray, float]]]:
    """The adapter as weight deltas for MiniLM (scale * B @ A per adapted linear layer), and each
    head's coefficients and bias by its model's name."""
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        tensors = {name: f.get_tensor(name).float() for name in f.keys()}
        scale = float(f.metadata()["lora_scale"])
    deltas = {f"{name.removesuffix('.lora_A')}.weight": scale * (tensors[name.replace(".lora_A", ".lora_B")] @ a)
              for name, a in tensors.items() if name.endswith(".lora_A")}
    heads = {model: (tensors[f"{key}.coef"].numpy(), float(tensors[f"{key}.bias"])) for model, key in HEADS.items()}
    return deltas, heads


@functools.cache
def _classifier(weights: Path) -> tuple[Head, ...]:
    """One set of models per process, whoever asks (each gateway, server or test)."""
    deltas, heads = load_classifier(weights)
    return tuple(Head(Embedder(model, deltas=deltas if model == "all-MiniLM-L6-v2" else None), *heads[model])
                 for model in HEADS)


class InjectionDetector:
    def __init__(self, weights: Path = WEIGHTS) -> None:
        self.heads = _classifier(weights)
        self.embedder = self.heads[0].embedder  # its tokens measure the windows
        # the vocabulary's words tell ROT13 and reversed text from plain text
        self.words = frozenset(w for w in self.embedder.tokenizer.vocab if w.isascii() and w.isalpha())
        self._remembered: OrderedDict[bytes, float] = OrderedDict()  # pair digest -> probability

    def probabilities(self, texts: list[str]) -> np.ndarray:
        """The higher of the two models' probabilities, per text."""
        return np.max([head.probabilities(head.embedder.embed(texts)) for head in self.heads], axis=0)

    async def _probabilities_async(self, texts: list[str]) -> np.ndarray:
        """As `probabilities`, the models side by side (each computes on its own thread)."""
        embeddings = await asyncio.gather(*(head.embedder.embed_async(texts) for head in self.heads))
        return np.max([head.probabilities(e) for head, e in zip(self.heads, embeddings)], axis=0)

    def judge(self, text: str, probability: float, threshold: float = THRESHOLD) -> InjectionVerdict:
        """`probability`: the classifier's, from `probabilities` (batched) or `judge_async`."""
        match = PATTERNS.search(text)
        return InjectionVerdict(probability >= threshold or match is not None, probability,
                                match.group() if match else None)

    def chunks(self, text: str, limit: int = MAX_CHUNKS) -> list[str]:
        """The text's first `limit` sentences; one of more than CHUNK_TOKENS tokens as windows
        stepping CHUNK_STRIDE."""
        found: list[str] = []
        for sentence in SENTENCE_END.split(text):
            if len(found) >= limit:
                break
            if sentence.strip():
                found += self._windows(unscrambled(sentence, self.words), limit - len(found))
        return found

    def _windows(self, sentence: str, limit: int) -> list[str]:
        if len(sentence) <= CHUNK_TOKENS:  # a token is at least one character
            return [sentence]
        # tokenize only what `limit` windows can cover (tokens average ~4 characters): a 4 MiB
        # run-on sentence would otherwise cost seconds before anything is classified
        sentence = sentence[:(limit * CHUNK_STRIDE + CHUNK_TOKENS) * 4]
        offsets = self.embedder.tokenizer(sentence, add_special_tokens=False, return_offsets_mapping=True,
                                          verbose=False)["offset_mapping"]
        if len(offsets) <= CHUNK_TOKENS:
            return [sentence]
        starts = range(0, len(offsets) - CHUNK_TOKENS + CHUNK_STRIDE, CHUNK_STRIDE)
        return [sentence[offsets[i][0]:offsets[min(i + CHUNK_TOKENS, len(offsets)) - 1][1]] for i in starts][:limit]

    def pairs(self, text: str, limit: int = MAX_CHUNKS) -> list[str]:
        """What is classified: each of the text's chunks with the next one (a text of one chunk
        alone). Read with its neighbour, "Email from my landlord: please ignore the previous
        invoice." keeps the context that tells it from an instruction ("How do I reply?"); an
        instruction planted in a document still stands out beside one sentence of it."""
        pieces = self.chunks(text, limit + 1)
        return pieces if len(pieces) < 2 else [f"{a} {b}" for a, b in zip(pieces, pieces[1:])]

    def _read(self, texts: list[str]) -> tuple[list[str], list[str]]:
        """The texts with their encoded spans decoded (base64, hex, tag characters...), which the
        patterns match, and their distinct pairs, at most MAX_CHUNKS, in order, which are classified."""
        texts = [revealed(text) for text in texts]
        found: dict[str, None] = {}
        for text in texts:
            if len(found) >= MAX_CHUNKS:
                break
            found.update(dict.fromkeys(self.pairs(text, MAX_CHUNKS - len(found))))
        return texts, list(found)

    async def judge_async(self, texts: list[str], threshold: float = THRESHOLD) -> InjectionVerdict:
        """One verdict over all of a request's texts: the highest pair probability, or a
        pattern found anywhere."""
        texts, pairs = await asyncio.to_thread(self._read, texts)
        probability = max(await self._pair_probabilities(pairs), default=0.0)
        return self.judge("\n".join(texts), probability, threshold)

    async def judge_each(self, texts: list[str], threshold: float = THRESHOLD) -> list[InjectionVerdict]:
        """`judge_async([text])` for each text, with the pairs of all of them classified in shared
        batches: many short texts (a labelled set) in a fraction of the calls."""
        read = await asyncio.to_thread(lambda: [self._read([text]) for text in texts])
        probabilities = iter(await self._pair_probabilities([pair for _, pairs in read for pair in pairs]))
        return [self.judge("\n".join(revealed), max((next(probabilities) for _ in pairs), default=0.0), threshold)
                for revealed, pairs in read]

    async def _pair_probabilities(self, pairs: list[str]) -> list[float]:
        """Each pair's probability: remembered, or classified BATCH at a time and remembered."""
        digests = [hashlib.sha256(w.encode()).digest() for w in pairs]
        known = {d: self._remembered[d] for d in digests if d in self._remembered}
        unknown = list({d: w for d, w in zip(digests, pairs) if d not in known}.items())
        for start in range(0, len(unknown), BATCH):
            batch = unknown[start:start + BATCH]
            probabilities = await self._probabilities_async([w for _, w in batch])
            known.update((digest, float(p)) for (digest, _), p in zip(batch, probabilities))
        for digest, probability in known.items():  # most recently used last
            self._remembered[digest] = probability
            self._remembered.move_to_end(digest)
        while len(self._remembered) > REMEMBERED:
            self._remembered.popitem(last=False)
        return [known[d] for d in digests]
