"""The sampler against plain per-row reference implementations."""

from __future__ import annotations

import torch

from hyperserve.engine.sampler import SamplingBatch, apply_penalties, sample

V = 50


def make_batch(n: int, **overrides) -> SamplingBatch:
    fields = dict(
        temperature=torch.ones(n), top_k=torch.full((n,), V), top_p=torch.ones(n), min_p=torch.zeros(n),
        presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
        output_token_counts=None, prompt_token_mask=None, logit_bias=None, token_bitmask=None,
        generators=[None] * n, num_logprobs=None,
        all_greedy=False, needs_top_k_top_p=True, needs_min_p=True,
    )
    fields.update(overrides)
    return SamplingBatch(**fields)


def reference_allowed(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens that survive min_p, then top_k, then top_p, computed the slow obvious way."""
    probs = torch.softmax(logits, -1)
    allowed = [t for t in range(V) if probs[t] >= min_p * probs.max()]
    allowed.sort(key=lambda t: -logits[t])
    allowed = allowed[:top_k]
    kept_probs = torch.softmax(logits[allowed], -1)
    kept, mass = [], 0.0
    for t, p in zip(allowed, kept_probs.tolist()):
        if mass >= top_p:
            break
        kept.append(t)
        mass += p
    return set(kept)


def test_filters_keep_exactly_the_reference_support():
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 3
    top_k, top_p, min_p = [V, 5, 20, 3], [1.0, 1.0, 0.6, 0.9], [0.0, 0.0, 0.05, 0.2]
    batch = make_batch(4, top_k=torch.tensor(top_k), top_p=torch.tensor(top_p), min_p=torch.tensor(min_p))
    seen: list[set[int]] = [set() for _ in range(4)]
    for seed in range(400):
        batch.generators = [torch.Generator().manual_seed(seed * 4 + i) for i in range(4)]
        for row, token in enumerate(sample(logits, batch).token_ids.tolist()):
            seen[row].add(token)
    for row in range(4):
        expected = reference_allowed(logits[row], top_k[row], top_p[row], min_p[row])
        assert seen[row] <= expected
        if len(expected) <= 5:
            assert seen[row] == expected  # small supports are fully explored in 400 draws


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    batch = make_batch(1, temperature=torch.tensor([0.7]), top_k=torch.tensor([4]), needs_top_k_top_p=False,
                       needs_min_p=False, generators=[torch.Generator().manual_seed(0)])
    counts = torch.zeros(4)
    draws = 20000
    for _ in range(draws):
        counts[sample(logits, batch).token_ids[0]] += 1
    expected = torch.softmax(logits[0] / 0.7, -1)
    total_variation = 0.5 * (counts / draws - expected).abs().sum()
    assert total_variation < 0.015


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    batch = make_batch(3, temperature=torch.tensor([0.0, 1.0, 0.0]))
    tokens = sample(logits, batch).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_seeded_row_is_independent_of_its_batch_neighbours():
    torch.manual_seed(2)
    logits = torch.randn(1, V)

    def draws(batch_size: int, position: int) -> list[int]:
        rows = torch.randn(batch_size, V)
        rows[position] = logits[0]
        generators = [None] * batch_size
        generators[position] = torch.Generator().manual_seed(1234)
        batch = make_batch(batch_size, generators=generators)
        return [int(sample(rows, batch).token_ids[position]) for _ in range(20)]

    alone = draws(1, 0)
    assert draws(5, 3) == alone
    assert draws(2, 1) == alone


def test_penalties_match_the_openai_and_ctrl_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    counts = torch.tensor([[2, 1, 0, 0]])
    prompt = torch.tensor([[False, False, True, False]])
    batch = make_batch(1, presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
                       repetition_penalty=torch.tensor([2.0]), output_token_counts=counts, prompt_token_mask=prompt)
    expected = torch.tensor([[2.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2, 1.0]])
    assert torch.allclose(apply_penalties(logits, batch), expected)


def test_logprobs_are_of_the_raw_logits_with_ranks():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    batch = make_batch(1, temperature=torch.tensor([0.0]), all_greedy=True, num_logprobs=2)
    out = sample(logits, batch)
    reference = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.tolist() == [0]
    assert torch.allclose(out.sampled_logprobs, reference[:1])
    assert out.sampled_ranks.tolist() == [1]
    assert out.top_token_ids.tolist() == [[0, 2]]
    assert torch.allclose(out.top_logprobs[0], reference[[0, 2]])


def test_row_argmax_is_torchs_argmax_ties_and_infinities_included():
    from hyperserve.engine.sampler import row_argmax

    torch.manual_seed(0)
    values = torch.randn(6, 1000)
    values[1, 10] = values[1, 20] = 99.0  # a tie: the first wins
    values[2] = float("-inf")
    values[2, 500] = 0.0
    values[3, ::2] = float("-inf")
    assert torch.equal(row_argmax(values), values.argmax(dim=-1))
    assert row_argmax(values).dtype == torch.long
