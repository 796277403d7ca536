"""How healthy a swarm is, stage by stage and boundary by boundary, from the live peers serving each.

A stage or boundary with nobody live on it is **broken** (no microbatch can cross it), one with a single live
peer is **degraded** (one more failure breaks it), one with two or more is **healthy**. The swarm is as healthy as
its worst place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Verdict(str, Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    BROKEN = "broken"

    @classmethod
    def of(cls, live: int) -> Verdict:
        return cls.BROKEN if live == 0 else cls.DEGRADED if live == 1 else cls.HEALTHY

    @property
    def rank(self) -> int:
        return {Verdict.HEALTHY: 0, Verdict.DEGRADED: 1, Verdict.BROKEN: 2}[self]


@dataclass(frozen=True)
class Health:
    """``replicas[k]``: live replicas of stage k; ``verifiers[b]``: live verifiers of boundary b|b+1."""

    replicas: tuple[int, ...]
    verifiers: tuple[int, ...]

    @classmethod
    def of(cls, replicas: Sequence[int], verifiers: Sequence[int]) -> Health:
        return cls(tuple(replicas), tuple(verifiers))

    def stage(self, k: int) -> Verdict:
        return Verdict.of(self.replicas[k])

    def boundary(self, b: int) -> Verdict:
        return Verdict.of(self.verifiers[b])

    @property
    def verdict(self) -> Verdict:
        places = [*map(Verdict.of, self.replicas), *map(Verdict.of, self.verifiers)]
        return max(places, key=lambda v: v.rank, default=Verdict.HEALTHY)

    @property
    def stages_without_replica(self) -> tuple[int, ...]:
        return tuple(k for k, n in enumerate(self.replicas) if n == 0)

    @property
    def boundaries_without_verifier(self) -> tuple[int, ...]:
        return tuple(b for b, n in enumerate(self.verifiers) if n == 0)

    @property
    def ok(self) -> bool:
        """Whether a microbatch can cross the whole pipeline (nothing broken)."""
        return self.verdict is not Verdict.BROKEN

    def problems(self) -> list[str]:
        """What is broken, then what is degraded, in words."""
        found = []
        if self.stages_without_replica:
            found.append("no live replica for stage " + ", ".join(map(str, self.stages_without_replica)))
        if self.boundaries_without_verifier:
            names = ", ".join(f"{b}|{b + 1}" for b in self.boundaries_without_verifier)
            found.append("no verifier on boundary " + names)
        single = [k for k, n in enumerate(self.replicas) if n == 1]
        if single:
            found.append("one replica left on stage " + ", ".join(map(str, single)))
        single = [b for b, n in enumerate(self.verifiers) if n == 1]
        if single:
            found.append("one verifier left on boundary " + ", ".join(f"{b}|{b + 1}" for b in single))
        return found

    def summary(self) -> str:
        verdict = self.verdict
        if verdict is Verdict.HEALTHY:
            return "healthy: every stage has two or more live replicas and every boundary two or more verifiers"
        return f"{verdict.value}: " + "; ".join(self.problems())
