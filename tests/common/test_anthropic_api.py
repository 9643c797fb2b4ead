"""The Messages API translation without a model: Anthropic's messages into chat's, and chat answers
(whole and streamed) into Messages."""

from __future__ import annotations

import json

import pytest

from hyperserve.common.anthropic_api import MessageBuilder, MessagesRequest, anthropic_error, chat_messages


def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_messages():
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "...", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    assert chat_messages(messages) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {"id": f"toolu_{i}", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
            for i, city in ((1, "Paris"), (2, "Rome"))]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]


def test_a_request_becomes_the_chat_request_with_the_same_meaning():
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["##"],
        "temperature": 0.5, "top_k": 5, "stream": True, "metadata": {"user_id": "u1"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "hi"}]})
    assert request.chat_body() == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}, "model": "m", "temperature": 0.5,
        "top_k": 5, "stop": ["##"], "user": "u1", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}], "tool_choice": "required", "parallel_tool_calls": True}


@pytest.mark.parametrize("body, says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}, "thinking"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "name"),
])
def test_what_cannot_be_served_is_named(body, says):
    with pytest.raises(ValueError, match=says):
        MessagesRequest.model_validate({"max_tokens": 5, **body}).chat_body()


def stream_of(text: str, arguments: str | None, finish_reason: str, stop_reason: str | None = None) -> list[dict]:
    chunks = [{"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"model": "m", "choices": [{"index": 0, "delta": {"content": piece}}]}
               for piece in text.split("|") if piece]
    if arguments is not None:
        call = {"index": 0, "id": "call_1", "function": {"name": "f", "arguments": arguments[:4]}}
        chunks.append({"model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
        rest = {"index": 0, "function": {"arguments": arguments[4:]}}
        chunks.append({"model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [rest]}}]})
    chunks.append({"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason,
                                              "stop_reason": stop_reason}]})
    chunks.append({"model": "m", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                                          "total_tokens": 10}})
    return chunks


@pytest.mark.parametrize("text, arguments, finish_reason, stop_reason", [
    ("Hello| there", None, "stop", None),
    ("Hel|lo", None, "length", None),
    ("The answer is ", None, "stop", "##"),
    ("Checking.", '{"city": "Paris"}', "tool_calls", None),
    ("", '{"city": "Paris"}', "tool_calls", None),
    ("", None, "stop", None),
])
def test_a_streamed_message_builds_the_whole_message(text, arguments, finish_reason, stop_reason):
    streamed = MessageBuilder(["##"])
    events = streamed.start()
    for chunk in stream_of(text, arguments, finish_reason, stop_reason):
        events += streamed.feed(chunk)
    events += streamed.finish()
    message = {"role": "assistant", "content": text.replace("|", "") or None}
    if arguments is not None:
        message["tool_calls"] = [{"id": "call_1", "type": "function",
                                  "function": {"name": "f", "arguments": arguments}}]
    whole = MessageBuilder(["##"]).from_completion({"model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 3},
                                                    "choices": [{"message": message, "finish_reason": finish_reason,
                                                                 "stop_reason": stop_reason}]})
    final = {**streamed.message(), "id": whole["id"]}
    assert final == whole
    assert whole["stop_reason"] == {"stop": "stop_sequence" if stop_reason else "end_turn", "length": "max_tokens",
                                    "tool_calls": "tool_use"}[finish_reason]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == list(range(len(whole["content"]))) == stops
    partial = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial or "{}") == ({"city": "Paris"} if arguments else {})


def test_errors_take_anthropic_s_shape():
    body = {"error": {"message": "too many", "type": "rate_limit_error", "param": None, "code": None}}
    assert anthropic_error(429, body) == {"type": "error", "error": {"type": "rate_limit_error", "message": "too many"}}
    assert anthropic_error(500, body)["error"]["type"] == "api_error"
    failed = MessageBuilder([])
    assert failed.feed({"error": {"message": "engine stopped", "type": "service_unavailable"}}) == [
        {"type": "error", "error": {"type": "overloaded_error", "message": "engine stopped"}}]
    assert failed.finish() == []


@pytest.mark.parametrize("text, arguments", [("It is| 4.", None), ("", '{"city": "Paris"}'), ("", None)])
def test_a_reasoning_models_thinking_is_a_thinking_block_whole_and_streamed(text, arguments):
    finish_reason = "tool_calls" if arguments else "stop"
    chunks = stream_of(text, arguments, finish_reason)
    thinking = [{"model": "m", "choices": [{"index": 0, "delta": {"content": "", "reasoning_content": piece}}]}
                for piece in ("2 + 2", " is 4")]
    streamed = MessageBuilder([])
    events = streamed.start()
    for chunk in chunks[:1] + thinking + chunks[1:]:
        events += streamed.feed(chunk)
    events += streamed.finish()
    message = {"role": "assistant", "content": text.replace("|", "") or None, "reasoning_content": "2 + 2 is 4"}
    if arguments is not None:
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        message["tool_calls"] = [call]
    whole = MessageBuilder([]).from_completion({"model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 3},
                                                "choices": [{"message": message, "finish_reason": finish_reason}]})
    assert {**streamed.message(), "id": whole["id"]} == whole
    assert whole["content"][0] == {"type": "thinking", "thinking": "2 + 2 is 4", "signature": ""}
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(whole["content"])))
    assert "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "thinking_delta") == "2 + 2 is 4"
