"""The responses /v1/responses keeps (`store`, true by default) for previous_response_id and GET / DELETE.

In memory and bounded twice, by a count and by a byte budget: past either the oldest go first, and a response
larger than the whole budget is not kept. What is kept is the response object and its whole conversation (the
earlier turns, this request's input, the reply), so that a continuation needs nothing that may have been evicted
since."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from server.conversation import Turn


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as GET returns it
    turns: tuple[Turn, ...]  # the conversation it ended, its instructions not included (they are not carried over)

    @property
    def size(self) -> int:
        """Bytes it holds, near enough: its JSON and its turns' text."""
        return len(json.dumps(self.response)) + sum(len(t.content) + len(json.dumps(t.calls)) for t in self.turns)


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.kept: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep it, evicting the oldest as needed; False where it alone is over the budget (or nothing is kept)."""
        size = stored.size
        if self.max_count == 0 or size > self.max_bytes:
            return False
        self.delete(response_id)
        self.kept[response_id] = (stored, size)
        self.bytes += size
        while len(self.kept) > self.max_count or self.bytes > self.max_bytes:
            _, (_, evicted) = self.kept.popitem(last=False)
            self.bytes -= evicted
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self.kept.get(response_id)
        return entry[0] if entry else None

    def delete(self, response_id: str) -> bool:
        entry = self.kept.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry[1]
        return entry is not None
