"""Evidence accumulated per sender on what a middle stage adds to the gradient: a direction shared by every token.

A middle stage sends back ``g_in = g_out + J_F(h_in)^T g_out`` (:mod:`passage`): the gradient it was given plus its
own contribution, one row per token. Each token's contribution depends on that token's text, so the mean of the
rows is small against their spread. Measured on the full profile's pipeline over 300 steps of clean training (the
256 rows the passage compares, boundaries 0 and 1): the coherence ``T = n |mean of the rows|^2 / (mean squared
distance of a row from that mean)``, about 1 for rows with no common direction, had median 2.7 and 99th percentile
16-18 after step 120 (tens in the first ten steps, when every token's gradient points the same way).

An attack that adds one vector to every token's gradient (a constant offset, a bias that grows step by step so that
no EMA and no fence notices it) puts that vector in the mean of the rows, where the honest contribution's rows
largely cancel. It is also what does the damage: the weight gradients of the stages below sum it over every
position of the microbatch, check after check, in the same direction. With an offset of 5% of the gradient's RMS
on two replicas of eight, the attackers' coherence had median 9.5-16 against the honest 3; with a drift of 0.005 of
the RMS a step on the quick profile, 30-90 after twenty steps against an honest median of 7. One tensor does not
separate them (the honest tail reaches 40-70); checks accumulated do.

So per (boundary, sender) a one-sided CUSUM, ``C = max(0, C + min(z, cap) - kappa)``, accumulates how far the
check's log T lies above its peers': ``z = (log T - centre) / scale``, the centre the median of the other senders'
medians and the scale the median of their IQRs, each over that sender's last ``depth`` accepted checks. Crossing
``limit`` is an alarm (a flag and a strike, like a fence crossing), and the sum restarts from half the limit, so an
attacker that keeps going raises its next alarm in half the time. Every sender counts alike, so a minority of
attackers moves neither the centre nor the scale (a window pooled over the boundary's checks let two attackers of
eight widen its IQR by half, and their evidence crawled); a lasting change the whole boundary shares (a phase of
training, an attack upstream reaching every replica) moves the centre with it once it fills the senders' windows
(while it does, every sender accumulates alike: subtracting the boundary's median z per check, as the peer test
does, is not built; no honest alarm called for it in the runs measured, docs/decisions.md); and honest
senders showed no lasting offset from one another (medians within 0.13 IQR of the boundary's over 300 steps),
which is why, unlike the peer test's distances (docs/decisions.md, "Tried and refused"), a distance is safe here.
Replayed offline on those runs, ``kappa`` 1.0 and ``limit`` 4 raised no alarm in 2,301 honest checks of the full
profile nor in 654 of the quick one; the false-alarm rate over 1,000 honest steps is in docs/decisions.md.

Needs the passage's rows (a middle stage's gradient, ``passage_floor`` > 0) and at least ``min_peers`` other
senders with ``min_checks`` accepted checks each, heard from in the last ``horizon`` checks: a lone sender has no
peers to be different from, and its own history moves with training. A scaled or rotated gradient keeps its rows'
balance and is left to the other tests; so is an attacker that hides a common direction inside honest-looking
per-token variation (it then does the damage of that direction's small share only).

Cost: ``depth`` floats and a sum per sender, for at most ``max_senders``; T is O(rows x hidden) over rows the
passage already has.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from sentinel_node.verification.senders import RecentSenders
from sentinel_node.verification.thresholds import quantile


def row_coherence(residual: torch.Tensor) -> float | None:
    """T of a (rows, hidden) tensor: n times the squared norm of its mean row over the mean squared distance of a row
    from it (about 1 when the rows share no direction); None when it is undefined (fewer than two rows, all alike,
    or non-finite values)."""
    rows = residual.double()
    if rows.dim() != 2 or rows.shape[0] < 2:
        return None
    mean = rows.mean(0)
    spread = float((rows - mean).square().sum(1).mean())
    value = rows.shape[0] * float(mean.square().sum()) / spread if spread > 0 else math.nan
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class CoherenceAlarm:
    """The sender's accumulated evidence (`evidence`, in IQRs of its peers' log coherence) crossed the limit."""

    coherence: float
    evidence: float


@dataclass
class _Sender:
    accepted: deque[float]  # log coherence of its recently accepted checks
    spread: tuple[float, float] = (0.0, 0.0)  # their median and IQR
    evidence: float = 0.0
    last_check: int = 0


class CoherenceEvidence:
    """The CUSUM of each sender's log coherence against its peers': the median of the other senders' medians, in
    units of the median of their IQRs (each over its last ``depth`` accepted checks), so that every sender counts
    alike and a minority of attackers moves neither the centre nor the scale (a window pooled over the boundary's
    checks let two attackers of eight widen its IQR by half and their evidence crawled: docs/decisions.md)."""

    def __init__(
        self,
        kappa: float,
        limit: float,
        max_senders: int,
        depth: int = 32,
        cap: float = 3.0,
        min_peers: int = 2,
        min_checks: int = 8,
        horizon: int = 256,
    ):
        self.depth, self.kappa, self.limit, self.cap = depth, kappa, limit, cap
        self.min_peers, self.min_checks, self.horizon = min_peers, min_checks, horizon
        self.senders: RecentSenders[_Sender] = RecentSenders(max_senders, lambda: _Sender(deque(maxlen=depth)))
        self.checks = 0

    @property
    def enabled(self) -> bool:
        return self.limit > 0 and self.depth > 0

    def observe(self, sender: str, coherence: float | None) -> CoherenceAlarm | None:
        """Adds one check's coherence to the sender's evidence; an alarm when it crossed the limit. Nothing is
        learned here: :meth:`accept` learns the checks that were accepted."""
        if not self.enabled or coherence is None or coherence <= 0:
            return None
        self.checks += 1
        mine = self.senders.get(sender)
        mine.last_check = self.checks
        peers = [
            state.spread
            for who, state in self.senders.items()
            if who != sender and len(state.accepted) >= self.min_checks and self._live(state)
        ]
        if len(peers) < self.min_peers:
            return None
        centre = statistics.median(median for median, _ in peers)
        scale = max(statistics.median(iqr for _, iqr in peers), 0.05)
        z = (math.log(coherence) - centre) / scale
        mine.evidence = max(0.0, mine.evidence + min(z, self.cap) - self.kappa)
        if mine.evidence <= self.limit:
            return None
        alarm = CoherenceAlarm(coherence, mine.evidence)
        mine.evidence = self.limit / 2
        return alarm

    def accept(self, sender: str, coherence: float | None) -> None:
        """Learns an accepted check's coherence into the sender's own window."""
        if not self.enabled or coherence is None or coherence <= 0:
            return
        mine = self.senders.get(sender)
        mine.accepted.append(math.log(coherence))
        ordered = sorted(mine.accepted)
        q1, median, q3 = (quantile(ordered, q) for q in (0.25, 0.5, 0.75))
        mine.spread = (median, q3 - q1)

    def _live(self, state: _Sender) -> bool:
        return self.checks - state.last_check < self.horizon

    def evidence(self, sender: str) -> float:
        state = self.senders.peek(sender)
        return state.evidence if state is not None else 0.0

    def forget(self, sender: str) -> None:
        self.senders.pop(sender)
