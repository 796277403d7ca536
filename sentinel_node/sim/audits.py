"""Recomputation audits in the simulator, through the code the verifier role runs: the same relay cache and draw
(:mod:`sentinel_node.pipeline.relay_cache`), case assembly and judge (:mod:`sentinel_node.pipeline.audits`) and
comparison (:mod:`sentinel_node.verification.audit`). What differs is only the transport: the verifier of a
stage's output boundary is asked for its crossing, and auditor replicas for their recomputation, by a direct call.

One auditing verifier per boundary (the first of ``sim.verifiers_per_boundary``): it keeps what crossed the
boundary, draws audits of the stage above it (boundary 0 also of stage 0) when a microbatch settles, and strikes in
its own ledger, so a conviction is a ban the mesh acts on like any other.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from sentinel_node.attacks import StageContext, lies_in_audits
from sentinel_node.pipeline.audits import AuditCase, AuditJudge, AuditResult, Recomputation, assemble
from sentinel_node.pipeline.recompute import NoReference
from sentinel_node.pipeline.relay_cache import AuditDraw, Crossing, RelayCache
from sentinel_node.verification.audit import AuditLedger, AuditOutcome
from sentinel_node.verification.losses import LossEvidence


@dataclass
class Station:
    """The auditing side of one boundary's verifier."""

    boundary: int
    cache: RelayCache
    draw: AuditDraw
    judge: AuditJudge
    losses: dict[int, LossEvidence] = field(default_factory=dict)  # per stage it audits


@dataclass
class AuditStats:
    """What the audits of one run did, split by whether the audited replica was honest."""

    outcomes: Counter = field(default_factory=Counter)  # (honest, outcome value) -> n
    first_failed: Counter = field(default_factory=Counter)  # honest -> audits whose first comparison failed
    incomparable: int = 0  # drawn, but no auditor shared the audited replica's reference
    no_auditor: int = 0  # drawn, but the stage had no other live replica
    # honest claims that passed: (direction, exact, error, error over the auditor's drift for the same steps)
    honest_errors: list[tuple[str, bool, float, float | None]] = field(default_factory=list)
    uncalibrated: int = 0  # first comparisons whose auditor had not stepped since the round (exact tests only)
    convictions: list[dict] = field(default_factory=list)  # evidence
    contradicted: Counter = field(default_factory=Counter)  # honest auditor -> recomputations two others contradicted
    # honest -> audits drawn while only the evidence of higher losses made the replica a suspect
    loss_suspect_draws: Counter = field(default_factory=Counter)
    # honest -> audits drawn on microbatches the trainer's loss gate held back
    held_draws: Counter = field(default_factory=Counter)
    # honest -> audits drawn on microbatches whose gradient failed its passage (and was dropped)
    passage_draws: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        def count(honest: bool) -> dict[str, int]:
            return {o.value: self.outcomes[honest, o.value] for o in AuditOutcome}

        honest = count(True)
        errors = {}
        for direction in ("activation", "gradient"):
            values = [e for d, exact, e, _ in self.honest_errors if d == direction and not exact]
            ratios = [r for d, exact, _, r in self.honest_errors if d == direction and not exact and r is not None]
            if values:
                errors[direction] = {
                    "n": len(values),
                    "p50": float(np.median(values)),
                    "p99": float(np.percentile(values, 99)),
                    "max": float(max(values)),
                    "drift_ratio_p99": float(np.percentile(ratios, 99)) if ratios else None,
                    "drift_ratio_max": float(max(ratios)) if ratios else None,
                }
        exact = [e for _, is_exact, e, _ in self.honest_errors if is_exact]
        return {
            "run": sum(self.outcomes.values()),
            "honest": honest,
            "malicious": count(False),
            "honest_audits": sum(honest.values()),
            "honest_failed_first": self.first_failed[True],
            "loss_suspect_draws": dict(honest=self.loss_suspect_draws[True], malicious=self.loss_suspect_draws[False]),
            "held_draws": dict(honest=self.held_draws[True], malicious=self.held_draws[False]),
            "passage_draws": dict(honest=self.passage_draws[True], malicious=self.passage_draws[False]),
            "honest_auditors_contradicted": self.contradicted[True],
            "incomparable": self.incomparable,
            "no_auditor": self.no_auditor,
            "honest_error": errors,
            "honest_exact": {"n": len(exact), "max": float(max(exact)) if exact else None},
            "uncalibrated": self.uncalibrated,
            "convictions": self.convictions,
        }


class MeshAudits:
    """The audits of one :class:`~sentinel_node.sim.mesh.Mesh`."""

    def __init__(self, mesh, seed: int) -> None:
        self.mesh = mesh
        config = mesh.config.verification
        self.tolerance = config.audit_tolerances()
        self.n_stages = mesh.n_stages
        self.max_age = 2 * mesh.config.pipeline.average_every
        self.suspect_evidence = config.suspect_evidence
        cache_bytes = int(config.audit_cache_mib * 2**20)
        self.stations: list[Station] = []
        for boundary in range(self.n_stages - 1):
            cache = RelayCache(cache_bytes)
            verifier = mesh.verifiers[boundary][0]
            judge = AuditJudge(
                self.tolerance, verifier.ledger, AuditLedger(config.audit_refusal_limit), cache.completed_between
            )
            draw = AuditDraw(
                config.audit_rate, seed + 7919 * boundary, config.probation_audit_rate, config.suspect_audit_rate
            )
            stages = [boundary + 1] + ([0] if boundary == 0 else [])
            losses = {
                stage: LossEvidence(
                    config.peer_pool, config.loss_kappa, config.loss_limit, config.loss_evidence, config.max_senders
                )
                for stage in stages
            }
            self.stations.append(Station(boundary, cache, draw, judge, losses))
        self.stats = AuditStats()

    # --- what the verifiers relay (called by the mesh as the microbatch crosses each boundary)

    def forward(
        self, step: int, name: str, boundary: int, sender: str, activation: torch.Tensor, tokens, targets
    ) -> None:
        crossing = Crossing(
            name,
            step,
            boundary,
            sender,
            activation,
            targets=targets if boundary == self.n_stages - 2 else None,
            tokens=tokens if boundary == 0 else None,
        )
        self.stations[boundary].cache.open(crossing)

    def backward(self, step: int, name: str, boundary: int, receiver: str, gradient: torch.Tensor) -> None:
        cache = self.stations[boundary].cache
        cache.answer(name, boundary, receiver, gradient)
        cache.completed(receiver, step)

    def settled(
        self, step: int, name: str, route, tainted: bool, loss: float | None = None, expected: float | None = None
    ) -> None:
        """The microbatch completed on every stage of ``route`` with ``loss`` (its text predicted ``expected``):
        each verifier settles it, adds the loss to the evidence about the replicas it audits, and draws audits."""
        for station in self.stations:
            crossing = station.cache.settle(name, station.boundary, tainted)
            if station.boundary == 0 and crossing is not None:
                station.cache.completed(crossing.sender, step)  # stage 0's backward ran once it got its gradient
        if tainted:
            return
        self._observe_losses(route, loss, expected)
        for stage in range(len(route)):
            station = self.stations[max(0, stage - 1)]
            strikes, audited = station.judge.strikes, route[stage].id
            suspect = self._suspect(audited, station, stage)
            by_loss = not suspect and station.losses[stage].suspicious(audited)
            if station.draw(probation=strikes.on_probation(audited), suspect=suspect or by_loss):
                if by_loss:
                    self.stats.loss_suspect_draws[not self.mesh.worker(audited).malicious] += 1
                self.audit(station, stage, name)

    def held(self, step: int, name: str, route, tainted: bool, loss: float, expected: float | None) -> None:
        """The trainer's loss gate held the microbatch back after its forward pass: no gradient came back, so each
        verifier closes the forward half of its crossing; the loss is evidence about every replica of the route,
        and every stage that sent an output is audited on it as a suspect is (the gate saw damage; an audit says
        whose)."""
        for station in self.stations:
            station.cache.hold(name, station.boundary, route[station.boundary + 1].id)
        if tainted:
            return
        self._observe_losses(route, loss, expected)
        for stage in range(len(route) - 1):
            station = self.stations[max(0, stage - 1)]
            if station.draw(suspect=True):
                self.stats.held_draws[not self.mesh.worker(route[stage].id).malicious] += 1
                self.audit(station, stage, name)

    def failed_passage(self, name: str, boundary: int, receiver: str, gradient: torch.Tensor) -> None:
        """The gradient ``receiver`` (a middle stage replica) sent across ``boundary`` failed its passage and was
        dropped: a suspicion, and its work on this microbatch is audited as a suspect's is
        (``roles.audits.VerifierAudits.failed_passage``). The crossing above it is complete: the next verifier
        passed its gradient back to the replica (on the network it settled it then)."""
        station = self.stations[boundary]
        above = self.stations[boundary + 1].cache.get(name, boundary + 1)
        if above is None or above.gradient is None or above.tainted or above.sender != receiver:
            return
        if station.cache.suspected(name, boundary, receiver, gradient) is None:
            return
        above.settled = True
        if station.draw(suspect=True):
            self.stats.passage_draws[not self.mesh.worker(receiver).malicious] += 1
            self.audit(station, boundary + 1, name)

    def _observe_losses(self, route, loss: float | None, expected: float | None) -> None:
        for stage in range(len(route)):
            station = self.stations[max(0, stage - 1)]
            station.losses[stage].observe(route[stage].id, loss, expected)

    def _suspect(self, worker: str, station: Station, stage: int) -> bool:
        """Whether any verifier holds a strike against ``worker`` (as a node reads the others' strike records), or
        the station's own peer test has gathered `suspect_evidence` against what it checks of it (the gradients of
        the stage above its boundary, the activations of stage 0)."""
        if any(ledger.suspect(worker) for ledger in self.mesh._ledgers()):
            return True
        direction = "gradient" if stage == station.boundary + 1 else "activation"
        verifier = self.mesh.verifiers[station.boundary][0]
        return verifier.suspicious(worker, station.boundary, direction, self.suspect_evidence)

    # --- one audit

    def audit(self, station: Station, stage: int, name: str) -> AuditResult | None:
        below = self.stations[stage - 1].cache.get(name, stage - 1) if stage > 0 else None
        above = self.stations[stage].cache.get(name, stage) if stage < self.n_stages - 1 else None
        case = assemble(stage, self.n_stages, below, above)
        if case is None:
            return None
        live = [w for w in self.mesh._live(stage) if w.id != case.audited and w.id not in self.mesh.excluded]
        candidates = station.draw.shuffle(live)
        if not candidates:
            self.stats.no_auditor += 1
            return None
        first, rest = self._recompute(case, candidates, None)
        if first is None:
            self.stats.incomparable += 1
            return None
        judge = station.judge
        recomputations, comparisons = [first], [judge.compare(case, first)]
        while judge.wants_another(recomputations, comparisons):
            another, rest = self._recompute(case, rest, first.version.round_step)
            if another is None:
                break
            recomputations.append(another)
            comparisons.append(judge.compare(case, another))
        result = judge.settle(case, recomputations, comparisons)
        self._count(case, result)
        return result

    def _recompute(self, case: AuditCase, candidates: list, round_step: int | None):
        """The first candidate's recomputation whose reference the audited replica shares (and, given
        ``round_step``, from that averaging round); with the candidates left after it."""
        for index, worker in enumerate(candidates):
            try:
                work, version, drift = worker.worker.recompute(
                    case.step, case.inputs, case.grad_output, case.targets, max_age=self.max_age
                )
            except NoReference:
                continue
            lie = lies_in_audits(worker.attackers)
            if lie is not None:
                work = lie(work, case.step, StageContext(inputs=case.inputs, grad_output=case.grad_output))
            if not version.includes(case.audited) or (round_step is not None and version.round_step != round_step):
                continue
            return Recomputation(worker.id, work, version, drift), candidates[index + 1 :]
        return None, []

    def _count(self, case: AuditCase, result: AuditResult) -> None:
        honest = not self.mesh.worker(case.audited).malicious
        self.stats.outcomes[honest, result.outcome.value] += 1
        if result.first.failed:
            self.stats.first_failed[honest] += 1
        elif honest:
            exact = result.first.finding.value == "same"
            drift, steps = result.recomputations[0].drift, max(0, case.step - result.version.round_step - 1)
            for direction, error in result.first.errors.items():
                rate = drift.per_step(direction)
                expected = None if rate is None or not steps else rate * steps
                ratio = None if not expected else error / expected
                self.stats.honest_errors.append((direction, exact, error, ratio))
        if math.isinf(max(result.first.allowances.values(), default=0.0)):
            self.stats.uncalibrated += 1
        if result.outcome is AuditOutcome.CONVICTED:
            self.stats.convictions.append({**result.evidence, "audited": case.audited, "honest": honest})
            self.mesh.exclude(case.audited, case.step)
        for auditor in result.contradicted:
            self.stats.contradicted[not self.mesh.worker(auditor).malicious] += 1
            if self.stations[max(0, case.stage - 1)].judge.strikes.is_banned(auditor):
                self.mesh.exclude(auditor, case.step)
