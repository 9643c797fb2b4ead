"""/v1/messages against the real server (SmolLM2), through Anthropic's own client: each answer is
compared with the chat completion of the same conversation, greedy, token for token."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

MODEL = "smollm2-135m"
GREEDY = {"extra_body": {"temperature": 0}}  # Anthropic's client no longer takes temperature itself
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": WEATHER["input_schema"]}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture
def chat(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0).chat.completions


def test_a_message_is_the_chat_answer_to_the_same_conversation(client, chat):
    message = client.messages.create(model=MODEL, max_tokens=24, system="Answer briefly.", messages=QUESTION,
                                     **GREEDY)
    reference = chat.create(model=MODEL, max_tokens=24, temperature=0,
                            messages=[{"role": "system", "content": "Answer briefly."}, *QUESTION])
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == reference.choices[0].message.content
    assert (message.usage.input_tokens, message.usage.output_tokens) == (reference.usage.prompt_tokens,
                                                                         reference.usage.completion_tokens)
    assert message.stop_reason == ("max_tokens" if reference.choices[0].finish_reason == "length" else "end_turn")
    counted = client.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=QUESTION)
    assert counted.input_tokens == reference.usage.prompt_tokens


def test_a_prefilled_answer_goes_on_from_the_prefill(client, chat):
    """Anthropic's prefill: a last assistant message is the start of the answer, which continues it."""
    prefilled = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    message = client.messages.create(model=MODEL, max_tokens=8, messages=prefilled, **GREEDY)
    reference = chat.create(model=MODEL, max_tokens=8, temperature=0, messages=prefilled,
                            extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert message.content[0].text == reference.choices[0].message.content
    assert "Paris" in message.content[0].text and message.usage.input_tokens == reference.usage.prompt_tokens


def test_a_streamed_message_is_the_whole_one(client):
    kwargs = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Name three colours."}], **GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_a_stop_sequence_is_reported_as_anthropic_reports_it(client, chat):
    message = client.messages.create(model=MODEL, max_tokens=24, stop_sequences=["Paris"], messages=QUESTION,
                                     **GREEDY)
    reference = chat.create(model=MODEL, max_tokens=24, temperature=0, stop=["Paris"], messages=QUESTION)
    assert message.content[0].text == reference.choices[0].message.content
    assert reference.choices[0].stop_reason == "Paris"  # vLLM's field: the stop string that ended it
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_and_tool_results_are_the_chat_answers(client, chat, stream):
    kwargs = dict(model=MODEL, max_tokens=40, tools=[WEATHER], **GREEDY,
                  messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    pieces = []
    if stream:
        with client.messages.stream(**kwargs) as events:
            pieces = [e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    reference = chat.create(model=MODEL, max_tokens=40, temperature=0, tools=[CHAT_WEATHER], parallel_tool_calls=False,
                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                            messages=[{"role": "user", "content": "Weather in Paris?"}]).choices[0].message
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [
        ("tool_use", "get_weather", json.loads(reference.tool_calls[0].function.arguments))]
    if stream:  # the input arrives in pieces as the model writes it
        assert len(pieces) > 1 and "".join(pieces) == reference.tool_calls[0].function.arguments

    use = message.content[0]
    answer = client.messages.create(model=MODEL, max_tokens=24, tools=[WEATHER], **GREEDY, messages=[
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}])
    replayed = {"id": use.id, "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}
    reference = chat.create(model=MODEL, max_tokens=24, temperature=0, tools=[CHAT_WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [replayed]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}]).choices[0].message
    assert [b.text for b in answer.content if b.type == "text"] == ([reference.content] if reference.content else [])


@pytest.mark.parametrize("body, says", [
    ({"max_tokens": 5, "messages": QUESTION, "temperature": 1.5}, "temperature"),
    ({"messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, "image"),
    ({"max_tokens": 5, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 100_000, "messages": QUESTION}, "maximum context length"),
])
def test_bad_requests_get_anthropic_errors_and_leave_nothing_running(server, body, says):
    reply = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    assert says in reply.json()["error"]["message"]
    server.wait_idle()
