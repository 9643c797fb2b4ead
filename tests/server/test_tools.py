"""Tool calling pieces without a model: parsing calls out of text, the same in a stream cut at any
point, the fallback prompt, and grammars that hold exactly the calls a tool_choice allows."""

from __future__ import annotations

import json

import pytest

from hyperserve.engine.structured_output import GrammarCompiler
from hyperserve.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from hyperserve.server.tools import (
    ToolCallStream,
    parse_tool_calls,
    render_messages,
    template_calls_tools,
    tool_constraint,
)

TOOLS = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]]
NAMES = {"get_weather", "get_time"}
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def test_calls_are_parsed_with_their_arguments_and_the_rest_is_content():
    content, calls = parse_tool_calls(ANSWER, NAMES)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", [
    "no calls here",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',  # not an offered tool
    '<tool_call>\n{"name": "get_time", "arguments": \n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}',  # cut off by max_tokens
])
def test_text_without_a_whole_valid_call_stays_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("piece", [3, 1000])
def test_with_calls_only_a_call_cut_short_is_not_content(piece):
    """tool_choice "required" or a named function: the grammar allows only calls, so an unfinished
    last block is a call that max_tokens cut, not text for the user."""
    cut = ANSWER[ANSWER.index("<tool_call>"):-25]
    assert parse_tool_calls(cut, NAMES)[0] == "<tool_call>" + cut.rsplit("<tool_call>", 1)[1]  # "auto": text
    content, calls = parse_tool_calls(cut, NAMES, calls_only=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    stream, content, calls = ToolCallStream(NAMES, calls_only=True), "", []
    pieces = [cut[i : i + piece] for i in range(0, len(cut), piece)]
    for i, text in enumerate(pieces):
        delta, new = stream.feed(text, final=i == len(pieces) - 1)
        content += delta
        calls += new
    assert content == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_a_stream_cut_anywhere_gives_the_same_calls_and_content(piece):
    stream = ToolCallStream(NAMES)
    content, calls = "", []
    pieces = [ANSWER[i : i + piece] for i in range(0, len(ANSWER), piece)]
    for i, text in enumerate(pieces):
        delta, new = stream.feed(text, final=i == len(pieces) - 1)
        assert "<" not in delta, "a tag is never sent as content"
        content += delta
        calls += new
    expected_content, expected = parse_tool_calls(ANSWER, NAMES)
    assert content.strip() == expected_content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in expected]


def test_text_that_only_looks_like_a_tag_is_sent_once_known():
    stream = ToolCallStream(NAMES)
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("box> b", final=True) == ("<toolbox> b", [])


def test_the_fallback_prompt_describes_the_tools_and_writes_calls_and_results_as_text():
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"c": 18}'}]})
    messages, tools = render_messages([m.for_template() for m in request.messages], TOOLS, native=False)
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                                                           '"arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"c": 18}\n</tool_response>'}


def test_templates_that_render_tool_calls_get_them_as_they_are():
    messages = [{"role": "user", "content": "hi"}]
    assert render_messages(messages, TOOLS, native=True) == (messages, [t.model_dump(exclude_none=True)
                                                                        for t in TOOLS])
    assert template_calls_tools("{% if tools %}<tool_call>{% endif %}")
    assert not template_calls_tools("{{ message['content'] }}")


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, 49152, smollm2_tokenizer.eos_token_id)


def _accepts(compiler, constraint, text: str, tokenizer) -> bool:
    grammar = compiler.grammar(constraint)
    return all(grammar.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
        grammar.matcher.is_accepting())


@pytest.mark.parametrize("choice, text, allowed", [
    ("required", ANSWER.split("\n", 1)[1], True),  # two calls
    ("required", "Sure, here it is.", False),
    ("required", '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>', False),
    ("required", '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>', False),
    ("get_time", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>', True),
    ("get_time", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', False),
    ("auto", "Just text.", True),
    ("auto", ANSWER, True),
    ("auto", 'Text <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', False),  # tz is required
])
def test_tool_choice_grammars_hold_exactly_the_allowed_calls(compiler, smollm2_tokenizer, choice, text, allowed):
    if choice == "get_time":
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    constraint = tool_constraint(TOOLS, choice, parallel=True, open_is_special=False)
    assert _accepts(compiler, constraint, text, smollm2_tokenizer) == allowed


def test_tool_choice_none_has_no_grammar_and_unknown_names_are_rejected():
    assert tool_constraint(TOOLS, "none", True, False) is None
    with pytest.raises(ValueError, match="not in tools"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "tools": [t.model_dump() for t in TOOLS],
                                              "tool_choice": {"type": "function", "function": {"name": "nope"}}})
