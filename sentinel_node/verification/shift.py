"""Telling a boundary that moved from a sender that cheats.

An attack nobody can see (a gradient with its sign inverted) still trains honest replicas wrongly, and then every
replica of that stage drifts away from the baseline together. Under an honest majority, attackers are fewer than half
of a stage's replicas: when at least half of the senders recently seen at a boundary (and at least two) were each
flagged repeatedly, the boundary itself moved. Such flags still replace the tensor but strike no one.
"""

from __future__ import annotations

from collections import Counter, deque


class BoundaryShift:
    def __init__(self, window: int, repeated: int = 2):
        self.repeated = repeated
        self.recent: deque[tuple[str, bool]] = deque(maxlen=window)

    @property
    def enabled(self) -> bool:
        return self.recent.maxlen is not None and self.recent.maxlen > 0

    def observe(self, sender: str, flagged: bool) -> None:
        if self.enabled:
            self.recent.append((sender, flagged))

    def widespread(self) -> bool:
        """True when at least half of the recent senders, and at least two, were flagged `repeated` times or more."""
        if not self.enabled:
            return False
        active = {sender for sender, _ in self.recent}
        flags = Counter(sender for sender, flagged in self.recent if flagged)
        shifted = sum(1 for n in flags.values() if n >= self.repeated)
        return shifted >= 2 and 2 * shifted >= len(active)
