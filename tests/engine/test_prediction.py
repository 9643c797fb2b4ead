"""Predicted outputs (`SamplingParams.prediction`, OpenAI's `prediction`): drafts from the answer a
caller expects, verified as any drafts are, with or without a speculative method. The answer is
the one plain decoding gives, right prediction or wrong; sampling keeps the target's distribution;
no KV is left behind."""

from __future__ import annotations

import random

import pytest

from hyperserve import LLM, SamplingParams
from hyperserve.engine.request import Prediction
from hyperserve.engine.speculative import predicted_continuation
from tests.conftest import tiny_config
from tests.engine.test_speculative import LENGTH, PROMPT, SAMPLES, VOCAB, _exact_joint, _total_variation

NUM_BLOCKS = 256


def test_a_prediction_is_followed_from_where_the_answer_stands():
    prediction = Prediction([10, 11, 12, 13, 14, 15, 16])
    assert predicted_continuation(prediction, [], 3) == (0, [10, 11, 12])  # the answer's start
    assert predicted_continuation(prediction, [10, 11], 3) == (0, [12, 13, 14])  # still its start
    # a word replaced (99 98 for 12): picked up again after it, from one token on
    assert predicted_continuation(prediction, [10, 11, 99, 98, 13], 2) == (1, [14, 15])
    assert predicted_continuation(prediction, [10, 11, 99, 98, 13, 77], 2) == (0, [])  # nowhere in it

    # a prediction whose lines repeat is followed in order: "1 2 3" is found ending past the cursor
    lines = Prediction([1, 2, 3, 9, 5, 1, 2, 3, 8])
    assert predicted_continuation(lines, [1, 2, 3], 1) == (0, [9])
    assert predicted_continuation(lines, [1, 2, 3, 7, 6, 1, 2, 3], 1) == (3, [8])  # the answer left line 1
    # ... but an answer that goes back finds the earlier line (two tokens or more)
    assert predicted_continuation(lines, [1, 2, 3, 7, 6, 1, 2, 3, 4, 5, 1, 2], 1) == (3, [3])


@pytest.fixture
def target(save_hf_model):
    _, path = save_hf_model(tiny_config("llama", vocab_size=64), seed=2)
    return path


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, num_kv_blocks=NUM_BLOCKS, block_size=4, max_model_len=96, dtype="float32",
               **kwargs)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_tokens": 4, "verify_cost": 0.2}],
                         ids=["no-method", "ngram"])
def test_greedy_answers_are_the_same_with_right_edited_and_wrong_predictions(target, speculative):
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (5, 12, 20)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _llm(target).generate(prompts, greedy, use_tqdm=False)
    answers = [o.outputs[0].token_ids for o in expected]
    edited = [a[:10] + [(t + 1) % 64 for t in a[10:13]] + a[13:] for a in answers]  # three tokens changed
    wrong = [[rng.randrange(64) for _ in range(40)] for _ in prompts]
    llm = _llm(target, speculative=speculative)
    for predictions in (answers, edited, wrong):
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prediction=p)
                  for p in predictions]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == answers
        drafted = sum(o.metrics.num_prediction_tokens for o in outputs)
        accepted = sum(o.metrics.num_accepted_prediction_tokens for o in outputs)
        if predictions is answers:  # every draft is the answer: all taken, most tokens drafted
            assert accepted == drafted >= 3 * 30
        elif predictions is edited:  # the three changed tokens are rejected, the rest followed again
            assert 3 * 25 <= accepted < drafted
        else:
            assert accepted < drafted
        assert llm.engine.kv_cache.num_free_blocks == NUM_BLOCKS


def test_sampled_tokens_with_a_prediction_follow_the_targets_distribution(save_hf_model):
    hf_model, path = save_hf_model(tiny_config("llama", vocab_size=VOCAB), seed=1)
    llm = LLM(model=path, num_kv_blocks=2048, block_size=4, max_model_len=64, max_num_seqs=512,
              dtype="float32", max_num_batched_tokens=4096, speculative={"max_batch": 10**6})
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True, n=SAMPLES, seed=3,
                            prediction=[1, 3, 0])
    counts: dict[tuple[int, ...], float] = {}
    for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1 / SAMPLES
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.by_source["prediction"][1] < stats.by_source["prediction"][0]
    assert _total_variation(counts, _exact_joint(hf_model, PROMPT, LENGTH)) < 0.12  # as test_speculative's
    assert llm.engine.kv_cache.num_free_blocks == 2048


def test_a_prediction_outside_the_vocabulary_or_the_context_is_refused(target):
    llm = _llm(target)
    for prediction, says in (([1, 64], "token ids must be integers"),
                             ([1] * 97, "more than this model's context")):
        with pytest.raises(ValueError, match=says):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, prediction=prediction), use_tqdm=False)
    assert llm.engine.kv_cache.num_free_blocks == NUM_BLOCKS and not llm.engine.has_unfinished_requests()
