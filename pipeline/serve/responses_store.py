"""The responses `POST /v1/responses` stored (`store`, true unless a request says false), for
`GET` and `DELETE /v1/responses/{id}` and a follow-up's `previous_response_id`: in memory, the
last `capacity` of them, least recently used first out. A response keeps its whole conversation
as input items (its previous response's, its own input, its output), so a follow-up renders the
same messages a client resending every item would; the prefix cache, not this store, keeps the
follow-up from prefilling the conversation again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

CAPACITY = 256


@dataclass(frozen=True)
class StoredResponse:
    response: dict       # the response object, as GET returns it
    conversation: tuple  # input items (responses_protocol's item models), oldest first


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list) -> None:
        with self._lock:
            self._responses[response["id"]] = StoredResponse(response, tuple(conversation))
            self._responses.move_to_end(response["id"])
            while len(self._responses) > self.capacity:
                self._responses.popitem(last=False)

    def get(self, id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._responses.get(id)
            if stored is not None:
                self._responses.move_to_end(id)
            return stored

    def delete(self, id: str) -> bool:
        with self._lock:
            return self._responses.pop(id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)
