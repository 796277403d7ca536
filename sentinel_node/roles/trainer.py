"""The trainer role: cuts the corpus into microbatches, sends each along a route, and paces global steps.

A global step is ``pipeline.microbatches_per_step`` microbatches, up to ``inflight`` of them in flight at once.
Each is one nested call (see :mod:`sentinel_node.roles.stage`) on a route picked from the live DHT announcements
(:func:`peers.choose_route`: a replica per stage, a verifier per boundary, never an excluded peer, weighted by
announced throughput); each hop carries alternates, so the peer that calls a hop retries once on another
candidate when the first fails before answering. A microbatch whose call still fails comes back here and is
retried on a new route that avoids the peers that failed it, up to ``max_attempts`` times. So is one whose
activation a verifier dropped (the route's replica that sent it is avoided): a cheater's flagged tensor then costs
the swarm a forward pass, not the tokens. So is one whose update the last stage held back because its loss was
above the ceiling the loss gate named (:mod:`sentinel_node.verification.excess`; every stage replica of the held
route is avoided). A dropped gradient is final, as the stages above it have counted the microbatch.

Step pacing: when every microbatch of step s has come back (its backward pass is complete on every stage of its
route), the trainer calls ``sentinel.stage.step(s)`` on every live stage replica, which applies the mean of the
gradients it accumulated; only then do step s+1's microbatches leave. The step also travels in every
microbatch's metadata, so a replica that missed a step call applies it before serving the next step.

Accounting: every training microbatch is sent once and settles exactly once as succeeded (a loss came back),
dropped (a verifier dropped it by policy, on its last attempt) or failed (no attempt got through); retries are
counted apart, and so are the attempts the loss gate held back.
:class:`Accounting` refuses to settle a microbatch twice.

Validation: every ``eval_every`` steps, fixed validation batches go through the swarm as forward-only
microbatches (``train=False``), so the loss is that of the model the swarm actually holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from hivemind.utils import get_logger

from dht import TrainerAnnouncement
from peers import NoRouteError, PairBlacklist, Route, SwarmView, choose_route, expand
from peers.agreement import Quiet, VerifierAgreement
from sentinel_node.data import DataError, TrainingData, load_training_data
from sentinel_node.roles.admission import admitted_certificate
from sentinel_node.roles.calls import note_failures
from sentinel_node.roles.common import JoinOptions, NodeError
from sentinel_node.roles.metrics import Sample
from sentinel_node.roles.node import Node, NodeContext, started_node, wait_for_stop
from sentinel_node.roles.route_modes import RoutingSchedule
from sentinel_node.roles.status import AccountingStatus, NodeStatus, TrainerStatus
from sentinel_node.roles.wire import (
    MAX_STEP_AHEAD,
    STAGE_FORWARD,
    STAGE_STEP,
    PipelineRequest,
    Shapes,
    StepReply,
    StepRequest,
)
from sentinel_node.transport import Hop, HopError, HopRefused, Reply, call_first_available, call_peer

logger = get_logger(__name__)

STEP_CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TrainerOptions:
    steps: int = 0  # 0: train until stopped
    inflight: int = 0  # microbatches in flight at once; 0: a whole step's
    eval_every: int = 10
    eval_batches: int = 4
    microbatch_timeout: float = 30.0
    max_attempts: int = 4
    wait_for_swarm: float = 120.0
    seed: int | None = None  # of the data stream and routing; None: the swarm's seed
    metrics_out: str | None = None  # JSON lines: one per step, then a summary
    status_file: str | None = None
    progress: bool = False
    start_step: int | None = None  # None: resume from the highest global step a trainer announced
    routing: RoutingSchedule = field(default_factory=RoutingSchedule)  # benches inject other modes
    state_dir: str | None = None  # keeps the data stream's position, so a restart reaches the swarm's step fast


def _dropped_sender(hops: list[Hop], taint: list[int]) -> str | None:
    """The stage replica whose activation a verifier dropped, ending a microbatch without a loss: the sender at the
    last tainted boundary, as the forward pass stops at the boundary that dropped it (None if no hop matches)."""
    if not taint:
        return None
    boundary = max(taint)
    for i, hop in enumerate(hops):
        if hop.boundary == boundary and i > 0:
            return hops[i - 1].peer_id
    return None


def data_digest(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """A short digest of a step's input tokens, so a run's log says which data each step saw."""
    digest = hashlib.sha1()
    for inputs, _ in batches:
        digest.update(inputs.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


class AccountingError(RuntimeError):
    """A microbatch was started or settled twice: a bug, never a network condition."""


@dataclass
class Accounting:
    """Where every training microbatch went."""

    sent: int = 0
    succeeded: int = 0
    dropped: int = 0
    failed: int = 0
    retried: int = 0
    held: int = 0  # attempts whose update the last stage held back (the loss gate); retried, or in the end dropped
    outcomes: dict[str, str] = field(default_factory=dict, repr=False)
    _open: set[str] = field(default_factory=set, repr=False)

    def start(self, microbatch: str) -> None:
        if microbatch in self._open or microbatch in self.outcomes:
            raise AccountingError(f"microbatch {microbatch} was already sent")
        self._open.add(microbatch)
        self.sent += 1

    def settle(self, microbatch: str, outcome: str) -> None:
        if microbatch not in self._open:
            raise AccountingError(f"microbatch {microbatch} settled twice or never sent")
        if outcome not in ("succeeded", "dropped", "failed"):
            raise ValueError(f"unknown outcome {outcome!r}")
        self._open.discard(microbatch)
        self.outcomes[microbatch] = outcome
        setattr(self, outcome, getattr(self, outcome) + 1)

    @property
    def in_flight(self) -> int:
        return len(self._open)

    @property
    def consistent(self) -> bool:
        """Every microbatch sent has settled exactly once."""
        settled = self.succeeded + self.dropped + self.failed
        return not self._open and settled == self.sent == len(self.outcomes)

    def as_dict(self) -> dict:
        return {
            "sent": self.sent,
            "succeeded": self.succeeded,
            "dropped": self.dropped,
            "failed": self.failed,
            "retried": self.retried,
            "held": self.held,
            "in_flight": self.in_flight,
            "consistent": self.consistent,
        }


@dataclass
class StepLog:
    step: int
    loss: float | None
    val_loss: float | None
    tokens_per_s: float
    microbatches: int
    flags: int
    strikes: int
    excluded: list[str]
    accounting: dict
    wall_s: float
    step_s: float = 0.0  # this step's time: its microbatches and the step calls, not validation
    mode: int = 0  # index into TrainerOptions.routing.modes
    data_digest: str = ""  # of the step's input tokens: which data it trained on (see data_digest)


@dataclass
class TrainerSummary:
    steps: int
    first_loss: float | None
    last_loss: float | None
    val_curve: list[tuple[int, float]]
    tokens_per_s: float
    accounting: dict
    excluded: list[str]
    wall_s: float
    first_step: int = 0
    duplicate_loss_gap: float | None = None  # duplicate mode: mean |loss_a - loss_b| of the two computations

    @property
    def first_val_loss(self) -> float | None:
        return self.val_curve[0][1] if self.val_curve else None

    @property
    def last_val_loss(self) -> float | None:
        return self.val_curve[-1][1] if self.val_curve else None


def run_trainer(
    options: JoinOptions,
    on_ready: Callable[[str, list[str]], None],
    stop_event: threading.Event | None = None,
    *,
    settings: TrainerOptions = TrainerOptions(),
    on_step: Callable[[StepLog], None] | None = None,
) -> TrainerSummary:
    """Trains until ``settings.steps`` global steps are done (0: until SIGTERM/SIGINT or ``stop_event``)."""
    config = options.config
    torch.set_num_threads(1)
    seed = config.swarm.seed if settings.seed is None else settings.seed
    try:
        data = load_training_data(config, seed, settings.state_dir)
    except DataError as e:
        raise NodeError(f"cannot read the training data: {e}") from None
    logger.info(f"training data: {data.description}")
    with started_node(options, stop_event) as context:
        return asyncio.run(TrainerNode(context, settings, data, on_step).serve(on_ready))


class TrainerNode(Node):
    role = "trainer"
    serves = False  # it only calls out

    def __init__(
        self,
        context: NodeContext,
        settings: TrainerOptions,
        data: TrainingData,
        on_step: Callable[[StepLog], None] | None,
    ) -> None:
        super().__init__(context, settings.status_file)
        self.settings, self.data, self.on_step = settings, data, on_step
        pipe = self.config.pipeline
        self.shapes = Shapes.of(self.config)
        self.certificate = admitted_certificate(self.config, self.peer_id, "trainer", context.options.certificate_path)
        # (verifier, replica) pairs that refused each other: a ban short of the quorum refuses every route through
        # the pair, so it is kept off routes for a while (backing off) while others exist
        self.apart = PairBlacklist()
        # verifiers that flag far less than the others of their boundary (peers.agreement): avoided on routes in a
        # closed verifier set, only reported in an open one, where a liar could make an honest verifier look quiet
        self.agreement = VerifierAgreement()
        self.quiet: dict[str, Quiet] = {}
        self.avoid_quiet = not self.config.swarm.open_verifiers
        seed = self.config.swarm.seed if settings.seed is None else settings.seed
        self.route_rng = random.Random(seed + 1)
        try:
            self.val_batches = data.validation_batches(settings.eval_batches)
        except DataError as e:
            raise NodeError(str(e)) from None
        self.accounting = Accounting()
        self.inflight = asyncio.Semaphore(settings.inflight or pipe.microbatches_per_step)
        self.losses: list[float] = []
        self.val_curve: list[tuple[int, float]] = []
        self.tokens = 0
        self.train_s = 0.0
        self.step = 0  # the next global step
        self.first_step = 0
        self.duplicate_gaps: list[float] = []
        self._started = time.monotonic()
        self._last_log: StepLog | None = None
        self._summary: TrainerSummary | None = None
        self._no_route_said = 0.0

    # --- lifecycle hooks

    def announcement(self) -> TrainerAnnouncement:
        return self.announced(TrainerAnnouncement, global_step=0, loss=None, certificate=self.certificate)

    def ready_line(self) -> str:
        return f"trainer {self.peer_id} joined swarm {self.config.swarm.prefix}"

    def describe_details(self) -> list[str]:
        pipe, data = self.config.pipeline, self.config.data
        steps = f"{self.settings.steps} global steps" if self.settings.steps else "global steps until stopped"
        return [
            f"trains {steps} of {pipe.microbatches_per_step} microbatches x {pipe.microbatch_size} x {pipe.seq_len} "
            f"tokens on {data.path or 'the embedded corpus'}, validating every {self.settings.eval_every} steps"
        ]

    async def main(self) -> TrainerSummary:
        """Trains until done, or until asked to stop (abandoning the microbatches in flight)."""
        training = asyncio.create_task(self._train())
        stopping = asyncio.create_task(wait_for_stop(self.context))
        try:
            await asyncio.wait({training, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not training.done():
                logger.info("asked to stop: abandoning the microbatches in flight")
                training.cancel()
                with suppress(asyncio.CancelledError):
                    await training
            else:
                training.result()
            if stopping.done():
                stopping.result()  # a dead DHT surfaces here
        finally:
            stopping.cancel()
        return self._summary_now()

    async def finish(self) -> None:
        self._summary_now()

    def _summary_now(self) -> TrainerSummary:
        """The summary, emitted once, however training ended."""
        if self._summary is None:
            self._summary = self.summary()
            self._emit({"event": "summary", **asdict(self._summary)})
        return self._summary

    def samples(self) -> list[Sample]:
        log, accounting = self._last_log, self.accounting
        samples = [
            Sample("sentinel_global_step", self.step - 1),
            Sample("sentinel_quiet_verifiers", len(self.quiet)),
        ]
        for outcome in ("succeeded", "dropped", "failed"):
            samples.append(Sample("sentinel_microbatches", getattr(accounting, outcome), (outcome,)))
        samples.append(Sample("sentinel_microbatches", accounting.held, ("held",)))
        if log is not None:
            samples.append(Sample("sentinel_tokens_per_second", log.tokens_per_s))
            if log.loss is not None:
                samples.append(Sample("sentinel_loss", log.loss, ("train",)))
        if self.val_curve:
            samples.append(Sample("sentinel_loss", self.val_curve[-1][1], ("validation",)))
        return samples

    def summary(self) -> TrainerSummary:
        gaps = self.duplicate_gaps
        return TrainerSummary(
            steps=self.step - self.first_step,
            first_loss=self.losses[0] if self.losses else None,
            last_loss=self.losses[-1] if self.losses else None,
            val_curve=list(self.val_curve),
            tokens_per_s=self.tokens / self.train_s if self.train_s else 0.0,
            accounting=self.accounting.as_dict(),
            excluded=sorted(self.views.view.excluded),
            wall_s=time.monotonic() - self._started,
            first_step=self.first_step,
            duplicate_loss_gap=float(np.mean(gaps)) if gaps else None,
        )

    # --- the training loop

    async def _train(self) -> None:
        await self._wait_for_swarm()
        self.first_step = self.step = self._resume_step()
        await self._validate(self.step)
        progress = self._progress_bar()
        try:
            for step in itertools.count(self.first_step):
                if self.settings.steps and step >= self.first_step + self.settings.steps:
                    break
                log = await self._global_step(step)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{log.loss:.3f}" if log.loss else "-", tok_s=f"{log.tokens_per_s:.0f}")
        finally:
            if progress is not None:
                progress.close()

    async def _global_step(self, step: int) -> StepLog:
        started = time.perf_counter()
        # off the event loop: a resumed stream may first fast-forward to this step
        batches = await asyncio.to_thread(self.data.step_batches, step)
        results = await asyncio.gather(
            *(self._microbatch(step, f"{step}.{i}", x, y, train=True) for i, (x, y) in enumerate(batches))
        )
        losses = [loss for loss in results if loss is not None]
        await self._step_all(step)
        await asyncio.to_thread(self.data.save_position, step)
        elapsed = time.perf_counter() - started
        self.step = step + 1
        tokens = len(losses) * self.shapes.tokens_per_microbatch
        self.tokens += tokens
        self.train_s += elapsed
        loss = float(np.mean(losses)) if losses else None
        if loss is not None:
            self.losses.append(loss)
        val_loss = None
        every = self.settings.eval_every
        if (every and self.step % every == 0) or self.step == self.first_step + self.settings.steps:
            val_loss = await self._validate(self.step)
        self.announcer.update(
            global_step=self.step,
            loss=loss,
            val_loss=self.val_curve[-1][1] if self.val_curve else None,
            throughput=tokens / elapsed,
        )
        view = self.views.view
        log = StepLog(
            step=step,
            loss=loss,
            val_loss=val_loss,
            tokens_per_s=tokens / elapsed,
            microbatches=len(losses),
            flags=sum(record.flags for record in view.ledger),
            strikes=sum(record.strikes for record in view.ledger),
            excluded=sorted(view.excluded),
            accounting=self.accounting.as_dict(),
            wall_s=time.monotonic() - self._started,
            step_s=elapsed,
            mode=self.settings.routing.index(step),
            data_digest=data_digest(batches),
        )
        logger.info(
            f"step {step}: loss {loss if loss is None else round(loss, 4)}, {log.tokens_per_s:.0f} tokens/s, "
            f"{log.flags} flags, {log.strikes} strikes, {len(log.excluded)} excluded"
            + ("" if val_loss is None else f", validation loss {val_loss:.4f}")
        )
        self._last_log = log
        self._emit({"event": "step", **asdict(log)})
        self.write_status()
        if self.on_step is not None:
            self.on_step(log)
        return log

    async def _microbatch(
        self, step: int, name: str, inputs: torch.Tensor, targets: torch.Tensor, train: bool
    ) -> float | None:
        """The loss of one microbatch, retried on new routes; None if it was dropped or failed."""
        if train:
            self.accounting.start(name)
        outcome, loss = "failed", None
        avoid: set[str] = set()
        mode = self.settings.routing.at(step)
        copies = mode.copies if train else 1
        # Attempts that failed only because a peer did not answer (it died, and the swarm's view still names it
        # until its record expires) are not counted against max_attempts until wait_for_swarm has passed: the
        # route is tried again once the view catches up, or once a replica has moved to cover the stage.
        patience = time.monotonic() + self.settings.wait_for_swarm
        try:
            async with self.inflight:
                attempt, tries = 0, 0
                while attempt < self.settings.max_attempts:
                    if tries and train:
                        self.accounting.retried += 1
                    tries += 1
                    routes = await self._routes_when_there_are(avoid, copies, mode, patience)
                    if routes is None:
                        attempt += 1
                        continue
                    calls = [
                        self._send(
                            step, f"{name}.{attempt}{'ab'[i] if copies > 1 else ''}", inputs, targets, train, hops
                        )
                        for i, hops in enumerate(routes)
                    ]
                    results = await asyncio.gather(*calls, return_exceptions=True)
                    errors = [r for r in results if isinstance(r, BaseException)]
                    if errors:
                        await self._after_failure(name, tries - 1, errors, avoid, routes)
                        unanswered = all(isinstance(e, HopError) and e.cause.unresponsive for e in errors)
                        if not unanswered or time.monotonic() > patience:
                            attempt += 1
                        continue
                    for hops, reply in zip(routes, results, strict=True):
                        for a, b in zip(hops, hops[1:], strict=False):
                            self.apart.register_success(a.peer_id, b.peer_id)
                        if train:  # validation microbatches are not judged as training ones are
                            self._judged(hops, reply.metadata.taint)
                    losses = [r.metadata.loss for r in results]
                    if any(r.metadata.held for r in results):
                        # the loss gate held the update back: no stage learned from it, and sent again on other
                        # replicas of every stage it counts once (a microbatch held on every attempt is dropped)
                        outcome = "dropped"
                        if train:
                            self.accounting.held += 1
                        if copies == 1 and attempt + 1 < self.settings.max_attempts:
                            avoid.update(hop.peer_id for hop in routes[0] if hop.boundary is None)
                            attempt += 1
                            continue
                        break
                    if None in losses:
                        outcome = "dropped"
                        dropped_by = _dropped_sender(routes[0], results[0].metadata.taint) if copies == 1 else None
                        if dropped_by is not None and attempt + 1 < self.settings.max_attempts:
                            # a verifier dropped an activation, so the microbatch ended there: no stage above saw
                            # it and none below got a gradient, and sent again around its sender it counts once
                            avoid.add(dropped_by)
                            attempt += 1
                            continue
                    else:
                        outcome, loss = "succeeded", float(np.mean(losses))
                        if copies > 1:
                            self.duplicate_gaps.append(abs(losses[0] - losses[1]))
                    break
        finally:
            if train:
                self.accounting.settle(name, outcome)
        if outcome == "failed":
            logger.warning(f"microbatch {name} failed after {self.settings.max_attempts} attempts")
        return loss

    async def _send(
        self, step: int, microbatch: str, inputs: torch.Tensor, targets: torch.Tensor, train: bool, hops: list[Hop]
    ) -> Reply:
        meta = PipelineRequest(
            deadline=time.time() + self.settings.microbatch_timeout,
            microbatch_id=microbatch,
            step=step,
            kind="forward",
            route=hops[1:],
            train=train,
            first_tokens=inputs[:, 0].tolist() if train else [],  # lets verifiers audit stage 0
        )
        candidates = [hops[0].peer_id, *hops[0].alternates]
        reply = await call_first_available(
            self.p2p,
            candidates,
            STAGE_FORWARD,
            [inputs, targets],
            meta,
            settings=self.transport,
            max_reply_bytes=self.shapes.activation_bytes,
        )
        note_failures(self.blacklist, reply.failures)
        return reply

    def _judged(self, hops: list[Hop], taint: list[int]) -> None:
        """Counts which verifiers relayed the microbatch and which boundaries replaced a tensor of it, and says once
        when a verifier turns quiet (or checks again)."""
        verifiers = {hop.boundary: hop.peer_id for hop in hops if hop.boundary is not None}
        senders = {  # the stage replicas on either side of each verifier: hops alternate stage, verifier, stage
            hop.boundary: (hops[i - 1].peer_id, hops[i + 1].peer_id)
            for i, hop in enumerate(hops)
            if hop.boundary is not None and 0 < i < len(hops) - 1
        }
        self.agreement.settled(verifiers, taint, senders)
        quiet = {q.verifier: q for q in self.agreement.quiet()}
        for verifier, q in quiet.items():
            if verifier not in self.quiet:
                action = (
                    "kept off routes while another verifier serves its boundary"
                    if self.avoid_quiet
                    else (
                        "still routed through: in an open verifier set a liar can make an honest verifier look quiet"
                    )
                )
                logger.warning(
                    f"verifier {verifier} of boundary {q.boundary} flagged {q.flags} of the last {q.relays} tensors "
                    f"it relayed{'' if q.sender is None else f' from {q.sender}'} while the others flagged "
                    f"{q.others_flags} of {q.others_relays} (p={q.p:.1e}): it may have stopped checking; {action}"
                )
        for verifier in set(self.quiet) - set(quiet):
            logger.info(f"verifier {verifier} flags as the others of its boundary do again")
        self.quiet = quiet

    async def _after_failure(
        self, name: str, attempt: int, errors: list[BaseException], avoid: set[str], routes: list[list[Hop]]
    ) -> None:
        for error in errors:
            if not isinstance(error, HopError):
                raise error
            failures = error.failures or [error]
            note_failures(self.blacklist, failures)
            # a peer that failed to answer is avoided; one that refused did its job (the culprit of a refusal is
            # the refusing peer, not the peer it refused), but it will refuse its neighbours on this route again
            avoid.update(f.culprit for f in failures if f.culprit and f.cause.avoid)
            for failure in failures:
                if failure.culprit and issubclass(failure.cause, HopRefused):
                    self._keep_apart(failure.culprit, routes)
            logger.info(f"microbatch {name}: attempt {attempt + 1} failed: {error}")
        if any(isinstance(e, HopError) and e.cause.view_behind for e in errors):
            # our view or theirs is behind (a peer just joined, or was just banned): catch up
            await asyncio.sleep(self.config.swarm.announce_period)
            await self.views.refresh(force=True)

    def _keep_apart(self, refuser: str, routes: list[list[Hop]]) -> None:
        """Keeps ``refuser`` off routes next to the peers it was next to on these routes, for a while."""
        for hops in routes:
            peers = [hop.peer_id for hop in hops]
            if refuser not in peers:
                continue
            at = peers.index(refuser)
            for neighbour in peers[max(0, at - 1) : at] + peers[at + 1 : at + 2]:
                seconds = self.apart.register_refusal(refuser, neighbour)
                logger.info(f"keeping {refuser} and {neighbour} apart on routes for {seconds:.0f}s (a refusal)")

    async def _routes_when_there_are(
        self, avoid: set[str], copies: int, mode, patience: float
    ) -> list[list[Hop]] | None:
        """Routes for a microbatch, waiting (until ``patience``) while some stage or boundary has nobody to serve
        it that is not suspended for failing to answer: a stage whose last replica died is covered again by a
        replica that moves there, and the microbatch should wait for it rather than use up its attempts on the
        dead peer and count as failed."""
        while True:
            patient = time.monotonic() < patience
            routes = await self._routes(avoid, copies, mode.barred(self.views.view), patient)
            if routes is not None or not patient:
                return routes

    async def _routes(
        self, avoid: set[str], copies: int, barred: set[str], patient: bool = False
    ) -> list[list[Hop]] | None:
        """``copies`` routes, never through ``barred`` verifiers; duplicates go through other replicas than the first
        copy where the swarm has them."""
        routes: list[list[Hop]] = []
        taken: set[str] = set()
        for _ in range(copies):
            hops = await self._route(avoid | taken, barred, patient)
            if hops is None:
                return None
            routes.append(hops)
            taken |= {hop.peer_id for hop in hops if hop.boundary is None}
        return routes

    async def _route(self, avoid: set[str], barred: set[str], patient: bool = False) -> list[Hop] | None:
        """The hops of a new route avoiding ``avoid`` if possible and ``barred`` always; None (after a pause) if the
        swarm has none. A ``patient`` caller gets None rather than a route through a peer suspended for not
        answering."""
        view = self.views.view
        avoid = avoid | barred | (set(self.quiet) if self.avoid_quiet else set())
        try:
            try:
                route = choose_route(view, self.route_rng, self.blacklist, avoid, apart=self.apart.apart)
            except NoRouteError:
                # better a peer that failed this microbatch once than none at all (but a suspended one only when
                # there is no time left to wait for the view to change)
                route = choose_route(view, self.route_rng, self.blacklist if patient else None, barred)
        except NoRouteError as e:
            if time.monotonic() - self._no_route_said > 10.0:  # once per stretch, not once per microbatch
                self._no_route_said = time.monotonic()
                logger.warning(f"no route through the swarm: {e}; waiting for peers")
            await asyncio.sleep(1.0)
            await self.views.refresh(force=True)
            return None
        return self._hops(route, view, avoid)

    def _hops(self, route: Route, view: SwarmView, avoid: set[str]) -> list[Hop]:
        return [
            Hop(peer_id=hop.peer_id, boundary=hop.boundary, alternates=list(hop.alternates))
            for hop in expand(route, view, self.route_rng, self.blacklist, avoid)
        ]

    def _resume_step(self) -> int:
        """Where this trainer's step count starts: stages apply each global step once, so a trainer that joins a
        swarm which already trained continues its count, after the step the live stages announce (robust to a
        minority of lying replicas, see ``SwarmView.step_estimate``) or the one other admitted trainers announce,
        when that is at most MAX_STEP_AHEAD further (a claim beyond what the stages show is ignored and logged)."""
        if self.settings.start_step is not None:
            return self.settings.start_step
        view = self.views.view
        stages = view.step_estimate() + 1
        others = [a.global_step for a in view.trainers.values() if a.peer_id != self.peer_id]
        plausible = [step for step in others if step <= stages + MAX_STEP_AHEAD]
        for step in sorted(set(others) - set(plausible)):
            logger.warning(
                f"ignoring a trainer's announced step {step}: the live stages are at step {stages - 1}, more than "
                f"{MAX_STEP_AHEAD} behind it"
            )
        return max([stages, *plausible])

    async def _step_all(self, step: int) -> None:
        """Tells every live stage replica that global step ``step`` is complete."""
        view = self.views.view
        replicas = [a.peer_id for k in range(view.n_stages) for a in view.live_replicas(k)]
        meta = StepRequest(deadline=time.time() + STEP_CALL_TIMEOUT_S, step=step)
        results = await asyncio.gather(
            *(
                call_peer(
                    self.p2p,
                    peer,
                    STAGE_STEP,
                    [],
                    meta,
                    settings=self.transport,
                    reply_model=StepReply,
                    max_reply_bytes=0,
                )
                for peer in replicas
            ),
            return_exceptions=True,
        )
        for peer, result in zip(replicas, results, strict=True):
            if isinstance(result, HopRefused):
                logger.warning(f"replica {peer} refused the step call for step {step}: {result}")
            elif isinstance(result, BaseException):
                # it applies the step when the next microbatch reaches it, if it is alive
                logger.info(f"step call to {peer} failed: {result}")

    async def _validate(self, step: int) -> float | None:
        results = await asyncio.gather(
            *(self._microbatch(step, f"val{step}.{i}", x, y, train=False) for i, (x, y) in enumerate(self.val_batches))
        )
        losses = [loss for loss in results if loss is not None]
        if not losses:
            logger.warning(f"validation at step {step}: no batch got through")
            return None
        val_loss = float(np.mean(losses))
        self.val_curve.append((step, val_loss))
        logger.info(f"validation loss at step {step}: {val_loss:.4f} ({len(losses)}/{len(results)} batches)")
        if step == self.first_step:
            self._emit({"event": "validation", "step": step, "val_loss": val_loss})
        return val_loss

    async def _wait_for_swarm(self) -> None:
        deadline = time.monotonic() + self.settings.wait_for_swarm
        while True:
            view = await self.views.refresh(force=True)
            health = view.health()
            # stages admit only trainers they can read in the DHT: wait until ours is there too
            if health.ok and self.peer_id in view.trainers:
                return
            if time.monotonic() > deadline:
                raise NodeError(
                    f"the swarm is not ready after {self.settings.wait_for_swarm:.0f}s ({health.summary()}); "
                    "start the missing stages and verifiers with the same --config and --initial-peers"
                )
            logger.info(f"waiting for the swarm: {health.summary()}")
            await asyncio.sleep(1.0)

    # --- output

    def _progress_bar(self):
        if not self.settings.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.settings.steps or None, desc="training", unit="step", dynamic_ncols=True)

    def _emit(self, record: dict) -> None:
        """Appends ``record`` as one JSON line to the metrics file (whole lines, so a reader can tail it)."""
        if self.settings.metrics_out is None:
            return
        try:
            with Path(self.settings.metrics_out).open("a") as out:
                out.write(json.dumps(record, default=str) + "\n")
        except OSError as e:
            logger.warning(f"cannot write metrics to {self.settings.metrics_out}: {e}")

    def status(self) -> TrainerStatus:
        return TrainerStatus(
            peer_id=self.peer_id,
            step=self.step,
            accounting=AccountingStatus(**self.accounting.as_dict()),
            val_curve=self.val_curve,
            quiet_verifiers=sorted(self.quiet),
            time=time.time(),
            **NodeStatus.view_fields(self.views.view),
        )
