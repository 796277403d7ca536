"""Recomputation audits: what no statistic can see (a gradient with its sign inverted, a stage that stopped
training, skipped its layers or replayed another microbatch's answer), caught by having another replica of the same
stage recompute a microbatch after the fact.

A stage's work on one microbatch is four tensors, held by the verifiers on either side of it: the input it was
given and the output it sent forward, the output gradient it was given and the input gradient it sent back. An
auditor replica recomputes the output and the input gradient from the input and the output gradient with the
*reference parameters* of the stage: the parameters its replicas held together after their last averaging round
(before the first round, the shared initialisation). It never uses, or touches, the parameters it trains.

Comparing like with like (docs/decisions.md, "Recomputation audits"). A replica's parameters equal the reference
until it applies its first optimizer step after the round; from then on each replica drifts by its own updates.

- Two recomputations from the same reference are the same computation: they agree within ``tolerance.exact`` (on
  a CPU in fp32 they are bitwise equal). That is how two auditors are compared.
- A claim is compared with the reference recomputation by its relative error, per direction. On a middle stage it
  is the error of the stage's *contribution* (:func:`contribution_error`): the stage's output is its input plus
  what its layers add, so the error is measured against what they add (and the input gradient against what the
  layers add to the output gradient). On stage 0's output and the last stage's input gradient it is the plain
  relative error. Within ``tolerance.exact`` the claim is the reference computation itself. Beyond that, how far
  an honest replica drifts depends on the model, the learning rate and the point of training (early in training a
  few steps move a small model's output by more than its whole size), so the allowance is calibrated on every
  audit by the auditor itself: it computes the microbatch with its own parameters too and reports how far those
  carried it from the reference, per step of its own (:class:`Drift`); a claim may drift ``tolerance.factor``
  times that per step it may have taken, never less than ``tolerance.floor``. Beyond its allowance, the stage did
  not compute what it claims. An auditor that has not stepped since the round cannot calibrate: only the exact
  tests below judge the claim.
- Two exact tests need no tolerance. A claim equal to what passes through the stage's layers (its input as its
  output, the output gradient as its input gradient, stage 0's bare token embeddings) says its layers added
  nothing: a stage that skipped its work. A claim equal to the reference computation although the verifiers saw
  the replica complete a training microbatch since the round (so it must have stepped, and its parameters must
  have moved) proves that it did not apply its optimizer step: a frozen replica. Honest drift can hide neither.
  Both hold only where the reference computation adds something: given zeros, a bias-free block returns zeros with
  any parameters, so on an input the reference passes through unchanged neither test is made.

Judgement (:func:`decide`). One auditor can lie, so a failed comparison convicts only when a second, independent
auditor's recomputation agrees with the first's and also fails the claim (when the first two disagree, a third
decides between them). When an auditor bears the claim out instead, the auditors that failed it are the ones
contradicted. With fewer than three replicas of a stage there is no second auditor, and a failed audit stays an
unconfirmed accusation that never bans anyone; a conviction against a lying auditor needs four.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

DIRECTIONS = ("activation", "gradient")


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and exact bytes (hex): names the tensor a record speaks of."""
    data = tensor.detach().cpu().contiguous()
    hasher = hashlib.sha256(f"{data.dtype}:{tuple(data.shape)}:".encode())
    hasher.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return hasher.hexdigest()


def relative_error(claimed: torch.Tensor | None, reference: torch.Tensor | None) -> float:
    """``|claimed - reference| / |reference|`` (Frobenius norms, in float64); infinite for a missing, misshapen or
    non-finite claim, 0 when both are missing."""
    if claimed is None and reference is None:
        return 0.0
    if claimed is None or reference is None or tuple(claimed.shape) != tuple(reference.shape):
        return float("inf")
    claimed, reference = claimed.detach().double(), reference.detach().double()
    if not bool(torch.isfinite(claimed).all()):
        return float("inf")
    scale = float(reference.norm())
    difference = float((claimed - reference).norm())
    if scale == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / scale


def contribution_error(
    claimed: torch.Tensor | None, reference: torch.Tensor | None, passthrough: torch.Tensor | None
) -> float:
    """``|claimed - reference| / |reference - passthrough|``: the error relative to what the stage's layers add to
    the tensor that passes through them (``passthrough``: a middle stage's input, or the output gradient coming
    back); the plain :func:`relative_error` without one."""
    if passthrough is None or reference is None or tuple(passthrough.shape) != tuple(reference.shape):
        return relative_error(claimed, reference)
    if claimed is None or tuple(claimed.shape) != tuple(reference.shape):
        return float("inf")
    base = passthrough.detach().double()
    return relative_error(claimed.detach().double() - base, reference.detach().double() - base)


@dataclass(frozen=True)
class Drift:
    """How far an auditor's own parameters have carried it from the reference: after ``steps`` optimizer steps of
    its own, the relative ``errors`` (per direction, measured as claims are) of its own computation of the audited
    microbatch against the reference one."""

    steps: int = 0
    errors: dict[str, float] = field(default_factory=dict)

    def per_step(self, direction: str) -> float | None:
        if self.steps <= 0 or direction not in self.errors:
            return None
        return self.errors[direction] / self.steps


@dataclass(frozen=True)
class AuditTolerance:
    """``exact``: the relative error at or below which two results are one computation. A claim may drift from
    the reference by what honest training moves a replica: ``factor`` times the auditor's own drift per step (on
    this very microbatch) times the steps the audited replica may have taken since the round, and never less than
    ``floor``."""

    exact: float
    floor: float
    factor: float

    def allowance(self, direction: str, drift: Drift | None, steps: int) -> float:
        """The largest error an honest claim may show in ``direction`` after at most ``steps`` steps of its own
        since the reference; infinite (only the exact tests judge) when the auditor has not stepped since the
        reference and so cannot tell how far a step carries a replica."""
        if steps <= 0:
            return self.floor
        rate = None if drift is None else drift.per_step(direction)
        if rate is None:
            return float("inf")
        return max(self.floor, self.factor * rate * steps)


@dataclass(frozen=True)
class Work:
    """What a stage computed on one microbatch: its output (not on the last stage) and its input gradient (not on
    the first). A claim is what the audited stage sent; a recomputation what an auditor computed."""

    output: torch.Tensor | None = None
    grad_input: torch.Tensor | None = None
    embedding: torch.Tensor | None = None  # stage 0's token embeddings: what its layers add to (recomputed only)

    def tensor(self, direction: str) -> torch.Tensor | None:
        return self.output if direction == "activation" else self.grad_input

    def directions(self) -> tuple[str, ...]:
        return tuple(d for d in DIRECTIONS if self.tensor(d) is not None)


class Finding(Enum):
    """How a claim compares with the reference recomputation."""

    SAME = "same"  # within the exact tolerance in every direction: the reference computation itself
    DRIFTED = "drifted"  # within the divergence tolerance: what an honest replica sends between rounds
    MISMATCH = "mismatch"  # beyond the divergence tolerance in some direction: not what it claims to be
    SKIPPED = "skipped"  # exactly what passes through the stage's layers: they added nothing
    FROZEN = "frozen"  # the reference computation, although the replica must have stepped since the round

    @property
    def failed(self) -> bool:
        return self in (Finding.MISMATCH, Finding.SKIPPED, Finding.FROZEN)


@dataclass(frozen=True)
class Comparison:
    """A claim against one recomputation: the relative error per direction, what it was allowed, and what it
    means."""

    errors: dict[str, float]
    finding: Finding
    direction: str  # the direction with the largest error relative to its allowance (the one at fault if failed)
    allowances: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.finding.failed

    @property
    def error(self) -> float:
        return self.errors[self.direction]


def errors_against(claimed: Work, reference: Work, passthrough: Work = Work(), residual: bool = True) -> dict:
    """The relative error of ``claimed`` against ``reference`` per direction (of the stage's contribution, with
    ``residual``: see :func:`compare`)."""
    directions = reference.directions() or claimed.directions()
    base = passthrough if residual else Work()
    return {d: contribution_error(claimed.tensor(d), reference.tensor(d), base.tensor(d)) for d in directions}


def compare(
    claimed: Work,
    recomputed: Work,
    tolerance: AuditTolerance,
    must_have_stepped: bool,
    passthrough: Work = Work(),
    residual: bool = True,
    drift: Drift | None = None,
    steps: int = 0,
) -> Comparison:
    """Judges a claim against the reference recomputation. ``must_have_stepped``: the replica completed a training
    microbatch after the round and before this one, so an honest replica's parameters have left the reference.
    ``passthrough``: what passes through the stage's layers unchanged (``output``: a middle stage's input or stage
    0's embeddings; ``grad_input``: the output gradient it was given); with ``residual``, errors are measured
    against what the layers add to it. ``drift``: the auditor's own; ``steps``: the most optimizer steps the
    audited replica can have taken since the reference (see :meth:`AuditTolerance.allowance`)."""
    directions = recomputed.directions() or claimed.directions()
    errors = errors_against(claimed, recomputed, passthrough, residual)
    allowances = {d: tolerance.allowance(d, drift, steps) for d in directions}
    # Where the reference computation itself passes the tensor through (an all-zero input: every layer of a
    # bias-free block maps zeros to zeros, whatever its parameters), neither exact test proves anything: an honest
    # replica returns its input there, and returns the reference result however far it stepped. An attacker
    # upstream sending zeros framed the honest replica after it as one that skipped its layers.
    inert = {
        d
        for d in directions
        if passthrough.tensor(d) is not None
        and relative_error(recomputed.tensor(d), passthrough.tensor(d)) <= tolerance.exact
    }
    skipped = [
        d
        for d in directions
        if d not in inert
        and passthrough.tensor(d) is not None
        and contribution_error(claimed.tensor(d), passthrough.tensor(d), recomputed.tensor(d)) <= tolerance.exact
    ]
    worst = max(directions, key=lambda d: errors[d] / allowances[d])
    if skipped:
        finding, worst = Finding.SKIPPED, skipped[0]
    elif any(errors[d] > allowances[d] for d in directions):
        finding = Finding.MISMATCH
    elif all(errors[d] <= tolerance.exact for d in directions):
        moving = [d for d in directions if d not in inert]  # where stepping must have changed the result
        finding = Finding.FROZEN if must_have_stepped and moving else Finding.SAME
        worst = max(moving or directions, key=lambda d: errors[d])
    else:
        finding = Finding.DRIFTED
    return Comparison(errors, finding, worst, allowances)


def agree(first: Work, second: Work, tolerance: AuditTolerance) -> bool:
    """Whether two recomputations from the same reference are the same computation."""
    directions = set(first.directions()) | set(second.directions())
    return all(relative_error(second.tensor(d), first.tensor(d)) <= tolerance.exact for d in directions)


class AuditOutcome(Enum):
    """What an audit decided."""

    PASSED = "passed"  # the first auditor's recomputation bears the claim out
    CONVICTED = "convicted"  # two auditors agree with each other and both fail the claim: a ban
    CONTRADICTED = "contradicted"  # an auditor bears the claim out against the one(s) that failed it: no strike
    DISPUTED = "disputed"  # auditors failed the claim but no two of them agree: no strike
    UNCONFIRMED = "unconfirmed"  # the first failed the claim and no second auditor answered (or exists)


# An audit asks at most this many auditors: a second to confirm a failure, a third when the first two disagree.
MAX_AUDITORS = 3


@dataclass(frozen=True)
class Decision:
    """An audit's outcome, and the auditors (by index) whose recomputation two others contradict."""

    outcome: AuditOutcome
    contradicted: tuple[int, ...] = ()
    convicting: tuple[int, ...] = ()  # the two agreeing auditors behind a conviction


def decide(comparisons: Sequence[Comparison], agree: Callable[[int, int], bool]) -> Decision:
    """The outcome of an audit from each auditor's comparison with the claim (in the order they were asked) and
    whether two auditors' recomputations agree (``agree(i, j)``).

    A conviction needs two auditors that agree with each other and both fail the claim; any other auditor that
    disagrees with them is contradicted. Without such a pair, an auditor that bears the claim out contradicts the
    auditors that failed it and disagree with it. One auditor alone never convicts anyone."""
    if not comparisons[0].failed:
        return Decision(AuditOutcome.PASSED)
    if len(comparisons) == 1:
        return Decision(AuditOutcome.UNCONFIRMED)
    indices = range(len(comparisons))
    for i in indices:
        for j in indices[i + 1 :]:
            if comparisons[i].failed and comparisons[j].failed and agree(i, j):
                others = tuple(k for k in indices if k not in (i, j) and not agree(k, i))
                return Decision(AuditOutcome.CONVICTED, others, (i, j))
    passing = [k for k in indices if not comparisons[k].failed]
    if passing:
        against = tuple(k for k in indices if comparisons[k].failed and not agree(k, passing[0]))
        return Decision(AuditOutcome.CONTRADICTED, against)
    return Decision(AuditOutcome.DISPUTED)


def wants_another(comparisons: Sequence[Comparison], agree: Callable[[int, int], bool]) -> bool:
    """Whether an audit in this state should ask one more auditor (up to :data:`MAX_AUDITORS`)."""
    outcome = decide(comparisons, agree).outcome
    undecided = outcome in (AuditOutcome.UNCONFIRMED, AuditOutcome.DISPUTED)
    return undecided and len(comparisons) < MAX_AUDITORS


@dataclass
class AuditCounts:
    """One peer's audits as this verifier saw them: as the audited stage, and as an auditor."""

    passed: int = 0
    convicted: int = 0
    contradicted: int = 0  # audits of this peer in which an auditor bore its claim out against the accusers
    disputed: int = 0
    unconfirmed: int = 0
    contradicting: int = 0  # as an auditor: recomputations two others contradicted (each a strike)
    refused: int = 0  # as an auditor: requests refused, failed or timed out
    refusal_streak: int = 0

    @property
    def run(self) -> int:
        return self.passed + self.convicted + self.contradicted + self.disputed + self.unconfirmed

    @property
    def failed(self) -> int:
        return self.convicted


@dataclass
class AuditLedger:
    """Counts of audits by peer, and when an auditor's refusals amount to a strike."""

    refusal_limit: int = 3  # refusals in a row that earn an auditor a strike
    peers: dict[str, AuditCounts] = field(default_factory=dict)

    def of(self, peer: str) -> AuditCounts:
        return self.peers.setdefault(peer, AuditCounts())

    def record(self, outcome: AuditOutcome, audited: str, auditors: Iterable[str]) -> None:
        counts = self.of(audited)
        setattr(counts, outcome.value, getattr(counts, outcome.value) + 1)
        for auditor in auditors:
            self.of(auditor).refusal_streak = 0

    def contradicting(self, auditor: str) -> None:
        self.of(auditor).contradicting += 1

    def refusal(self, auditor: str) -> bool:
        """Notes a refused or failed request; True when it completes a streak of ``refusal_limit`` (a strike)."""
        counts = self.of(auditor)
        counts.refused += 1
        counts.refusal_streak += 1
        if counts.refusal_streak >= self.refusal_limit:
            counts.refusal_streak = 0
            return True
        return False

    def totals(self) -> dict[str, int]:
        keys = ("passed", "convicted", "contradicted", "disputed", "unconfirmed", "refused")
        totals = {key: sum(getattr(c, key) for c in self.peers.values()) for key in keys}
        totals["run"] = sum(c.run for c in self.peers.values())
        return totals
