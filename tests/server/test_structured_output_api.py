"""Structured output and tool calling through the OpenAI API, with the official client against a
real server: answers parse and validate, streaming gives what the whole response gives, and a
constraint that cannot compile is a 400 that says why before any engine work."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 40}}, "required": ["tz"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_json_schema_response_format_parses_and_validates(client, server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"]}
    for temperature in (0, 1):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "The largest city of France, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
            temperature=temperature, seed=7, max_tokens=100)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    server.wait_idle()


def test_json_object_response_format_is_a_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the name and age of a person as JSON."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_guided_extras_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="A date:", max_tokens=20, temperature=1, seed=3,
                                  extra_body={"guided_regex": r"20\d{2}-[01]\d-[0-3]\d"})
    assert len(r.choices[0].text) == 10 and r.choices[0].text.startswith("20")


@pytest.mark.parametrize("body, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}, "nope"),
    ({"guided_regex": "[a-z"}, "unclosed character class"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "one output constraint"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
])
def test_constraints_that_cannot_be_served_are_400s_that_say_why(client, server, body, reason):
    with pytest.raises(openai.BadRequestError, match=reason) as info:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, extra_body=body)
    assert info.value.body["type"] == "invalid_request_error"
    server.wait_idle()


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _joined(deltas) -> list[tuple[str, str]]:
    """Streamed call deltas as a client joins them, by index: (name, arguments text)."""
    calls: dict[int, tuple[str, str]] = {}
    for d in deltas:
        name, arguments = calls.get(d.index, ("", ""))
        calls[d.index] = (name + (d.function.name or ""), arguments + (d.function.arguments or ""))
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate_and_stream_as_they_answer(client, server, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  temperature=0, max_tokens=120)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _calls(choice.message.tool_calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_time"]

    deltas, content, finish = [], "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        deltas += delta.tool_calls or []
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    # as OpenAI streams calls: each opens with its id and name, then its arguments come in pieces
    opening = [d for d in deltas if d.id]
    assert [d.index for d in opening] == list(range(len(calls)))
    assert all(d.function.name and d.type == "function" for d in opening)
    streamed = _joined(deltas)
    assert [(name, json.loads(arguments)) for name, arguments in streamed] == calls
    assert [arguments for _, arguments in streamed] == [c.function.arguments for c in choice.message.tool_calls]
    assert len(deltas) > 2 * len(calls)
    assert content == "" and finish == "tool_calls"
    server.wait_idle()


def test_a_forced_call_cut_short_by_max_tokens_is_not_content(client, server):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=0,
                  max_tokens=12)
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content is None and not r.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(not c.choices[0].delta.content and not c.choices[0].delta.tool_calls for c in chunks)
    assert len(chunks) == 2 and chunks[-1].choices[0].finish_reason == "length"  # the role, then the end
    server.wait_idle()


def test_a_tool_result_goes_back_in(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "cloudy"})}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=30)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > 100  # the fallback prompt, the call and its result are in the prompt


# ---- other models' call formats: Llama 3's bare JSON on SmolLM2 (--tool-call-parser), Qwen3-Coder's
# XML on SmolLM2 through a chat template of that layout (--chat-template), and a Mistral-style model
# whose chat template renders tools itself and whose marker is a special token

QWEN3_CODER_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You have access to the following functions:

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments | items %}<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # Qwen3-Coder's layout, abridged: calls in XML, their arguments read as a mapping

MISTRAL_TEMPLATE = (  # Mistral 7B v0.3's layout, abridged; it rejects call ids that are not 9 characters
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for call in message.tool_calls %}"
    "{%- if call.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9') }}"
    "{%- endif %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments|tojson }}, "id": "{{ call.id }}"}'
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]</s>"
    "{%- elif message.role == 'assistant' %} {{ message.content }}</s>"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ message.content|tojson }}, "
    "\"call_id\": \"{{ message.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)


@pytest.fixture(scope="module", params=["llama3_json", "qwen3_coder", "mistral"])
def format_server(request, tmp_path_factory, smollm2_tokenizer):
    """(server, model name, format name): SmolLM2 told to write Llama 3's calls, SmolLM2 with a
    Qwen3-Coder chat template, or a random-weight Mistral-shaped model with SmolLM2's vocabulary plus
    the special token [TOOL_CALLS]."""
    from tests.conftest import tiny_config
    from tests.server.conftest import start_server, stop_server

    if request.param == "llama3_json":
        flags, model = ("--model", MODEL, "--tool-call-parser", "llama3_json"), MODEL
    elif request.param == "qwen3_coder":  # no --tool-call-parser: the template says which format
        template = tmp_path_factory.mktemp("qwen3-coder") / "template.jinja"
        template.write_text(QWEN3_CODER_TEMPLATE)
        flags, model = ("--model", MODEL, "--chat-template", str(template)), MODEL
    else:
        import copy

        import torch
        from transformers import AutoModelForCausalLM

        directory = tmp_path_factory.mktemp("mistral-tools")
        tokenizer = copy.deepcopy(smollm2_tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
        tokenizer.chat_template = MISTRAL_TEMPLATE
        tokenizer.save_pretrained(directory)
        torch.manual_seed(0)
        config = tiny_config("mistral", vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        flags, model = ("--model", str(directory)), str(directory)
    server = start_server(*flags, "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "2",
                          log_name=f"tools-{request.param}")
    yield server, model, request.param
    stop_server(server)


def test_other_call_formats_are_written_parsed_and_streamed(format_server):
    server, model, name = format_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=model, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, temperature=0, max_tokens=150)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(tool, arguments)] = _calls(choice.message.tool_calls)
    jsonschema.validate(arguments, {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[tool])
    call = choice.message.tool_calls[0]
    assert (len(call.id) == 9 and call.id.isalnum()) if name == "mistral" else call.id.startswith("call_")

    deltas, content = [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        deltas += chunk.choices[0].delta.tool_calls or []
        content += chunk.choices[0].delta.content or ""
    assert [(name, json.loads(text)) for name, text in _joined(deltas)] == [(tool, arguments)] and content == ""

    # the prompt: Mistral's and Qwen3-Coder's templates render the tools; SmolLM2's own gets them
    # described in Llama 3's format
    ids = httpx.post(f"{server.url}/tokenize", json={"model": model, "messages": ASK_WEATHER,
                                                     "tools": [WEATHER]}).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": ids}).json()["prompt"]
    if name == "mistral":
        assert "[AVAILABLE_TOOLS]" in prompt and "You can call functions" not in prompt
    elif name == "qwen3_coder":
        assert '{"type": "function", "function": {"name": "get_weather"' in prompt
        assert "<function=example_function_name>" in prompt and "You can call functions" not in prompt
    else:
        assert '{"name": "function_name", "parameters": {"argument": "value"}}' in prompt

    # the call and its result go back in, through the template (Mistral's checks the id)
    messages = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls

    # a parameter name that would end XML's tag early is refused, where other formats write it in JSON
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "boolean"}}, "required": ["a>b"]}}}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": model, "messages": ASK_WEATHER, "tools": [odd], "tool_choice": "required", "max_tokens": 40})
    if name == "qwen3_coder":
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"
        assert "'f.a>b'" in answer.json()["error"]["message"]
    else:
        assert answer.status_code == 200
        assert "a>b" in json.loads(answer.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    server.wait_idle()
