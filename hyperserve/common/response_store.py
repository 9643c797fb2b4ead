"""The Responses API's stored answers (common/responses_api.py): what `previous_response_id` continues
and GET / DELETE /v1/responses/{id} read, private to each API key, least recently used dropped first
once they hold more than their bound."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hyperserve.common.errors import APIError

DEFAULT_STORE_BYTES = 64 * 2**20


@dataclass
class StoredResponse:
    owner: str  # the API key that made it ("" without keys): no other key sees it
    previous_id: str | None
    messages: list[dict[str, Any]]  # this turn's input and answer, as chat messages
    items: list[dict[str, Any]]  # this turn's input items, for /input_items
    response: dict[str, Any]
    size: int = 0


class ResponseStore:
    """Stored responses, least recently used dropped first once they hold more than `max_bytes` (as
    JSON). A conversation is its chain of previous_response_id links; reading it refreshes them all."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        entry.size = len(json.dumps([entry.messages, entry.items, entry.response]))
        self._entries[entry.response["id"]] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes and self._entries:
            self.bytes -= self._entries.popitem(last=False)[1].size

    def get(self, owner: str, response_id: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            raise APIError(404, f"no response {response_id!r}: it was never stored, was deleted, or was dropped to "
                                "make room", param="response_id", code="response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, owner: str, response_id: str) -> None:
        self.bytes -= self.get(owner, response_id).size
        del self._entries[response_id]

    def conversation(self, owner: str, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of the chain ending at `response_id`, oldest first."""
        turns = []
        while response_id is not None:
            try:
                entry = self.get(owner, response_id)
            except APIError as missing:
                missing.param = "previous_response_id"
                raise
            turns.append(entry.messages)
            response_id = entry.previous_id
        return [message for turn in reversed(turns) for message in turn]
