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


def test_a_reasoning_models_thinking_replays_and_folds_back():
    body = {"id": "x", "created": 1, "model": "m", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "4.", "reasoning_content": "2 + 2"},
                         "logprobs": None, "finish_reason": "stop"}], "usage": None}
    assert _fold(list(replay(body, chat=True, include_usage=False)), chat=True) == body
    pieces = [{"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
              for delta in ({"content": "", "reasoning_content": "2 +"}, {"content": "", "reasoning_content": " 2"},
                            {"content": "4."})]
    folded = StreamAccumulator(chat=True)
    for piece in [*pieces, {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]:
        folded.add(piece)
    assert folded.response()["choices"][0]["message"] == body["choices"][0]["message"]


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


def test_logprobs_of_streamed_chunks_fold_into_the_whole_answers():
    """A streamed miss is cached with its logprobs, so a later hit that asked for them gets them."""
    entry = {"token": "Par", "logprob": -0.1, "bytes": [80, 97, 114], "top_logprobs": []}
    folded = StreamAccumulator(chat=True)
    folded.add({"id": "x", "choices": [{"index": 0, "delta": {"content": "Par"}, "logprobs": {"content": [entry]},
                                        "finish_reason": None}]})
    folded.add({"id": "x", "choices": [{"index": 0, "delta": {"content": "is"},
                                        "logprobs": {"content": [{**entry, "token": "is"}]},
                                        "finish_reason": "stop"}]})
    assert folded.response()["choices"][0]["logprobs"] == {"content": [entry, {**entry, "token": "is"}]}
    completion = StreamAccumulator(chat=False)
    for i, token in enumerate([" Par", "is"]):
        logprobs = {"tokens": [token], "token_logprobs": [-0.5], "top_logprobs": [{token: -0.5}],
                    "text_offset": [4 * i]}
        completion.add({"id": "x", "choices": [{"index": 0, "text": token, "logprobs": logprobs,
                                                "finish_reason": "stop" if i else None}]})
    assert completion.response()["choices"][0]["logprobs"] == {
        "tokens": [" Par", "is"], "token_logprobs": [-0.5, -0.5], "top_logprobs": [{" Par": -0.5}, {"is": -0.5}],
        "text_offset": [0, 4]}
    body = {"id": "x", "created": 1, "model": "m", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"},
                         "logprobs": {"content": [entry]}, "finish_reason": "stop"}], "usage": None}
    assert _fold(list(replay(body, chat=True, include_usage=False)), chat=True) == body
