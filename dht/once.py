"""Say a thing once per cause: a peer of another swarm config would otherwise fill a node's log on every record."""

from __future__ import annotations

import threading
from collections.abc import Hashable


class OncePer:
    """``first(key)`` is True the first time a key is seen, for at most `capacity` keys (after that, never: many
    forged causes must not grow a node's memory or its log). Thread-safe: validators and readers run in several."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def first(self, key: Hashable) -> bool:
        with self._lock:
            if key in self._seen or len(self._seen) >= self.capacity:
                return False
            self._seen.add(key)
            return True
