"""The Responses API's store: conversations by previous_response_id, private to each key, bounded."""

from __future__ import annotations

import pytest

from hyperserve.common.errors import APIError
from hyperserve.common.response_store import ResponseStore, StoredResponse


def stored(owner: str, response_id: str, previous: str | None, text: str) -> StoredResponse:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]
    return StoredResponse(owner, previous, messages, [], {"id": response_id})


def test_the_store_rebuilds_a_conversation_for_its_owner_only():
    store = ResponseStore()
    store.put(stored("key:a", "r1", None, "one"))
    store.put(stored("key:a", "r2", "r1", "two"))
    assert [m["content"] for m in store.conversation("key:a", "r2")] == ["one", "ONE", "two", "TWO"]
    with pytest.raises(APIError) as missing:
        store.conversation("key:b", "r2")
    assert missing.value.status == 404 and missing.value.param == "previous_response_id"
    store.delete("key:a", "r1")
    with pytest.raises(APIError):  # a conversation whose start is gone cannot be continued
        store.conversation("key:a", "r2")


def test_the_store_drops_the_least_recently_used_beyond_its_bytes():
    store = ResponseStore(max_bytes=400)
    for i in range(10):
        store.put(stored("", f"r{i}", None, "x" * 50))
        store.get("", "r0")  # read: kept
    assert store.bytes <= 400
    store.get("", "r0")
    with pytest.raises(APIError):
        store.get("", "r1")
    nothing = ResponseStore(max_bytes=0)  # --responses-store-mb 0: nothing is kept
    nothing.put(stored("", "r", None, "x"))
    with pytest.raises(APIError):
        nothing.get("", "r")
