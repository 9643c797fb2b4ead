"""A harmony-speaking model (GPT-OSS's format) behind the chat API: its calls, constrained answers and
markers, end to end (the format's reading itself: tests/server/test_harmony.py)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import save_scripted_model

# a harmony template in miniature: GPT-OSS's renders tools as a developer message too
TEMPLATE = ("{% for m in messages %}{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>"
            "{{ m.thinking }}<|end|>{% endif %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if tools %}<|start|>developer<|message|># Tools"
            "{% for t in tools %} functions.{{ t.function.name }}{% endfor %}<|end|>{% endif %}"
            "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}"
            "<|end|>{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
ARGUMENTS = '{"city": "Paris"}'
SCRIPT = ["<|channel|>", "commentary", " to=functions.get_weather ", "<|constrain|>", "json", "<|message|>",
          ARGUMENTS, "<|call|>"]


@pytest.fixture(scope="module")
def harmony_model(smollm2_source, tmp_path_factory):
    """A one-layer model that answers by script (as tests/server/test_reasoning.py's): from the
    generation prompt's last token it writes SCRIPT, a call to get_weather in harmony; from a
    <|message|> the prompt wrote, the call's arguments. SmolLM2's tokenizer with harmony's markers
    as special tokens and SCRIPT's words as tokens."""
    from tokenizers import AddedToken

    from hyperserve.models.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_source)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.add_tokens([AddedToken(word, normalized=False) for word in SCRIPT if word not in MARKERS])
    tokenizer.chat_template = TEMPLATE
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           return_dict=False)
    chain = [prompt[-1], *tokenizer.convert_tokens_to_ids(SCRIPT)]
    assert len(set(chain)) == len(chain), "the script's tokens must differ"
    eos = tokenizer.convert_tokens_to_ids(["<|call|>", "<|return|>"])
    return save_scripted_model(tokenizer, list(zip(chain, chain[1:])), eos, tmp_path_factory.mktemp("harmony"))


@pytest.fixture(scope="module")
def client(harmony_model):
    from hyperserve.engine.engine import LLMEngine
    from hyperserve.server.app import build_app
    from hyperserve.server.model_pool import ModelEntry
    from hyperserve.server.settings import ServerSettings
    from tests.server.conftest import serve_in_process

    entry = ModelEntry("oss", lambda: LLMEngine.from_kwargs(model=harmony_model, dtype="float32",
                                                            num_kv_blocks=64, max_model_len=512))
    client = serve_in_process(build_app([entry], ServerSettings(model_name="oss")))
    yield client
    client.__exit__(None, None, None)


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0,
        "tools": [tool("get_weather")]}


def test_a_harmony_call_is_a_tool_call_whole_and_streamed(client):
    """The model's text keeps the markers (a completion shows them); the chat answer is the call
    alone, its finish reason tool_calls, streamed as OpenAI's deltas that add up to it. The
    template rendered the tools itself (no fallback prompt)."""
    prompt = client.post("/tokenize", json=CHAT).json()["tokens"]
    assert "# Tools functions.get_weather" in client.post("/detokenize", json={"tokens": prompt}).json()["prompt"]
    raw = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                               "skip_special_tokens": False}).json()
    assert raw["choices"][0]["text"].startswith("<|channel|>commentary to=functions.get_weather <|constrain|>json")
    choice = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    name, arguments, finish = None, "", None
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for chunk_choice in json.loads(line[6:])["choices"]:
                    delta = chunk_choice["delta"]
                    assert not delta.get("content") and "<|" not in json.dumps(delta)
                    for piece in delta.get("tool_calls") or []:
                        name = piece["function"].get("name") or name
                        arguments += piece["function"].get("arguments") or ""
                    finish = chunk_choice["finish_reason"] or finish
    assert (name, arguments, finish) == ("get_weather", ARGUMENTS, "tool_calls")


def test_a_constrained_answer_is_the_body_of_a_header_the_prompt_writes(client):
    """response_format: the prompt opens the final channel and the model writes the JSON as the
    answer's content; a named tool_choice: the prompt opens the call's header, the model its
    arguments under the function's schema."""
    body = {"messages": CHAT["messages"], "max_tokens": 16, "temperature": 0,
            "response_format": {"type": "json_object"}}
    answer = client.post("/v1/chat/completions", json=body).json()  # after "assistant" it would write <|channel|>
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": ARGUMENTS}
    named = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = client.post("/v1/chat/completions", json=named).json()["choices"][0]
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGUMENTS}


def test_reasoning_effort_reaches_the_template(client):
    """OpenAI's reasoning_effort is a variable of the chat template, which GPT-OSS's writes into its
    system message."""
    usage = [client.post("/v1/chat/completions", json={**CHAT, **effort}).json()["usage"]["prompt_tokens"]
             for effort in ({}, {"reasoning_effort": "high"})]
    written = client.post("/tokenize", json={"prompt": "<|start|>system<|message|>Reasoning: high<|end|>"})
    assert usage[1] - usage[0] == written.json()["count"]


def test_earlier_thinking_goes_back_to_the_template(client):
    """An assistant message's reasoning_content, as answers carry it, is the template's `thinking`
    (GPT-OSS's shows the model its thinking before a call it made)."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "A greeting."},
                {"role": "user", "content": "Bye"}]
    tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|message|>Hello" in prompt


def test_required_with_several_tools_makes_the_model_call_one_of_them(client):
    """tool_choice "required" with several functions: the prompt opens a call's header up to its
    recipient, and a grammar holds the model to an offered name, the rest of the header (its
    markers special tokens) and arguments its schema allows. This scripted model, which writes no
    call from there by itself, is held to one: the first offered name in token order, then from
    <|message|> its scripted arguments. Streamed, the same call."""
    body = {**CHAT, "tools": [tool("get_weather"), tool("get_time")], "tool_choice": "required", "max_tokens": 48}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": ARGUMENTS}
    name, arguments = None, ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for piece in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                    name = piece["function"].get("name") or name
                    arguments += piece["function"].get("arguments") or ""
    assert (name, arguments) == ("get_time", ARGUMENTS)
