"""GPT-OSS's harmony answers read into reasoning, content and tool calls, whole and streamed
(the server end to end: tests/server/test_harmony_api.py)."""

from __future__ import annotations

import json

import pytest

from hyperserve.server import harmony

THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
TOOLS = frozenset({"get_weather"})

ANSWERS = [
    # thinking, then the answer (the closing <|return|> there or not: the detokenizer may drop it)
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
     ("The user wants the weather.", "It is sunny.", [])),
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.", ("The user wants the weather.",
                                                                           "It is sunny.", [])),
    # thinking, then a call
    (THINK + CALL, ("The user wants the weather.", None, [("get_weather", '{"city": "Paris"}')])),
    # the recipient in the role's part of the header, a preamble for the user before the call
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather'
     '<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>',
     (None, "Checking.", [("get_weather", '{"city": "Rome"}')])),
    # a call to a function not offered is text
    ('<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}<|call|>', (None, "{}", [])),
    # the answer alone; a model that writes no harmony at all
    ("<|channel|>final<|message|>Hi <|there|>!", (None, "Hi <|there|>!", [])),
    ("Just text, < and all.", (None, "Just text, < and all.", [])),
    # thinking cut off by max_tokens
    ("<|channel|>analysis<|message|>Hmm", ("Hmm", "", [])),
]


def _calls(calls):
    return [(call["function"]["name"], call["function"]["arguments"]) for call in calls]


@pytest.mark.parametrize(("answer", "expected"), ANSWERS)
def test_a_whole_answer_splits_into_thinking_content_and_calls(answer, expected):
    reasoning, content, calls = harmony.HarmonyParser(TOOLS).split(answer)
    assert (reasoning, content, _calls(calls)) == expected
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)


@pytest.mark.parametrize(("answer", "expected"), ANSWERS)
def test_every_cut_of_the_stream_gives_the_whole_answers_split(answer, expected):
    """Fed in two pieces at every cut (markers split included), and a character at a time: the same
    reasoning, content and calls as the whole answer, the calls' deltas adding up to them."""
    for pieces in [*([answer[:cut], answer[cut:]] for cut in range(len(answer) + 1)), list(answer)]:
        stream = harmony.HarmonyParser(TOOLS).stream()
        reasoning, content, arguments = "", "", {}
        for i, piece in enumerate(pieces):
            thought, text, deltas = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + thought, content + text
            for delta in deltas:
                arguments[delta["index"]] = arguments.get(delta["index"], "") + delta["function"]["arguments"]
        whole_reasoning, whole_content, calls = expected
        assert reasoning == (whole_reasoning or "")
        assert content == (whole_content or "")
        assert [arguments[i] for i in sorted(arguments)] == [a for _, a in calls]


def test_the_stream_holds_back_only_a_possible_marker():
    stream = harmony.HarmonyParser(TOOLS).stream()
    assert stream.feed("<|channel|>analysis<|mess") == ("", "", [])  # the header is not whole yet
    assert stream.feed("age|>Let me <|") == ("Let me ", "", [])
    assert stream.feed("end|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi", [])


def test_a_header_the_prompt_wrote_opens_the_answer():
    """A constrained answer's header is the prompt's (header_for): the model writes the body alone,
    the final answer's or a named function's arguments."""
    assert harmony.HarmonyParser(TOOLS, harmony.header_for()).split('{"a": 1}') == (None, '{"a": 1}', [])
    _, content, calls = harmony.HarmonyParser(TOOLS, harmony.header_for("get_weather")).split('{"city": "Oslo"}')
    assert content is None and _calls(calls) == [("get_weather", '{"city": "Oslo"}')]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
