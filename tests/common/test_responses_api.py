"""The Responses API translation without a model: requests into chat requests, chat answers (whole
and streamed) into Responses, and the store that previous_response_id reads."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from hyperserve.common.responses_api import (
    ResponseBuilder,
    ResponsesRequest,
    chat_messages,
    input_items,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_request_becomes_the_chat_request_with_the_same_meaning():
    raw = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0, "seed": 7,
           "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
           "parallel_tool_calls": False, "stream": True, "unknown_field": 1,
           "input": [
               {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "reasoning", "summary": []},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
           ]}
    request = ResponsesRequest.model_validate(raw)
    system = [{"role": "system", "content": request.instructions}]
    body = request.chat_body(raw, system + chat_messages(input_items(request.input)))
    assert body == {
        "model": "m", "max_tokens": 50, "temperature": 0, "seed": 7, "stream": True,
        "stream_options": {"include_usage": True}, "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }


@pytest.mark.parametrize("extra, asked", [
    ({}, None), ({"include": ["message.output_text.logprobs"]}, 0), ({"top_logprobs": 5}, 5),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, 3)])
def test_logprobs_are_asked_of_chat_when_included(extra, asked):
    raw = {"input": "hi", **extra}
    body = ResponsesRequest.model_validate(raw).chat_body(raw, [])
    assert (body.get("logprobs"), body.get("top_logprobs")) == ((None, None) if asked is None else (True, asked))


@pytest.mark.parametrize("text, response_format", [
    ({"format": {"type": "text"}}, None),
    ({"format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
     {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}}),
])
def test_text_format_becomes_response_format(text, response_format):
    raw = {"input": "hi", "text": text}
    body = ResponsesRequest.model_validate(raw).chat_body(raw, [])
    assert body.get("response_format") == response_format
    assert ResponsesRequest.model_validate(raw).echo()["text"] == text


@pytest.mark.parametrize("extra, refusal", [
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "file_search_call.results"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
])
def test_what_cannot_be_honoured_is_refused_by_name(extra, refusal):
    assert refusal in ResponsesRequest.model_validate({"input": "hi", **extra}).refused()


def test_reasoning_effort_is_chats_reasoning_effort():
    """reasoning.effort passes to the chat request as reasoning_effort (a chat template variable:
    GPT-OSS's), and the response echoes it."""
    raw = {"input": "hi", "reasoning": {"effort": "low"}}
    request = ResponsesRequest.model_validate(raw)
    assert request.refused() is None and request.chat_body(raw, [])["reasoning_effort"] == "low"
    assert request.echo()["reasoning"] == {"effort": "low", "summary": None}


def test_unset_or_empty_settings_are_not_refused():
    request = ResponsesRequest.model_validate({"input": "hi", "reasoning": {}, "include": [], "truncation": "disabled",
                                               "background": False})
    assert request.refused() is None


@pytest.mark.parametrize("raw", [
    {"input": "hi", "tools": [{"type": "web_search"}]},
    {"input": "hi", "temperature": 3},
    {"input": "hi", "max_output_tokens": 0},
    {"input": 5},
])
def test_invalid_requests_fail_validation(raw):
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate(raw)


@pytest.mark.parametrize("item, names", [
    ({"type": "web_search_call", "id": "x"}, "web_search_call"),
    ({"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}, "call_id"),
    ({"type": "function_call_output", "call_id": "c", "output": 3}, "output"),
])
def test_unservable_input_items_are_named(item, names):
    with pytest.raises(ValueError, match=names):
        chat_messages([item])


def token_logprobs(piece: str) -> dict:
    return {"token": piece, "logprob": -len(piece) / 10, "bytes": list(piece.encode()),
            "top_logprobs": [{"token": piece, "logprob": -len(piece) / 10, "bytes": list(piece.encode())}]}


def stream_of(text_pieces: list[str], calls: list[dict], finish_reason: str) -> list[dict]:
    """Chat chunks as the server streams them: role, text (one token a piece, with its logprobs),
    calls (arguments in two pieces), finish, usage."""
    chunks = [{"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"model": "m", "choices": [{"index": 0, "delta": {"content": piece},
                                           "logprobs": {"content": [token_logprobs(piece)]}}]}
               for piece in text_pieces]
    for i, call in enumerate(calls):
        arguments = call["function"]["arguments"]
        first = {**call, "index": i, "function": {"name": call["function"]["name"], "arguments": arguments[:3]}}
        chunks.append({"model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [first]}}]})
        rest = {"index": i, "function": {"arguments": arguments[3:]}}
        chunks.append({"model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [rest]}}]})
    chunks.append({"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]})
    chunks.append({"model": "m", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                                          "total_tokens": 13,
                                                          "prompt_tokens_details": {"cached_tokens": 2}}})
    return chunks


def without_ids(response: dict) -> dict:
    text = json.dumps(response)
    for item in response["output"]:
        text = text.replace(item["id"], "ID")
    return json.loads(text.replace(response["id"], "ID"))


CALL = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("pieces, calls, finish_reason", [
    (["Hello", " there", "!"], [], "stop"),
    (["Checking."], [CALL], "tool_calls"),
    ([], [CALL], "tool_calls"),
    (["Hel", "lo"], [], "length"),
    ([], [], "stop"),
])
def test_a_streamed_answer_builds_the_same_response_as_the_whole_answer(pieces, calls, finish_reason):
    echo = ResponsesRequest.model_validate({"input": "hi"}).echo()
    streamed = ResponseBuilder(echo)
    events = streamed.start()
    for chunk in stream_of(pieces, calls, finish_reason):
        events += streamed.feed(chunk)
    events += streamed.finish()
    message = {"role": "assistant", "content": "".join(pieces) or None, **({"tool_calls": calls} if calls else {})}
    logprobs = {"content": [token_logprobs(piece) for piece in pieces]}
    whole = ResponseBuilder(echo).from_completion({
        "model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                                   "logprobs": logprobs}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 2}}})
    final = events[-1]["response"]
    assert without_ids(final) == without_ids(whole)
    assert final["status"] == ("incomplete" if finish_reason == "length" else "completed")
    assert final["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 4,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if finish_reason == "length" else "response.completed")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "".join(pieces)
    assert [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]] == \
        logprobs["content"]
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == [
        item["type"] for item in final["output"]]
    if calls:
        call = final["output"][-1]
        assert (call["call_id"], call["name"], call["arguments"]) == ("call_7", "get_weather", '{"city": "Paris"}')
        assert streamed.assistant["tool_calls"] == [CALL]  # what a later turn replays


def test_an_error_chunk_fails_the_response():
    builder = ResponseBuilder(ResponsesRequest.model_validate({"input": "hi"}).echo())
    builder.start()
    events = builder.feed({"error": {"message": "engine failed", "type": "server_error", "param": "messages"}})
    assert [e["type"] for e in events] == ["error", "response.failed"] and events[0]["param"] == "input"
    assert events[1]["response"]["error"] == {"code": "server_error", "message": "engine failed"}
    assert builder.finish() == []


@pytest.mark.parametrize("pieces, calls", [(["It is", " 4."], []), ([], [CALL]), ([], [])])
def test_a_reasoning_models_thinking_is_a_reasoning_item_whole_and_streamed(pieces, calls):
    """reasoning_content (--reasoning-parser) becomes a reasoning item before the answer, its text
    streamed as reasoning_text deltas; streamed and whole answers agree."""
    echo = ResponsesRequest.model_validate({"input": "hi"}).echo()
    thinking = [{"model": "m", "choices": [{"index": 0, "delta": {"content": "", "reasoning_content": piece}}]}
                for piece in ("2 + 2", " is 4")]
    chunks = stream_of(pieces, calls, "tool_calls" if calls else "stop")
    streamed = ResponseBuilder(echo)
    events = streamed.start()
    for chunk in chunks[:1] + thinking + chunks[1:]:
        events += streamed.feed(chunk)
    events += streamed.finish()
    message = {"role": "assistant", "content": "".join(pieces) or None, "reasoning_content": "2 + 2 is 4",
               **({"tool_calls": calls} if calls else {})}
    whole = ResponseBuilder(echo).from_completion({
        "model": "m", "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop",
                                   "logprobs": {"content": [token_logprobs(piece) for piece in pieces]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 2}}})
    assert without_ids(events[-1]["response"]) == without_ids(whole)
    reasoning = whole["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "2 + 2 is 4"}]
    assert [item["type"] for item in whole["output"][1:]] == ["function_call"] if calls else ["message"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "2 + 2 is 4"
    assert [e["text"] for e in events if e["type"] == "response.reasoning_text.done"] == ["2 + 2 is 4"]
