"""Trains the prompt-injection classifier: logistic regression (L2, Newton's method) on
all-MiniLM-L6-v2 embeddings of data/prompt_injection.jsonl's train split; writes
hyperserve/security/injection_classifier.npz and prints held-out precision and recall.

    python scripts/train_injection_classifier.py
"""

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyperserve.common.embedder import Embedder  # noqa: E402
from hyperserve.security.injection import WEIGHTS  # noqa: E402


def load(split: str) -> tuple[list[str], np.ndarray]:
    rows = [json.loads(line) for line in (ROOT / "data" / "prompt_injection.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == split]
    return [r["text"] for r in rows], np.array([r["label"] for r in rows], dtype=np.float64)


def fit(x: np.ndarray, y: np.ndarray, l2: float = 1.0, steps: int = 25) -> tuple[np.ndarray, float]:
    """Newton's method on the L2-regularised log-loss (the bias is not regularised)."""
    xb = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(xb.shape[1])
    penalty = np.full(xb.shape[1], l2)
    penalty[-1] = 0.0
    for _ in range(steps):
        p = 1 / (1 + np.exp(-xb @ w))
        gradient = xb.T @ (p - y) + penalty * w
        hessian = (xb * (p * (1 - p))[:, None]).T @ xb + np.diag(penalty)
        w -= np.linalg.solve(hessian, gradient)
    return w[:-1], float(w[-1])


def main() -> None:
    embedder = Embedder()
    texts, y = load("train")
    coef, bias = fit(embedder.embed(texts).astype(np.float64), y)
    np.savez(WEIGHTS, coef=coef.astype(np.float32), bias=np.float32(bias))
    test_texts, test_y = load("test")
    predicted = (embedder.embed(test_texts) @ coef + bias) >= 0
    tp = int((predicted & (test_y == 1)).sum())
    print(f"wrote {WEIGHTS}; held-out precision {tp / max(1, predicted.sum()):.3f}, "
          f"recall {tp / max(1, (test_y == 1).sum()):.3f}")


if __name__ == "__main__":
    main()
