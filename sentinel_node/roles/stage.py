"""The stage role: one replica of stage K of the model, serving microbatches as nested calls (see
docs/architecture.md section 5).

``sentinel.stage.forward`` takes a microbatch (stage 0: token ids; later stages: the hidden states a verifier of
boundary K-1|K relayed) with its targets, computes the stage's forward pass, calls the next hop of the route (the
verifier of boundary K|K+1) and waits for the gradient it answers with, runs the backward pass with it, and
answers its own caller with the gradient for its input. The last stage computes the loss and answers with its
input gradient at once. An answer without a gradient means a verifier dropped the microbatch's gradient: the
stage forgets its graph and passes that on.

Callers: activations are accepted only from a live verifier admitted for the input boundary (stage 0: from a
live admitted trainer), never from an excluded peer; the caller is the authenticated peer id of the connection. The
next hop is called only if it is a live verifier admitted for the output boundary, whatever the route says (the
route comes from the caller). Admission is the swarm's trust roots' (docs/security.md), read from the swarm view.

Steps: ``sentinel.stage.step`` (from a live admitted trainer) applies the mean of the gradients accumulated since
the last step; a forward for a later step first applies a step that was missed. Steps only go forward, and one more
than MAX_STEP_AHEAD ahead of both this replica's and the swarm's (as the live replicas announce it) is refused and
logged as an attack, whether it comes in a step call or in a microbatch. Every ``pipeline.average_every`` steps the
replica averages its parameters with the stage's other live replicas (see :mod:`sentinel_node.roles.averaging`).

State: with ``--state-dir`` the replica resumes from its newest checkpoint there, and saves one every
``checkpoint_every`` global steps and on shutdown (see :mod:`sentinel_node.roles.replica_state`). Before it
serves, it downloads the stage's state from a live replica the swarm view names and keeps it when it is ahead of
its own; it then shares its own state with replicas that join later. A call showing that it missed whole global
steps while serving (it was cut off from the swarm) makes it take a live replica's newer state the same way, taking
no training microbatch meanwhile.

Placement: without ``--stage`` the node reads the swarm view first and takes the stage that needs it most
(:func:`peers.placement.choose_stage`), announces itself ``joining`` there while it syncs, then serves; every
``swarm.rebalance_period`` seconds on average (at random, so replicas do not all look at once) it checks whether
moving to another stage would raise the slowest stage's throughput enough (:func:`peers.placement.plan_move`),
and if so stops taking work, finishes the global step under way, and serves the other stage (a stage whose last
replica died gets covered that way). With ``--stage K`` the replica stays on stage K.

Red team: with an :class:`AttackOptions`, the replica corrupts the activations and/or gradients it sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.performance_ema import PerformanceEMA

from dht import DHTUnavailable, StageAnnouncement
from peers import SwarmView, SwarmWatcher
from peers.placement import Move, StageChoice, choose_stage, plan_rebalance, should_yield, stage_loads
from sentinel_node.attacks import (
    Attacker,
    AttackError,
    StageContext,
    arm,
    attack_maker,
    lies_in_audits,
    refuses_steps,
)
from sentinel_node.config import Config
from sentinel_node.model.stage import layer_range
from sentinel_node.model.weights import WeightsError
from sentinel_node.pipeline import StageWorker
from sentinel_node.pipeline.device import DeviceError, resolve_device
from sentinel_node.pipeline.throughput import measure
from sentinel_node.roles.audits import StageRecompute
from sentinel_node.roles.averaging import ReplicaAverager
from sentinel_node.roles.calls import call_hop
from sentinel_node.roles.common import JoinOptions, NodeError, software_version
from sentinel_node.roles.compute import ComputeLane
from sentinel_node.roles.metrics import Sample
from sentinel_node.roles.node import Node, NodeContext, periodically, started_node, wait_for_stop
from sentinel_node.roles.reachability import Reachability
from sentinel_node.roles.replica_state import Behind, ReplicaState, when_behind
from sentinel_node.roles.status import NodeStatus, ReachabilityStatus, StageStatus
from sentinel_node.roles.views import Gatekeeper, live_trainer, live_verifier, shows_others
from sentinel_node.roles.wire import (
    MAX_STEP_AHEAD,
    STAGE_FORWARD,
    STAGE_STEP,
    VERIFIER_RELAY,
    PipelineRequest,
    Shapes,
    StepReply,
    StepRequest,
)
from sentinel_node.transport import (
    Answer,
    HopMalformed,
    HopRefused,
    HopUnavailable,
    Incoming,
    MicrobatchReply,
    TensorServer,
)

logger = get_logger(__name__)

AttackTarget = Literal["activation", "gradient", "both"]

# Averaging rounds: how long replicas look for each other, and how long a round may take in all.
AVERAGE_MATCHMAKING_S = 2.0
AVERAGE_TIMEOUT_S = 15.0
NETWORK_ALPHA = 0.3  # weight of the latest report period in the served-tokens figure
# A replica that moves waits at most this long for the global step under way to be applied before it leaves.
MOVE_DRAIN_S = 30.0
# How long a joining replica waits for a view of the swarm it can decide its state by: a loaded machine's first DHT
# reads may time out for a while (at a load average of 38 on 2 cores a restarted replica's failed for over 60 s).
SWARM_READ_TIMEOUT_S = 300.0
SWARM_READ_REPORT_S = 15.0  # it says it is waiting this often
CATCH_UP_SYNCS = 3  # states taken again when the swarm trained on while one downloaded
RESYNC_DRAIN_S = 20.0  # the most a resync waits for the microbatches in flight before it replaces the parameters


@dataclass(frozen=True)
class AttackOptions:
    """A red-team replica: what it corrupts, from which global step, how often."""

    name: str | None = None  # from the catalogue (sentinel_node.attacks)
    file: str | None = None  # or PATH.py:NAME
    target: AttackTarget = "both"
    start: int = 0
    probability: float = 1.0

    def build(self, config: Config, stage: int, seed: int) -> dict[str, Attacker]:
        """An Attacker per direction this stage sends (the last stage sends no activation, stage 0 no gradient)."""
        _, make = attack_maker(self.name, self.file, lambda d: config.verification.monitor_settings(d, seed))
        attackers = arm(
            make,
            self.target,
            stage,
            config.pipeline.n_stages,
            start=self.start,
            probability=self.probability,
            seed=f"{seed}:{stage}",
        )
        if not attackers:
            raise AttackError(f"stage {stage} sends no {self.target}: nothing to attack (choose another target)")
        return attackers


@dataclass(frozen=True)
class StageOptions:
    stage: int | None = None  # None: chosen from the swarm view, and rebalanced while the node runs
    attack: AttackOptions | None = None
    device: str = "auto"  # CUDA when visible, else the CPU
    status_file: str | None = None
    average: bool = True
    state_dir: str | None = None  # checkpoints: resume from, and save to, this directory
    checkpoint_every: int = 10  # global steps between checkpoints
    resume_behind: bool = False  # serve a state older than the swarm's step (adopting the swarm's step)

    @property
    def placed(self) -> bool:
        """Whether the swarm chooses (and may change) the stage, rather than ``--stage``."""
        return self.stage is None

    def checkpoints(self, stage: int) -> str | None:
        """Where stage ``stage``'s checkpoints live: the state dir itself with ``--stage``, else a directory per
        stage inside it (a placed replica may serve several stages in its life)."""
        if self.state_dir is None or not self.placed:
            return self.state_dir
        return str(Path(self.state_dir) / f"stage{stage}")


def run_stage(
    options: JoinOptions,
    on_ready: Callable[[str, list[str]], None],
    stop_event: threading.Event | None = None,
    *,
    settings: StageOptions,
) -> None:
    """Serves stage ``settings.stage`` (or the stage the swarm needs most, moving when it needs another more) until
    SIGTERM/SIGINT (or ``stop_event``)."""
    config = options.config
    n_stages = config.pipeline.n_stages
    if settings.stage is not None and not 0 <= settings.stage < n_stages:
        raise NodeError(f"--stage {settings.stage} is outside 0..{n_stages - 1} (the config has {n_stages} stages)")
    torch.set_num_threads(1)  # many nodes share a machine's cores; one thread each avoids oversubscription
    try:
        resolve_device(settings.device)  # a device this machine lacks fails before anything starts
        if settings.attack is not None and settings.stage is not None:
            settings.attack.build(config, settings.stage, config.swarm.seed)
    except (DeviceError, AttackError) as e:
        raise NodeError(str(e)) from None
    choice, reachability = None, None
    while True:
        # Each stage is served by a DHT and p2pd of its own (the same identity): p2pd ties handler names to the
        # client connection that registered them, and once a moved replica had removed its handlers, the new ones
        # were never served (re-adding them hung, or the daemon answered "protocols not supported"; measured)
        with started_node(options, stop_event) as context:
            if choice is None:
                choice = _choose(context) if settings.placed else StageChoice(settings.stage, "pinned by --stage")
            logger.info(f"serving stage {choice.stage}: {choice.reason}")
            served = asyncio.run(_serve(context, settings, choice.stage, on_ready, reachability))
            if served.move is None or context.stop.event.is_set():
                return
        choice, reachability = StageChoice(served.move.target, served.move.reason), served.reachability


def _choose(context: NodeContext) -> StageChoice:
    """The stage this node should serve, from a fresh view of the swarm, announced at once as ``joining`` so that
    nodes joining a moment later see it. Nodes started together wait a random moment first, so they do not all
    read the same view."""
    config, rng = context.config, random.Random()
    time.sleep(rng.uniform(0, 2 * config.swarm.announce_period))
    watcher = SwarmWatcher(context.store, config.pipeline.n_stages, config.swarm.exclusion_policy())
    view = watcher.view
    for _ in range(3):
        try:
            view = watcher.refresh()
            break
        except DHTUnavailable as e:
            logger.info(f"reading the swarm to choose a stage: {e}; trying again")
    choice = choose_stage(stage_loads(view, leave_out={context.peer_id}), rng)
    _announce_joining(context, choice.stage)
    # Nodes started together may have read the same view: once their choices are in the DHT, the one of two on the
    # same stage with the larger peer id chooses again while some stage has nobody (a slow machine read late)
    for _ in range(3):
        time.sleep(config.swarm.announce_period)
        try:
            view = watcher.refresh()
        except DHTUnavailable:
            break
        if not should_yield(view, context.peer_id, choice.stage):
            break
        choice = choose_stage(stage_loads(view, leave_out={context.peer_id}), rng)
        _announce_joining(context, choice.stage)
    return choice


def _announce_joining(context: NodeContext, stage: int) -> None:
    config = context.config
    record = StageAnnouncement(
        peer_id=context.peer_id,
        maddrs=context.maddrs,
        state="joining",
        relayed=False,
        throughput=0.0,
        name=context.options.name,
        stage=stage,
        config_hash=config.swarm_hash(),
        version=software_version(),
        time=get_dht_time(),
    )
    with contextlib.suppress(Exception):  # the node announces itself again in a moment anyway
        context.store.put(record, ttl=config.swarm.announce_ttl)


async def _serve(
    context: NodeContext,
    settings: StageOptions,
    stage: int,
    on_ready: Callable[[str, list[str]], None],
    reachability: Reachability | None,
) -> StageNode:
    """Serves ``stage`` until the node is stopped or decides to move; returns the node (its ``move``, if any)."""
    config = context.config
    seed = config.swarm.seed
    try:
        attackers = settings.attack.build(config, stage, seed) if settings.attack else {}
    except AttackError as e:
        raise NodeError(str(e)) from None
    try:
        worker = StageWorker(config.model, config.pipeline, stage, seed=seed, device=settings.device)
    except (DeviceError, WeightsError) as e:
        raise NodeError(str(e)) from None
    worker.applies_step = refuses_steps(attackers)  # a stage-level attack may refuse optimizer steps
    state = ReplicaState(worker, config.swarm_hash(), settings.checkpoints(stage), settings.checkpoint_every)
    state.resume()
    averager = None
    if settings.average:
        averager = ReplicaAverager(
            worker.module,
            context.dht,
            prefix=context.store.keys.averager(stage),  # validators know exactly these keys
            matchmaking_time=AVERAGE_MATCHMAKING_S,
            timeout=AVERAGE_TIMEOUT_S,
        )
    node = StageNode(context, settings, worker, attackers, averager, state, reachability)
    try:
        await node.serve(on_ready)
    finally:
        if averager is not None:
            averager.shutdown()
    return node


class StageNode(Node):
    """The serving side of one stage replica."""

    role = "stage"
    announces_joining = True  # while it syncs the stage's state

    def __init__(
        self,
        context: NodeContext,
        settings: StageOptions,
        worker: StageWorker,
        attackers: dict[str, Attacker],
        averager: ReplicaAverager | None,
        state: ReplicaState,
        reachability: Reachability | None = None,
    ) -> None:
        super().__init__(context, settings.status_file)
        self.settings, self.worker = settings, worker
        self.stage = worker.stage
        self.reachability = reachability  # known from the stage it served before a move: not checked again
        self.n_stages = self.config.pipeline.n_stages
        self.attackers = attackers
        self.averager = averager
        self.shapes = Shapes.of(self.config)
        self.lane = ComputeLane(f"stage{self.stage}")
        self.gate = Gatekeeper(self.views)
        self.state = state
        self.last_step = state.step  # the last global step applied (or being applied)
        self.stats = {
            "served": 0,
            "evaluated": 0,
            "dropped": 0,
            "held": 0,  # the loss gate held the update back
            "failed": 0,
            "attacked": 0,
            "steps": 0,
        }
        self.averaging: asyncio.Task | None = None
        self.averaged_with: list[str] = []
        self._averaged: list[torch.Tensor] | None = None  # the snapshot of a finished round, until applied
        self._cpu_s = 0.0  # CPU time of this replica's torch work (its compute lane's thread)
        self._reported = (0, 0.0)  # microbatches and CPU time at the last throughput report
        # tokens per CPU second of compute, what trainers weigh routes by and placement sums per stage
        self.throughput = PerformanceEMA(alpha=0.3, paused=True)
        self.network = 0.0  # tokens per wall second actually served, an average over report periods (idle ones too)
        self.measured_cached = False
        self.forward_cpu_s = 0.0  # of training forwards alone: what a verifier's check is weighed against
        self.forwards = 0
        self._reported_at = time.monotonic()
        self.move: Move | None = None  # set when the replica decided to serve another stage
        self.leaving = False  # it takes no new microbatch: it is about to move
        self.resyncing: asyncio.Task | None = None  # taking the stage's state after missing steps (_notice_missed)
        self.in_flight = 0
        self.recompute = StageRecompute(self)  # recomputation audits (sentinel_node/roles/audits.py)
        self.lies_in_audits = lies_in_audits(attackers)  # a red-team replica may lie as an auditor
        self._averaged_round: tuple[int, list[str], int] | None = None  # a finished round's step, group, step count

    # --- lifecycle hooks

    async def prepare(self) -> None:
        # measured first: the figure goes into the joining announcement other nodes place themselves by
        shape = (self.shapes.batch, self.shapes.seq_len, self.shapes.vocab, self.shapes.hidden)
        measured = await self.lane.run(measure, self.worker, self.config.swarm_hash(), shape, self.settings.state_dir)
        self.measured_cached = measured.cached
        tokens = self.shapes.tokens_per_microbatch
        self.throughput.update(tokens, interval=tokens / measured.tokens_per_s)
        self.announcer.update(throughput=float(self.throughput.samples_per_second))
        if self.averager is not None:
            await self.state.sync(self._other_replicas, self.averager, self.lane, self._behind_the_swarm)
            self.last_step = self.state.step
            for _ in range(CATCH_UP_SYNCS):
                # the swarm trains on while a state downloads: a replica that joins a fast one takes it again
                if self.state.synced_from is None or self.last_step >= await self._swarm_step():
                    break
                await self.state.sync(self._other_replicas, self.averager, self.lane)
                self.last_step = self.state.step
        await self._check_not_behind()
        if self.averager is not None:
            self.averager.share_state(self.state.current)
            self.views.listeners.append(lambda view: self.averager.set_excluded(view.excluded))
        if self.state.resumed_from is not None or self.state.synced_from is not None:
            self.worker.reference.clear()  # its parameters are not the initialisation: no reference until it averages

    async def add_handlers(self, server: TensorServer) -> None:
        if self.worker.is_first:
            expect = [self.shapes.tokens, self.shapes.tokens]
        else:
            expect = [self.shapes.hidden_spec, self.shapes.tokens]
        await server.add_handler(
            STAGE_FORWARD, self._forward, PipelineRequest, admit=self._admit, authorize=self._authorize, expect=expect
        )
        await server.add_handler(
            STAGE_STEP, self._step, StepRequest, admit=self._admit_step, authorize=self._authorize_step, expect=[]
        )
        await self.recompute.add_handler(server)

    def announcement(self) -> StageAnnouncement:
        return self.announced(
            StageAnnouncement,
            throughput=float(self.throughput.samples_per_second),
            network=float(self.network),
            stage=self.stage,
            last_step=self.last_step,
        )

    def background(self):
        tasks = [periodically(self.config.swarm.announce_period, self._report)]
        if self.settings.placed and self.config.swarm.rebalance_period > 0:
            tasks.append(self._rebalance())
        return tasks

    @property
    def moving(self) -> bool:
        return self.move is not None and not self.context.stop.event.is_set()

    def ready_line(self) -> str:
        kind = "red-team replica" if self.attackers else "replica"
        return f"stage {self.stage} {kind} {self.peer_id} serving swarm {self.config.swarm.prefix}"

    def describe_details(self) -> list[str]:
        model, worker = self.config.model, self.worker
        layers = layer_range(model.n_layers, self.stage, self.n_stages)
        params = sum(p.numel() for p in worker.module.parameters())
        extra = (" + embedding" if worker.is_first else "") + (" + head and loss" if worker.is_last else "")
        memory = ""
        if worker.device.type == "cuda":
            memory = f", {torch.cuda.memory_allocated(worker.device) / 2**20:.0f} MiB on the GPU"
        source = "cached for this host" if self.measured_cached else "measured now"
        return [
            f"stage {self.stage} of {self.n_stages}: layers {layers.start}-{layers.stop - 1}{extra}, "
            f"{params / 1e6:.2f}M parameters (model: {model.n_layers} layers x {model.hidden_size} wide)",
            f"device: {worker.device} ({worker.precision.name}, optimizer {worker.optimizer_name}){memory}",
            f"compute throughput: {self.throughput.samples_per_second:,.0f} tokens/s ({source})",
            "placement: " + ("chosen by the swarm, rebalanced" if self.settings.placed else "pinned by --stage"),
        ]

    async def main(self) -> Move | None:
        """Serves until asked to stop, or until it decided to move (then it drains first)."""
        await wait_for_stop(self.context, also=lambda: self.move is not None)
        if self.move is None:
            received = self.context.stop.received
            logger.info(f"{received.name if received else 'asked to stop'}: shutting down")
            return None
        await self._drain()
        return self.move

    async def stopping(self) -> None:
        if self.averaging is not None:
            self.averaging.cancel()
        if self.resyncing is not None:
            self.resyncing.cancel()

    async def finish(self) -> None:
        with contextlib.suppress(Exception):  # a failed save is logged inside; the stop goes on
            await self.lane.run(self.state.save)
        await asyncio.to_thread(self.state.close)

    def close(self) -> None:
        self.lane.close()

    async def _check_not_behind(self) -> None:
        """A replica whose state is older than the swarm's step must not serve it as current: the stage would go back
        to that state unnoticed (a restart from a stale checkpoint once lost 944 steps). NodeError naming both steps,
        unless ``resume_behind``, which adopts the swarm's step for this state.

        On a stage that no live replica holds (its last one died, and this one joined, moved or came back to cover
        it), fresh weights, or this replica's own checkpoint less than a checkpoint interval behind, adopt the
        swarm's step with a warning: no newer state of the stage exists anywhere, and refusing would leave the stage
        uncovered for good (:func:`sentinel_node.roles.replica_state.when_behind`)."""
        view = await self._read_swarm()
        swarm_step = view.step_estimate(exclude=self.peer_id)
        others = [a for a in view.live_replicas(self.stage) if a.peer_id != self.peer_id]
        verdict = when_behind(
            self.last_step,
            swarm_step,
            resumed=self.state.resumed_from is not None,
            synced=self.state.synced_from is not None,
            others=bool(others),
            resume_behind=self.settings.resume_behind,
            checkpoint_every=self.settings.checkpoint_every,
        )
        mine = "fresh weights" if self.last_step < 0 else f"step {self.last_step}"
        where = f" (checkpoint in {self.state.state_dir})" if self.state.resumed_from is not None else ""
        lost = swarm_step - self.last_step
        if verdict is Behind.SERVE:
            if self.last_step < swarm_step:
                # a live replica's state, taken again and again while the swarm trained on: not a stale checkpoint.
                # The first call of a later step finds the steps it lacks and takes the state once more
                logger.info(
                    f"stage {self.stage}: the state taken is at step {self.last_step}, the swarm's at {swarm_step} "
                    "(it trains faster than a state downloads); the first call of a later step takes the state again"
                )
            return
        if verdict is Behind.REFUSE:
            raise NodeError(
                f"stage {self.stage}: this replica's state is at {mine}{where}, but the swarm's live replicas are at "
                f"step {swarm_step}; serving it would set the stage back {lost} steps. Restore "
                "a newer checkpoint into --state-dir, or rejoin with --resume-behind to serve this state at the "
                f"swarm's step {swarm_step} knowingly"
            )
        if verdict is Behind.ADOPT_UNCOVERED:
            logger.warning(
                f"stage {self.stage} has no other live replica and no state to sync: serving fresh weights as step "
                f"{swarm_step}, the swarm's step (the stage's training so far is lost)"
            )
        elif verdict is Behind.ADOPT_LAST:
            logger.warning(
                f"stage {self.stage} has no other live replica: serving {mine}{where}, this replica's last "
                f"checkpoint, as step {swarm_step}, the swarm's step (the {lost} steps after it were lost with the "
                "process that computed them, and no live replica holds them)"
            )
        else:
            logger.warning(
                f"stage {self.stage}: --resume-behind: serving {mine}{where} as step {swarm_step}, the swarm's step "
                f"({lost} steps of training on this stage are lost)"
            )
        with self.state.lock:
            self.state.step = self.last_step = swarm_step

    async def _swarm_step(self) -> int:
        return (await self._read_swarm()).step_estimate(exclude=self.peer_id)

    async def _behind_the_swarm(self) -> bool:
        """Whether this replica's state is older than the swarm's step (so a failed download is worth retrying)."""
        return self.state.step < await self._swarm_step()

    async def _other_replicas(self) -> list[str]:
        view = await self._read_swarm()
        return [a.peer_id for a in view.live_replicas(self.stage) if a.peer_id != self.peer_id]

    async def _read_swarm(self) -> SwarmView:
        """The swarm as the DHT shows it now, for deciding whether this replica's state is current: a view read for
        the question and showing another node. A failed or premature read gives an empty view, which reads as a
        swarm without replicas at step -1: the churn soak saw a SIGKILLed replica, restarted while its sibling
        served, resume its step-0 checkpoint, find "no other live replica", serve it as step 48 and get banned.
        NodeError when no such view comes within SWARM_READ_TIMEOUT_S. The first node of a swarm (no
        --initial-peers) has nobody else to see: any view read will do."""
        first = not self.context.options.initial_peers
        shows = None if first else lambda v: shows_others(v, self.peer_id)
        deadline = time.monotonic() + SWARM_READ_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            view = await self.views.read(min(SWARM_READ_REPORT_S, left), shows=shows)
            if view is not None:
                return view
            logger.info(
                f"stage {self.stage}: waiting for the swarm's records (the DHT did not answer, or showed no "
                "other node)"
            )
        raise NodeError(
            f"stage {self.stage}: the swarm's records could not be read in {SWARM_READ_TIMEOUT_S:.0f}s (the DHT "
            "did not answer, or showed no other node); without them this replica cannot tell whether its state "
            "is current. Check --initial-peers, then rejoin"
        )

    def samples(self) -> list[Sample]:
        samples = [
            Sample("sentinel_global_step", self.last_step),
            Sample("sentinel_tokens_per_second", self.throughput.samples_per_second),
            Sample("sentinel_checkpoints_saved", self.state.saved),
            Sample("sentinel_checkpoint_failures", self.state.failed),
        ]
        for outcome in ("served", "evaluated", "dropped", "held", "failed"):
            samples.append(Sample("sentinel_microbatches", self.stats[outcome], (outcome,)))
        for outcome in ("served", "unavailable"):
            samples.append(Sample("sentinel_recomputations", self.recompute.stats[outcome], (outcome,)))
        return samples

    def _report(self) -> None:
        """Announces tokens per CPU second of this replica's compute (what trainers weigh routes by), followed as
        an average over report periods with some work in them; the tokens per second it served (its network
        figure: compute, waiting on peers and idle time together); and its last step."""
        done = self.stats["served"] + self.stats["evaluated"] + self.stats["dropped"] + self.stats["held"]
        microbatches, cpu_s = done - self._reported[0], self._cpu_s - self._reported[1]
        now = time.monotonic()
        wall_s, self._reported_at = now - self._reported_at, now
        if wall_s > 0:  # PerformanceEMA takes no empty period, and an idle period must pull this figure down
            rate = max(microbatches, 0) * self.shapes.tokens_per_microbatch / wall_s
            self.network = NETWORK_ALPHA * rate + (1 - NETWORK_ALPHA) * self.network
        if microbatches >= 2 and cpu_s > 0:
            self.throughput.update(microbatches * self.shapes.tokens_per_microbatch, interval=cpu_s)
        self._reported = (done, self._cpu_s)
        self.announcer.update(throughput=float(self.throughput.samples_per_second), network=float(self.network))
        if self.announcer.record.last_step != self.last_step:
            self.announcer.update(last_step=self.last_step)
        problem = None if self.state.problem is None else self.state.problem[:256]
        if self.announcer.record.checkpoint_problem != problem:
            self.announcer.update(checkpoint_problem=problem)
        self.write_status()

    def status(self) -> StageStatus:
        reach = self.reachability
        return StageStatus(
            stage=self.stage,
            peer_id=self.peer_id,
            attacker=bool(self.attackers),
            last_step=self.last_step,
            resumed_from=self.state.resumed_from,
            synced_from=self.state.synced_from,
            resyncs=self.state.resyncs,
            checkpoints=self.state.saved,
            checkpoint_failures=self.state.failed,
            checkpoint_problem=self.state.problem,
            reachability=None if reach is None else ReachabilityStatus(**reach.as_dict()),
            averaging_rounds=self.averager.rounds if self.averager else 0,
            averaged_with=self.averaged_with,
            throughput=self.throughput.samples_per_second,
            forward_cpu_ms=1000 * self.forward_cpu_s / self.forwards if self.forwards else None,
            compute_cpu_s=self._cpu_s,
            time=time.time(),
            recomputations=dict(self.recompute.stats),
            recompute_cpu_s=self.recompute.cpu_s,
            reference=None if self.worker.reference.latest is None else self.worker.reference.latest.digest,
            **self.stats,
            **NodeStatus.view_fields(self.views.view),
        )

    # --- who may call

    async def _admit(self, caller: str) -> None:
        """Who may send this stage microbatches (decided on the peer id alone, before reading the request)."""
        if self.stage == 0:
            await self.gate.require(
                caller,
                lambda view: live_trainer(view, caller),
                "stage 0 takes microbatches only from a live trainer the swarm admits",
            )
        else:
            boundary = self.stage - 1
            await self.gate.require(
                caller,
                lambda view: live_verifier(view, caller, boundary),
                f"stage {self.stage} accepts activations only from a live verifier admitted for boundary "
                f"{boundary}|{self.stage}",
            )

    def _authorize(self, caller: str, metadata: PipelineRequest) -> None:
        if self.leaving and metadata.train:
            raise HopUnavailable(f"this replica of stage {self.stage} is moving to another stage; try another")
        if self.resyncing is not None and metadata.train:
            raise HopUnavailable(f"this replica of stage {self.stage} is taking the stage's state; try another")
        if not self.worker.is_last:
            if not metadata.route:
                raise HopRefused(f"stage {self.stage} is not the last stage: the route must name the next hop")
            if metadata.route[0].boundary != self.stage:
                raise HopRefused(f"the hop after stage {self.stage} must be a verifier of boundary {self.stage}")
        self._check_step(metadata.step, caller, "a microbatch")

    async def _admit_step(self, caller: str) -> None:
        await self.gate.require(
            caller, lambda view: live_trainer(view, caller), "only a live trainer the swarm admits paces steps"
        )

    def _authorize_step(self, caller: str, metadata: StepRequest) -> None:
        self._check_step(metadata.step, caller, "a step call")

    def _check_step(self, step: int, caller: str, what: str) -> None:
        """Refuses a step far ahead of this replica's own and of the swarm's (an attack: it would freeze learning,
        every real step counting as already applied)."""
        horizon = max(self.last_step, self.views.view.step_estimate(exclude=self.peer_id)) + MAX_STEP_AHEAD
        if step > horizon:
            logger.warning(
                f"stage {self.stage}: refused {what} for step {step} from {caller}: this replica is at step "
                f"{self.last_step}, at most {horizon} is plausible (an attack, or a trainer counting wrong)"
            )
            raise HopRefused(
                f"step {step} is more than {MAX_STEP_AHEAD} steps ahead of stage {self.stage}'s {self.last_step}"
            )

    # --- microbatches

    async def _forward(self, incoming: Incoming[PipelineRequest]) -> Answer:
        self.in_flight += 1
        try:
            return await self._forward_one(incoming)
        finally:
            self.in_flight -= 1

    async def _forward_one(self, incoming: Incoming[PipelineRequest]) -> Answer:
        meta = incoming.metadata
        inputs, targets = incoming.tensors
        if (
            int(targets.min()) < 0
            or int(targets.max()) >= self.shapes.vocab
            or (self.worker.is_first and (int(inputs.min()) < 0 or int(inputs.max()) >= self.shapes.vocab))
        ):
            raise HopMalformed(f"token ids must lie in [0, {self.shapes.vocab}); resend real tokens")
        await self._catch_up(meta.step)
        if not meta.train:
            return await self._evaluate(meta, inputs, targets)
        key = meta.microbatch_id
        if self.worker.is_last:
            loss, grad = await self._compute(self._loss_and_grad, key, inputs, targets, meta.step, meta.loss_ceiling)
            if grad is None:  # the loss gate: nothing learned from it, the trainer sends it again elsewhere
                self.stats["held"] += 1
                return Answer([], MicrobatchReply(loss=loss, taint=meta.taint, held=True))
            self.stats["served"] += 1
            return Answer([grad], MicrobatchReply(loss=loss, taint=meta.taint))
        output = await self._compute(self._forward_and_send, key, inputs, meta.step)
        try:
            reply = await self._call_next(meta, [output, targets])
            gradients = reply.tensors
            if len(gradients) > 1 or (gradients and not self._fits(gradients[0])):
                raise HopMalformed(
                    f"the answer must be at most one finite {self.config.pipeline.wire_dtype} gradient of shape "
                    f"{self.shapes.activation}, got {[(tuple(g.shape), str(g.dtype)) for g in gradients]}",
                    peer=reply.peer,
                )
            if not gradients:  # a verifier dropped the gradient (or replaced our activation), or the loss gate held
                self.worker.discard(key)  # the update back: nothing to learn
                self.stats["held" if reply.metadata.held else "dropped"] += 1
                return Answer([], reply.metadata)
            grad_input = await self._compute(self._backward_and_send, key, gradients[0], meta.step)
        except BaseException:
            self.worker.discard(key)
            self.stats["failed"] += 1
            raise
        self.stats["served"] += 1
        return Answer([] if grad_input is None else [grad_input], reply.metadata)

    async def _evaluate(self, meta: PipelineRequest, inputs: torch.Tensor, targets: torch.Tensor) -> Answer:
        self.stats["evaluated"] += 1
        if self.worker.is_last:
            loss = await self._compute(self._eval_loss, inputs, targets)
            return Answer([], MicrobatchReply(loss=loss, taint=meta.taint))
        output = await self._compute(self._eval_forward, inputs, meta.step)
        reply = await self._call_next(meta, [output, targets])
        return Answer([], reply.metadata)

    async def _call_next(self, meta: PipelineRequest, tensors: list[torch.Tensor]):
        hop, next_meta = meta.advance()
        return await call_hop(
            self.p2p,
            hop,
            self.views.view,
            self.blacklist,
            VERIFIER_RELAY,
            tensors,
            next_meta,
            self.transport,
            nobody=f"no verifier the route names for boundary {self.stage}|{self.stage + 1} is live, admitted and "
            "not excluded",
            allowed=lambda peer: live_verifier(self.views.view, peer, self.stage),
            max_reply_bytes=self.shapes.activation_bytes,
            refresh=lambda: self.views.refresh(force=True),
        )

    def _fits(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.dtype == self.shapes.dtype
            and tuple(tensor.shape) == self.shapes.activation
            and bool(torch.isfinite(tensor).all())
        )

    # --- torch work, in the compute lane

    async def _compute(self, fn: Callable, *args):
        return await self.lane.run(self._timed, fn, *args)

    def _timed(self, fn: Callable, *args):
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            self._cpu_s += time.thread_time() - started

    def _send(
        self, direction: str, tensor: torch.Tensor, step: int, context: StageContext | None = None
    ) -> torch.Tensor:
        attacker = self.attackers.get(direction)
        if attacker is None:
            return tensor
        sent, attacked = attacker(tensor, step, context)
        self.stats["attacked"] += int(attacked)
        return sent

    def _forward_and_send(self, key: str, inputs: torch.Tensor, step: int) -> torch.Tensor:
        started = time.thread_time()
        output = self.worker.forward(key, inputs)
        self.forward_cpu_s += time.thread_time() - started
        self.forwards += 1
        return self._send("activation", output, step, StageContext(self.worker.module, inputs))

    def _backward_and_send(self, key: str, grad_output: torch.Tensor, step: int) -> torch.Tensor | None:
        grad_input = self.worker.backward(key, grad_output)
        context = StageContext(self.worker.module, grad_output=grad_output)
        return None if grad_input is None else self._send("gradient", grad_input, step, context)

    def _loss_and_grad(
        self, key: str, inputs: torch.Tensor, targets: torch.Tensor, step: int, ceiling: float | None = None
    ) -> tuple[float, torch.Tensor | None]:
        """The loss and the gradient to send back; no gradient (and nothing accumulated) for a loss that is not at
        or below the ``ceiling`` the last boundary's verifier named."""
        loss = self.worker.forward_loss(key, inputs, targets)
        if ceiling is not None and not loss <= ceiling:
            self.worker.discard(key)
            return loss, None
        grad = self.worker.backward_loss(key)
        return loss, self._send("gradient", grad, step, StageContext(self.worker.module, inputs, targets))

    def _eval_forward(self, inputs: torch.Tensor, step: int) -> torch.Tensor:
        return self._send("activation", self.worker.evaluate(inputs), step)

    def _eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self.worker.evaluate_loss(inputs, targets)

    # --- global steps and averaging

    async def _step(self, incoming: Incoming[StepRequest]) -> Answer:
        step = incoming.metadata.step
        microbatches = self.worker.accumulated
        stepped = await self._apply_step(step)
        return Answer([], StepReply(stepped=stepped, microbatches=microbatches, averaging=self.averaging is not None))

    async def _catch_up(self, step: int) -> None:
        """A microbatch of a later step means the trainer moved on: apply a step call that never arrived."""
        self._notice_missed(step)
        if step > self.last_step + 1 and self.worker.accumulated:
            logger.info(f"stage {self.stage}: no step call for step {step - 1}; applying it now")
            await self._apply_step(step - 1)

    def _notice_missed(self, step: int) -> None:
        """A call for ``step`` that shows this replica missed whole global steps (no step call and no microbatch of
        theirs reached it: it was cut off from the swarm) starts a resync: serving on, its parameters would lag the
        stage's by those steps, and the next averaging round would drag the live replicas back towards them."""
        covered = self.last_step + 1 + (1 if self.worker.accumulated else 0)  # a step call missed, its work here
        if step <= covered or self.resyncing is not None or self.averager is None or self.last_step < 0:
            return
        self.resyncing = asyncio.create_task(self._resync(self.last_step, step))

    async def _resync(self, behind: int, step: int) -> None:
        """Takes no new training microbatch, lets those in flight finish, then takes the stage's state from a live
        replica that is past step ``behind`` (the last step this replica applied before the gap)."""
        logger.warning(
            f"stage {self.stage}: a call for step {step} came after step {behind}: this replica missed "
            f"{step - behind - 1} global step(s), cut off from the swarm; taking the stage's state from a live replica"
        )
        try:
            deadline = time.monotonic() + RESYNC_DRAIN_S
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            view = await self.views.refresh(force=True)
            peers = [
                a.peer_id for a in view.live_replicas(self.stage) if a.peer_id != self.peer_id and a.last_step > behind
            ]
            if not peers:
                logger.warning(f"stage {self.stage}: no live replica is past step {behind}; serving on with ours")
                return
            if await self.state.resync(peers, self.averager, self.lane, behind):
                self.worker.reference.clear()  # not the parameters its reference was kept for: none until it averages
                self.worker.accumulated = 0  # gradients of the parameters it had (restore_state cleared them)
                self._averaged = None  # a round of the old parameters: merging it would undo the resync
                with self.state.lock:
                    self.last_step = max(self.last_step, self.state.step)
            else:
                logger.warning(f"stage {self.stage}: no live replica gave its state; serving on with ours")
        except Exception as e:
            logger.warning(f"stage {self.stage}: the resync failed: {type(e).__name__}: {e}; serving on with ours")
        finally:
            self.resyncing = None

    async def _apply_step(self, step: int) -> bool:
        if step <= self.last_step:
            return False
        self._notice_missed(step)
        self.last_step = step
        stepped = await self._compute(self._step_and_merge, step)
        self.stats["steps"] += int(stepped)
        due = (step + 1) % self.config.pipeline.average_every == 0
        if self.averager is not None and due and self.averaging is None:
            self.averaging = asyncio.create_task(self._average(step))
        return stepped

    def _step_and_merge(self, step: int) -> bool:
        """The optimizer step, then the change an averaging round brought, if one finished since the last step.

        Parameters change only here, between global steps, when no microbatch holds a graph through them: changing
        them under a pending backward pass would fail it (autograd checks the versions of saved tensors).
        """
        with self.state.lock:
            stepped = self.worker.step(step)
            if self._averaged is not None:
                self.averager.apply(self._averaged)
                self._averaged = None
                self._keep_reference(step)
            self.state.step = step
        self.state.save(force=False)
        return stepped

    def _keep_reference(self, step: int) -> None:
        """Recomputation audits: the round just merged is the stage's reference from the next step on."""
        if self._averaged_round is not None:
            round_step, group, steps_at = self._averaged_round
            self.worker.set_reference(round_step, step + 1, group, self.averager.averaged(), steps_at)
            self._averaged_round = None

    async def _average(self, step: int) -> None:
        view = self.views.view
        others = [a.peer_id for a in view.live_replicas(self.stage) if a.peer_id != self.peer_id]
        if not others or view.is_excluded(self.peer_id):
            self.averaging = None  # nobody to average with (or nobody who would average with us)
            return
        try:
            snapshot, steps_at = await self.lane.run(lambda: (self.averager.snapshot(), self.worker.steps))
            group = await asyncio.to_thread(self.averager.average, step)
            if group is not None:
                self._averaged = snapshot  # applied with the next step
                self._averaged_round = (step, group, steps_at)
                self.averaged_with = group
                others = len(group) - 1
                logger.info(
                    f"stage {self.stage}: averaged parameters at step {step} with {others} other "
                    f"replica{'s' if others != 1 else ''}"
                )
        except Exception as e:
            logger.warning(f"stage {self.stage}: averaging at step {step} failed: {type(e).__name__}: {e}")
        finally:
            self.averaging = None

    # --- placement

    def _costs(self) -> list[float]:
        """Each stage's relative cost per token: its layer count."""
        model = self.config.model
        return [float(len(layer_range(model.n_layers, k, self.n_stages))) for k in range(self.n_stages)]

    async def _rebalance(self) -> None:
        """At random intervals around ``swarm.rebalance_period``, checks whether this replica should serve another
        stage; sets :attr:`move` (which ends :meth:`main`) when it should."""
        swarm, rng = self.config.swarm, random.Random()
        while self.move is None:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * swarm.rebalance_period)
            if self.leaving:
                return
            view = await self.views.refresh(force=True)
            # as the view counts it (its announced throughput): not in it yet, plan_rebalance gives None
            move = plan_rebalance(view, self.peer_id, swarm.balance_quality, self._costs())
            if move is not None:
                logger.info(f"stage {self.stage}: {move.reason}; moving")
                self.move = move

    async def _drain(self, timeout: float = MOVE_DRAIN_S) -> None:
        """Before a move: takes no new training microbatch, lets those in flight finish and waits for the step
        they belong to (so their gradients are applied here, not lost), then returns."""
        self.leaving = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.in_flight or self.worker.accumulated):
            await asyncio.sleep(0.1)
        if self.worker.accumulated:
            logger.warning(
                f"stage {self.stage}: no step call came within {timeout:.0f}s; leaving "
                f"{self.worker.accumulated} microbatches' gradients unapplied"
            )
