"""Exact and semantic caching with the real all-MiniLM-L6-v2 embeddings."""

import asyncio
import time

import pytest

from hyperserve.common.embedder import Embedder
from hyperserve.gateway.cache_store import RedisStore, SQLiteStore
from hyperserve.gateway.response_cache import ResponseCache, cache_key, is_deterministic

QUESTION = "What's the capital of France?"
PARAPHRASE = "Tell me France's capital city"
SAME_WORDS_OTHER_QUESTION = "What's the capital gains tax in France?"


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def _chat(content: str, system: str | None = None, **params) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"messages": messages, "temperature": 0, "max_tokens": 32, **params}


def _answer(text: str) -> dict:
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                      "finish_reason": "stop"}]}


def _lookup(cache: ResponseCache, body: dict, model: str = "m"):
    return asyncio.run(cache.lookup(cache_key("chat", model, body)))[0]


def _insert(cache: ResponseCache, body: dict, text: str, model: str = "m") -> None:
    asyncio.run(cache.insert(cache_key("chat", model, body), _answer(text)))


def test_keys_ignore_transport_fields_and_whitespace_but_not_sampling():
    key = cache_key("chat", "m", _chat(QUESTION))
    assert cache_key("chat", "m", _chat("  What's the   capital of France? ", stream=True, user="u")) == key
    assert cache_key("chat", "m", _chat(QUESTION, temperature=0.5)).namespace != key.namespace
    assert cache_key("chat", "m", _chat(QUESTION, system="Be brief.")).namespace != key.namespace
    assert cache_key("chat", "other", _chat(QUESTION)).namespace != key.namespace
    assert cache_key("chat", "m", _chat(PARAPHRASE)).namespace == key.namespace
    assert key.text == QUESTION


def test_greedy_seeded_and_beam_search_answers_are_cached_sampled_ones_not():
    assert is_deterministic({"temperature": 0}) and is_deterministic({"seed": 3})
    assert is_deterministic({"use_beam_search": True, "n": 2})
    assert not is_deterministic({}) and not is_deterministic({"temperature": 0.7, "use_beam_search": False})
    body = {"prompt": "Hi", "use_beam_search": True, "n": 2, "length_penalty": 1.0}
    shorter = {**body, "length_penalty": 0.5}
    assert cache_key("completion", "m", body).exact != cache_key("completion", "m", shorter).exact


def test_output_constraints_tools_and_tool_calls_are_part_of_the_key():
    key = cache_key("chat", "m", _chat(QUESTION))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({"response_format": {"type": "json_object"}}, {"guided_regex": "[a-z]+"}, {"tools": tools},
                  {"tools": tools, "tool_choice": "required"}):
        assert cache_key("chat", "m", _chat(QUESTION, **extra)).namespace != key.namespace, extra
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    other = {**call, "function": {"name": "f", "arguments": '{"x": 2}'}}
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    changed = [turns[0], {**turns[1], "tool_calls": [other]}, turns[2]]
    assert cache_key("chat", "m", {"messages": turns}).exact != cache_key("chat", "m", {"messages": changed}).exact


def test_the_callers_scope_is_part_of_both_keys():
    alice, bob = (cache_key("chat", "m", _chat(QUESTION), scope) for scope in ("key:alice", "key:bob"))
    assert alice.exact != bob.exact and alice.namespace != bob.namespace
    scoped, open_gateway = (cache_key("completion", "m", {"prompt": "x"}, scope) for scope in ("a", None))
    assert scoped.namespace != open_gateway.namespace


def test_paraphrase_hits_and_a_different_question_with_the_same_words_misses(embedder):
    cache = ResponseCache(SQLiteStore(":memory:", 100), ttl_s=60, embedder=embedder, threshold=0.9)
    _insert(cache, _chat(QUESTION), "Paris.")
    exact = _lookup(cache, _chat(QUESTION))
    assert exact.kind == "exact" and exact.entry.response == _answer("Paris.")
    hit = _lookup(cache, _chat(PARAPHRASE))
    assert hit.kind == "semantic" and hit.similarity >= 0.9 and hit.entry.response == _answer("Paris.")
    assert _lookup(cache, _chat(SAME_WORDS_OTHER_QUESTION)) is None


def test_namespaces_never_hit_across_system_prompt_sampling_or_model(embedder):
    cache = ResponseCache(SQLiteStore(":memory:", 100), ttl_s=60, embedder=embedder, threshold=0.5)
    _insert(cache, _chat(QUESTION), "Paris.")
    assert _lookup(cache, _chat(QUESTION, system="Answer in French.")) is None
    assert _lookup(cache, _chat(QUESTION, temperature=0.7)) is None
    assert _lookup(cache, _chat(QUESTION, max_tokens=64)) is None
    assert _lookup(cache, _chat(QUESTION), model="other") is None
    assert _lookup(cache, _chat(PARAPHRASE)) is not None  # the low threshold alone would let it hit


def test_threshold_is_respected(embedder):
    cache = ResponseCache(SQLiteStore(":memory:", 100), ttl_s=60, embedder=embedder, threshold=0.95)
    _insert(cache, _chat(QUESTION), "Paris.")
    assert _lookup(cache, _chat(PARAPHRASE)) is None  # similarity ~0.91
    assert _lookup(cache, _chat("What's France's capital?")).kind == "semantic"  # ~0.98


def test_entries_survive_a_restart(embedder, tmp_path):
    path = str(tmp_path / "cache.sqlite")
    first = ResponseCache(SQLiteStore(path, 100), ttl_s=60, embedder=embedder)
    _insert(first, _chat(QUESTION), "Paris.")
    first.close()
    second = ResponseCache(SQLiteStore(path, 100), ttl_s=60, embedder=embedder)
    assert second.sync_index() == 1
    assert _lookup(second, _chat(PARAPHRASE)).entry.response == _answer("Paris.")


def test_entries_expire_after_their_ttl(embedder):
    cache = ResponseCache(SQLiteStore(":memory:", 100), ttl_s=0.3, embedder=embedder)
    _insert(cache, _chat(QUESTION), "Paris.")
    assert _lookup(cache, _chat(QUESTION)) is not None
    time.sleep(0.4)
    assert _lookup(cache, _chat(QUESTION)) is None
    assert _lookup(cache, _chat(PARAPHRASE)) is None


def test_least_recently_used_entry_is_evicted_beyond_max_entries():
    cache = ResponseCache(SQLiteStore(":memory:", 2), ttl_s=60)
    for question in ("one", "two"):
        _insert(cache, _chat(question), question)
    assert _lookup(cache, _chat("one")) is not None  # "two" is now the least recently used
    _insert(cache, _chat("three"), "three")
    assert [_lookup(cache, _chat(q)) is not None for q in ("one", "two", "three")] == [True, False, True]


def test_redis_store_is_shared_by_replicas(embedder, redis_url):
    replica_a = ResponseCache(RedisStore(redis_url, "test-shared:", 100, timeout_s=10.0), ttl_s=60, embedder=embedder)
    replica_b = ResponseCache(RedisStore(redis_url, "test-shared:", 100, timeout_s=10.0), ttl_s=60, embedder=embedder)
    _insert(replica_a, _chat(QUESTION), "Paris.")
    assert _lookup(replica_b, _chat(QUESTION)).kind == "exact"
    hit = _lookup(replica_b, _chat(PARAPHRASE))
    assert hit.kind == "semantic" and hit.entry.response == _answer("Paris.")
    assert _lookup(replica_b, _chat(SAME_WORDS_OTHER_QUESTION)) is None


def test_redis_store_evicts_least_recently_used(redis_url):
    cache = ResponseCache(RedisStore(redis_url, "test-lru:", 2, timeout_s=10.0), ttl_s=60)
    for question in ("one", "two"):
        _insert(cache, _chat(question), question)
    assert _lookup(cache, _chat("one")) is not None
    _insert(cache, _chat("three"), "three")
    assert [_lookup(cache, _chat(q)) is not None for q in ("one", "two", "three")] == [True, False, True]


def test_saved_index_is_loaded_at_start_and_discarded_for_another_store(embedder, tmp_path):
    path, index_dir = str(tmp_path / "cache.sqlite"), tmp_path / "cache.index"
    first = ResponseCache(SQLiteStore(path, 100), ttl_s=60, embedder=embedder, index_dir=index_dir)
    _insert(first, _chat(QUESTION), "Paris.")
    first.close()  # saves the index
    second = ResponseCache(SQLiteStore(path, 100), ttl_s=60, embedder=embedder, index_dir=index_dir)
    assert second.sync_index() == 0  # nothing to rebuild: the graph came from disk
    assert _lookup(second, _chat(PARAPHRASE)).entry.response == _answer("Paris.")
    _insert(second, _chat("Who wrote Hamlet?"), "Shakespeare.")
    second.close()
    fresh = ResponseCache(SQLiteStore(str(tmp_path / "other.sqlite"), 100), ttl_s=60, embedder=embedder,
                          index_dir=index_dir)
    assert len(fresh.index) == 0 and _lookup(fresh, _chat(PARAPHRASE)) is None
