"""How a trainer routes its microbatches, as an object it is given: the production path knows no benchmark.

The default routes through any live verifier and computes each microbatch once. The benches inject others:
only some verifiers (a checking one against a plain relay), two copies of each microbatch on different replicas
(the duplicate-computation baseline SENTINEL replaces), or a schedule that changes mode at every global step so
that the modes share the machine's load and the point of training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peers import SwarmView


@dataclass(frozen=True)
class RoutingMode:
    """``only_verifiers``: route through these verifiers only (empty: any); ``copies``: replicas that compute each
    training microbatch (2: the duplicate-computation baseline, whose losses are compared)."""

    only_verifiers: tuple[str, ...] = ()
    copies: int = 1

    def __post_init__(self) -> None:
        if self.copies < 1:
            raise ValueError(f"copies must be at least 1, got {self.copies}")

    def barred(self, view: SwarmView) -> set[str]:
        """The announced verifiers this mode keeps off its routes."""
        return set(view.verifiers) - set(self.only_verifiers) if self.only_verifiers else set()


NORMAL = RoutingMode()


@dataclass(frozen=True)
class RoutingSchedule:
    """The mode of each global step: ``modes[step % len(modes)]``."""

    modes: tuple[RoutingMode, ...] = field(default_factory=lambda: (NORMAL,))

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("a routing schedule needs at least one mode")

    def index(self, step: int) -> int:
        return step % len(self.modes)

    def at(self, step: int) -> RoutingMode:
        return self.modes[self.index(step)]
