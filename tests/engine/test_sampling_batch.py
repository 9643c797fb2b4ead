"""SamplingBatchBuilder over requests without a model: the rows' bans, masks and generators."""

import math

import torch

from hyperserve.engine.request import Request
from hyperserve.engine.sampling_batch import SamplingBatchBuilder
from hyperserve.sampling_params import SamplingParams

VOCAB, EOS = 16, 2


def request(request_id: str, **params) -> Request:
    return Request(request_id, [5, 6, 7], SamplingParams(**params), 0.0, eos_token_ids=frozenset({EOS}))


def test_rows_before_min_tokens_ban_eos_and_stop_ids_and_drafts_count_toward_it():
    builder = SamplingBatchBuilder(VOCAB, torch.device("cpu"))
    r = request("a", min_tokens=2, stop_token_ids=[9], max_tokens=8, temperature=0.0)
    # a row after 0 and after 1 draft token bans the ends; after 2 the answer may end
    batch = builder.build([(r, []), (r, [4]), (r, [4, 4])])
    bias = batch.logit_bias
    assert [math.isinf(bias[row, EOS]) for row in range(3)] == [True, True, False]
    assert [math.isinf(bias[row, 9]) for row in range(3)] == [True, True, False]
    assert batch.all_greedy and batch.temperature is None


def test_allowed_token_ids_leave_only_those_tokens_and_penalties_count_drafts():
    builder = SamplingBatchBuilder(VOCAB, torch.device("cpu"))
    r = request("a", allowed_token_ids=[3, 4], presence_penalty=0.5)
    r.output_token_ids.append(3)
    batch = builder.build([(r, [4])])
    assert torch.isfinite(batch.logit_bias[0]).nonzero().flatten().tolist() == [3, 4]
    assert batch.output_token_counts[0, 3] == 1 and batch.output_token_counts[0, 4] == 1
    assert batch.prompt_token_mask[0].nonzero().flatten().tolist() == [5, 6, 7]


def test_a_seeded_request_keeps_its_generator_until_released():
    builder = SamplingBatchBuilder(VOCAB, torch.device("cpu"))
    seeded, unseeded = request("s", temperature=1.0), request("u", temperature=1.0)
    seeded.seed = 7
    first = builder.build([(seeded, []), (unseeded, [])]).generators
    assert first[1] is None and builder.build([(seeded, [])]).generators[0] is first[0]
    builder.release(["s"])
    assert builder.generators == {}
