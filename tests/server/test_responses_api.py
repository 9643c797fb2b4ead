"""/v1/responses against the real server (SmolLM2), through OpenAI's own client: each answer is
compared with the chat completion of the same conversation, greedy, token for token."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_text(client, messages, max_tokens) -> tuple[str, dict]:
    reply = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0,
                                           max_tokens=max_tokens)
    return reply.choices[0].message.content, reply.usage


def test_a_response_is_the_chat_answer_to_the_same_messages(client):
    response = client.responses.create(model="smollm2-135m", instructions="Answer in one sentence.",
                                       input="What is the capital of France?", temperature=0, max_output_tokens=24)
    text, usage = chat_text(client, [{"role": "system", "content": "Answer in one sentence."},
                                     {"role": "user", "content": "What is the capital of France?"}], 24)
    assert response.output_text == text and text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens,
                                                                           usage.completion_tokens)
    assert response.status == ("incomplete" if usage.completion_tokens == 24 else "completed")
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "smollm2-135m"


def test_a_streamed_response_has_the_same_text_and_ordered_events(client):
    kwargs = dict(model="smollm2-135m", input="Name three colours.", temperature=0, max_output_tokens=12)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model="smollm2-135m", input="My name is Ada. Say hello.", temperature=0,
                                    max_output_tokens=16)
    second = client.responses.create(model="smollm2-135m", input="What is my name?", temperature=0,
                                     max_output_tokens=16, previous_response_id=first.id)
    text, _ = chat_text(client, [{"role": "user", "content": "My name is Ada. Say hello."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], 16)
    assert second.output_text == text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:  # its conversation can no longer be continued
        client.responses.create(model="smollm2-135m", input="Again?", previous_response_id=second.id)
    assert missing.value.body["param"] == "previous_response_id"
    server.wait_idle()


def test_tool_calls_and_their_outputs_are_the_chat_answers(client):
    """A named tool's call, then the answer to its output: each equals chat's with the same tools."""
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    question = {"role": "user", "content": "What's the weather in Paris?"}
    called = client.responses.create(model="smollm2-135m", input=question["content"], tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     parallel_tool_calls=False, temperature=0, max_output_tokens=40)
    reference = client.chat.completions.create(
        model="smollm2-135m", messages=[question], tools=tools, parallel_tool_calls=False, temperature=0,
        max_tokens=40, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = called.output[0]
    assert [(o.type, o.name, o.arguments) for o in called.output] == [
        ("function_call", "get_weather", reference.tool_calls[0].function.arguments)]
    assert "city" in json.loads(call.arguments)
    events = list(client.responses.create(model="smollm2-135m", input=question["content"], tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"}, stream=True,
                                          parallel_tool_calls=False, temperature=0, max_output_tokens=40))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments  # in pieces as the model writes them

    answer = client.responses.create(model="smollm2-135m", previous_response_id=called.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}], temperature=0, max_output_tokens=24)
    replayed_call = {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}
    reference = client.chat.completions.create(
        model="smollm2-135m", tools=tools, temperature=0, max_tokens=24,
        messages=[question, {"role": "assistant", "content": None, "tool_calls": [replayed_call]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]).choices[0].message
    assert answer.output_text == (reference.content or "")
    assert [o.name for o in answer.output if o.type == "function_call"] == [
        c.function.name for c in reference.tool_calls or []]


@pytest.mark.parametrize("body, param, says", [
    ({"input": "hi", "max_output_tokens": 100_000}, "max_output_tokens", "maximum context length"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}], },
     "input", "input_image"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"input": "hi", "background": True}, None, "background"),
    ({"input": []}, "input", "no message"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id", "no response"),
])
def test_bad_requests_get_an_openai_error_and_leave_nothing_running(server, body, param, says):
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": "smollm2-135m", **body}, timeout=30)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"]
    server.wait_idle()


def test_a_client_that_leaves_a_stream_aborts_its_request(server):
    body = {"model": "smollm2-135m", "input": "Tell me a long story.", "stream": True, "ignore_eos": True,
            "max_output_tokens": 4000}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    server.wait_idle(timeout=3)  # 4,000 tokens would take half a minute: only an abort frees the engine this soon


def test_logprobs_are_chat_s_whole_and_streamed(client):
    kwargs = dict(model="smollm2-135m", input="Name a colour.", temperature=0, max_output_tokens=6, top_logprobs=2,
                  include=["message.output_text.logprobs"])
    whole = client.responses.create(**kwargs)
    reference = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=6, logprobs=True,
                                               top_logprobs=2, messages=[{"role": "user", "content": "Name a colour."}])

    def summary(tokens) -> list[tuple]:
        return [(t.token, t.logprob, [top.token for top in t.top_logprobs]) for t in tokens]

    expected = summary(reference.choices[0].logprobs.content)
    assert summary(whole.output[0].content[0].logprobs) == expected
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(token, logprob) for token, logprob, _ in expected]
