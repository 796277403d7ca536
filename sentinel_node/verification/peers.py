"""Evidence accumulated per sender, against its peers at the same boundary: a rank CUSUM.

Replicas of one stage, in the same steps, send tensors that look alike: the same model (they average parameters)
on different text. So each check's distances to the reference are ranked against the distances of the other
senders' recent checks at this boundary. For an honest sender the rank is uniform whatever the boundary does (a
fast phase of training, honest stages retrained by an attack upstream: everyone moves together). A sender that is
consistently further from the reference than its peers ranks high, check after check, even when every tensor is
inside the per-tensor fences.

Per metric, the rank becomes a normal score z; the median z of the boundary's recent checks (what every sender
shares) is taken off, and a one-sided CUSUM per (sender, metric), ``C = max(0, C + z - kappa)``, accumulates the
rest. Crossing `limit` is an alarm; the sender's sums then restart from half the limit, so an attacker that keeps
going raises its next alarm in half the time. Ranks bound what one check can add (a rank cannot exceed the top),
which is what keeps a single honest outlier from raising an alarm: only consistency can.

Ranks need peers: with fewer than two other senders in the pool (a stage of one or two replicas) nothing is
accumulated, and there is no majority to be different from.

Cost: the pool holds `pool` score vectors, the sums `max_senders` x metrics numbers; a check is O(pool x metrics),
independent of the tensor's size.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from sentinel_node.verification.senders import RecentSenders


@dataclass(frozen=True)
class PeerAlarm:
    """The sender's evidence crossed the limit on `metric` (its sum was `evidence`)."""

    metric: str
    evidence: float


class PeerEvidence:
    def __init__(
        self,
        metrics: tuple[str, ...],
        pool: int,
        kappa: float,
        limit: float,
        max_senders: int,
        min_peers: int = 2,
        min_pool: int = 12,
    ):
        self.metrics, self.kappa, self.limit = metrics, kappa, limit
        self.min_peers, self.min_pool = min_peers, min_pool
        self.pool: deque[tuple[str, np.ndarray]] = deque(maxlen=pool)
        self.shared: deque[np.ndarray] = deque(maxlen=pool)
        self.sums: RecentSenders[np.ndarray] = RecentSenders(max_senders, lambda: np.zeros(len(metrics)))

    @property
    def enabled(self) -> bool:
        return self.limit > 0 and (self.pool.maxlen or 0) > 0

    def observe(self, sender: str, scores: dict[str, float]) -> PeerAlarm | None:
        """Adds one check's scores; an alarm when the sender's evidence crossed the limit on some metric."""
        if not self.enabled:
            return None
        mine = np.array([scores[name] for name in self.metrics], dtype=np.float64)
        others = [values for who, values in self.pool if who != sender]
        self.pool.append((sender, mine))
        if len(others) < self.min_pool or len({who for who, _ in self.pool if who != sender}) < self.min_peers:
            return None
        peers = np.stack(others)
        below = (peers < mine).sum(0) + 0.5 * (peers == mine).sum(0)
        rank = (below + 0.5) / (len(peers) + 1)
        z = torch.special.ndtri(torch.from_numpy(rank)).numpy()
        self.shared.append(z)
        excess = z - np.median(np.stack(self.shared), axis=0)
        sums = self.sums.get(sender)
        np.maximum(sums + excess - self.kappa, 0.0, out=sums)
        worst = int(sums.argmax())
        if sums[worst] <= self.limit:
            return None
        alarm = PeerAlarm(self.metrics[worst], float(sums[worst]))
        sums[:] = np.minimum(sums, self.limit / 2)
        return alarm

    def evidence(self, sender: str) -> float:
        """The sender's largest sum (0 for a sender not heard from)."""
        sums = self.sums.peek(sender)
        return float(sums.max()) if sums is not None else 0.0

    def forget(self, sender: str) -> None:
        self.sums.pop(sender)
