"""Evidence accumulated per sender on what a middle stage adds to the gradient: a direction shared by every token.

A middle stage sends back ``g_in = g_out + J_F(h_in)^T g_out`` (:mod:`passage`): the gradient it was given plus its
own contribution, one row per token. Each token's contribution depends on that token's text, so the mean of the
rows is small against their spread. An attack that adds one vector to every token's gradient (a constant offset, a
bias that grows step by step so that no EMA and no fence notices it) puts that vector in the mean of the rows, where
the honest contribution's rows largely cancel. It is also what does the damage: the weight gradients of the stages
below sum it over every position of the microbatch, check after check, in the same direction.

The check's **offset** is that mean row in units of the rows' spread, ``u = sqrt(n) mean / sqrt(mean squared
distance of a row from the mean)`` (:func:`mean_row`; its squared norm ``T``, the row coherence, is about 1 for rows
with no common direction). Its size alone separates poorly: on the full profile's pipeline (the 256 rows the passage
compares, boundaries 0 and 1, 300 steps of clean training) the honest ``T`` had median 2.7 and 99th percentile 16-23,
while an offset of 5% of the gradient's RMS on two replicas of eight had median 9.5-16. Its direction separates: the
honest offsets of a boundary lie in a few directions of the hidden space (effective rank 5.5-7 of 128; three
directions hold 60-70% of their energy), with a sign that changes from microbatch to microbatch, and an offset an
attacker adds lies almost wholly outside them (the 5% offset stood 12 honest standard deviations out along its own
direction, check after check). So each check is judged by the offset's size **in the honest spread of offsets**,
``q = u^T S^-1 u`` (Mahalanobis), with ``S`` the second moment of a peer's recent accepted offsets plus a ridge of
``ridge`` times its mean eigenvalue, and the check's score the log of the median of ``q`` over its live peers: a
minority of attackers' own offsets (which widen their ``S`` along the attack) never judge anyone alone.

At real widths the offset is first projected to ``sketch`` dimensions by a random matrix the verifier keeps secret:
a stage that knew it could hide its offset in its null space. Widths up to ``sketch`` are judged unprojected.

Per (boundary, sender), a one-sided CUSUM, ``C = max(0, C + min(z, cap) - kappa)``, accumulates how far the
check's score lies above its peers': ``z = (score - centre) / scale``, the centre the median of the other senders'
medians and the scale the median of their IQRs, each over that sender's last ``depth`` accepted scores. Crossing
``limit`` is an alarm (a flag and a strike, like a fence crossing), and the sum restarts from half the limit, so an
attacker that keeps going raises its next alarm in half the time. Every sender counts alike, so a minority of
attackers moves neither the centre nor the scale. A change the whole boundary shares (a phase of training, an
attack upstream reaching every replica) moves the centre once it fills the senders' windows; until then, when the
median over the live senders of their latest z exceeds ``kappa`` (the median sender accumulates), it is taken off
each check, as the peer test takes its boundary's median always (always here would let a minority of attackers
lift the median and slow their own proof: docs/decisions.md). Honest senders showed no lasting offset from one
another, which is why, unlike the peer test's distances (docs/decisions.md, "Tried and refused"), a distance is
safe here.

Measured (docs/decisions.md, "The offset's direction"): replayed offline on every gradient check of full- and
quick-profile runs, the whitened score alarmed on an offset of 5% of the RMS 2-5 steps after it began where the
size ``T`` alone took 86-100, and on a drift of 0.001 of the RMS a step 31-58 steps in where ``T`` took 74-92;
``kappa`` 1.0, ``limit`` 4, ``sketch`` 32 and ``ridge`` 0.1 raised no alarm in 1,887 honest full-profile checks nor
in 599 quick-profile ones.

Needs the passage's rows (a middle stage's gradient, ``passage_floor`` > 0) and at least ``min_peers`` other
senders with ``min_checks`` accepted checks each, heard from in the last ``horizon`` checks: a lone sender has no
peers to be different from, and its own history moves with training. A scaled or rotated gradient keeps its rows'
balance and is left to the other tests; so is an attacker that hides a common direction inside honest-looking
per-token variation, or puts its offset along the honest offsets' own few directions (it then hides inside their
random sign: a bias that flips with theirs is not a bias).

Cost: per sender ``depth`` offsets and scores of ``sketch`` floats and one ``sketch x sketch`` inverse, for at most
``max_senders``; per check ``O(rows x hidden)`` over rows the passage already has, plus ``O(peers x sketch^2)``.
"""

from __future__ import annotations

import math
import secrets
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

from sentinel_node.verification.senders import RecentSenders
from sentinel_node.verification.thresholds import quantile


def mean_row(residual: torch.Tensor) -> torch.Tensor | None:
    """The offset of a (rows, hidden) tensor: its mean row times sqrt(rows) over the root mean squared distance of a
    row from it (float64; about unit norm when the rows share no direction); None when it is undefined (fewer than two
    rows, all alike, or non-finite values)."""
    rows = residual.double()
    if rows.dim() != 2 or rows.shape[0] < 2:
        return None
    mean = rows.mean(0)
    spread = float((rows - mean).square().sum(1).mean())
    if not (spread > 0 and math.isfinite(spread)):
        return None
    offset = mean * math.sqrt(rows.shape[0] / spread)
    return offset if bool(torch.isfinite(offset).all()) else None


def row_coherence(residual: torch.Tensor) -> float | None:
    """T of a (rows, hidden) tensor: the squared norm of its :func:`mean_row` (n times the squared norm of its mean
    row over the mean squared distance of a row from it; about 1 when the rows share no direction)."""
    offset = mean_row(residual)
    return None if offset is None else float(offset.square().sum())


@dataclass(frozen=True)
class CoherenceAlarm:
    """The sender's accumulated evidence (`evidence`, in IQRs of its peers' scores) crossed the limit; `size` is this
    check's offset in the honest spread of offsets (``q``; an honest one measures about the few directions honest
    offsets take, the ridge shrinking the rest)."""

    size: float
    evidence: float


@dataclass
class _Sender:
    offsets: deque[torch.Tensor]  # projected offsets of its recently accepted checks
    scores: deque[float]  # log q of its recently accepted checks that could be judged
    inverse: torch.Tensor | None = None  # of the ridged second moment of `offsets`
    spread: tuple[float, float] = (0.0, 0.0)  # the median and IQR of `scores`
    z: float | None = None  # of its latest judged check
    evidence: float = 0.0
    last_check: int = 0


@dataclass(eq=False)
class CoherenceEvidence:
    """The CUSUM of each sender's whitened offsets against its peers' (module docstring). ``generator`` draws the
    secret projection (None: the OS's entropy)."""

    kappa: float
    limit: float
    max_senders: int
    depth: int = 32
    cap: float = 3.0
    min_peers: int = 2
    min_checks: int = 8
    horizon: int = 256
    sketch: int = 32
    ridge: float = 0.1
    generator: torch.Generator | None = None
    checks: int = field(default=0, init=False)
    projection: torch.Tensor | None = field(default=None, init=False)  # (sketch, width); None: unprojected
    width: int | None = field(default=None, init=False)

    def __post_init__(self):
        depth = self.depth
        self.senders: RecentSenders[_Sender] = RecentSenders(
            self.max_senders, lambda: _Sender(deque(maxlen=depth), deque(maxlen=depth))
        )

    @property
    def enabled(self) -> bool:
        return self.limit > 0 and self.depth > 0

    def observe(self, sender: str, offset: torch.Tensor | None) -> CoherenceAlarm | None:
        """Adds one check's offset (:func:`mean_row`) to the sender's evidence; an alarm when it crossed the limit.
        Nothing is learned here: :meth:`accept` learns the checks that were accepted."""
        u = self._project(offset)
        if u is None:
            return None
        self.checks += 1
        mine = self.senders.get(sender)
        mine.last_check = self.checks
        score = self._score(sender, u)
        peers = [
            state.spread
            for who, state in self.senders.items()
            if who != sender and len(state.scores) >= self.min_checks and self._live(state)
        ]
        if score is None or len(peers) < self.min_peers:
            return None
        centre = statistics.median(median for median, _ in peers)
        scale = max(statistics.median(iqr for _, iqr in peers), 0.05)
        z = min((score - centre) / scale, self.cap)
        # what most senders share is the boundary moving (a phase of training, an attack upstream reaching every
        # replica), evidence against no one: taken off once the median sender's latest z accumulates too. Not below
        # that, where a minority of attackers would lift the median and slow its own proof (docs/decisions.md)
        mine.z = z
        latest = [state.z for _, state in self.senders.items() if state.z is not None and self._live(state)]
        common = statistics.median(latest) if len(latest) > self.min_peers else 0.0
        if common > self.kappa:
            z -= common
        mine.evidence = max(0.0, mine.evidence + z - self.kappa)
        if mine.evidence <= self.limit:
            return None
        alarm = CoherenceAlarm(math.exp(score), mine.evidence)
        mine.evidence = self.limit / 2
        return alarm

    def accept(self, sender: str, offset: torch.Tensor | None) -> None:
        """Learns an accepted check: its offset into the sender's second moment, its score (when its peers could
        judge it) into the sender's window."""
        u = self._project(offset)
        if u is None:
            return
        score = self._score(sender, u)
        mine = self.senders.get(sender)
        mine.last_check = self.checks
        mine.offsets.append(u)
        if len(mine.offsets) >= self.min_checks:
            stacked = torch.stack(list(mine.offsets))
            moment = stacked.T @ stacked / len(stacked)
            ridge = self.ridge * float(moment.diagonal().mean()) * torch.eye(len(moment), dtype=moment.dtype)
            if bool(torch.isfinite(moment).all()):  # finite offsets can still overflow squared: keep the last one
                mine.inverse = torch.linalg.pinv(moment + ridge, hermitian=True)
        if score is not None:
            mine.scores.append(score)
            ordered = sorted(mine.scores)
            q1, median, q3 = (quantile(ordered, q) for q in (0.25, 0.5, 0.75))
            mine.spread = (median, q3 - q1)

    def _project(self, offset: torch.Tensor | None) -> torch.Tensor | None:
        """The offset in the sketch (None: not judged: the test is off, the offset undefined or of another width)."""
        if not self.enabled or offset is None or offset.dim() != 1 or not len(offset):
            return None
        if self.width is None:
            self.width = len(offset)
            if self.width > self.sketch:
                draw = self.generator or torch.Generator().manual_seed(secrets.randbits(63))
                scale = 1 / math.sqrt(self.sketch)
                self.projection = torch.randn(self.sketch, self.width, generator=draw, dtype=torch.float64) * scale
        if len(offset) != self.width:
            return None
        u = offset.double()
        return u if self.projection is None else self.projection @ u

    def _score(self, sender: str, u: torch.Tensor) -> float | None:
        """log of the median over live peers of ``u^T S^-1 u``; None with fewer than ``min_peers`` of them."""
        sizes = [
            float(u @ state.inverse @ u)
            for who, state in self.senders.items()
            if who != sender and state.inverse is not None and self._live(state)
        ]
        if len(sizes) < self.min_peers:
            return None
        size = statistics.median(sizes)
        return math.log(size) if size > 0 else None

    def _live(self, state: _Sender) -> bool:
        return self.checks - state.last_check < self.horizon

    def evidence(self, sender: str) -> float:
        state = self.senders.peek(sender)
        return state.evidence if state is not None else 0.0

    def forget(self, sender: str) -> None:
        self.senders.pop(sender)
