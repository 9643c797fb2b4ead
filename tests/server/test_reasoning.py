"""Reasoning parsers: an answer's thinking and its content, whole and however the stream cuts it."""

from __future__ import annotations

import json
import random

import pytest

from hyperserve.server import reasoning
from tests.server.conftest import save_scripted_model

CASES = [  # parser, answer, (reasoning, content)
    ("qwen3", "<think>\nLet me add.\n2 + 2 = 4\n</think>\n\nIt is 4.", ("Let me add.\n2 + 2 = 4", "It is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),  # thinking off: no think block in the answer
    ("qwen3", "<think>\n\n</think>\n\nIt is 4.", ("", "It is 4.")),
    ("qwen3", "<think>Still thinking when max_tokens came", ("Still thinking when max_tokens came", "")),
    ("qwen3", "Use <think> tags, like </think> this", (None, "Use <think> tags, like </think> this")),
    ("qwen3", "<thin", (None, "<thin")),  # ended inside what might have been the marker
    ("deepseek_r1", "Let me add.\n</think>\n\nIt is 4.", ("Let me add.", "It is 4.")),
    ("deepseek_r1", "<think>Let me add.</think>It is 4.", ("Let me add.", "It is 4.")),
    ("deepseek_r1", "Thinking < and </thin and more", ("Thinking < and </thin and more", "")),
    ("deepseek_r1", "a\n\n\nb\n</think>x</think>", ("a\n\n\nb", "x</think>")),
]


@pytest.mark.parametrize(("parser", "answer", "expected"), CASES)
def test_a_whole_answer_splits_into_thinking_and_content(parser, answer, expected):
    assert reasoning.split(parser, answer) == expected


@pytest.mark.parametrize(("parser", "answer", "expected"), CASES)
def test_every_cut_of_the_stream_gives_the_whole_answers_split(parser, answer, expected):
    """One character at a time, every two-piece cut, and random cuts: the pieces add up to the
    whole answer's split, and nothing is sent twice."""
    cuts = [list(answer)] + [[answer[:i], answer[i:]] for i in range(len(answer) + 1)]
    rng = random.Random(0)
    for _ in range(20):
        points = sorted(rng.sample(range(len(answer) + 1), min(4, len(answer) + 1)))
        cuts.append([answer[a:b] for a, b in zip([0, *points], [*points, len(answer)])])
    for pieces in cuts:
        stream = reasoning.stream(parser)
        fed = [stream.feed(piece) for piece in pieces] + [stream.feed("", final=True)]
        thought, content = "".join(r for r, _ in fed), "".join(c for _, c in fed)
        assert (thought, content) == (expected[0] or "", expected[1]), pieces


def test_thinking_streams_as_it_comes_holding_back_only_a_possible_marker():
    stream = reasoning.stream("qwen3")
    assert stream.feed("<think>\nStep one") == ("Step one", "")
    assert stream.feed(", step two.\n</th") == (", step two.", "")  # the newline may precede </think>
    assert stream.feed("ink>\n\nDone") == ("", "Done")


@pytest.mark.parametrize(("parser", "text", "token_ids", "expected"), [
    ("qwen3", "<think>a b</think>Hi", [7, 1, 2, 9, 5], 4),  # 9 is </think>: it counts as thinking
    ("qwen3", "Hi there", [5, 6], 0),  # no thinking
    ("qwen3", "<think>a b c", [7, 1, 2, 3], 4),  # cut off while thinking
    ("deepseek_r1", "a</think>Hi", [1, 9, 5], 2),
])
def test_the_thinking_tokens_are_counted_up_to_the_closing_marker(parser, text, token_ids, expected):
    assert reasoning.num_tokens(parser, text, token_ids, end_id=9) == expected


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="qwen3"):
        reasoning.stream("o1")


THOUGHT, ANSWER = ["<think>", "Let", " me", " think", "</think>"], "Hello"


@pytest.fixture(scope="module")
def scripted_model(smollm2_source, tmp_path_factory):
    """A one-layer model that answers by script: its layers add nothing, so each next token
    depends on the last one alone, and the LM head maps the prompt's last token to <think>, then
    through THOUGHT to "Hello" and <|im_end|>. SmolLM2's tokenizer with <think> and </think>
    added; its ChatML template writes an empty think block for enable_thinking false, as Qwen3's."""
    from hyperserve.models.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_source)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template += ("{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
                                "{{ '<think>\n\n</think>\n\n' }}{% endif %}")
    hi = [{"role": "user", "content": "Hi"}]
    thinking = list(tokenizer.apply_chat_template(hi, add_generation_prompt=True, return_dict=False))
    direct = list(tokenizer.apply_chat_template(hi, add_generation_prompt=True, return_dict=False,
                                                enable_thinking=False))
    chain = [thinking[-1], *tokenizer.convert_tokens_to_ids(["<think>"]),
             *[tokenizer(piece, add_special_tokens=False).input_ids[0] for piece in THOUGHT[1:4]],
             *tokenizer.convert_tokens_to_ids(["</think>"]), tokenizer(ANSWER).input_ids[0],
             tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert len(set(chain + [direct[-1]])) == len(chain) + 1, "the script's tokens must differ"
    links = [*zip(chain, chain[1:]), (direct[-1], chain[-2])]
    return save_scripted_model(tokenizer, links, chain[-1], tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def client(scripted_model):
    from hyperserve.engine.engine import LLMEngine
    from hyperserve.server.app import build_app
    from hyperserve.server.model_pool import ModelEntry
    from hyperserve.server.settings import ServerSettings
    from tests.server.conftest import serve_in_process

    entry = ModelEntry("thinker", lambda: LLMEngine.from_kwargs(model=scripted_model, dtype="float32",
                                                                num_kv_blocks=64, max_model_len=512))
    client = serve_in_process(build_app([entry], ServerSettings(model_name="thinker", reasoning_parser="qwen3")))
    yield client
    client.__exit__(None, None, None)


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0}


def streamed(client, body: dict) -> tuple[str, str]:
    """(reasoning_content, content) of a chat answer, streamed."""
    thought, content = "", ""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    thought += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return thought, content


def test_the_thinking_of_an_answer_is_its_reasoning_content(client):
    raw = client.post("/v1/completions", json={"prompt": client.post("/tokenize", json=CHAT).json()["tokens"],
                                               "max_tokens": 16, "temperature": 0}).json()
    assert raw["choices"][0]["text"] == "".join(THOUGHT) + ANSWER  # the model's own text: the parser splits it
    answer = client.post("/v1/chat/completions", json=CHAT).json()
    whole = answer["choices"][0]
    assert whole["message"]["reasoning_content"] == "Let me think"
    assert whole["message"]["content"] == ANSWER and whole["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == len(THOUGHT) + 2  # the answer, and <|im_end|>
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHT)}
    assert streamed(client, CHAT) == ("Let me think", ANSWER)


def test_chat_template_kwargs_reach_the_template(client):
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    answer = client.post("/v1/chat/completions", json=body).json()
    message = answer["choices"][0]["message"]
    assert message["content"] == ANSWER and "reasoning_content" not in message
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    for kwargs in ({"tokenize": True}, {"chat_template": "{{ 1 }}"}, {"not a name": 1}):
        response = client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_the_responses_and_messages_apis_carry_the_thinking_through_their_sdks(client):
    """A reasoning item before the message (OpenAI's SDK, whole and streamed), a thinking block
    before the text (Anthropic's)."""
    import anthropic
    import openai

    responses = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client).responses
    whole = responses.create(model="thinker", input="Hi", max_output_tokens=16, temperature=0)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Let me think" and whole.output_text == ANSWER
    assert whole.usage.output_tokens_details.reasoning_tokens == len(THOUGHT)
    with responses.stream(model="thinker", input="Hi", max_output_tokens=16, temperature=0) as stream:
        thought = "".join(event.delta for event in stream if event.type == "response.reasoning_text.delta")
        streamed = stream.get_final_response()
    assert thought == "Let me think" and streamed.output[0].content[0].text == thought
    assert streamed.output_text == ANSWER
    messages = anthropic.Anthropic(base_url="http://testserver", api_key="-", http_client=client).messages
    answer = messages.create(model="thinker", max_tokens=16, messages=[{"role": "user", "content": "Hi"}])
    assert [(block.type, getattr(block, "thinking", None) or getattr(block, "text", None))
            for block in answer.content] == [("thinking", "Let me think"), ("text", ANSWER)]
    with messages.stream(model="thinker", max_tokens=16, messages=[{"role": "user", "content": "Hi"}]) as stream:
        final = stream.get_final_message()
    assert [block.model_dump(include={"type", "thinking", "text"}) for block in final.content] == \
        [block.model_dump(include={"type", "thinking", "text"}) for block in answer.content]


def test_a_constrained_answer_thinks_first_then_follows_its_constraint(client):
    """The script answers "Hello"; the constraint allows "Bye" alone. It applies after </think>:
    the thinking stays, and the content is the constraint's. With the thinking closed in the prompt,
    from the first token."""
    body = {**CHAT, "guided_choice": ["Bye"]}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me think", "Bye")
    assert streamed(client, body) == ("Let me think", "Bye")
    schema = {"type": "object", "properties": {"word": {"enum": ["Bye"]}}, "required": ["word"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    message = client.post("/v1/chat/completions", json={**CHAT, "response_format": fmt}).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think" and json.loads(message["content"]) == {"word": "Bye"}
    closed = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    message = client.post("/v1/chat/completions", json=closed).json()["choices"][0]["message"]
    assert message["content"] == "Bye" and "reasoning_content" not in message


@pytest.mark.parametrize(("parser", "prompt", "expected"), [
    ("qwen3", [1, 2, 3], (False,)),  # no marker: the answer may open its thinking
    ("deepseek_r1", [1, 2, 3], (True,)),  # ... or starts in it
    ("qwen3", [1, 7, 5], (True,)),  # the prompt opened it
    ("qwen3", [1, 7, 5, 9, 0], None),  # and closed it: only blank text follows
    ("qwen3", [7, 5, 9, 4, 1], (False,)),  # an earlier turn's thinking, closed: the answer may think again
])
def test_where_a_constrained_answer_starts_is_read_from_the_prompt(parser, prompt, expected):
    decode = {0: "\n\n", 1: "Hi", 4: "It is 4.", 5: "hmm"}.__getitem__
    thinking = reasoning.thinking_before(parser, prompt, 7, 9, lambda ids: "".join(map(decode, ids)))
    assert (thinking if thinking is None else (thinking.open,)) == expected
