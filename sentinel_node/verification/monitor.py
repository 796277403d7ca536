"""One boundary, one direction: check every tensor that crosses it (docs/architecture.md section 3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from sentinel_node.verification.baseline import EmaBaseline
from sentinel_node.verification.drift import DriftTest
from sentinel_node.verification.metrics import METRICS
from sentinel_node.verification.profile import Profiler, Scan
from sentinel_node.verification.shift import BoundaryShift
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
    strike_limit: int
    forgive_after: int
    drift_window: int
    drift_limit: float
    shift_window: int
    replacement: str
    seed: int


class VerdictKind(Enum):
    """What a check decided about a tensor."""

    ACCEPTED = "accepted"  # passed on as it came, and learned from (unless warming up only builds the baseline)
    MALFORMED = "malformed"  # not a tensor of the boundary's shape, dtype and finite values
    METRIC = "metric"  # a statistic over its threshold
    DRIFT = "drift"  # the sender's recent checks sit persistently high inside the thresholds
    SKIPPED = "skipped"  # not judged: the microbatch was tainted upstream, or verification is off


FLAGS = frozenset({VerdictKind.MALFORMED, VerdictKind.METRIC, VerdictKind.DRIFT})


@dataclass
class Verdict:
    """What a check decided. `tensor` is what to pass on: the input, or a replacement; None means drop it.

    `kind` is the decision; `struck` whether the sender got a strike for it (a flag during a boundary-wide shift
    gives none); `over` the metrics over their thresholds (kind METRIC); `problem` what is wrong with a malformed
    tensor (also set on a SKIPPED verdict whose tensor was malformed and replaced). `reason` is for display only.
    """

    kind: VerdictKind
    tensor: torch.Tensor | None
    struck: bool = False
    over: tuple[str, ...] = ()
    problem: str | None = None
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
            text = "metric:" + ",".join(self.over)
        elif self.kind is VerdictKind.DRIFT:
            text = "drift"
        elif self.problem is not None:
            text = self.problem
        else:
            return None
        return text if self.struck or not self.flagged else f"{text} (boundary-wide shift: no strike)"


class BoundaryMonitor:
    """Checks tensors crossing one boundary in one direction against an EMA baseline.

    `check(tensor, sender)` returns a Verdict; the strike ledger (shared by a verifier's monitors when it passes
    one in) says when a sender is banned. Tensors of tainted microbatches are neither judged nor learned from.
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
        self.thresholds = {
            name: AdaptiveThreshold(
                settings.window, settings.fence_k, settings.floors[name], settings.fence_spaces[name]
            )
            for name in METRICS
        }
        self.drift = DriftTest(settings.drift_window, settings.drift_limit)
        self.shift = BoundaryShift(settings.shift_window)
        self.ledger = ledger if ledger is not None else SenderStrikes(settings.strike_limit, settings.forgive_after)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.accepted = 0

    @property
    def warming_up(self) -> bool:
        return self.accepted < self.settings.warmup

    def check(self, tensor: torch.Tensor, sender: str, tainted: bool = False) -> Verdict:
        problem, scan = self._malformed(tensor)
        if tainted:
            # an honest peer downstream of a replaced tensor is not to blame; only keep garbage from travelling
            replacement = self._replace(tensor) if problem else tensor
            return Verdict(VerdictKind.SKIPPED, replacement, problem=problem)
        if problem:
            return self._flag(tensor, sender, VerdictKind.MALFORMED, problem=problem)

        profile = self.profiler.profile(scan)
        reference = self.baseline.reference
        if reference is None:
            self._accept(profile, {})
            return self._accepted(tensor, sender, {}, {}, warming_up=True)

        scores = {name: metric(profile, reference) for name, metric in METRICS.items()}
        limits = {name: self.thresholds[name].threshold() for name in METRICS}
        if self.warming_up:
            self._accept(profile, scores)
            return self._accepted(tensor, sender, scores, limits, warming_up=True)

        over = tuple(name for name in METRICS if scores[name] > limits[name])
        severity = max(self.thresholds[name].severity(scores[name]) for name in METRICS)
        kind = VerdictKind.METRIC if over else VerdictKind.DRIFT if self.drift.observe(sender, severity) else None
        self.shift.observe(sender, kind is not None)
        if kind is not None:
            return self._flag(tensor, sender, kind, scores, limits, over=over, strike=not self.shift.widespread())
        self._accept(profile, scores)
        return self._accepted(tensor, sender, scores, limits)

    def _accepted(
        self, tensor: torch.Tensor, sender: str, scores: dict, limits: dict, warming_up: bool = False
    ) -> Verdict:
        record = self.ledger.record(sender, False)
        return Verdict(
            VerdictKind.ACCEPTED, tensor, scores=scores, thresholds=limits, warming_up=warming_up, sender=record
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
        over: tuple[str, ...] = (),
        problem: str | None = None,
        strike: bool = True,
    ) -> Verdict:
        return Verdict(
            kind,
            self._replace(tensor),
            struck=strike,
            over=over,
            problem=problem,
            scores=scores or {},
            thresholds=limits or {},
            sender=self.ledger.record(sender, True) if strike else self.ledger.peek(sender),
        )

    def _accept(self, profile, scores: dict[str, float]) -> None:
        self.baseline.update(profile)
        for name, score in scores.items():
            self.thresholds[name].accept(score)
        self.accepted += 1

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
