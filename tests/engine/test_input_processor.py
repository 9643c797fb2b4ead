"""The prompt checks, without a model: a processor over a 256-token vocabulary and no tokenizer."""

import pytest

from hyperserve.engine.input_processor import ContextLengthError, InputProcessor
from hyperserve.engine.structured_output import GrammarCompiler
from hyperserve.sampling_params import SamplingParams, StructuredOutputs

VOCAB, CONTEXT = 256, 8


@pytest.fixture
def inputs() -> InputProcessor:
    return InputProcessor(None, VOCAB, CONTEXT, GrammarCompiler(None, VOCAB, None))


def test_a_prompt_that_fills_the_context_is_refused_and_truncation_keeps_its_end(inputs):
    assert inputs.process_prompt([1, 2, 3]) == (None, [1, 2, 3])
    with pytest.raises(ContextLengthError, match="8 tokens"):
        inputs.process_prompt(list(range(CONTEXT)))
    assert inputs.process_prompt(list(range(20)), truncate=4) == (None, [16, 17, 18, 19])


@pytest.mark.parametrize("prompt", [[], [VOCAB], [-1], [1.0], "text without a tokenizer"])
def test_empty_or_foreign_prompts_are_refused(inputs, prompt):
    with pytest.raises(ValueError):
        inputs.process_prompt(prompt)


def test_a_grammar_needs_a_tokenizer(inputs):
    inputs.check_params(SamplingParams(stop_token_ids=[VOCAB - 1]))
    with pytest.raises(ValueError, match="tokenizer"):
        inputs.check_params(SamplingParams(structured_outputs=StructuredOutputs(regex="a+")))
