"""Responses kept for `previous_response_id` (OpenAI's Responses API with
`store: true`): a bounded in-memory LRU, per server process. A restart
forgets them; past the bounds the least recently used go first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
MAX_CHARS = 32 * 2**20  # all stored conversations' text together


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # its messages (without instructions), answer included

    @property
    def chars(self) -> int:
        return sum(len(m["content"]) for m in self.conversation)


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        if item.chars > self.max_chars:
            return  # larger than the whole store: not kept
        old = self._items.pop(response_id, None)
        if old is not None:
            self._chars -= old.chars
        self._items[response_id] = item
        self._chars += item.chars
        while len(self._items) > self.max_responses or self._chars > self.max_chars:
            _, evicted = self._items.popitem(last=False)
            self._chars -= evicted.chars
