"""The official openai client (sync, async, streaming) against a real server process."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from hyperserve import __version__

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
# float32 answers "The capital of France is Paris." by a margin of 1.5 nats on the first token; asked
# without "Answer in one word." it starts "The" or "L'Étoile..." by 0.08 nats, which any kernel change flips
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_health_was_503_while_loading(server):
    assert server.statuses_while_loading[0] == 503 and server.statuses_while_loading[-1] == 200
    assert httpx.get(f"{server.url}/ping").json() == {"status": "ok"}  # vLLM's and SageMaker's probe
    assert httpx.post(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_models_lists_the_served_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "all-MiniLM-L6-v2"]  # the second embeds


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_with_string_list_and_token_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 10
    ids = client.completions.create(model=MODEL, prompt=[504, 3821, 314], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_greedy_completion_equals_the_offline_engine(client, smollm2_tokenizer):
    from hyperserve import LLM, SamplingParams

    # a prompt that shares no prefix block with other tests' (chat prompts share the template's
    # system turn): a prefix-cache hit would prefill fewer rows on the server, and int4 (this
    # GGUF's default) computes a few rows with another kernel than many
    text = "Lighthouse keepers on the northern islands kept a log of every ship that"
    prompt = smollm2_tokenizer(text).input_ids
    llm = LLM(num_kv_blocks=64, max_model_len=1024)
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == expected[0].outputs[0].text


def test_beam_search_answers_as_the_offline_engine(client, smollm2_tokenizer):
    """vLLM's use_beam_search: the n best answers of a search n beams wide, best first, as
    LLM.beam_search gives them (streamed: all at once); what a beam search cannot honour is a 400.
    The prompt shares no prefix with other tests', so that the server's rounds prefill as many rows
    as the offline engine's (int4 computes a few rows with another kernel than many)."""
    from hyperserve import LLM, BeamSearchParams

    prompt = smollm2_tokenizer("The recipe for bread calls for").input_ids
    llm = LLM(num_kv_blocks=64, max_model_len=1024)
    expected = llm.beam_search([prompt], BeamSearchParams(3, 16), use_tqdm=False)[0].outputs
    beams = {"use_beam_search": True}
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, n=3, stream=True,
                                       stream_options={"include_usage": True}, extra_body=beams)
    texts, usage = ["", "", ""], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [e.text for e in expected] and len(set(texts)) == 3
    assert usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, n=2,
                                          extra_body=beams)
    assert [c.index for c in chat.choices] == [0, 1] and "Paris" in chat.choices[0].message.content
    assert chat.choices[0].message.content != chat.choices[1].message.content
    with pytest.raises(openai.BadRequestError, match="beam search does not take stop, logprobs"):
        client.completions.create(model=MODEL, prompt="Hi", n=2, stop=["x"], logprobs=1, extra_body=beams)
    with pytest.raises(openai.BadRequestError, match="up to 10"):
        client.completions.create(model=MODEL, prompt="Hi", n=11, extra_body=beams)
    with pytest.raises(openai.BadRequestError, match="length_penalty"):
        client.completions.create(model=MODEL, prompt="Hi", n=2, extra_body={**beams, "length_penalty": -1e6})


def test_n_samples_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0, n=3, seed=11)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1


def test_stop_string_is_not_returned(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    text = full.choices[0].message.content
    stop = text.split()[3]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                       stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop)]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.logprob <= 0


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=3, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(3)]


def test_streamed_completion_logprobs_are_the_whole_answers(client):
    """Each chunk's text_offset counts from the completion's start, as in the whole answer."""
    kwargs = dict(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True) if c.choices]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for lp in chunks if lp for v in getattr(lp, field)] == getattr(whole, field), field


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, smollm2_tokenizer):
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs=1 and one
    output token. Each prompt token after the first has its logprob, the same as vLLM's
    `prompt_logprobs` gives, and the top one's beside it."""
    prompts = [smollm2_tokenizer.encode(t) for t in ("The capital of France is Paris",
                                                      "Two plus two is four")]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
                                  echo=True, extra_body={"prompt_logprobs": 1})
    assert len(r.choices) == 2
    for prompt, choice in zip(prompts, r.choices):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1 and "".join(lp.tokens) == choice.text
        assert choice.text.startswith(smollm2_tokenizer.decode(prompt))
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v < 0 for v in lp.token_logprobs[1:])
        assert all(max(top.values()) >= v for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
        vllm = choice.prompt_logprobs
        assert vllm[0] is None and len(vllm) == len(prompt)
        theirs = [vllm[i][str(t)]["logprob"] for i, t in enumerate(prompt) if i]
        assert theirs == lp.token_logprobs[1:len(prompt)]
    # "Paris" after "The capital of France is" is far likelier than after "Two plus two is"
    paris = r.choices[0].logprobs.token_logprobs[len(prompts[0]) - 1]
    assert paris > -3


def test_streams_send_prompt_logprobs_with_their_first_chunk(client):
    """vLLM's prompt_logprobs in a stream: with each completion choice's first chunk, beside a
    chat answer's first choices; the same as the whole answer's."""
    extra = {"extra_body": {"prompt_logprobs": 2}}
    kwargs = dict(model=MODEL, prompt="One, two, three,", max_tokens=3, temperature=0, **extra)
    whole = client.completions.create(**kwargs).choices[0].prompt_logprobs
    stream = client.completions.create(**kwargs, stream=True)
    chunks = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    assert chunks[0] == whole and whole[0] is None and len(whole) > 3 and not any(chunks[1:])
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, **extra)
    whole = client.chat.completions.create(**kwargs).model_extra["prompt_logprobs"]
    stream = client.chat.completions.create(**kwargs, stream=True)
    chunks = [c.model_extra.get("prompt_logprobs") for c in stream]
    assert [c for c in chunks if c] == [whole] and whole[0] is None and len(whole) > 10


def test_streamed_echo_sends_the_prompt_first_and_the_same_logprobs(client):
    kwargs = dict(model=MODEL, prompt="One, two, three,", max_tokens=4, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[0].text.startswith("One, two, three,")
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        streamed = [v for c in chunks if c.logprobs for v in getattr(c.logprobs, field)]
        assert streamed == getattr(whole.logprobs, field)
    assert whole.logprobs.text_offset == [sum(len(t) for t in whole.logprobs.tokens[:i])
                                          for i in range(len(whole.logprobs.tokens))]
    plain = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4, temperature=0,
                                      echo=True)
    assert plain.choices[0].text == whole.text and plain.choices[0].logprobs is None


def test_vllm_extras_shape_the_prompt_and_the_answer(client, smollm2_tokenizer):
    """continue_final_message goes on with a prefilled answer; truncate_prompt_tokens keeps the
    prompt's end; min_tokens holds back the end of a one-word answer."""
    prefilled = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=MODEL, messages=prefilled, temperature=0, max_tokens=3,
                                       extra_body={"continue_final_message": True,
                                                   "add_generation_prompt": False})
    expected = smollm2_tokenizer.apply_chat_template(prefilled, continue_final_message=True, tokenize=True,
                                                     return_dict=False)
    assert r.usage.prompt_tokens == len(expected) and "Paris" in r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        client.chat.completions.create(model=MODEL, messages=prefilled,
                                       extra_body={"continue_final_message": True})
    r = client.completions.create(model=MODEL, prompt="one two three four five six seven eight", max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30,
                                       extra_body={"min_tokens": 15})
    assert r.usage.completion_tokens >= 15


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_async_streaming_requests_run_concurrently(client, aclient):
    """Three streams at once give each the text it gets alone (greedy, not streamed)."""
    prompts = [f"Count to {i}:" for i in range(3)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in prompts]

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_three() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    assert all(alone)
    assert asyncio.run(all_three()) == alone


def test_priority_and_vllm_extras_are_accepted(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0.8,
                                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                              "ignore_eos": True, "priority": -1})
    assert r.usage.completion_tokens == 4


def test_usage_reports_cached_prompt_tokens(client):
    messages = [{"role": "system", "content": "You answer in one word. " * 40},
                {"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens


def test_pinned_system_prompt_via_cache_endpoint(server, client):
    import httpx

    system = {"role": "system", "content": "You are a librarian. Recommend one book per answer. " * 20}
    r = httpx.post(f"{server.url}/v1/cache", json={"messages": [system], "ttl": 600}, timeout=60)
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["object"] == "cache" and pin["cached_tokens"] >= pin["prompt_tokens"] - 16 > 0
    reply = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                           messages=[system, {"role": "user", "content": "A mystery novel?"}])
    assert reply.usage.prompt_tokens_details.cached_tokens >= pin["cached_tokens"]
    assert httpx.delete(f"{server.url}/v1/cache/{pin['id']}").json()["deleted"] is True
    gone = httpx.delete(f"{server.url}/v1/cache/{pin['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "cache_not_found"
    bad = httpx.post(f"{server.url}/v1/cache", json={"prompt": "x", "messages": [system]})
    assert bad.status_code == 400


def test_tokenize_counts_what_a_request_would_run_and_detokenize_inverts_it(server, client,
                                                                             smollm2_tokenizer):
    import httpx

    text = "Tokenizers split words into pieces, like un-believ-able."
    counted = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert counted["tokens"] == smollm2_tokenizer(text).input_ids
    assert counted["count"] == len(counted["tokens"])
    assert counted["token_strs"] == smollm2_tokenizer.convert_ids_to_tokens(counted["tokens"])
    assert counted["max_model_len"] == 8192
    usage = client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == counted["count"]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION, "tools": tools}).json()
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": counted["tokens"]}).json()
    assert back == {"prompt": text}
    for path, body in [("/tokenize", {"prompt": "x", "messages": QUESTION}), ("/tokenize", {}),
                       ("/detokenize", {"tokens": [10**9]}), ("/detokenize", {"tokens": ["a"]})]:
        assert httpx.post(f"{server.url}{path}", json=body).status_code == 400
