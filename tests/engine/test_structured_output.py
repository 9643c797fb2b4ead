"""Structured output: grammar masks against the grammar itself, and the real model's constrained
output against the constraint (JSON schemas validated with jsonschema, regexes, choices), alone,
mixed into batches of free requests, with n > 1 and with speculative decoding."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
import torch

from hyperserve.engine.sampler import apply_token_bitmask
from hyperserve.engine.structured_output import GrammarCompiler, Phase
from hyperserve.llm import LLM
from hyperserve.sampling_params import SamplingParams, StructuredOutputs, Thinking
from tests.conftest import EXACT, SMOLLM2
from tests.engine.schemas import schemas


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, 49152, smollm2_tokenizer.eos_token_id)


def allowed(bitmask_row: torch.Tensor, vocab: int = 49152) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_bitmask_sets_exactly_the_disallowed_logits_to_minus_infinity():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32)
    masked = apply_token_bitmask(logits, bitmask)
    for row in range(3):
        for token in range(70):
            bit = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert masked[row, token] == (logits[row, token] if bit else float("-inf"))


def test_draft_rows_get_the_masks_of_consuming_the_drafts_one_by_one(compiler, smollm2_tokenizer):
    constraint = StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                         "required": ["n"]})
    drafts = smollm2_tokenizer.encode('{"n": 12', add_special_tokens=False)
    grammar = compiler.grammar(constraint)
    masks = compiler.start_masks([(grammar, drafts[:j]) for j in range(len(drafts) + 1)]).result()
    reference = compiler.grammar(constraint)
    for j, token in enumerate(drafts):
        expected = torch.full((1, masks.shape[1]), -1, dtype=torch.int32)
        reference.matcher.unsafe_compute_mask_ptr(expected.data_ptr(), expected.numel() * 4)
        assert torch.equal(masks[j], expected[0]), f"row {j}"
        assert reference.accept(token)
    # the matcher itself is back where it started: the drafts were only tried
    assert allowed(masks[0]) == allowed(compiler.start_masks([(grammar, [])]).result()[0])


def test_rows_after_a_rejected_draft_are_left_unconstrained(compiler, smollm2_tokenizer):
    grammar = compiler.grammar(StructuredOutputs(choice=["yes", "no"]))
    bad = smollm2_tokenizer.encode("maybe", add_special_tokens=False)[0]
    masks = compiler.start_masks([(grammar, []), (grammar, [bad]), (grammar, [bad, bad])]).result()
    assert bad not in allowed(masks[0])
    assert (masks[1:] == -1).all()


def test_trying_drafts_up_to_an_eos_leaves_the_grammar_where_it_was(compiler, smollm2_tokenizer):
    """llguidance's rollback does not count a consumed EOS: drafts stop before one."""
    grammar = compiler.grammar(StructuredOutputs(choice=["yes please"]))
    tokens = smollm2_tokenizer.encode("yes please", add_special_tokens=False)
    drafts = tokens + [compiler.eos_token_id, tokens[0]]
    compiler.start_masks([(grammar, drafts[:j]) for j in range(len(drafts) + 1)]).result()
    assert all(grammar.accept(token) for token in tokens) and grammar.is_finished


def test_a_reasoning_models_thinking_is_free_and_the_constraint_applies_after_it(compiler, smollm2_tokenizer):
    """Row masks across the thinking: the first row allows <think> besides the answer's first
    tokens, rows inside the thinking allow everything, and the row after </think> is the
    constraint's start; trying the drafts leaves the grammar where it was."""
    start, end, word = smollm2_tokenizer.encode(" start end word", add_special_tokens=False)
    yes = smollm2_tokenizer.encode("yes", add_special_tokens=False)
    constraint = StructuredOutputs(choice=["yes", "no"])
    grammar = compiler.grammar(replace(constraint, thinking=Thinking(start, end)))
    drafts = [start, word, yes[0], end, *yes]
    masks = compiler.start_masks([(grammar, drafts[:j]) for j in range(len(drafts) + 1)]).result()
    fresh = compiler.start_masks([(compiler.grammar(constraint), [])]).result()[0]
    assert allowed(masks[0]) == allowed(fresh) | {start}
    assert (masks[1:4] == -1).all()  # inside the thinking, after <think>, the word and a "yes"
    assert torch.equal(masks[4], fresh)  # after </think>: the constraint from its start
    assert allowed(masks[5]) != allowed(fresh) and not (masks[5] == -1).all()
    assert grammar.phase is Phase.MAY_THINK
    assert all(grammar.accept(token) for token in drafts) and grammar.is_finished
    direct = compiler.grammar(replace(constraint, thinking=Thinking(start, end)))
    assert not direct.accept(word)  # no <think> first: the constraint applies from the first token
    opened = compiler.grammar(replace(constraint, thinking=Thinking(start, end, open=True)))
    assert opened.accept(word) and opened.accept(start) and not opened.is_finished  # thinking: anything goes


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("constraint, reason", [
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "nope"),
    (StructuredOutputs(regex="[a-z"), "unclosed"),
    (StructuredOutputs(grammar="root ::= ("), "grammar"),
    (StructuredOutputs(json="{not json"), "Expecting property name"),
    (StructuredOutputs(json={"type": "array", "items": _nested(5000)}), "cannot"),
    (StructuredOutputs(grammar="root ::= [" * 200), "grammar"),
])
def test_a_constraint_that_cannot_compile_is_a_value_error_that_says_why(compiler, constraint, reason):
    with pytest.raises(ValueError, match=reason):
        compiler.compile(constraint)


def test_constraints_compile_once(compiler):
    constraint = StructuredOutputs(regex="[0-9]{3}")
    assert compiler.compile(constraint) is compiler.compile(StructuredOutputs(regex="[0-9]{3}"))


def test_structured_outputs_takes_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


# ---- the real model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(SMOLLM2)


def _chat(llm, what: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": f"Reply with {what} as JSON."}])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_parses_and_validates_against_its_schema(llm, temperature):
    cases = schemas()
    assert len(cases) >= 50
    for _, schema in cases:  # the schemas are valid JSON schemas themselves
        jsonschema.Draft202012Validator.check_schema(schema)
    # room to finish: sampled at 1.0, SmolLM2 can ramble in a free-text field for 400+ tokens before closing it
    outputs = llm.generate(
        [_chat(llm, what) for what, _ in cases],
        [SamplingParams(temperature=temperature, seed=i, max_tokens=1000,
                        structured_outputs=StructuredOutputs(json=schema)) for i, (_, schema) in enumerate(cases)],
        use_tqdm=False,
    )
    for (what, schema), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (what, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.slow
def test_regex_choice_and_grammar_outputs_match(llm):
    prompts = [_chat(llm, w) for w in ("a date", "a colour", "a sum", "a greeting")]
    constraints = [
        StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}"),
        StructuredOutputs(choice=["red", "green", "blue"]),
        StructuredOutputs(grammar='root ::= num " + " num " = " num\nnum ::= [0-9]{1,3}'),  # GBNF
        StructuredOutputs(grammar='start: GREETING " " NAME\nGREETING: "hello" | "hi"\nNAME: /[A-Z][a-z]{1,9}/'),
    ]
    for temperature in (0.0, 1.0):
        outputs = llm.generate(prompts, [SamplingParams(temperature=temperature, seed=1, max_tokens=40,
                                                        structured_outputs=c) for c in constraints], use_tqdm=False)
        texts = [o.outputs[0].text for o in outputs]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", texts[0]), texts
        assert texts[1] in ("red", "green", "blue"), texts
        assert re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}", texts[2]), texts
        assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{1,9}", texts[3]), texts


@pytest.mark.slow
def test_grammar_rows_mixed_into_a_batch_of_free_requests_decode_as_alone(smollm2_tokenizer):
    """Batch invariance: a constrained request's tokens do not depend on what shares its steps,
    and free requests are untouched by their neighbours' masks; with chunked prefill, a KV pool
    small enough that requests are preempted and recomputed (grammar state and all), and the
    grammar's forced tokens drafted (the default)."""
    llm = LLM(SMOLLM2, num_kv_blocks=24, block_size=16, max_model_len=384, max_num_batched_tokens=48, **EXACT)
    schema = schemas()[10][1]
    constrained = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputs(json=schema))
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    story = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. "
    prompts = [_chat(llm, "a user with a nested address"), _chat(llm, "a person"),
               smollm2_tokenizer(story * 8).input_ids, smollm2_tokenizer(story * 16).input_ids]
    params = [constrained, constrained, free, free]
    alone = [llm.generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in together) > 0, "the pool should have forced preemption"
    assert all(o.metrics.num_accepted_tokens > 0 for o in together[:2])
    assert [o.outputs[0].token_ids for o in together] == alone
    for output in together[:2]:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


@pytest.mark.slow
def test_n_samples_each_follow_the_grammar(llm):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "shade": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "shade"], "additionalProperties": False}
    output = llm.generate([_chat(llm, "a colour and a shade")],
                          [SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=40,
                                          structured_outputs=StructuredOutputs(json=schema))], use_tqdm=False)[0]
    assert len(output.outputs) == 4
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.slow
def test_drafts_of_forced_tokens_and_ngram_drafts_give_the_plain_greedy_output():
    """The tokens a grammar forces (JSON keys and punctuation, a regex's literal text) drafted and
    verified in one step (the default), and n-gram drafts besides, each checked against the
    grammar's masks for their rows: the greedy output is that of one token a step, and it
    validates; the forced drafts were made and accepted."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}},
        "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"]}
    question = ('Repeat this list as JSON: {"items": [{"name": "apple", "qty": 1}, {"name": "pear", "qty": 2}, '
                '{"name": "plum", "qty": 3}]}')
    verdict = r"Verdict: (yes|no)\. Confidence: \d{1,2} ?%"
    constraints = [StructuredOutputs(json=schema), StructuredOutputs(regex=verdict)]
    outputs = []
    for options in ({"speculative_forced_tokens": False}, {},
                    {"speculative_method": "ngram", "num_speculative_tokens": 4}):
        llm = LLM(SMOLLM2, **EXACT, **options)
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in (question, "Is water wet?")]
        outputs.append(llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=80, structured_outputs=c)
                                              for c in constraints], use_tqdm=False))
        llm.close()
    plain, forced, ngram = ([o.outputs[0] for o in run] for run in outputs)
    assert [c.token_ids for c in forced] == [c.token_ids for c in plain] == [c.token_ids for c in ngram]
    assert all(o.metrics.num_draft_tokens == 0 for o in outputs[0])
    assert all(0 < o.metrics.num_accepted_tokens <= o.metrics.num_draft_tokens for o in outputs[1])
    jsonschema.validate(json.loads(forced[0].text), schema)
    assert re.fullmatch(verdict, forced[1].text)
