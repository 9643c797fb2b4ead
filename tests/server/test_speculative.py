"""`hyperserve serve --speculative-method ngram`: the same greedy text as the plain server, streamed,
with the speculation counters in /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
GROUNDED = [{"role": "user", "content": "Repeat exactly: " + "one two three four five six seven. " * 4}]


@pytest.fixture(scope="module")
def ngram_server():
    s = start_server("--kv-cache-memory-gb", "0.5", "--speculative-method", "ngram",
                     "--num-speculative-tokens", "5", log_name="ngram")
    yield s
    stop_server(s)


def _streamed_text(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=GROUNDED, temperature=0, max_tokens=60,
                                            stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_speculative_server_streams_the_same_greedy_text(ngram_server, server):
    assert _streamed_text(ngram_server.url) == _streamed_text(server.url)
    accepted = ngram_server.metric("spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= ngram_server.metric("spec_decode_num_draft_tokens_total")
    assert ngram_server.metric("spec_decode_mean_accepted_length") > 1
    ngram_server.wait_idle()


def test_a_question_asked_again_is_drafted_from_its_first_answer(ngram_server, server):
    """Open chat has little to copy from its prompt; asked again, the first answer is the draft."""
    messages = [{"role": "user", "content": "What are the benefits of regular exercise?"}]

    def ask(url: str) -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=80)
        return r.choices[0].message.content

    expected, accepted = ask(server.url), []
    for _ in range(2):
        before = ngram_server.metric("spec_decode_num_accepted_tokens_total")
        assert ask(ngram_server.url) == expected
        accepted.append(ngram_server.metric("spec_decode_num_accepted_tokens_total") - before)
    assert accepted[1] > max(2 * accepted[0], 50), accepted  # of 79 tokens after the first
    by_source = {line.split('source="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                 for line in httpx.get(f"{ngram_server.url}/metrics").text.splitlines()
                 if line.startswith("hyperserve:spec_decode_num_accepted_tokens_by_source_total{")}
    assert by_source["history"] > accepted[1] / 2, by_source  # the first answer drafted most of the second
    ngram_server.wait_idle()


def test_a_prediction_is_drafted_on_a_server_without_a_method(server):
    """OpenAI's Predicted Outputs on the plain server: the same answer whatever the prediction;
    a prediction that is the answer drafts most of it, counted in usage as OpenAI counts it."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    paragraph = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin covers "
                 "seven million square kilometres, of which five and a half million are covered by the "
                 "rainforest. The region includes territory belonging to nine nations. The majority of the "
                 "forest is contained within Brazil, with 60% of the rainforest, followed by Peru with 13%, "
                 "and Colombia with 10%.")
    question = f"Repeat the following paragraph exactly:\n\n{paragraph}"
    ask = dict(model=MODEL, temperature=0, max_tokens=100, messages=[{"role": "user", "content": question}])
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens > 40 and plain.usage.completion_tokens_details is None
    right = client.chat.completions.create(**ask, prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= plain.usage.completion_tokens - 10, details
    assert details.rejected_prediction_tokens <= 5, details
    unlike = {"type": "content", "content": [{"type": "text", "text": "Nothing alike. "}]}
    stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True},
                                            prediction=unlike)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens < details.rejected_prediction_tokens, details
    for prediction in ({"type": "image", "content": "x"},
                       {"type": "content", "content": [{"type": "image_url"}]}):
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={**ask, "prediction": prediction},
                           timeout=30)
        assert reply.status_code == 400 and "prediction" in reply.text, reply.text
    server.wait_idle()
