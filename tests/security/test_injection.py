import json
from pathlib import Path

import pytest

from hyperserve.common.embedder import Embedder
from hyperserve.security.injection import InjectionDetector, keyword_baseline

DATA = Path(__file__).parents[2] / "data" / "prompt_injection.jsonl"


def _f1(predicted: list[bool], labels: list[int]) -> float:
    tp = sum(p and y for p, y in zip(predicted, labels))
    precision = tp / max(1, sum(predicted))
    recall = tp / max(1, sum(labels))
    return 2 * precision * recall / max(1e-9, precision + recall)


@pytest.fixture(scope="module")
def held_out():
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    test = [r for r in rows if r["split"] == "test"]
    assert {r["text"] for r in test}.isdisjoint(r["text"] for r in rows if r["split"] == "train")
    return [r["text"] for r in test], [r["label"] for r in test]


def test_classifier_beats_the_keyword_baseline_on_held_out_families(held_out):
    texts, labels = held_out
    detector = InjectionDetector(Embedder())
    ours = [detector.judge(t, p).flagged for t, p in zip(texts, detector.probabilities(texts))]
    baseline = [keyword_baseline(t) for t in texts]
    assert _f1(ours, labels) > _f1(baseline, labels) + 0.1
    assert _f1(ours, labels) >= 0.85


def test_the_embedder_computes_single_threaded_without_limiting_other_threads():
    """Its own OpenMP pool beside the engine's would stop OpenMP spin-waiting (see Embedder)."""
    import torch

    from hyperserve.common.embedder import shared_embedder

    embedder = shared_embedder()
    before = torch.get_num_threads()
    assert embedder._worker.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before
