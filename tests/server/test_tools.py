"""Tool calling pieces without a model, in each format: parsing calls out of text, the same in a
stream cut at any point, the fallback prompt, which format a chat template renders, and grammars
that hold exactly the calls a tool_choice allows."""

from __future__ import annotations

import json

import pytest

from hyperserve.engine.structured_output import GrammarCompiler
from hyperserve.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from hyperserve.server.tools import (
    FORMATS,
    HERMES,
    ToolCallStream,
    ToolFormat,
    detect_format,
    parse_tool_calls,
    render_messages,
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
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
ALL = list(FORMATS.values())


def answer(fmt: ToolFormat, calls=CALLS) -> str:
    """Text, then calls, as a model of this format writes them (a bare answer is only calls)."""
    return ("" if fmt.layout == "bare" else "Let me check.\n") + fmt.write(calls)


def test_each_format_writes_calls_as_its_models_do():
    assert HERMES.write(CALLS) == ANSWER.split("\n", 1)[1]
    assert FORMATS["mistral"].write(CALLS) == ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                               '{"name": "get_time", "arguments": {"tz": "CET"}}]')
    assert FORMATS["granite"].write(CALLS[:1]) == ('<|tool_call|>[{"name": "get_weather", '
                                                   '"arguments": {"city": "Paris"}}]')
    assert FORMATS["llama3_json"].write(CALLS) == ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                                   '{"name": "get_time", "parameters": {"tz": "CET"}}')


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_calls_are_parsed_with_their_arguments_and_the_rest_is_content(fmt):
    content, calls = parse_tool_calls(answer(fmt), NAMES, fmt=fmt)
    assert content == (None if fmt.layout == "bare" else "Let me check.")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


def test_mistral_call_ids_are_nine_letters_and_digits_as_its_templates_require():
    _, calls = parse_tool_calls(answer(FORMATS["mistral"]), NAMES, fmt=FORMATS["mistral"])
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert all(c["id"].startswith("call_") for c in parse_tool_calls(ANSWER, NAMES)[1])


def test_llama3_calls_may_follow_the_python_tag_and_one_call_is_an_answer():
    fmt = FORMATS["llama3_json"]
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', NAMES,
                                      fmt=fmt)
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"tz": "UTC"}']
    text = 'The answer is {"name": "get_time", "parameters": {"tz": "UTC"}}'  # not the whole answer: text
    assert parse_tool_calls(text, NAMES, fmt=fmt) == (text, [])


BROKEN = {  # text that holds no whole valid call, per format
    "hermes": ['<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "get_time", "arguments": \n</tool_call>',
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}'],
    "mistral": ['[TOOL_CALLS][{"name": "unknown", "arguments": {}}]',
                '[TOOL_CALLS][{"name": "get_time", "arguments": ]',
                '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "CET"}}, {"name": "get_ti'],
    "granite": ['<|tool_call|>{"name": "get_time", "arguments": {"tz": "CET"}}'],  # not a list
    "llama3_json": ['{"name": "unknown", "parameters": {}}', '{"name": "get_time", "parameters": {"tz": "CET"}}; {',
                    '{"name": "get_time", "parameters": {"tz": "CET"}} and more'],
}


@pytest.mark.parametrize("fmt, text", [(FORMATS[name], text) for name, texts in BROKEN.items() for text in texts]
                         + [(fmt, "no calls here") for fmt in ALL], ids=lambda v: getattr(v, "name", ""))
def test_text_without_a_whole_valid_call_stays_content(fmt, text):
    assert parse_tool_calls(text, NAMES, fmt=fmt) == (text, [])


def _feed(stream: ToolCallStream, text: str, piece: int) -> tuple[str, list[dict]]:
    content, calls = "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] or [""]
    for i, part in enumerate(pieces):
        delta, new = stream.feed(part, final=i == len(pieces) - 1)
        assert stream.fmt.marker not in delta, "a marker is never sent as content"
        content += delta
        calls += new
    return content, calls


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("piece", [3, 1000])
def test_with_calls_only_a_call_cut_short_is_not_content(fmt, piece):
    """tool_choice "required" or a named function: the grammar allows only calls, so an unfinished
    last one is a call that max_tokens cut, not text for the user."""
    whole = fmt.write(CALLS)
    cut = whole[:-25]
    content, calls = parse_tool_calls(cut, NAMES, fmt=fmt)  # "auto": the unfinished call is text
    if fmt.layout == "blocks":  # blocks stand alone: the first is a call
        assert content == "<tool_call>" + cut.rsplit("<tool_call>", 1)[1] and len(calls) == 1
    else:  # a list or a bare answer is calls only if it parses whole
        assert (content, calls) == (cut, [])
    content, calls = parse_tool_calls(cut, NAMES, calls_only=True, fmt=fmt)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    content, calls = _feed(ToolCallStream(NAMES, calls_only=True, fmt=fmt), cut, piece)
    assert content == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_a_stream_cut_anywhere_gives_the_same_calls_and_content(fmt, piece):
    text = answer(fmt)
    content, calls = _feed(ToolCallStream(NAMES, fmt=fmt), text, piece)
    expected_content, expected = parse_tool_calls(text, NAMES, fmt=fmt)
    assert (content.strip() or None) == expected_content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in expected]


@pytest.mark.parametrize("fmt, text", [(HERMES, "a <tool"), (FORMATS["mistral"], "a [TOOL"),
                                       (FORMATS["llama3_json"], " <|python")], ids=["hermes", "mistral", "llama3"])
def test_text_that_only_looks_like_a_marker_is_sent_once_known(fmt, text):
    stream = ToolCallStream(NAMES, fmt=fmt)
    assert stream.feed(text) == ("" if fmt.layout == "bare" else "a ", [])
    rest = "box> b"
    assert stream.feed(rest, final=True) == (text[len("a "):] + rest if fmt.layout != "bare" else text + rest, [])


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_the_fallback_prompt_describes_the_format_and_writes_calls_and_results_as_text(fmt):
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"c": 18}'}]})
    messages, tools = render_messages([m.for_template() for m in request.messages], TOOLS, native=False, fmt=fmt)
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert fmt.write([("function_name", {"argument": "value"})]) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": fmt.write([("get_weather", {"city": "Paris"})])}
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"c": 18}\n</tool_response>'}


def test_templates_that_render_tool_calls_get_them_as_they_are():
    messages = [{"role": "user", "content": "hi"}]
    assert render_messages(messages, TOOLS, native=True) == (messages, [t.model_dump(exclude_none=True)
                                                                        for t in TOOLS])


@pytest.mark.parametrize("template, name", [
    ("{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>", "hermes"),  # Qwen 2.5
    ("[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS] {{ tool_calls|tojson }}", "mistral"),
    ("{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>...<|tool_call|>", "granite"),  # Granite 3
    ('{%- if tools is not none %}... Respond in the format {"name": function name, "parameters": dictionary of '
     'argument name and its value}. <|python_tag|>', "llama3_json"),  # Llama 3.1
    ('{%- if tools is not none %}Respond in the format {"name": function name, "parameters": dictionary of '
     'argument name and its value}.', "llama3_json"),  # Llama 3.2, which has no python tag
    ("{{ message['content'] }}<tool_call>", None),  # no tools in it
    ("{% for m in messages %}{{ m.content }}{% endfor %}{# tools #}", None),  # tools, but in no known format
    (None, None),
])
def test_a_chat_template_says_which_format_it_renders(template, name):
    assert detect_format(template) is (FORMATS[name] if name else None)


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, 49152, smollm2_tokenizer.eos_token_id)


def _accepts(compiler, constraint, text: str, tokenizer) -> bool:
    grammar = compiler.grammar(constraint)
    return all(grammar.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
        grammar.matcher.is_accepting())


GET_TIME = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})


def _cases(fmt: ToolFormat) -> list[tuple]:
    """(tool_choice, text, whether the grammar allows it) in this format."""
    text = "" if fmt.layout == "bare" else "Text "
    return [
        ("required", fmt.write(CALLS), True),  # two calls
        ("required", "Sure, here it is.", False),
        ("required", fmt.write([("get_weather", {"town": "Paris"})]), False),
        ("required", fmt.write([("get_weather", {"city": 3})]), False),
        (GET_TIME, fmt.write([("get_time", {"tz": "CET"})]), True),
        (GET_TIME, fmt.write([("get_weather", {"city": "Paris"})]), False),
        (GET_TIME, fmt.write(CALLS[::-1]), False),  # a named function: one call
        ("auto", "Just text.", True),
        ("auto", answer(fmt), True),
        ("auto", text + fmt.write([("get_time", {})]), False),  # tz is required
    ]


@pytest.mark.parametrize("fmt, choice, text, allowed", [(fmt, *case) for fmt in ALL for case in _cases(fmt)],
                         ids=lambda v: getattr(v, "name", None) or (v if isinstance(v, str) and len(v) < 9 else ""))
def test_tool_choice_grammars_hold_exactly_the_allowed_calls(compiler, smollm2_tokenizer, fmt, choice, text,
                                                             allowed):
    constraint = tool_constraint(TOOLS, choice, parallel=True, fmt=fmt)
    assert _accepts(compiler, constraint, text, smollm2_tokenizer) == allowed


def test_a_marker_that_is_one_special_token_is_asked_for_as_that_token(compiler, smollm2_tokenizer):
    """Mistral's [TOOL_CALLS] and Granite's <|tool_call|> are special tokens, which no text can
    spell: the grammar names the token (here SmolLM2's <|im_start|>, id 1, stands for one)."""
    fmt = ToolFormat("list", "list", "<|im_start|>")
    calls = smollm2_tokenizer.encode(fmt.write(CALLS)[len(fmt.marker):], add_special_tokens=False)
    for choice, tokens, allowed in [("required", [1, *calls], True), ("auto", [1, *calls], True),
                                    ("required", calls, False),
                                    ("auto", smollm2_tokenizer.encode("Just text.", add_special_tokens=False), True)]:
        grammar = compiler.grammar(tool_constraint(TOOLS, choice, parallel=True, fmt=fmt, marker_id=1))
        assert (all(grammar.accept(t) for t in tokens) and grammar.matcher.is_accepting()) == allowed


def test_tool_choice_none_has_no_grammar_and_unknown_names_are_rejected():
    assert tool_constraint(TOOLS, "none", True) is None
    with pytest.raises(ValueError, match="not in tools"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "tools": [t.model_dump() for t in TOOLS],
                                              "tool_choice": {"type": "function", "function": {"name": "nope"}}})
