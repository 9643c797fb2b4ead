"""Beam search (hyperserve/beam_search.py) against transformers' generate(num_beams=...) on the same
float32 weights: the same answers, in the same order, with the same scores."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hyperserve import LLM, BeamSearchParams
from hyperserve.beam_search import BeamSearch
from tests.conftest import tiny_config

PROMPTS = [[5, 17, 30, 99, 100, 42], [7, 8, 9, 200, 3]]
WIDTH, MAX_TOKENS = 3, 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face folder, and the transformers model."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32).eval()
    with torch.no_grad():  # far from uniform, so that beams differ by more than rounding
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.15)
    model.save_pretrained(path)
    return model, path


def transformers_beams(model, prompt: list[int], eos: int | None, length_penalty: float
                       ) -> list[tuple[list[int], float]]:
    """(tokens up to and with an EOS, score) of each of transformers' answers, best first."""
    out = model.generate(torch.tensor([prompt]), num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
                         max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos or 0,
                         length_penalty=length_penalty, early_stopping=False, output_scores=True,
                         return_dict_in_generate=True)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores):
        tokens = sequence[len(prompt):].tolist()
        if eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]  # the padding after it is the EOS again
        beams.append((tokens, float(score)))
    return beams


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("eos_at", [None, 1, 3], ids=["ignore_eos", "eos-2nd-token", "eos-4th-token"])
def test_beam_search_matches_transformers(base, tmp_path, eos_at, length_penalty):
    """Without an EOS every answer runs to max_tokens; with one (a token the free search's best beam
    writes second or fourth), hypotheses that end early compete with the live beams under the
    length penalty, and the search may stop before max_tokens (transformers' heuristic). Both
    prompts are searched at once, each round one batch."""
    model, path = base
    eos, free = None, transformers_beams(model, PROMPTS[0], None, length_penalty)
    if eos_at is not None:
        eos = free[0][0][eos_at]
        path = shutil.copytree(path, tmp_path / "model")
        for name in ("config.json", "generation_config.json"):
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = eos
            (path / name).write_text(json.dumps(config))
    llm = LLM(model=str(path), quantization=None, dtype="float32", num_kv_blocks=64, block_size=4,
              max_model_len=128)
    assert llm.engine.eos_token_ids == ({eos} if eos is not None else llm.engine.eos_token_ids)
    params = BeamSearchParams(WIDTH, MAX_TOKENS, ignore_eos=eos is None, length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        expected = transformers_beams(model, prompt, eos, length_penalty)
        assert [c.token_ids for c in output.outputs] == [tokens for tokens, _ in expected]
        for answer, (tokens, score) in zip(output.outputs, expected):
            assert answer.cumulative_logprob / len(tokens) ** length_penalty == pytest.approx(score, abs=1e-4)
            assert answer.finish_reason == ("stop" if tokens[-1] == eos else "length")
    if eos is not None:  # the best free answer has the EOS inside it: it cannot be an answer now
        assert free[0][0] not in [c.token_ids for c in outputs[0].outputs]


def test_beam_width_and_length_penalty_are_bounded():
    """The width by the logprobs a request returns; the length penalty where length ** it stays a
    finite, non-zero float (1e6 overflowed a score, -1e6 divided by zero: a 500 before)."""
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(11, 8)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, 0)
    for penalty in (1e6, -1e6, float("nan")):
        with pytest.raises(ValueError, match="length_penalty"):
            BeamSearchParams(2, 8, length_penalty=penalty)


def test_a_search_stops_once_no_live_beam_can_beat_its_hypotheses():
    """An EOS counts only among the first width candidates; once width hypotheses are kept and the
    best live beam scores no better, the search is done before max_tokens."""
    search = BeamSearch([1, 2], BeamSearchParams(1, 8), eos_token_ids=frozenset({0}))
    search.advance([{5: -0.1, 0: -0.2}])  # the EOS is second, beyond the first width: no hypothesis
    assert not search.hypotheses and search.round_prompts() == [[1, 2, 5]] and not search.done
    search.advance([{0: -0.3, 6: -4.0}])  # [5, EOS] scores -0.4 / 2; the live [5, 6] -4.1 / 2
    assert [b.token_ids for b in search.hypotheses] == [[5, 0]] and search.live[0].token_ids == [5, 6]
    assert search.done
    answer = search.output("r", tokenizer=None).outputs[0]
    assert (answer.token_ids, answer.finish_reason, answer.stop_reason) == ([5, 0], "stop", 0)
    assert answer.cumulative_logprob == pytest.approx(-0.4)
