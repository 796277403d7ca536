"""One boundary, one direction: check every tensor that crosses it (docs/architecture.md section 3).

Four tests, each for what the others miss:

- per-tensor fences (:mod:`thresholds`) on the distances (:mod:`metrics`) of the tensor's profile to a reference a
  minority cannot walk (:mod:`reference`): blatant corruption, flagged on the tensor itself;
- evidence accumulated per sender against its peers at this boundary (:mod:`peers`): small deviations that are
  consistent, inside every fence;
- near-copies of recent tensors of other content (:mod:`replay`): free-riders;
- for a middle stage's gradient, evidence accumulated per sender that the stage's own contribution shares one
  direction across its tokens (:mod:`coherence`): an offset added to every token, however small or slow;
- for activations, evidence accumulated per sender that its mean row departs from its peers' the same way, check
  after check (:mod:`drift`): a rotation or a small bias that keeps every norm and spread inside the fences.

A fence crossed, not blatantly, while a quarter of the other senders crossed it too is the boundary moving
(:mod:`shift`): accepted, and learned from.

Strikes are weighted by the evidence (:mod:`strikes`), and a moderate crossing of a sender with peers strikes only
when it repeats a recent flag of the sender: an isolated one is a suspicion, audited.

Given the gradient its sender was given, a gradient is also judged on its passage through the sender's layers
(:mod:`passage`): a flag there drops the gradient and makes the sender a suspect, never a strike; the caller has
the crossing audited (``roles.audits``), and only a failed audit bans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from sentinel_node.verification.baseline import EmaBaseline
from sentinel_node.verification.coherence import CoherenceAlarm, CoherenceEvidence
from sentinel_node.verification.drift import PeerMeans
from sentinel_node.verification.metrics import FENCE_ONLY, METRICS, SPIKY
from sentinel_node.verification.passage import Given, GradientPassage, PassageScore
from sentinel_node.verification.peers import PeerAlarm, PeerEvidence
from sentinel_node.verification.profile import Profile, Profiler, Scan
from sentinel_node.verification.reference import PeerReference
from sentinel_node.verification.replay import ReplayMatch, ReplaySketcher, ReplayStore
from sentinel_node.verification.shift import SharedShift
from sentinel_node.verification.strikes import SenderRecord, SenderStrikes
from sentinel_node.verification.thresholds import AdaptiveThreshold

REPLACEMENTS = ("ema", "zero", "drop")


@dataclass(frozen=True)
class MonitorSettings:
    """Plain values for one monitor; `sentinel_node.config.VerificationConfig.monitor_settings` builds them."""

    beta: float
    n_projections: int
    n_quantiles: int
    spectral_rank: int
    spectral_oversample: int
    spectral_power_iterations: int
    window: int
    fence_k: float
    fence_spaces: dict[str, str]
    floors: dict[str, float]
    row_clip: float
    warmup: int
    warmup_fenced_after: int
    strike_limit: int
    forgive_after: int
    forgive_steps: int
    blatant_severity: float
    blatant_limit: int
    blatant_forgive_after: int
    probation: int
    reference_pool: int
    reference_horizon: int
    peer_pool: int
    peer_kappa: float
    peer_limit: float
    replay_keep: int
    replay_width: int
    replay_similarity: float
    max_senders: int
    replacement: str
    seed: int
    passage_floor: float = 0.0  # the gradient's passage through the sending stage (passage.py); 0: not judged
    coherence_kappa: float = 1.0  # the coherence test's allowance per check, in IQRs (coherence.py)
    coherence_limit: float = 0.0  # its evidence that flags (0: off; it also needs the passage)
    drift_kappa: float = 1.0  # the drift test's allowance per check, in IQRs (drift.py)
    drift_limit: float = 0.0  # its evidence that flags (0: off)
    private_seed: int | None = None  # what the stages judged must not know (the tests' sketches); None: the OS's
    metrics: tuple[str, ...] = tuple(METRICS)  # those judged at this boundary and direction
    repeat_within: int = 0  # a moderate crossing of a sender with peers strikes only within this many of its checks
    # of its previous flag (strikes.py; 0: every crossing strikes)


class VerdictKind(Enum):
    """What a check decided about a tensor."""

    ACCEPTED = "accepted"  # passed on as it came, and learned from (unless warming up only builds the baseline)
    MALFORMED = "malformed"  # not a tensor of the boundary's shape, dtype and finite values
    METRIC = "metric"  # a statistic over its threshold
    PEER = "peer"  # the sender's recent checks were consistently further from the reference than its peers'
    REPLAY = "replay"  # a near-copy of a recent tensor that carried other tokens
    PASSAGE = "passage"  # a gradient that does not follow the one its sender was given: dropped, a suspicion
    COHERENCE = "coherence"  # the sender's contributions to gradients consistently shared one direction over tokens
    DRIFT = "drift"  # the sender's mean activation row consistently departed from its peers' in one direction
    SKIPPED = "skipped"  # not judged: the microbatch was tainted upstream, or verification is off


FLAGS = frozenset(
    {
        VerdictKind.MALFORMED,
        VerdictKind.METRIC,
        VerdictKind.PEER,
        VerdictKind.REPLAY,
        VerdictKind.PASSAGE,
        VerdictKind.COHERENCE,
        VerdictKind.DRIFT,
    }
)


@dataclass
class Verdict:
    """What a check decided. `tensor` is what to pass on: the input, or a replacement; None means drop it.

    `kind` is the decision; `struck` whether the sender got a strike for it; `blatant` whether the flag weighed
    double (far over a threshold, or a copy); `over` the metrics over their thresholds (kind METRIC, or an ACCEPTED
    tensor whose crossing was `shared` with other senders) or the one whose evidence crossed (kind PEER);
    `replay` what the tensor copies (kind REPLAY); `coherence` the evidence that crossed (kinds COHERENCE, DRIFT);
    `problem` what is wrong with a malformed tensor (also set on a SKIPPED verdict whose tensor was malformed and
    replaced). `severity` is the largest metric's place between its window's median (0) and its threshold (1).
    `reason` is for display.
    """

    kind: VerdictKind
    tensor: torch.Tensor | None
    struck: bool = False
    blatant: bool = False
    over: tuple[str, ...] = ()
    problem: str | None = None
    replay: ReplayMatch | None = None
    peer: PeerAlarm | None = None
    coherence: CoherenceAlarm | None = None
    severity: float = 0.0
    shared: bool = False
    scores: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    warming_up: bool = False
    sender: SenderRecord | None = None

    @property
    def flagged(self) -> bool:
        return self.kind in FLAGS

    @property
    def skipped(self) -> bool:
        return self.kind is VerdictKind.SKIPPED

    @property
    def malformed(self) -> bool:
        """The tensor's form was wrong (shape, dtype, non-finite values), whether or not it was judged."""
        return self.problem is not None

    @property
    def tainted(self) -> bool:
        """The microbatch no longer carries its true tensor: checks further along must not judge it."""
        return self.flagged

    @property
    def banned(self) -> bool:
        return self.sender is not None and self.sender.banned

    @property
    def reason(self) -> str | None:
        """Why it was flagged (or why a skipped tensor was replaced), for people to read."""
        if self.kind is VerdictKind.METRIC:
            return "metric:" + ",".join(self.over) + (" (blatant)" if self.blatant else "")
        if self.kind is VerdictKind.PEER:
            return f"peer:{self.over[0]} (consistently further from the reference than the other senders)"
        if self.kind is VerdictKind.REPLAY and self.replay is not None:
            return f"replay: a near-copy ({self.replay.similarity:.2f}) of a tensor {self.replay.age} checks ago"
        if self.kind is VerdictKind.PASSAGE:
            return "passage: not the gradient it was given, carried through the residual stream (a suspect: audited)"
        if self.kind is VerdictKind.COHERENCE and self.coherence is not None:
            return (
                f"coherence: its layers' gradients shared one direction across tokens, check after check "
                f"(this one {self.coherence.size:.3g} in the honest spread)"
            )
        if self.kind is VerdictKind.DRIFT and self.coherence is not None:
            return (
                f"drift: its activations' mean departed from its peers' the same way, check after check "
                f"(this one {self.coherence.size:.3g} in the honest spread)"
            )
        return self.problem

    @property
    def evidence(self) -> str:
        """The scores over their thresholds, for logs: "spectral 0.121 > 0.085" (empty when none was)."""
        return ", ".join(
            f"{name} {self.scores[name]:.3g} > {self.thresholds[name]:.3g}"
            for name in self.over
            if name in self.scores and name in self.thresholds
        )


class BoundaryMonitor:
    """Checks tensors crossing one boundary in one direction.

    `check(tensor, sender, content=...)` returns a Verdict; the strike ledger (shared by a verifier's monitors when
    it passes one in) says when a sender is banned. Tensors of tainted microbatches are neither judged nor learned
    from. `content` names the microbatch's tokens (a hash of its targets): near-copies of the same content are
    legitimate (retries, duplicate computation), of other content they are replays. `step` is the global step the
    check falls in, as the caller knows it (not as the sender claims it): a lone sender's moderate flags of one step
    give it one strike at most. `given`, for a gradient, holds rows of the output gradient its sender was given
    (what the next verifier passed back to it): the input gradient must follow it through the residual stream
    (:mod:`passage`).
    `dtype` is the boundary's wire dtype (float32, bfloat16 or float16): a tensor of another is malformed, the
    statistics are taken in float32 whatever it is, and replacements are made in it. `device` is where the
    statistics are computed (a GPU verifier's); the baseline, the verdicts and the tensors passed on stay on the CPU.
    """

    def __init__(
        self,
        settings: MonitorSettings,
        hidden_size: int,
        expected_shape: tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        ledger: SenderStrikes | None = None,
        device: str | torch.device = "cpu",
    ):
        if settings.replacement not in REPLACEMENTS:
            raise ValueError(f"replacement must be one of {REPLACEMENTS}, not {settings.replacement!r}")
        self.settings, self.hidden_size, self.expected_shape, self.dtype = settings, hidden_size, expected_shape, dtype
        self.profiler = Profiler(
            hidden_size,
            settings.n_projections,
            settings.n_quantiles,
            settings.spectral_rank,
            settings.seed,
            settings.row_clip,
            oversample=settings.spectral_oversample,
            power_iterations=settings.spectral_power_iterations,
            device=device,
        )
        self.baseline = EmaBaseline(settings.beta)
        self.peer_reference = PeerReference(settings.reference_pool, settings.reference_horizon, settings.max_senders)
        self.thresholds = {
            name: AdaptiveThreshold(
                settings.window, settings.fence_k, settings.floors[name], settings.fence_spaces[name]
            )
            for name in settings.metrics
        }
        self.metrics = {name: METRICS[name] for name in settings.metrics}
        ranked = tuple(name for name in settings.metrics if name not in FENCE_ONLY)
        self.peers = PeerEvidence(
            ranked, settings.peer_pool, settings.peer_kappa, settings.peer_limit, settings.max_senders
        )
        self.shift = SharedShift(settings.peer_pool)
        self.passage = GradientPassage(settings.window, settings.fence_k, settings.passage_floor)
        seed = settings.private_seed
        secret = None if seed is None else torch.Generator().manual_seed(seed)
        self.coherence = CoherenceEvidence(
            settings.coherence_kappa, settings.coherence_limit, settings.max_senders, generator=secret
        )
        self.means = PeerMeans()
        secret = None if seed is None else torch.Generator().manual_seed(seed + 1)
        self.drift = CoherenceEvidence(
            settings.drift_kappa, settings.drift_limit, settings.max_senders, generator=secret
        )
        self.sketcher = ReplaySketcher(hidden_size, settings.replay_width, settings.seed)
        self.replays = ReplayStore(settings.replay_keep, settings.replay_similarity)
        self.ledger = (
            ledger
            if ledger is not None
            else SenderStrikes(
                settings.strike_limit,
                settings.forgive_after,
                settings.blatant_limit,
                settings.blatant_forgive_after,
                settings.max_senders,
                settings.probation,
                settings.forgive_steps,
                settings.repeat_within,
            )
        )
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.accepted = 0

    @property
    def warming_up(self) -> bool:
        return self.accepted < self.settings.warmup

    def reference(self) -> Profile | None:
        """What tensors are judged against: the senders' median, or with fewer than three senders the EMA."""
        return self._references()[1]

    def _references(self) -> tuple[Profile | None, Profile | None]:
        """The senders' median (None with fewer than three senders), and what tensors are judged against."""
        median = self.peer_reference.reference()
        return median, median if median is not None else self.baseline.reference

    def check(
        self,
        tensor: torch.Tensor,
        sender: str,
        tainted: bool = False,
        content: int | None = None,
        step: int | None = None,
        given: Given | None = None,
    ) -> Verdict:
        problem, scan = self._malformed(tensor)
        if tainted:
            # an honest peer downstream of a replaced tensor is not to blame; only keep garbage from travelling
            replacement = self._replace(tensor) if problem else tensor
            return Verdict(VerdictKind.SKIPPED, replacement, problem=problem)
        if problem:
            return self._flag(tensor, sender, VerdictKind.MALFORMED, problem=problem, now=step)
        passage = None if given is None else self.passage.judge(tensor, given)
        if passage is not None and passage.over:
            # an input gradient the residual stream cannot have carried from the output gradient it was given: not
            # passed on, and a suspicion, not a strike (a replica whose parameters an attacker disturbed through
            # averaging sends such gradients honestly); the caller has the crossing audited, and the audit decides
            return self._flag(
                tensor,
                sender,
                VerdictKind.PASSAGE,
                scores={"passage": passage.score},
                limits={"passage": passage.threshold},
                severity=passage.severity,
                over=("passage",),
                strike=False,
                now=step,
            )

        copied = self._replayed(tensor, sender, content)
        profile = self.profiler.profile(scan)
        median, reference = self._references()
        self.peer_reference.observe(sender, profile)
        if reference is None:
            self._accept(profile, {})
            self._accept_passage(sender, passage)
            self._accept_mean(sender, profile, None)
            return self._accepted(tensor, sender, {}, {}, warming_up=True, now=step)

        scores = {name: metric(profile, reference) for name, metric in self.metrics.items()}
        limits = {name: self.thresholds[name].threshold() for name in self.metrics}
        severities = {name: self.thresholds[name].severity(scores[name]) for name in self.metrics}
        severity = max(severities.values())
        alarm = self.peers.observe(sender, scores)
        coherent = None if passage is None else self.coherence.observe(sender, passage.offset)
        deviation = self.means.deviation(sender, profile.mean) if self.drift.enabled else None
        drifted = self.drift.observe(sender, deviation)
        evidence = dict(scores=scores, limits=limits, severity=severity, now=step)
        over = self._over(scores, limits, judged_by_peers=median is not None)
        blatant = (
            max((v for name, v in severities.items() if name not in SPIKY), default=0.0)
            >= self.settings.blatant_severity
        )
        shared = self.shift.observe(sender, over, blatant=blatant or copied is not None)
        if copied is not None:
            return self._flag(tensor, sender, VerdictKind.REPLAY, blatant=True, replay=copied, **evidence)
        if over and (blatant or not shared):
            alone = median is None and not blatant  # no majority to lean on (fewer than three senders)
            if alone and not self.shift.peer_inside(sender, over):
                # the EMA is the reference, and one that only learns from accepted tensors never follows an honest
                # shift of a lone sender, which would then be flagged on every tensor. A moderate crossing moves
                # it, as flagged tensors enter the median's pool; a lone sender walking it this way pays a strike a
                # step (one it could walk below the fences free). Not where the other sender of a pair stayed
                # inside these fences: the crossing is then this sender's own, and an attacker beside one honest
                # replica would walk the EMA to itself within a step (docs/decisions.md)
                self.baseline.update(profile)
            # with peers, a crossing of one sender's own is evidence on every tensor that repeats it (strikes.py)
            step = step if alone else None
            return self._flag(
                tensor,
                sender,
                VerdictKind.METRIC,
                over=over,
                blatant=blatant,
                step=step,
                repeated=not alone,
                **evidence,
            )
        if coherent is not None:
            return self._flag(
                tensor, sender, VerdictKind.COHERENCE, over=("coherence",), coherence=coherent, **evidence
            )
        if drifted is not None:
            return self._flag(tensor, sender, VerdictKind.DRIFT, over=("drift",), coherence=drifted, **evidence)
        if alarm is not None:
            return self._flag(tensor, sender, VerdictKind.PEER, over=(alarm.metric,), peer=alarm, **evidence)
        warming_up = self.warming_up
        self._accept(profile, scores)
        self._accept_passage(sender, passage)
        self._accept_mean(sender, profile, deviation)
        verdict = self._accepted(tensor, sender, scores, limits, severity, warming_up, now=step)
        verdict.over, verdict.shared = over, bool(over)
        return verdict

    def _over(self, scores: dict[str, float], limits: dict[str, float], judged_by_peers: bool) -> tuple[str, ...]:
        """The metrics whose fence the scores cross. In warm-up, only those whose fence holds `warmup_fenced_after`
        scores, and only where a majority of senders is the reference: that reference needs no warm-up, and an
        attack that starts in warm-up would otherwise be learned by the fences before any could flag it (the
        sweep's `start_blatant`: noise at a deep boundary early in training sits 1-2 times over its fence, not the
        4 times of a blatant crossing, and was accepted until the audits banned it). A lone sender's EMA is still
        forming in warm-up, so its tensors wait for the whole of it."""
        if not self.warming_up:
            return tuple(name for name in self.metrics if scores[name] > limits[name])
        after = self.settings.warmup_fenced_after
        if not judged_by_peers or not after:
            return ()
        return tuple(
            name for name in self.metrics if len(self.thresholds[name].scores) >= after and scores[name] > limits[name]
        )

    def _replayed(self, tensor: torch.Tensor, sender: str, content: int | None) -> ReplayMatch | None:
        if not self.replays.enabled:
            return None
        sketch = self.sketcher(tensor.float())  # a 16-bit wire's tensors are sketched in float32, as profiled
        match = self.replays.match(sketch, content)
        self.replays.add(sketch, sender, content)
        return match

    def _accepted(
        self,
        tensor: torch.Tensor,
        sender: str,
        scores: dict,
        limits: dict,
        severity: float = 0.0,
        warming_up: bool = False,
        now: int | None = None,
    ) -> Verdict:
        record = self.ledger.record(sender, False, now=now)
        return Verdict(
            VerdictKind.ACCEPTED,
            tensor,
            scores=scores,
            thresholds=limits,
            severity=severity,
            warming_up=warming_up,
            sender=record,
        )

    def _malformed(self, tensor: torch.Tensor) -> tuple[str | None, Scan | None]:
        """What is wrong with the tensor's form, or None; and its first pass (read once, for the profile too)."""
        if not isinstance(tensor, torch.Tensor):
            return f"not a tensor: {type(tensor).__name__}", None
        if self.expected_shape is not None and tuple(tensor.shape) != tuple(self.expected_shape):
            return f"shape {tuple(tensor.shape)} instead of {tuple(self.expected_shape)}", None
        if tensor.dim() != 3 or tensor.shape[-1] != self.hidden_size:
            return f"shape {tuple(tensor.shape)} is not (batch, tokens, {self.hidden_size})", None
        if tensor.dtype != self.dtype:
            return f"dtype {tensor.dtype} instead of {self.dtype}", None
        scan = self.profiler.scan(tensor)
        return (None if scan.finite else "non-finite values"), scan

    def _flag(
        self,
        tensor: torch.Tensor,
        sender: str,
        kind: VerdictKind,
        scores: dict[str, float] | None = None,
        limits: dict[str, float] | None = None,
        severity: float = 0.0,
        over: tuple[str, ...] = (),
        problem: str | None = None,
        blatant: bool = False,
        replay: ReplayMatch | None = None,
        peer: PeerAlarm | None = None,
        coherence: CoherenceAlarm | None = None,
        step: int | None = None,
        now: int | None = None,
        strike: bool = True,
        repeated: bool = False,
    ) -> Verdict:
        """`step` only for a lone sender's moderate fence crossings: those of one step are one piece of evidence
        (:meth:`SenderStrikes.record`). `repeated` for a sender with peers' moderate fence crossing its peers do not
        share: a strike when it repeats a recent flag of the sender, a suspicion when isolated. A malformed tensor, a
        replay, a blatant crossing and an alarm of the sequential tests are evidence each. `strike` False: a
        suspicion only (the passage)."""
        record = self.ledger.record(
            sender,
            True,
            weight=2 if blatant else 1,
            blatant=blatant,
            step=step,
            now=now,
            strike=strike,
            repeated_only=repeated,
        )
        if record.banned:
            self.peer_reference.forget(sender)
            self.peers.forget(sender)
            self.shift.forget(sender)
            self.coherence.forget(sender)
            self.drift.forget(sender)
            self.means.forget(sender)
        return Verdict(
            kind,
            self._replace(tensor),
            struck=strike,
            blatant=blatant,
            over=over,
            problem=problem,
            replay=replay,
            peer=peer,
            coherence=coherence,
            severity=severity,
            scores=scores or {},
            thresholds=limits or {},
            warming_up=self.warming_up,
            sender=record,
        )

    def _accept(self, profile: Profile, scores: dict[str, float]) -> None:
        self.baseline.update(profile)
        for name, score in scores.items():
            self.thresholds[name].accept(score)
        self.accepted += 1

    def _accept_passage(self, sender: str, passage: PassageScore | None) -> None:
        if passage is not None:
            self.passage.accept(passage)
            self.coherence.accept(sender, passage.offset)

    def _accept_mean(self, sender: str, profile: Profile, deviation: torch.Tensor | None) -> None:
        if self.drift.enabled:
            self.drift.accept(sender, deviation)
            self.means.accept(sender, profile.mean)

    def _replace(self, tensor: torch.Tensor) -> torch.Tensor | None:
        policy = self.settings.replacement
        if policy == "drop":
            return None
        shape = self.expected_shape or _plausible_shape(tensor, self.hidden_size)
        if policy == "zero":
            return torch.zeros(shape, dtype=self.dtype)
        return self.baseline.replacement(shape, self.dtype, self.generator)


def _plausible_shape(tensor: torch.Tensor, hidden_size: int) -> tuple[int, ...]:
    """The shape a replacement should take when the monitor was not told one: the input's, mended to hidden size."""
    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 else (1, 1, hidden_size)
    return (*shape[:-1], hidden_size)
