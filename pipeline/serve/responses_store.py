"""The responses `POST /v1/responses` stored (`store`, true unless a request says false), for
`GET` and `DELETE /v1/responses/{id}` and a follow-up's `previous_response_id`: in memory, the
last `capacity` of them and at most `max_chars` characters of conversations, least recently used
first out (256 requests of --max-request-mb each would otherwise hold gigabytes on rank 0). A
response keeps its whole conversation as input items (its previous response's, its own input,
its output), so a follow-up renders the same messages a client resending every item would; the
prefix cache, not this store, keeps the follow-up from prefilling the conversation again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

CAPACITY = 256
MAX_CHARS = 64 * 2**20  # of every stored conversation's text together: ~64 MB of strings


@dataclass(frozen=True)
class StoredResponse:
    response: dict       # the response object, as GET returns it
    conversation: tuple  # input items (responses_protocol's item models), oldest first
    chars: int           # the conversation's text, counted against MAX_CHARS


def conversation_chars(value) -> int:
    """The characters of the items' text fields (content, arguments, output, summaries, ...): what
    holds the memory. A follow-up's items are the same objects as its previous response's, so
    this overcounts a chain of responses, which only makes the bound stricter."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(conversation_chars(v) for v in value)
    if hasattr(value, "__dict__"):  # an item (a pydantic model: its fields are its __dict__)
        return sum(conversation_chars(v) for v in vars(value).values())
    return 0


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY, max_chars: int = MAX_CHARS):
        self.capacity, self.max_chars = capacity, max_chars
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list) -> bool:
        """Keep the response (False where its conversation alone is over max_chars: not kept)."""
        stored = StoredResponse(response, tuple(conversation), conversation_chars(conversation))
        if stored.chars > self.max_chars:
            return False
        with self._lock:
            self._drop(response["id"])
            self._responses[response["id"]] = stored
            self._chars += stored.chars
            while len(self._responses) > self.capacity or self._chars > self.max_chars:
                self._drop(next(iter(self._responses)))
        return True

    def get(self, id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._responses.get(id)
            if stored is not None:
                self._responses.move_to_end(id)
            return stored

    def delete(self, id: str) -> bool:
        with self._lock:
            return self._drop(id)

    def _drop(self, id: str) -> bool:
        stored = self._responses.pop(id, None)
        if stored is not None:
            self._chars -= stored.chars
        return stored is not None

    def __len__(self) -> int:
        return len(self._responses)
