"""A data x pipeline parallel mesh trained in one process, with the stage and verifier code the network uses.

Per microbatch the mesh picks a random live replica per stage and a verifier per boundary, runs the forward pass
stage by stage through the verifiers, the loss on the last stage, and the backward pass back through them.
Malicious replicas corrupt what they send after the attack start; verifiers flag, replace, taint and strike; a
sender banned by any verifier leaves the routing and the parameter averaging (the simulator trusts every
verifier, as a swarm does with `trusted_verifiers` and a quorum of one).
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from peers.agreement import VerifierAgreement
from sentinel_node.attacks import DIRECTIONS, Attacker, AttackFn, StageContext, arm, refuses_steps
from sentinel_node.config import Config
from sentinel_node.model.corpus import Corpus, sample_batch, validation_batches
from sentinel_node.pipeline import BoundaryVerifier, StageWorker
from sentinel_node.sim.audits import MeshAudits
from sentinel_node.sim.stats import DetectionStats
from sentinel_node.verification import Verdict, VerdictKind, content_of
from sentinel_node.verification.passage import Given

Target = Literal["activation", "gradient", "both"]

# attempts at a microbatch whose activation a verifier dropped, as the trainer's `max_attempts` (roles.trainer)
ATTEMPTS = 4


@dataclass(frozen=True)
class AttackPlan:
    """Which attack malicious replicas run and on what; `make(direction)` builds one attack function."""

    name: str
    target: Target
    make: Callable[[str], AttackFn]

    def directions(self) -> tuple[str, ...]:
        return DIRECTIONS if self.target == "both" else (self.target,)


@dataclass
class SimWorker:
    id: str
    stage: int
    worker: StageWorker
    attackers: dict[str, Attacker] = field(default_factory=dict)

    @property
    def malicious(self) -> bool:
        return bool(self.attackers)

    def send(
        self, direction: str, tensor: torch.Tensor, step: int, context: StageContext | None = None
    ) -> tuple[torch.Tensor, bool]:
        attacker = self.attackers.get(direction)
        return attacker(tensor, step, context) if attacker is not None else (tensor, False)


@dataclass
class Life:
    """One identity of a malicious replica that comes back under a fresh one whenever it is banned (a Sybil):
    when it joined, how many microbatches it was routed, and when it was banned (None: it lasted the run)."""

    replica: str  # the replica's first identity
    identity: str
    joined_step: int
    microbatches: int = 0
    banned_step: int | None = None

    @property
    def steps(self) -> int | None:
        return None if self.banned_step is None else self.banned_step - self.joined_step


@dataclass
class StepLog:
    """One global step (numbered from 0, as on the network). ``loss`` is None when no microbatch of the step got
    through (verifiers dropped them all); ``dropped`` counts the step's dropped microbatches."""

    step: int
    loss: float | None
    val_loss: float | None
    flags: int
    strikes: int
    banned: list[str]
    microbatches: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class StepCounts:
    """What verifiers did in one global step, honest senders and attackers apart: flags given in the step, and the
    most standing strikes any one sender held at its end (in any verifier's ledger)."""

    step: int
    flags_honest: int
    flags_attacker: int
    strikes_honest: int
    strikes_attacker: int


@dataclass
class SimResult:
    malicious: list[str]
    honest: list[str]
    banned_at: dict[str, tuple[int, int]]  # worker -> (global step, microbatches since the attack start)
    stats: DetectionStats
    val_curve: list[tuple[int, float]]
    train_losses: list[float]
    honest_max_strikes: int  # the most strikes an honest worker held at any time
    microbatches: int
    dropped: int
    attack_start: int = 0
    timeline: list[StepCounts] = field(default_factory=list)
    audits: dict | None = None  # sentinel_node.sim.audits.AuditStats.summary(), when audits ran
    lives: list[Life] = field(default_factory=list)  # with re-joining attackers: every identity they held
    # verifier ("v<boundary>.<index>") -> (global step, microbatches since the attack start) when the trainer's
    # agreement test (peers.agreement) first found it quiet
    quiet_at: dict[str, tuple[int, int]] = field(default_factory=dict)
    silent: list[str] = field(default_factory=list)  # the verifiers that relayed without checking

    @property
    def final_val_loss(self) -> float:
        return self.val_curve[-1][1]


class Mesh:
    """The mesh for one run; `run()` trains it and returns what happened.

    A mesh trained part of the way can be copied (`fork`) and each copy armed (`arm`) with another attack or without
    verification: runs that differ only from the attack start on then share everything before it, exactly.
    """

    def __init__(
        self,
        config: Config,
        corpus: Corpus,
        plan: AttackPlan | None = None,
        verify: bool = True,
        seed: int | None = None,
    ):
        self.config, self.corpus = config, corpus
        self.seed = config.swarm.seed if seed is None else seed
        pipe, sim = config.pipeline, config.sim
        self.n_stages = pipe.n_stages
        self.shape = (pipe.microbatch_size, pipe.seq_len, config.model.hidden_size)
        self.workers = [
            [
                SimWorker(f"s{k}r{r}", k, StageWorker(config.model, pipe, k, seed=self.seed))
                for r in range(sim.replicas)
            ]
            for k in range(self.n_stages)
        ]
        self.verifiers = [
            [
                BoundaryVerifier(
                    config.verification,
                    [k],
                    config.model.hidden_size,
                    self.shape,
                    self.seed,
                    verify,
                    dtype=getattr(torch, pipe.wire_dtype),
                    gate_boundary=self.n_stages - 2,
                    vocab=config.model.vocab_size,
                    private_seed=self.seed * 1000 + 10 * k + v,  # a verifier's own secret, reproducible here
                )
                for v in range(sim.verifiers_per_boundary)
            ]
            for k in range(self.n_stages - 1)
        ]
        # what the trainer sees of the verifiers: who relayed each microbatch, which boundaries replaced a tensor
        self.agreement = VerifierAgreement()
        self.quiet_at: dict[str, tuple[int, int]] = {}
        self._relayed: dict[int, str] = {}
        self._tainted: set[int] = set()
        self._senders: dict[int, set[str]] = {}
        self._dropped_from: str | None = None  # the sender of the activation a verifier dropped, this attempt
        self._held: list[SimWorker] | None = None  # the route of this attempt, when the loss gate held it back
        self.held = 0  # attempts held back by the loss gate
        self.excluded: dict[str, tuple[int, int]] = {}
        self.rejoin = config.sim.rejoin
        self.lives: dict[str, Life] = {}  # identity -> its life, for malicious replicas once the attack starts
        self.stats = DetectionStats()
        self.data_rng = np.random.default_rng([self.seed, 0xDA7A])
        self._passage_rows = torch.Generator().manual_seed(self.seed + 5)
        self.val_batches = validation_batches(corpus, sim.eval_batches, pipe.microbatch_size, pipe.seq_len, self.seed)
        self.eval_stages = [StageWorker(config.model, pipe, k, seed=self.seed).module for k in range(self.n_stages)]
        self.microbatches = 0
        self.attack_microbatches = 0
        self.dropped = 0
        self.step = 0
        self.val_curve: list[tuple[int, float]] = []
        self.train_losses: list[float] = []
        self._flags_by_step: list[Counter] = []
        self._strikes_by_step: list[dict[str, int]] = []
        self._flags: Counter = Counter()
        self.attack_start = config.sim.attack_start
        self.arm(plan, verify)

    def arm(self, plan: AttackPlan | None, verify: bool = True, attack_start: int | None = None) -> None:
        """From now on, malicious replicas run `plan` (from `attack_start`, default the config's) and verifiers
        check (`verify`) or only relay. Which replicas are malicious depends on the seed alone."""
        self.plan, self.verify = plan, verify
        if attack_start is not None:
            self.attack_start = attack_start
        for worker in self.all_workers:
            worker.attackers = {}
        for verifiers in self.verifiers:
            for i, verifier in enumerate(verifiers):
                verifier.enabled = verify and i >= self.config.sim.silent_verifiers
        self._arm_attackers()
        # audits run with verification (the simulator's verifiers audit as the network's do)
        audited = verify and self.config.verification.audit_rate > 0
        self.audits = MeshAudits(self, self.seed + 3) if audited else None

    def fork(self) -> Mesh:
        """A copy to go on with on its own (the corpus is shared, not copied)."""
        return copy.deepcopy(self, memo={id(self.corpus): self.corpus})

    def _arm_attackers(self) -> None:
        if self.plan is None:
            return
        sim = self.config.sim
        picker = random.Random(self.seed + 2)
        per_stage = int(sim.replicas * sim.malicious_fraction)
        per_stage = min(per_stage, (sim.replicas - 1) // 2)  # an honest majority on every stage
        for k, replicas in enumerate(self.workers):
            if (k == 0 and not sim.attack_first_stage) or (k == self.n_stages - 1 and not sim.attack_last_stage):
                continue
            for worker in picker.sample(replicas, per_stage):
                worker.attackers = arm(
                    self.plan.make,
                    self.plan.target,
                    k,
                    self.n_stages,
                    start=self.attack_start,
                    probability=sim.attack_probability,
                    seed=f"{self.seed}:{worker.id}",
                )
                worker.worker.applies_step = refuses_steps(worker.attackers)

    @property
    def all_workers(self) -> list[SimWorker]:
        return [w for stage in self.workers for w in stage]

    def worker(self, worker_id: str) -> SimWorker:
        return next(w for w in self.all_workers if w.id == worker_id)

    def exclude(self, worker_id: str, step: int) -> None:
        """A verifier banned the worker (statistics or a convicting audit): it leaves routing and averaging. With
        ``rejoin``, a malicious one comes back at once under a fresh identity, with an honest replica's
        parameters (the state a joining replica downloads), and attacks on."""
        if worker_id in self.excluded:
            return
        self.excluded[worker_id] = (step, self.attack_microbatches)
        life = self.lives.get(worker_id)
        if life is not None:
            life.banned_step = step
        worker = next((w for w in self.all_workers if w.id == worker_id), None)
        if not self.rejoin or worker is None or not worker.malicious:
            return
        replica = life.replica if life is not None else worker_id
        worker.id = f"{replica}~{sum(1 for x in self.lives.values() if x.replica == replica)}"
        self.lives[worker.id] = Life(replica, worker.id, step)
        donor = next((w for w in self._live(worker.stage) if not w.malicious), None)
        if donor is not None:
            worker.worker.module.load_state_dict(donor.worker.module.state_dict())

    def _live(self, stage: int) -> list[SimWorker]:
        live = [w for w in self.workers[stage] if w.id not in self.excluded]
        return live or self.workers[stage]

    def _route(self, stage: int, name: str, avoid: set[str] = frozenset()) -> SimWorker:
        """The replica of `stage` for microbatch `name`: the first live one (not in `avoid`, when another is live)
        in an order drawn for that microbatch alone, so excluding a worker moves only its own microbatches and the
        clean, undefended and defended runs of a benchmark keep every other choice in common (the loss curves then
        differ by the attack, not by chance)."""
        replicas = self.workers[stage]
        order = random.Random(f"{self.seed}:route:{stage}:{name}").sample(replicas, len(replicas))
        live = [w for w in order if w.id not in self.excluded]
        return next((w for w in live if w.id not in avoid), live[0] if live else order[0])

    def _choose(self, options: list, *key: object):
        """One of `options`, drawn for `key` alone (the same in every run of this seed)."""
        return options[random.Random(":".join(map(str, (self.seed, *key)))).randrange(len(options))]

    def _verifier(self, boundary: int, name: str) -> BoundaryVerifier:
        """The verifier of ``boundary`` that relays microbatch (attempt) ``name``."""
        return self.verifiers[boundary][self._choose(range(len(self.verifiers[boundary])), "verifier", boundary, name)]

    def _check(
        self,
        boundary: int,
        direction: str,
        tensor: torch.Tensor,
        sender: SimWorker,
        attacked: bool,
        tainted: bool,
        step: int,
        name: str,
        content: int,
        given: Given | None = None,
    ) -> Verdict:
        verifier = self._verifier(boundary, name)
        verdict = verifier.check(
            boundary, direction, tensor, sender.id, tainted, content=content, step=step, given=given
        )
        self._relayed[boundary] = f"v{boundary}.{self.verifiers[boundary].index(verifier)}"
        self._senders.setdefault(boundary, set()).add(sender.id)
        if verdict.flagged:
            self._tainted.add(boundary)
        self.stats.record(direction, attacked, verdict)
        if verdict.flagged:
            self._flags[sender.id] += 1
        if verdict.banned:
            self.exclude(sender.id, step)
        return verdict

    def _microbatch(self, step: int, name: str, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One microbatch through a route; one whose activation a verifier dropped goes again on a route that
        avoids that activation's sender, and one the loss gate held back on a route that avoids every replica of the
        held one, as the trainer sends them again (``roles.trainer``, up to its attempts)."""
        avoid: set[str] = set()
        for attempt in range(ATTEMPTS):
            self._relayed, self._tainted, self._senders = {}, set(), {}
            self._dropped_from, self._held = None, None
            loss = self._through(step, name if attempt == 0 else f"{name}.{attempt}", inputs, targets, avoid)
            senders = {boundary: tuple(sorted(ids)) for boundary, ids in self._senders.items()}
            self.agreement.settled(self._relayed, self._tainted, senders)
            for quiet in self.agreement.quiet():
                self.quiet_at.setdefault(quiet.verifier, (step, self.attack_microbatches))
            if self._held is not None:
                self.held += 1
                avoid.update(worker.id for worker in self._held)
                continue
            if loss is not None or self._dropped_from is None:
                return loss
            avoid.add(self._dropped_from)
        return None

    def _through(
        self, step: int, name: str, inputs: torch.Tensor, targets: torch.Tensor, avoid: set[str] = frozenset()
    ) -> float | None:
        route = [self._route(k, name, avoid) for k in range(self.n_stages)]
        if step >= self.attack_start:
            for worker in route:
                if worker.malicious:
                    self.lives.setdefault(worker.id, Life(worker.id, worker.id, self.attack_start)).microbatches += 1
        content = content_of(targets)
        hidden, tainted, replaced_at = inputs, False, None
        audits = self.audits
        for k in range(self.n_stages - 1):
            sender = route[k]
            output = sender.worker.forward(name, hidden)
            sent, attacked = sender.send("activation", output, step, StageContext(sender.worker.module, hidden))
            verdict = self._check(k, "activation", sent, sender, attacked, tainted, step, name, content)
            if verdict.flagged and replaced_at is None:
                replaced_at = k
            tainted = tainted or verdict.tainted
            if verdict.tensor is None or tuple(verdict.tensor.shape) != self.shape:
                # dropped by policy, or (undefended) a tensor the next stage cannot even take
                self._dropped_from = sender.id if verdict.tensor is None else None
                return self._drop(route[: k + 1], name)
            hidden = verdict.tensor
            if audits is not None:
                audits.forward(step, name, k, sender.id, hidden, inputs, targets)
        # the last boundary's verifier names the loss above which the last stage holds the update back (as on the
        # network, not for a microbatch a verifier replaced a tensor of: its loss is not the route's doing)
        gate = self._verifier(self.n_stages - 2, name).gate if self.n_stages > 1 and not tainted else None
        gated = None if gate is None else gate.before(content, targets)
        expected = None if gate is None else gate.expected(gated)
        loss = route[-1].worker.forward_loss(name, hidden, targets)
        if gate is not None:
            held = gate.holds(gated, loss)
            gate.after(gated, loss, held)
            if held:  # no stage learns from it, and it goes again on other replicas
                self._held = route
                for worker in route:
                    worker.worker.discard(name)
                if audits is not None:
                    audits.held(step, name, route, tainted, loss, expected)
                return loss
        grad = route[-1].worker.backward_loss(name)
        context = StageContext(route[-1].worker.module, hidden, targets)
        given = None  # the last stage's output gradient comes from the loss, not from a verifier
        for k in range(self.n_stages - 1, 0, -1):
            boundary = k - 1
            if boundary == replaced_at:
                # the gradient of a replaced activation says nothing about what its sender computed
                self._drop(route[:k], name)
                return loss
            sent, attacked = route[k].send("gradient", grad, step, context)
            # a middle stage's gradient is judged against the one the next verifier passed back to it (passage.py)
            verdict = self._check(
                boundary, "gradient", sent, route[k], attacked, tainted, step, name, content, given=given
            )
            if verdict.kind is VerdictKind.PASSAGE and audits is not None:
                audits.failed_passage(name, boundary, route[k].id, sent)  # a suspicion: an audit decides
            # the rows the verifier of this boundary draws when it asks for the gradient it passed back
            given = (
                None
                if verdict.tensor is None
                else Given.sample(verdict.tensor, self.config.verification.passage_rows, self._passage_rows)
            )
            tainted = tainted or verdict.tainted
            if verdict.tensor is None or tuple(verdict.tensor.shape) != self.shape:
                self._drop(route[:k], name)
                return loss
            if audits is not None:
                audits.backward(step, name, boundary, route[k].id, verdict.tensor)
            context = StageContext(route[k - 1].worker.module, grad_output=verdict.tensor)
            grad = route[k - 1].worker.backward(name, verdict.tensor)
        if audits is not None:
            audits.settled(step, name, route, tainted, loss, expected)
        return loss

    def _drop(self, route: list[SimWorker], name: str) -> None:
        for worker in route:
            worker.worker.discard(name)
        self.dropped += 1

    def _average(self, step: int | None = None) -> None:
        """Replicas of each stage average parameters, leaving excluded peers out (hivemind's averager's role); after
        the round of global step ``step`` each keeps the result as its audits' reference."""
        for stage in self.workers:
            members = [w for w in stage if w.id not in self.excluded]
            live = [w.worker.module for w in members]
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in live), strict=True):
                    mean = torch.stack([p.data for p in params]).mean(0)
                    for p in params:
                        p.data.copy_(mean)
            if step is not None and self.audits is not None:
                for w in members:
                    w.worker.set_reference(step, step + 1, [m.id for m in members])

    @torch.no_grad()
    def validation_loss(self) -> float:
        for k, module in enumerate(self.eval_stages):
            live = [w.worker.module for w in self._live(k)]
            for target, *sources in zip(module.parameters(), *(m.parameters() for m in live), strict=True):
                target.copy_(torch.stack(sources).mean(0))
        losses = []
        for inputs, targets in self.val_batches:
            hidden = inputs
            for module in self.eval_stages:
                hidden = module(hidden)
            losses.append(float(self.eval_stages[-1].loss(hidden, targets)))
        return float(np.mean(losses))

    def run(self, steps: int | None = None, on_step: Callable[[StepLog], None] | None = None) -> SimResult:
        """Trains up to global step `steps` (default the config's) from where the mesh is, and says what happened."""
        self.advance(self.config.sim.steps if steps is None else steps, on_step)
        return self.result()

    def advance(self, until: int, on_step: Callable[[StepLog], None] | None = None) -> None:
        """Trains global steps from the current one up to (not including) `until`; the last one is evaluated."""
        pipe, sim = self.config.pipeline, self.config.sim
        if not self.val_curve:
            self.val_curve.append((0, self.validation_loss()))
        for step in range(self.step, until):
            losses = []
            for m in range(pipe.microbatches_per_step):
                inputs, targets = sample_batch(self.corpus.train, pipe.microbatch_size, pipe.seq_len, self.data_rng)
                self.microbatches += 1
                self.attack_microbatches += int(step >= self.attack_start)
                loss = self._microbatch(step, f"{step}:{m}", inputs, targets)
                if loss is not None:
                    losses.append(loss)
            for worker in self.all_workers:
                worker.worker.step(step)
            if (step + 1) % pipe.average_every == 0:
                self._average(step)
            self.train_losses.append(float(np.mean(losses)) if losses else float("nan"))
            self._flags_by_step.append(self._flags)
            self._flags = Counter()
            self._strikes_by_step.append(self._standing_strikes())
            val = None
            if (step + 1) % sim.eval_every == 0 or step == until - 1:
                val = self.validation_loss()
                self.val_curve.append((step + 1, val))
            self.step = step + 1
            if on_step is not None:
                loss = float(np.mean(losses)) if losses else None
                dropped = pipe.microbatches_per_step - len(losses)
                on_step(self._step_log(step, loss, val, pipe.microbatches_per_step, dropped))

    def _standing_strikes(self) -> dict[str, int]:
        """Each sender's strikes now, the most any one verifier holds against it."""
        found: dict[str, int] = {}
        for ledger in self._ledgers():
            for sender, rec in ledger.senders.items():
                found[sender] = max(found.get(sender, 0), rec.strikes)
        return found

    def _ledgers(self):
        return [v.ledger for verifiers in self.verifiers for v in verifiers]

    def _step_log(self, step: int, loss: float | None, val: float | None, microbatches: int, dropped: int) -> StepLog:
        strikes = sum(rec.strikes for ledger in self._ledgers() for rec in ledger.senders.values())
        return StepLog(step, loss, val, self.stats.flags, strikes, sorted(self.excluded), microbatches, dropped)

    def result(self) -> SimResult:
        malicious = sorted({w.id for w in self.all_workers if w.malicious} | set(self.lives))
        honest = sorted(w.id for w in self.all_workers if not w.malicious)
        bad = set(malicious)
        timeline = [
            StepCounts(
                step,
                sum(n for sender, n in flags.items() if sender not in bad),
                sum(n for sender, n in flags.items() if sender in bad),
                max((n for sender, n in strikes.items() if sender not in bad), default=0),
                max((n for sender, n in strikes.items() if sender in bad), default=0),
            )
            for step, (flags, strikes) in enumerate(zip(self._flags_by_step, self._strikes_by_step, strict=True))
        ]
        return SimResult(
            malicious=malicious,
            honest=honest,
            banned_at=dict(self.excluded),
            stats=self.stats,
            val_curve=list(self.val_curve),
            train_losses=list(self.train_losses),
            honest_max_strikes=max((c.strikes_honest for c in timeline), default=0),
            microbatches=self.microbatches,
            dropped=self.dropped,
            attack_start=self.attack_start,
            timeline=timeline,
            audits=None if self.audits is None else self.audits.stats.summary(),
            lives=[copy.copy(life) for life in self.lives.values()],
            quiet_at=dict(self.quiet_at),
            silent=[
                f"v{k}.{i}"
                for k, vs in enumerate(self.verifiers)
                for i, v in enumerate(vs)
                if self.verify and not v.enabled
            ],
        )
