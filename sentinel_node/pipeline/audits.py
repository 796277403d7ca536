"""Recomputation audits as verifiers run them, the same in the verifier role and in the simulator: assembling a
stage's work on a settled microbatch from the two crossings around it, choosing auditors, and judging and striking
(the comparison itself is :mod:`sentinel_node.verification.audit`).

Who audits whom: the verifier of a stage's input boundary (k-1|k) audits stage k; stage 0, which has none, is
audited by the verifier of boundary 0|1. The auditing verifier holds one crossing itself and fetches the other
(from the verifier of boundary k|k+1) by microbatch id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sentinel_node.pipeline.recompute import ReferenceVersion
from sentinel_node.pipeline.relay_cache import Crossing
from sentinel_node.verification.audit import (
    AuditLedger,
    AuditOutcome,
    AuditTolerance,
    Comparison,
    Drift,
    Work,
    agree,
    compare,
    decide,
    wants_another,
)
from sentinel_node.verification.strikes import SenderStrikes


def auditing_boundary(stage: int) -> int:
    """The boundary whose verifier audits ``stage``."""
    return max(0, stage - 1)


@dataclass(frozen=True)
class AuditCase:
    """Stage ``stage``'s work on one settled microbatch, reconstructed by the verifiers around it: what it was
    given (``inputs``: token ids on stage 0, else hidden states; ``grad_output``, not on the last stage;
    ``targets``, on the last stage) and what it sent (``claimed``)."""

    microbatch: str
    step: int
    stage: int
    audited: str
    inputs: torch.Tensor
    grad_output: torch.Tensor | None
    targets: torch.Tensor | None
    claimed: Work
    digests: dict[str, str]

    @property
    def passthrough(self) -> Work:
        """What passes through the stage's residual stream unchanged (nothing on stage 0, whose input is tokens)."""
        hidden = self.inputs if self.inputs.is_floating_point() else None
        return Work(output=hidden if self.claimed.output is not None else None, grad_input=self.grad_output)


def assemble(stage: int, n_stages: int, below: Crossing | None, above: Crossing | None) -> AuditCase | None:
    """The case for ``stage`` from the crossing at its input boundary (``below``) and at its output boundary
    (``above``); None when a needed half is missing, tainted, unsettled or not of the same stage replica.

    A microbatch the trainer's loss gate held back (its crossings ``held``) had no backward pass: its case is the
    forward half alone (the output claimed for the input), and the last stage, which sends no output, has none."""
    first, last = stage == 0, stage == n_stages - 1
    halves = ([] if first else [below]) + ([] if last else [above])
    if any(c is None or not c.settled or c.tainted for c in halves):
        return None
    held = any(c.held for c in halves)
    if held and (last or not all(c.held for c in halves)):
        return None
    if not held and any(c.gradient is None for c in halves):
        return None
    if first:
        if above.tokens is None:
            return None
        audited, inputs = above.sender, above.tokens
    else:
        audited, inputs = below.receiver, below.activation
        if audited is None or (not last and above.sender != audited) or (not last and above.step != below.step):
            return None
    digests: dict[str, str] = {"input": (above.digest("tokens") if first else below.digest("activation"))}
    if not last:
        digests["output"] = above.digest("activation")
        if not held:
            digests["grad_output"] = above.digest("gradient")
    if not first and not held:
        digests["grad_input"] = below.digest("gradient")
    crossing = above if first else below
    return AuditCase(
        microbatch=crossing.microbatch,
        step=crossing.step,
        stage=stage,
        audited=audited,
        inputs=inputs,
        grad_output=None if last or held else above.gradient,
        targets=below.targets if last else None,
        claimed=Work(output=None if last else above.activation, grad_input=None if first or held else below.gradient),
        digests=digests,
    )


@dataclass(frozen=True)
class Recomputation:
    """What an auditor replica answered: the work recomputed with the reference ``version`` it holds, and how far
    its own parameters carried it from there (its ``drift``)."""

    auditor: str
    work: Work
    version: ReferenceVersion
    drift: Drift = Drift()


@dataclass(frozen=True)
class AuditResult:
    """One finished audit: its outcome, each auditor's recomputation and comparison, and who was contradicted."""

    case: AuditCase
    outcome: AuditOutcome
    recomputations: tuple[Recomputation, ...]
    comparisons: tuple[Comparison, ...]
    contradicted: tuple[str, ...]
    convicting: tuple[int, ...] = ()

    @property
    def first(self) -> Comparison:
        return self.comparisons[0]

    @property
    def auditors(self) -> tuple[str, ...]:
        return tuple(r.auditor for r in self.recomputations)

    @property
    def version(self) -> ReferenceVersion:
        return self.recomputations[0].version

    @property
    def evidence(self) -> dict:
        """What a signed strike record carries about a failed audit: the first accusing auditor and the one that
        confirmed it (for a conviction), their errors, the microbatch and the digests of the tensors."""
        pair = self.convicting or (0,)
        accuser = self.comparisons[pair[0]]
        confirmed = self.comparisons[pair[1]] if len(pair) > 1 else None
        return {
            "microbatch": self.case.microbatch,
            "step": self.case.step,
            "stage": self.case.stage,
            "finding": accuser.finding.value if accuser.failed else "mismatch",
            "direction": accuser.direction,
            "error": _finite(accuser.error),
            "confirmed_error": None if confirmed is None else _finite(confirmed.error),
            "auditors": [self.recomputations[i].auditor for i in pair],
            "digests": dict(self.case.digests),
            "parameters": self.version.digest,
        }


def _finite(error: float) -> float:
    """An error for a record: a missing or non-finite claim's infinite error as a large finite number."""
    return float(min(error, 1e9))


def candidate_auditors(live: Sequence[str], audited: str, order) -> list[str]:
    """The live, non-excluded replicas of the stage other than the audited one, in the verifier's random order."""
    return order([peer for peer in dict.fromkeys(live) if peer != audited])


class AuditJudge:
    """Compares claims with recomputations, decides, counts and strikes: one per verifier.

    ``stepped(peer, after, before)`` says whether the verifier saw ``peer`` complete a training microbatch at a
    step strictly between the two (so its parameters must have left a reference taken after step ``after``).
    """

    def __init__(self, tolerance: AuditTolerance, strikes: SenderStrikes, ledger: AuditLedger, stepped) -> None:
        self.tolerance, self.strikes, self.ledger, self.stepped = tolerance, strikes, ledger, stepped

    def comparable(self, case: AuditCase, recomputation: Recomputation) -> bool:
        """Whether the auditor's reference is one the audited replica shares (it averaged in that round)."""
        return recomputation.version.includes(case.audited)

    def compare(self, case: AuditCase, recomputation: Recomputation) -> Comparison:
        """The claim against one auditor's recomputation, allowed the drift that auditor measured."""
        round_step = recomputation.version.round_step
        must_have_stepped = self.stepped(case.audited, round_step, case.step)
        steps = max(0, case.step - round_step - 1)  # the most steps the audited replica took since the round
        if case.stage == 0:  # stage 0's layers add to its embeddings, which the auditor recomputed
            passthrough, residual = Work(output=recomputation.work.embedding), False
        else:
            passthrough, residual = case.passthrough, True
        return compare(
            case.claimed,
            recomputation.work,
            self.tolerance,
            must_have_stepped,
            passthrough,
            residual,
            recomputation.drift,
            steps,
        )

    def _agreement(self, recomputations: Sequence[Recomputation]):
        return lambda i, j: agree(recomputations[i].work, recomputations[j].work, self.tolerance)

    def wants_another(self, recomputations: Sequence[Recomputation], comparisons: Sequence[Comparison]) -> bool:
        """Whether to ask one more auditor (of the same reference version as the first)."""
        return wants_another(comparisons, self._agreement(recomputations))

    def settle(
        self, case: AuditCase, recomputations: Sequence[Recomputation], comparisons: Sequence[Comparison]
    ) -> AuditResult:
        """Decides the audit from its auditors' recomputations (all from one averaging round), records it and
        strikes: a conviction bans the audited replica, and each auditor that two others contradict gets a
        strike."""
        decision = decide(comparisons, self._agreement(recomputations))
        contradicted = tuple(recomputations[i].auditor for i in decision.contradicted)
        self.ledger.record(decision.outcome, case.audited, [r.auditor for r in recomputations])
        if decision.outcome is AuditOutcome.CONVICTED:
            self.strikes.convict(case.audited)
        for auditor in contradicted:
            self.ledger.contradicting(auditor)
            self.strikes.record(auditor, flagged=True)
        return AuditResult(
            case,
            decision.outcome,
            tuple(recomputations),
            tuple(comparisons),
            contradicted,
            decision.convicting,
        )

    def refused(self, auditor: str) -> bool:
        """Notes that ``auditor`` refused, failed or timed out; True when that earned it a strike."""
        if self.ledger.refusal(auditor):
            self.strikes.record(auditor, flagged=True)
            return True
        return False
