import json

from hyperserve.gateway.streaming import StreamAccumulator, replay


def _fold(events, chat):
    folded = StreamAccumulator(chat)
    for event in events:
        data = event.removeprefix("data: ").strip()
        if data != "[DONE]":
            folded.add(json.loads(data))
    return folded.response()


def test_replayed_chat_answer_folds_back_to_the_same_answer():
    body = {"id": "x", "created": 1, "model": "m", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "logprobs": None,
                         "finish_reason": "stop"},
                        {"index": 1, "message": {"role": "assistant", "content": "It is Paris"}, "logprobs": None,
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    events = list(replay(body, chat=True, include_usage=True))
    assert events[-1] == "data: [DONE]\n\n"
    assert _fold(events, chat=True) == body


def test_completion_replay_without_usage():
    body = {"id": "x", "created": 1, "model": "m", "object": "text_completion",
            "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    events = list(replay(body, chat=False, include_usage=False))
    assert not any('"usage"' in e for e in events)
    assert _fold(events, chat=False)["choices"] == body["choices"]


def test_unfinished_stream_is_not_an_answer():
    folded = StreamAccumulator(chat=True)
    folded.add({"id": "x", "choices": [{"index": 0, "delta": {"content": "Par"}, "finish_reason": None}]})
    assert folded.response() is None


def test_tool_calls_replay_and_fold_back():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"c": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]
    body = {"id": "x", "created": 1, "model": "m", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                         "logprobs": None, "finish_reason": "tool_calls"}], "usage": None}
    assert _fold(list(replay(body, chat=True, include_usage=False)), chat=True) == body


def test_tool_call_arguments_streamed_in_pieces_are_joined():
    folded = StreamAccumulator(chat=True)
    folded.add({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]},
        "finish_reason": None}]})
    folded.add({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": ': 1}'}}]}, "finish_reason": "tool_calls"}]})
    message = folded.response()["choices"][0]["message"]
    assert message["tool_calls"] == [{"id": "call_1", "type": "function", "function": {"name": "f",
                                                                                      "arguments": '{"a": 1}'}}]
    assert message["content"] is None
