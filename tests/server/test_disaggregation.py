"""Disaggregated prefill: a decode server whose long prompts a prefill server computes, against
one engine computing everything itself."""

from __future__ import annotations

import httpx
import pytest

from hyperserve import LLM, SamplingParams
from tests.server.conftest import free_port, start_server, stop_server

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "2048", "--kv-cache-memory-gb", "0.25")
MIN_TOKENS = 64
BLOCK = 16


@pytest.fixture(scope="module")
def prefill_server():
    server = start_server("--role", "prefill", *FLAGS, log_name="prefill")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def decode_server(prefill_server):
    server = start_server("--role", "decode", "--prefill-url", prefill_server.url, "--disagg-min-tokens",
                          str(MIN_TOKENS), *FLAGS, log_name="decode")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def reference():
    """One engine, as `hyperserve serve` runs it, computing every prompt itself."""
    llm = LLM(max_model_len=2048, kv_cache_memory_gb=0.25)

    def answer(prompt: list[int]) -> str:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text

    return answer


@pytest.fixture(scope="module")
def story(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer("The quick brown fox jumps over the lazy dog by the river. " * 16).input_ids  # ~200


def counter(server, name: str) -> float:
    """A kv transfer counter (0 before the server's first step exports it)."""
    try:
        return server.metric(f"{name}_total")
    except KeyError:
        return 0.0


def complete(server, prompt: list[int], **extra) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_long_prompt_is_prefilled_remotely_with_the_same_answer(decode_server, prefill_server, reference, story):
    received, sent = counter(decode_server, "kv_blocks_received"), counter(prefill_server, "kv_blocks_sent")
    body = complete(decode_server, story)
    blocks = (len(story) - 1) // BLOCK
    assert counter(decode_server, "kv_blocks_received") - received == blocks
    assert counter(prefill_server, "kv_blocks_sent") - sent == blocks
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK  # computed here: the tail
    assert body["choices"][0]["text"] == reference(story)
    decode_server.wait_idle()
    prefill_server.wait_idle()  # its pin is released once the blocks are read


def test_prefix_cache_works_on_the_decode_side(decode_server, reference, story, smollm2_tokenizer):
    complete(decode_server, story)  # cached here now, by a transfer or the previous test's
    received = counter(decode_server, "kv_blocks_received")
    assert complete(decode_server, story)["choices"][0]["text"] == reference(story)
    assert counter(decode_server, "kv_blocks_received") == received, "a cached prompt moves nothing"
    longer = story + smollm2_tokenizer(" Then the fox ran into the forest and hid." * 12).input_ids
    body = complete(decode_server, longer)
    new_blocks = (len(longer) - 1) // BLOCK - (len(story) - 1) // BLOCK
    assert counter(decode_server, "kv_blocks_received") - received == new_blocks  # only what it lacked
    assert body["choices"][0]["text"] == reference(longer)


def test_a_salted_prompt_is_prefilled_apart_and_found_by_its_salt(decode_server, prefill_server, reference, story):
    """Another tenant's (cache_salt) copy of a cached prompt takes nothing of the first tenant's
    blocks on either server: it is transferred again, under its own hashes, which its next
    request finds."""
    complete(decode_server, story)  # cached unsalted on both sides
    received, sent = counter(decode_server, "kv_blocks_received"), counter(prefill_server, "kv_blocks_sent")
    blocks = (len(story) - 1) // BLOCK
    body = complete(decode_server, story, cache_salt="tenant b")
    assert counter(decode_server, "kv_blocks_received") - received == blocks
    assert counter(prefill_server, "kv_blocks_sent") - sent == blocks
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    assert body["choices"][0]["text"] == reference(story)
    assert complete(decode_server, story, cache_salt="tenant b")["choices"][0]["text"] == reference(story)
    assert counter(decode_server, "kv_blocks_received") - received == blocks  # found here: nothing moved
    decode_server.wait_idle()
    prefill_server.wait_idle()


def test_short_prompts_stay_local(decode_server, chat_prompt_ids):
    received = counter(decode_server, "kv_blocks_received")
    complete(decode_server, chat_prompt_ids[0])  # fewer than MIN_TOKENS tokens
    assert counter(decode_server, "kv_blocks_received") == received


def test_prefill_server_down_means_local_prefill(reference, story):
    server = start_server("--role", "decode", "--prefill-url", f"http://127.0.0.1:{free_port()}",
                          "--disagg-min-tokens", str(MIN_TOKENS), "--prefill-timeout-s", "5", *FLAGS,
                          log_name="decode-alone")
    try:
        body = complete(server, story)
        assert body["choices"][0]["text"] == reference(story)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert counter(server, "kv_transfer_failures") == 1
    finally:
        stop_server(server)


def test_prefill_endpoint_refuses_blocks_that_would_not_fit(prefill_server, story):
    url = f"{prefill_server.url}/v1/kv/prefill"
    response = httpx.post(url, json={"prompt_token_ids": story, "kv_identity": "another-model"})
    assert response.status_code == 409 and response.json()["error"]["param"] == "kv_identity"
    for bad in ({"prompt_token_ids": [], "kv_identity": "x"}, {"prompt_token_ids": [10**9], "kv_identity": "x"},
                {"prompt_token_ids": story, "kv_identity": "x", "skip_blocks": -1}):
        response = httpx.post(url, json=bad)
        assert response.status_code in (400, 409), response.text
    prefill_server.wait_idle()


def test_plain_servers_have_no_prefill_endpoint(server):
    response = httpx.post(f"{server.url}/v1/kv/prefill", json={"prompt_token_ids": [1], "kv_identity": "x"})
    assert response.status_code == 404
