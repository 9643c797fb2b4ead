"""Reading tool calls out of text without a model, in each format: calls and content of a whole
answer, the same from a stream cut at any point, calls cut short, and text that only looks like a
call."""

from __future__ import annotations

import json
import random

import pytest

from hyperserve.server.tool_calls import ToolCallStream, parse_tool_calls
from hyperserve.server.tools import FORMATS, HERMES
from tests.server.test_tools import ALL, ANSWER, CALLS, NAMES, answer


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_calls_are_parsed_with_their_arguments_and_the_rest_is_content(fmt):
    content, calls = parse_tool_calls(answer(fmt), NAMES, fmt=fmt)
    assert content == (None if fmt.layout == "bare" else "Let me check.")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


def test_qwen3_coder_calls_are_xml_with_string_parameters_as_text_and_others_as_json():
    fmt = FORMATS["qwen3_coder"]
    arguments = {"path": "a.py", "content": "line one\n\nline three\n", "count": 3,
                 "flags": {"x": [True, None]}}
    text = fmt.write([("write_file", arguments)])
    assert text == ("<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
                    "<parameter=content>\nline one\n\nline three\n\n</parameter>\n"
                    "<parameter=count>\n3\n</parameter>\n"
                    '<parameter=flags>\n{"x": [true, null]}\n</parameter>\n</function>\n</tool_call>')
    strings = frozenset({("write_file", "path"), ("write_file", "content"), ("write_file", "note")})
    for known in (frozenset(), strings):  # the strings read as JSON where they do, or known as text
        _, [call] = parse_tool_calls(text, {"write_file"}, fmt=fmt, string_parameters=known)
        assert call["function"]["arguments"] == json.dumps(arguments)
    empty = fmt.write([("write_file", {"note": "", "content": "\n"})])
    stream, deltas = ToolCallStream({"write_file"}, fmt=fmt, string_parameters=strings), []
    # a string's text streams as it comes, all but a closing tag in the making
    for i, char in enumerate(empty + text):
        deltas += stream.feed(char, final=i == len(empty + text) - 1)[1]
    assert [json.loads(arguments) for _, arguments in _merge(deltas)] == \
        [{"note": "", "content": "\n"}, arguments]
    assert len([d for d in deltas if d["index"] == 1]) > len(arguments["content"])
    digits = fmt.write([("get_weather", {"city": "75001"})])  # a string that reads as JSON stays a string
    _, [call] = parse_tool_calls(digits, NAMES, fmt=fmt)
    assert json.loads(call["function"]["arguments"]) == {"city": 75001}
    city = frozenset({("get_weather", "city")})
    _, [call] = parse_tool_calls(digits, NAMES, fmt=fmt, string_parameters=city)
    assert json.loads(call["function"]["arguments"]) == {"city": "75001"}


def test_mistral_call_ids_are_nine_letters_and_digits_as_its_templates_require():
    _, calls = parse_tool_calls(answer(FORMATS["mistral"]), NAMES, fmt=FORMATS["mistral"])
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert all(c["id"].startswith("call_") for c in parse_tool_calls(ANSWER, NAMES)[1])


def test_llama3_calls_may_follow_the_python_tag_and_one_call_is_an_answer():
    fmt = FORMATS["llama3_json"]
    tagged = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}'
    content, calls = parse_tool_calls(tagged, NAMES, fmt=fmt)
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"tz": "UTC"}']
    text = 'The answer is {"name": "get_time", "parameters": {"tz": "UTC"}}'  # not the whole answer: text
    assert parse_tool_calls(text, NAMES, fmt=fmt) == (text, [])


BROKEN = {  # text that holds no call to an offered tool that opens whole, per format
    "hermes": ['<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "get_time", "arguments": \n</tool_call>',
               '<tool_call>\n{"name": "get_ti'],
    "mistral": ['[TOOL_CALLS][{"name": "unknown", "arguments": {}}]',
                '[TOOL_CALLS][{"name": "get_time", "arguments": ]',
                '[TOOL_CALLS][{"name": "get_ti'],
    "granite": ['<|tool_call|>{"name": "get_time", "arguments": {"tz": "CET"}}'],  # not a list
    "llama3_json": ['{"name": "unknown", "parameters": {}}', '{"name": "get_ti'],
    "qwen3_coder": ['<tool_call>\n<function=unknown>\n</function>\n</tool_call>',
                    "<tool_call>\n<function=get_ti"],
}


@pytest.mark.parametrize("fmt, text",
                         [(FORMATS[name], text) for name, texts in BROKEN.items() for text in texts]
                         + [(fmt, "no calls here") for fmt in ALL], ids=lambda v: getattr(v, "name", ""))
def test_text_without_a_whole_valid_call_stays_content(fmt, text):
    assert parse_tool_calls(text, NAMES, fmt=fmt) == (text, [])


@pytest.mark.parametrize("fmt, text, content, arguments", [
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}', None, ['{"tz": "CET"}']),
    (HERMES, 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "C', "Sure.", ['{"tz": "C']),
    (FORMATS["mistral"], '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "CET"}}, {"name": "get_ti',
     None, ['{"tz": "CET"}']),
    (FORMATS["llama3_json"], '{"name": "get_time", "parameters": {"tz": "CET"}}; {', None, ['{"tz": "CET"}']),
    (FORMATS["llama3_json"], '{"name": "get_time", "parameters": {"tz": "CET"}} and more', "and more",
     ['{"tz": "CET"}']),
], ids=["unclosed", "cut", "list-cut", "bare-cut", "bare-then-text"])
def test_a_call_cut_short_after_its_name_keeps_the_arguments_written(fmt, text, content, arguments):
    """A call that max_tokens or a stop string cut once its name was written is a call, with its
    arguments as far as they went (as OpenAI gives truncated calls; finish_reason says why): a
    stream has sent it by then, and a whole answer reads the same."""
    expected = [("get_time", a) for a in arguments]
    parsed_content, calls = parse_tool_calls(text, NAMES, fmt=fmt)
    assert (parsed_content, _pairs(calls)) == (content, expected)
    for piece in (1, 3):
        streamed, deltas = _feed(ToolCallStream(NAMES, fmt=fmt), text, piece)
        assert (streamed.strip() or None, _merge(deltas)) == (content, expected)


def _merge(deltas: list[dict]) -> list[tuple[str, str]]:
    """Streamed call deltas as a client accumulates them: (name, arguments) per index."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        name, arguments = calls.setdefault(delta["index"], ["", ""])
        function = delta["function"]
        calls[delta["index"]] = [name + function.get("name", ""), arguments + function["arguments"]]
    return [tuple(calls[i]) for i in sorted(calls)]


def _pairs(calls: list[dict]) -> list[tuple[str, str]]:
    """Whole calls as _merge gives streamed ones: (name, arguments)."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _feed(stream: ToolCallStream, text: str, piece: int, well_formed: bool = True) -> tuple[str, list[dict]]:
    content, calls = "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] or [""]
    for i, part in enumerate(pieces):
        delta, new = stream.feed(part, final=i == len(pieces) - 1)
        assert not well_formed or stream.fmt.marker not in delta, "a call's marker is never sent as content"
        content += delta
        calls += new
    return content, calls


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("calls_only", [False, True])
def test_calls_cut_short_are_not_content_and_a_stream_agrees(fmt, calls_only):
    """An answer cut inside its second call: the first call is whole; the second is a call only if
    its name was written (in the block format, whose calls open sooner), with its arguments as far
    as they went; no text of either is content, whatever the tool choice."""
    cut = fmt.write(CALLS)[:-25]
    # the second is cut inside its arguments, or before </function>
    second = {"json": '{"', "xml": '{"tz": "CET"'}[fmt.syntax]
    expected = [("get_weather", '{"city": "Paris"}')]
    if fmt.layout == "blocks":
        expected.append(("get_time", second))
    content, calls = parse_tool_calls(cut, NAMES, calls_only, fmt)
    assert content is None and _pairs(calls) == expected
    for piece in (1, 3, 1000):
        streamed, deltas = _feed(ToolCallStream(NAMES, calls_only, fmt), cut, piece)
        assert streamed == "" and _merge(deltas) == expected


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_arguments_stream_piece_by_piece_after_the_calls_id_and_name(fmt):
    """As OpenAI streams a call: first its index, id, type and name (with what of the arguments
    came with it), then the arguments' JSON text in pieces as the model writes it (XML: each
    parameter as it closes), one delta per call and feed; brackets and quotes inside strings do
    not end them early."""
    tricky = {"city": 'Paris } " ] {', "nested": {"list": [1, {"a": "}"}]}}
    text = answer(fmt, [("get_weather", tricky), ("get_time", {"tz": "CET"})])
    stream, deltas = ToolCallStream(NAMES, fmt=fmt), []
    for i, char in enumerate(text):  # one character at a time
        new = stream.feed(char, final=i == len(text) - 1)[1]
        assert len({d["index"] for d in new}) == len(new)
        deltas += new
    for index, (name, arguments) in enumerate([("get_weather", tricky), ("get_time", {"tz": "CET"})]):
        mine = [d for d in deltas if d["index"] == index]
        assert mine[0]["id"] and mine[0]["type"] == "function" and mine[0]["function"]["name"] == name
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in mine[1:])
        pieces = [d["function"]["arguments"] for d in mine]
        if fmt.syntax == "xml":  # the opening brings "{", each parameter comes whole, then "}"
            assert pieces == ["{", *[", " * (i > 0) + json.dumps(dict([item]))[1:-1]
                                     for i, item in enumerate(arguments.items())], "}"]
        else:  # the opening brings the first character, then one a feed
            assert pieces == list(json.dumps(arguments))
    assert [json.loads(c["function"]["arguments"]) for c in parse_tool_calls(text, NAMES, fmt=fmt)[1]] == [
        tricky, {"tz": "CET"}]


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_a_stream_cut_anywhere_gives_the_same_calls_and_content(fmt, piece):
    text = answer(fmt)
    content, deltas = _feed(ToolCallStream(NAMES, fmt=fmt), text, piece)
    expected_content, expected = parse_tool_calls(text, NAMES, fmt=fmt)
    assert (content.strip() or None) == expected_content
    assert _merge(deltas) == _pairs(expected)
    assert [json.loads(arguments) for _, arguments in _merge(deltas)] == [arguments for _, arguments in CALLS]


@pytest.mark.parametrize("fmt, text", [(HERMES, "a <tool"), (FORMATS["mistral"], "a [TOOL"),
                                       (FORMATS["llama3_json"], " <|python")],
                         ids=["hermes", "mistral", "llama3"])
def test_text_that_only_looks_like_a_marker_is_sent_once_known(fmt, text):
    stream = ToolCallStream(NAMES, fmt=fmt)
    assert stream.feed(text) == ("" if fmt.layout == "bare" else "a ", [])
    rest = "box> b"
    sent = text[len("a "):] + rest if fmt.layout != "bare" else text + rest
    assert stream.feed(rest, final=True) == (sent, [])


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_any_text_cut_anywhere_reads_the_same_streamed_as_whole(fmt):
    """Model output built at random from the format's own pieces, junk and cuts (what a model
    without a grammar, or a stop string, can leave): the stream never fails, and what it sends,
    joined as a client joins it, is what the whole answer reads as."""
    rng = random.Random(fmt.name)
    call = fmt.write([("get_weather", {"city": 'Pa"r}is', "unit": "c"})])
    pieces = [call, call[: len(call) // 2], fmt.marker, fmt.close or "}", "<function=get_time>\n",
              "<parameter=tz>\n", "\n</parameter>\n", "</function>", '{"name": "get_time", ',
              '"arguments": {"tz": "', "]", "; ", ", ", "[", "{", '"', "\\", "\n", " ", "text ", "<tool",
              "[TOOL", "<|python_tag|>", "null", "ünï"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        strings = frozenset({("get_weather", "city"), ("get_time", "tz")})
        whole_content, whole_calls = parse_tool_calls(text, NAMES, fmt=fmt, string_parameters=strings)
        stream = ToolCallStream(NAMES, fmt=fmt, string_parameters=strings)
        content, deltas = _feed(stream, text, rng.randint(1, 9), well_formed=False)
        assert (content.strip() or None, _merge(deltas)) == (whole_content, _pairs(whole_calls)), text
