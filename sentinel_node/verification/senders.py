"""Per-sender state with a bound: many identities must not exhaust a verifier's memory."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class RecentSenders(Generic[T]):
    """State for at most `capacity` senders; making room evicts the one heard from longest ago.

    `get` creates a sender's state with `factory` and counts as hearing from it; `peek` and iteration do not.
    """

    def __init__(self, capacity: int, factory: Callable[[], T]):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity, self.factory = capacity, factory
        self._state: OrderedDict[str, T] = OrderedDict()

    def get(self, sender: str) -> T:
        state = self._state.get(sender)
        if state is None:
            return self.put(sender, self.factory())
        self._state.move_to_end(sender)
        return state

    def put(self, sender: str, state: T) -> T:
        self._state.pop(sender, None)
        while len(self._state) >= self.capacity:
            self._state.popitem(last=False)
        self._state[sender] = state
        return state

    def peek(self, sender: str) -> T | None:
        return self._state.get(sender)

    def pop(self, sender: str) -> T | None:
        return self._state.pop(sender, None)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(list(self._state.items()))

    def __contains__(self, sender: str) -> bool:
        return sender in self._state

    def __len__(self) -> int:
        return len(self._state)
