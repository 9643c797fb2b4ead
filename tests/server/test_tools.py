"""Tool calling pieces without a model, in each format: how calls are written, the fallback prompt,
which format a chat template renders, and grammars that hold exactly the calls a tool_choice
allows. Reading calls out of text: test_tool_calls.py."""

from __future__ import annotations

import pytest

from hyperserve.engine.structured_output import GrammarCompiler
from hyperserve.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from hyperserve.server.tools import (
    FORMATS,
    HERMES,
    ToolFormat,
    detect_format,
    render_messages,
    tool_constraint,
)

TOOLS = [Tool.model_validate(t) for t in [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]]
NAMES = {"get_weather", "get_time"}
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
ANSWER = ('Let me check.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
ALL = list(FORMATS.values())


def answer(fmt: ToolFormat, calls=CALLS) -> str:
    """Text, then calls, as a model of this format writes them (a bare answer is only calls)."""
    return ("" if fmt.layout == "bare" else "Let me check.\n") + fmt.write(calls)


def test_each_format_writes_calls_as_its_models_do():
    assert HERMES.write(CALLS) == ANSWER.split("\n", 1)[1]
    assert FORMATS["mistral"].write(CALLS) == ('[TOOL_CALLS]'
                                               '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                               '{"name": "get_time", "arguments": {"tz": "CET"}}]')
    assert FORMATS["granite"].write(CALLS[:1]) == ('<|tool_call|>[{"name": "get_weather", '
                                                   '"arguments": {"city": "Paris"}}]')
    assert FORMATS["llama3_json"].write(CALLS) == (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}')


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_the_fallback_prompt_describes_the_format_and_writes_calls_and_results_as_text(fmt):
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"c": 18}'}]})
    messages, tools = render_messages([m.for_template() for m in request.messages], TOOLS, native=False,
                                      fmt=fmt)
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
    ("[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS] {{ tool_calls|tojson }}",
     "mistral"),
    ("{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>...<|tool_call|>",  # Granite 3
     "granite"),
    ('{%- if tools is not none %}... Respond in the format {"name": function name, '
     '"parameters": dictionary of argument name and its value}. <|python_tag|>', "llama3_json"),  # Llama 3.1
    ('{%- if tools is not none %}Respond in the format {"name": function name, "parameters": dictionary of '
     'argument name and its value}.', "llama3_json"),  # Llama 3.2, which has no python tag
    ("{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>\n<function=example_function_name>\n"
     "<parameter=example_parameter_1>", "qwen3_coder"),  # Qwen3-Coder
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
        # XML's strings are text
        ("required", fmt.write([("get_weather", {"city": 3})]), fmt.syntax == "xml"),
        (GET_TIME, fmt.write([("get_time", {"tz": "CET"})]), True),
        (GET_TIME, fmt.write([("get_weather", {"city": "Paris"})]), False),
        (GET_TIME, fmt.write(CALLS[::-1]), False),  # a named function: one call
        ("auto", "Just text.", True),
        ("auto", answer(fmt), True),
        ("auto", text + fmt.write([("get_time", {})]), False),  # tz is required
    ]


def _case_id(value) -> str:
    return getattr(value, "name", None) or (value if isinstance(value, str) and len(value) < 9 else "")


@pytest.mark.parametrize("fmt, choice, text, allowed", [(fmt, *case) for fmt in ALL for case in _cases(fmt)],
                         ids=_case_id)
def test_tool_choice_grammars_hold_exactly_the_allowed_calls(compiler, smollm2_tokenizer, fmt, choice, text,
                                                             allowed):
    constraint = tool_constraint(TOOLS, choice, parallel=True, fmt=fmt)
    assert _accepts(compiler, constraint, text, smollm2_tokenizer) == allowed


XML_TOOL = Tool.model_validate({"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "required": ["path", "content"], "properties": {
        "path": {"type": "string", "maxLength": 12}, "content": {"type": "string"},
        "mode": {"type": "integer", "minimum": 0, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string"}}}}}})


@pytest.mark.parametrize("arguments, allowed", [
    ({"path": "a.py", "content": "x = 1\n\n</parameter\nprint(x)"}, True),  # any text up to the closing tag
    ({"path": "a.py", "content": "", "mode": 6, "tags": ["new", "py"]}, True),
    ({"path": "a-very-long-name.py", "content": "x"}, False),  # maxLength
    ({"path": "a.py", "content": "x", "mode": 9}, False),  # maximum
    ({"path": "a.py", "content": "x", "mode": "6"}, True),  # written the same as 6
    ({"path": "a.py", "content": "x", "tags": "new"}, False),  # not a JSON list
    ({"content": "x", "path": "a.py"}, False),  # the schema's order
    ({"path": "a.py"}, False),  # content is required
], ids=["multiline", "all", "too-long", "too-big", "digits", "not-a-list", "order", "missing"])
def test_qwen3_coder_grammars_type_each_parameter_by_its_schema(compiler, smollm2_tokenizer, arguments,
                                                               allowed):
    fmt = FORMATS["qwen3_coder"]
    text = fmt.write([("write_file", arguments)])
    for choice in ("required", "auto"):
        constraint = tool_constraint([XML_TOOL], choice, parallel=False, fmt=fmt)
        assert _accepts(compiler, constraint, text, smollm2_tokenizer) == allowed


def test_a_marker_that_is_one_special_token_is_asked_for_as_that_token(compiler, smollm2_tokenizer):
    """Mistral's [TOOL_CALLS] and Granite's <|tool_call|> are special tokens, which no text can
    spell: the grammar names the token (here SmolLM2's <|im_start|>, id 1, stands for one)."""
    fmt = ToolFormat("list", "list", "<|im_start|>")
    calls = smollm2_tokenizer.encode(fmt.write(CALLS)[len(fmt.marker):], add_special_tokens=False)
    text = smollm2_tokenizer.encode("Just text.", add_special_tokens=False)
    for choice, tokens, allowed in [("required", [1, *calls], True), ("auto", [1, *calls], True),
                                    ("required", calls, False), ("auto", text, True)]:
        grammar = compiler.grammar(tool_constraint(TOOLS, choice, parallel=True, fmt=fmt, marker_id=1))
        assert (all(grammar.accept(t) for t in tokens) and grammar.matcher.is_accepting()) == allowed


def test_tool_choice_none_has_no_grammar_and_unknown_names_are_rejected():
    assert tool_constraint(TOOLS, "none", True) is None
    with pytest.raises(ValueError, match="not in tools"):
        ChatCompletionRequest.model_validate({
            "messages": [{"role": "user", "content": "x"}], "tools": [t.model_dump() for t in TOOLS],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}})
