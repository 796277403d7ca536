"""An extra SENTINEL test: a sender whose tensors sit persistently high inside the thresholds.

Per-tensor fences miss an attacker who keeps every metric just under them. Honest senders scatter around the
window's median; such an attacker does not. Each check's severity (0 at the median, 1 at the threshold, the
largest over the metrics) is averaged per sender over a window of its checks, and a mean above `limit` is a flag.
"""

from __future__ import annotations

from collections import deque


class DriftTest:
    def __init__(self, window: int, limit: float):
        self.window, self.limit = window, limit
        self.history: dict[str, deque[float]] = {}

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def observe(self, sender: str, severity: float) -> bool:
        """Adds one check's severity; True when the sender's window is full and its mean is over the limit."""
        if not self.enabled:
            return False
        history = self.history.setdefault(sender, deque(maxlen=self.window))
        # one absurd score must not carry a whole window: those are the per-tensor fences' business
        history.append(min(severity, 2.0))
        if len(history) < self.window or sum(history) / len(history) <= self.limit:
            return False
        history.clear()  # a fresh window before the next verdict, so one episode is one flag
        return True

    def mean(self, sender: str) -> float:
        history = self.history.get(sender)
        return sum(history) / len(history) if history else 0.0
