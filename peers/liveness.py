"""A short-lived blacklist of peers that just failed to answer, with exponential backoff.

This is about liveness, not honesty: a suspended peer is skipped for a few seconds so that new work does not keep
trying a dead peer first; a ban (peers.policy) is the swarm's verdict on a cheater. Modelled on hivemind's
``Blacklist`` (hivemind/dht/node.py), with a cap on the suspension and an injectable clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffParams:
    base_time: float = 1.0  # seconds of the first suspension
    backoff_rate: float = 2.0  # each successive failure multiplies the suspension by this
    max_time: float = 60.0  # the longest suspension

    def __post_init__(self) -> None:
        if self.base_time <= 0 or self.max_time < self.base_time:
            raise ValueError(
                f"need 0 < base_time <= max_time, got base_time={self.base_time} max_time={self.max_time}"
            )
        if self.backoff_rate < 1:
            raise ValueError(f"backoff_rate must be at least 1, got {self.backoff_rate}")


class LivenessBlacklist:
    """Thread-safe: several callers may report failures at once."""

    def __init__(self, params: BackoffParams = BackoffParams(), clock: Callable[[], float] = time.monotonic):
        self.params, self._clock = params, clock
        self._until: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._gone: set[str] = set()  # peers with failures that a view since then did not show
        self._lock = threading.Lock()

    def register_failure(self, peer: str) -> float:
        """Suspends ``peer`` (unless it already is) and returns how long it stays suspended, in seconds."""
        with self._lock:
            now = self._clock()
            if self._until.get(peer, now) > now:  # failures of calls started before the suspension add nothing
                return self._until[peer] - now
            failures = self._failures.get(peer, 0)
            duration = min(self.params.base_time * self.params.backoff_rate**failures, self.params.max_time)
            self._until[peer] = now + duration
            self._failures[peer] = failures + 1
            return duration

    def seen(self, present: Collection[str]) -> None:
        """The peers a fresh view of the swarm shows. A peer with failures on record that was missing from a view
        (its announcement expired: it was cut off, or restarted) and is back in this one starts afresh: those
        failures were of its absence, and a backoff grown through a partition (1, 2, 4, 8 s...) would keep it off
        routes for as long again after it returned."""
        with self._lock:
            for peer in list(self._failures):
                if peer in present:
                    if peer in self._gone:
                        self._until.pop(peer, None)
                        self._failures.pop(peer, None)
                        self._gone.discard(peer)
                else:
                    self._gone.add(peer)

    def register_success(self, peer: str) -> None:
        """``peer`` answered: lift its suspension and forget its failures."""
        with self._lock:
            self._until.pop(peer, None)
            self._failures.pop(peer, None)
            self._gone.discard(peer)

    def __contains__(self, peer: object) -> bool:
        with self._lock:
            return self._until.get(peer, 0.0) > self._clock()  # type: ignore[arg-type]

    def suspended(self) -> dict[str, float]:
        """Suspended peers and the seconds each has left."""
        with self._lock:
            now = self._clock()
            return {peer: until - now for peer, until in self._until.items() if until > now}


class PairBlacklist:
    """Pairs of peers kept apart for a while (with the same backoff): a verifier that refused, or banned, a stage
    replica below the swarm's quorum will refuse it again, so a route should not put the two next to each other.

    Order does not matter: ``apart(a, b) == apart(b, a)``.
    """

    def __init__(
        self, params: BackoffParams = BackoffParams(5.0, 2.0, 120.0), clock: Callable[[], float] = time.monotonic
    ):
        self._pairs = LivenessBlacklist(params, clock)

    @staticmethod
    def _key(a: str, b: str) -> str:
        return "|".join(sorted((a, b)))

    def register_refusal(self, a: str, b: str) -> float:
        """Keeps ``a`` and ``b`` apart; returns for how many seconds."""
        return self._pairs.register_failure(self._key(a, b))

    def register_success(self, a: str, b: str) -> None:
        self._pairs.register_success(self._key(a, b))

    def apart(self, a: str, b: str) -> bool:
        return self._key(a, b) in self._pairs

    def pairs(self) -> dict[str, float]:
        """The pairs kept apart (``a|b``) and the seconds each has left."""
        return self._pairs.suspended()
