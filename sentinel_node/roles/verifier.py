"""The verifier role: relays microbatches across the boundaries it serves and checks both directions with SENTINEL.

``sentinel.verifier.relay`` is called by a live replica of stage b with the activation it computed (and the
targets). The verifier checks it with :class:`~sentinel_node.pipeline.BoundaryVerifier` (boundary b, sender =
the caller's authenticated peer id), calls the next hop (a replica of stage b+1) with the activation or its clean
replacement, checks the gradient that replica answers with (sender = that replica), and answers the caller with
the gradient or its replacement. So a microbatch crosses a boundary as one call, forward and back.

- A flagged tensor is replaced (or dropped, per ``verification.replacement``/``gradient_replacement``) and the
  boundary is added to the microbatch's ``taint``, which travels in the call's metadata forward and in the reply
  backward: other verifiers skip a tainted microbatch, so honest peers that merely propagate a replaced tensor are
  not accused. The gradient of a replaced activation is not passed back (it says nothing about what the sender
  computed): the sender gets an answer without a gradient.
- A malformed activation (NaN/Inf, wrong shape or dtype) is a strike for its sender and a ``malformed`` error
  back to it; a malformed gradient is a strike and is dropped (an answer cannot be refused).
- Strikes and bans are published as signed :class:`~dht.StrikeRecord` (one per accused peer, refreshed on each
  change, living ``swarm.strike_ttl`` seconds, carrying this verifier's role certificate so that every reader can
  check it is admitted); a peer this verifier banned is refused as a caller and skipped as a next hop. Excluded
  peers (the swarm's verdict) are refused too.
- The next hop is called only if it is a live replica of the next stage, whatever the route says.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.performance_ema import PerformanceEMA

from dht import RecordError, RecordStore, RoleCertificate, StrikeRecord, VerifierAnnouncement
from peers import StepClock
from sentinel_node.pipeline import BoundaryVerifier
from sentinel_node.pipeline.device import DeviceError, resolve_device
from sentinel_node.roles.admission import admitted_certificate
from sentinel_node.roles.audits import VerifierAudits
from sentinel_node.roles.calls import call_hop
from sentinel_node.roles.common import JoinOptions, NodeError, software_version
from sentinel_node.roles.compute import ComputeLane
from sentinel_node.roles.metrics import Sample
from sentinel_node.roles.node import Node, NodeContext, periodically, started_node
from sentinel_node.roles.status import NodeStatus, ReachabilityStatus, SenderCounts, VerifierStatus
from sentinel_node.roles.views import Gatekeeper, live_replica, stage_of
from sentinel_node.roles.wire import STAGE_FORWARD, VERIFIER_RELAY, PipelineRequest, Shapes
from sentinel_node.transport import (
    Answer,
    HopBanned,
    HopMalformed,
    HopRefused,
    Incoming,
    MicrobatchReply,
    TensorServer,
    check_tensors,
)
from sentinel_node.transport.server import expected_bytes
from sentinel_node.verification import Given, Verdict, VerdictKind, content_of

logger = get_logger(__name__)


@dataclass(frozen=True)
class VerifierOptions:
    boundaries: tuple[int, ...] = ()  # empty: every boundary of the config
    verify: bool = True  # False: a plain relay (overhead measurements, undefended runs)
    status_file: str | None = None
    device: str = "cpu"  # where the statistics are computed: cpu, cuda or cuda:N
    audit: bool = True  # False: checks, but no recomputation audits (overhead measurements)


@dataclass
class CheckStats:
    """What this verifier checked, per boundary and direction, and the CPU time it spent on it."""

    # (boundary, direction) -> [checks, flags, strikes given]
    by_boundary: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    skipped: int = 0
    malformed: int = 0
    relayed: int = 0
    held: int = 0  # microbatches whose update the last stage held back (the loss gate)
    cpu_s: float = 0.0

    def count(self, boundary: int, direction: str, flagged: bool, struck: bool) -> None:
        counts = self.by_boundary.setdefault((boundary, direction), [0, 0, 0])
        counts[0] += 1
        counts[1] += int(flagged)
        counts[2] += int(struck)

    def per_direction(self, index: int) -> dict[str, int]:
        totals = {"activation": 0, "gradient": 0}
        for (_, direction), counts in self.by_boundary.items():
            totals[direction] += counts[index]
        return totals

    @property
    def checks(self) -> dict[str, int]:
        return self.per_direction(0)

    @property
    def flags(self) -> dict[str, int]:
        return self.per_direction(1)

    def status_fields(self) -> dict:
        checked = sum(self.checks.values())
        return {
            "checks": dict(self.checks),
            "flags": dict(self.flags),
            "skipped": self.skipped,
            "malformed": self.malformed,
            "relayed": self.relayed,
            "held": self.held,
            "check_cpu_s": self.cpu_s,
            "cpu_ms_per_check": 1000 * self.cpu_s / checked if checked else None,
        }


def run_verifier(
    options: JoinOptions,
    on_ready: Callable[[str, list[str]], None],
    stop_event: threading.Event | None = None,
    *,
    settings: VerifierOptions = VerifierOptions(),
) -> None:
    """Serves until SIGTERM/SIGINT (or ``stop_event``); checks on the CPU unless ``settings.device`` names a GPU."""
    config = options.config
    n_boundaries = config.pipeline.n_stages - 1
    boundaries = (
        tuple(sorted(set(settings.boundaries))) or _certified_boundaries(options) or tuple(range(n_boundaries))
    )
    outside = [b for b in boundaries if not 0 <= b < n_boundaries]
    if outside:
        raise NodeError(
            f"--boundaries {outside} are outside 0..{n_boundaries - 1}: boundary b sits between stage b and b+1 "
            f"of the config's {config.pipeline.n_stages} stages"
        )
    try:
        device = resolve_device(settings.device)
    except DeviceError as e:
        raise NodeError(str(e)) from None
    torch.set_num_threads(1)
    shapes = Shapes.of(config)
    checker = BoundaryVerifier(
        config.verification,
        boundaries,
        shapes.hidden,
        shapes.activation,
        config.swarm.seed,
        enabled=settings.verify,
        dtype=shapes.dtype,
        device=device,
        gate_boundary=n_boundaries - 1,
        vocab=shapes.vocab,
    )
    if device.type != "cpu":
        logger.info(f"verifier statistics on {device}")
    with started_node(options, stop_event) as context:
        asyncio.run(VerifierNode(context, settings, boundaries, checker).serve(on_ready))


def _certified_boundaries(options: JoinOptions) -> tuple[int, ...]:
    """The boundaries of this verifier's certificate, its default when it names some (empty otherwise)."""
    if options.certificate_path is None:
        return ()
    try:
        certificate = RoleCertificate.from_file(options.certificate_path)
    except ValueError:
        return ()  # reported, with what to do, when the node checks its admission
    return tuple(certificate.boundaries or ())


class StrikePublisher:
    """Publishes this verifier's latest verdict on each peer from a thread of its own (a DHT write can take
    seconds); records waiting for the thread are coalesced, only the newest per peer is written.

    Every ``republish_every`` seconds the standing records (the last written per peer, until it expires) are
    written again, unchanged: same time, same expiration, so a republished record means no more than it did. A
    write reaches the DHT nodes the writer can reach then; one made while a node was cut off, or blacklisted by
    the writer's DHT after a partition, is missing there, and readers whose search visits only such nodes never
    see it (a swarm healed from a partition once held two views of the same verifier's records for good).
    Rewriting is what Kademlia does for this; a node that has the record stores nothing new."""

    def __init__(self, store: RecordStore, ttl: float, republish_every: float | None = None) -> None:
        self.store, self.ttl = store, ttl
        self.republish_every = republish_every
        self._latest: dict[str, StrikeRecord] = {}
        self._standing: dict[str, StrikeRecord] = {}  # written, as written; only the publisher thread touches it
        self._lock = threading.Lock()
        self._wake: queue.Queue[None] = queue.Queue()
        self._stopped = False
        self.published = 0
        self.republished = 0
        self._thread = threading.Thread(target=self._run, name="strike-publisher", daemon=True)
        self._thread.start()

    def submit(self, record: StrikeRecord) -> None:
        with self._lock:
            self._latest[record.accused] = record
        self._wake.put(None)

    def stop(self, timeout: float = 10.0) -> None:
        """Writes what is pending (within ``timeout``), then stops."""
        self._stopped = True
        self._wake.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        due = None if self.republish_every is None else time.monotonic() + self.republish_every
        while True:
            with contextlib.suppress(queue.Empty):  # woken by a record, or the republish is due
                self._wake.get(timeout=None if due is None else max(0.0, due - time.monotonic()))
            self._drain()
            if self._stopped:
                return
            if due is not None and time.monotonic() >= due:
                self._republish()
                due = time.monotonic() + self.republish_every

    def _drain(self) -> None:
        """Writes the pending verdicts, until none is pending, so a stop never loses the last ones."""
        while True:
            with self._lock:
                pending, self._latest = self._latest, {}
            if not pending:
                return
            for record in pending.values():
                self._put(record.replace(time=get_dht_time()))

    def _republish(self) -> None:
        now = get_dht_time()
        for accused, record in list(self._standing.items()):
            self._drain()  # a rewrite can take seconds: a verdict that came meanwhile goes first, then supersedes
            if self._standing.get(accused) is not record:
                continue  # replaced by a newer verdict just written
            if record.time + self.ttl <= now + 1.0:  # about to expire: its lifetime is its writer's statement
                del self._standing[accused]
            elif self._put(record, republished=True):
                self.republished += 1

    def _put(self, record: StrikeRecord, republished: bool = False) -> bool:
        try:
            # a new record is written now: its time must fit the lifetime it claims (dht.validation), however long
            # it waited; a republished one keeps its time and so the expiration it had
            self.store.put(record, ttl=record.time + self.ttl - get_dht_time())
            self._standing[record.accused] = record
            if not republished:
                self.published += 1
            return True
        except RecordError as e:
            logger.error(f"cannot publish a strike record on {record.accused}: {e}")
        except Exception as e:  # a failing DHT must not end the thread; the next republish retries
            logger.warning(f"publishing a strike record failed ({type(e).__name__}: {e})")
        return False


class VerifierNode(Node):
    """The serving side of one verifier."""

    role = "verifier"

    def __init__(
        self, context: NodeContext, settings: VerifierOptions, boundaries: Sequence[int], checker: BoundaryVerifier
    ) -> None:
        super().__init__(context, settings.status_file)
        self.settings, self.checker = settings, checker
        self.boundaries = tuple(boundaries)
        self.shapes = Shapes.of(self.config)
        self.lane = ComputeLane("verifier")
        self.gate = Gatekeeper(self.views)
        self.stats = CheckStats()
        self.certificate = admitted_certificate(
            self.config, self.peer_id, "verifier", context.options.certificate_path, self.boundaries
        )
        # standing records are written again once an announcement's lifetime: a peer cut off for longer has dropped
        # out of every view, and comes back to find what it missed within that long again
        self.publisher = StrikePublisher(
            context.store, self.config.swarm.strike_ttl, republish_every=self.config.swarm.announce_ttl
        )
        self._published: dict[str, tuple[int, int, bool]] = {}
        self._strikes_given: dict[str, int] = {}  # each sender's strike count after its last check
        self.step_clock = StepClock()  # the global step flags are counted in (peers.step_clock)
        self.capacity = PerformanceEMA(alpha=0.3, paused=True)  # checks per CPU second it sustains
        self._reported = (0, 0.0)  # checks and CPU seconds at the last report
        self._metrics: dict[str, dict[str, float]] = {}  # each sender's metrics at its last published check
        self._thresholds: dict[str, dict[str, float]] = {}  # and their thresholds then
        self.audits = VerifierAudits(self)  # recomputation audits (sentinel_node/roles/audits.py)

    # --- lifecycle hooks

    async def prepare(self) -> None:
        # also without checking (--no-verify): a relay announces what checking would sustain here, as a verifier
        # that stopped checking would, so routes treat it as any other (peers.agreement is what notices it)
        checks, cpu_s = await self.lane.run(self._benchmark)
        self.capacity.update(checks, interval=cpu_s)
        self.views.listeners.append(self._restart_replaced)

    def _restart_replaced(self, view) -> None:
        """A stage whose every replica this verifier learned from has left, now served by another (a replica that
        moved in with fresh weights), is learned anew: its tensors would otherwise be flagged as an attack."""
        for boundary, direction in list(self.checker.monitors):
            stage = boundary if direction == "activation" else boundary + 1
            live = {a.peer_id for a in view.live_replicas(stage)}
            if self.checker.restart_if_replaced(boundary, direction, live):
                logger.info(
                    f"boundary {boundary}|{boundary + 1} {direction}s: every replica of stage {stage} it learned from "
                    "has left and another serves it; its baseline starts afresh"
                )

    def _benchmark(self, checks: int = 8) -> tuple[int, float]:
        """(checks, CPU seconds) of checking random activations on a scratch verifier of the same config: what this
        machine sustains, announced before any real traffic (the real monitors never see these tensors)."""
        scratch = BoundaryVerifier(
            self.config.verification, [0], self.shapes.hidden, self.shapes.activation, self.config.swarm.seed
        )
        started = time.thread_time()
        for index in range(checks):
            scratch.check(0, "activation", torch.randn(self.shapes.activation), f"benchmark{index % 2}", False)
        return checks, max(time.thread_time() - started, 1e-6)

    def background(self):
        return [periodically(self.config.swarm.announce_period, self._report)]

    def _report(self) -> None:
        """Announces the checks per CPU second this verifier sustains, followed over periods with traffic."""
        checks = sum(self.stats.checks.values())
        done, cpu_s = checks - self._reported[0], self.stats.cpu_s - self._reported[1]
        if done >= 2 and cpu_s > 0:
            self.capacity.update(done, interval=cpu_s)
            self._reported = (checks, self.stats.cpu_s)
        self.announcer.update(throughput=float(self.capacity.samples_per_second))
        self.write_status()

    async def add_handlers(self, server: TensorServer) -> None:
        # Tensors reach the handler unchecked (no expect, NaN allowed) so the verification core sees every
        # malformed activation and strikes its sender; the handler checks the targets itself.
        await server.add_handler(
            VERIFIER_RELAY,
            self._relay,
            PipelineRequest,
            admit=self._admit,
            authorize=self._authorize,
            require_finite=False,
            max_bytes=expected_bytes([self.shapes.hidden_spec, self.shapes.tokens]),
        )
        await self.audits.add_handler(server)

    def announcement(self) -> VerifierAnnouncement:
        return self.announced(
            VerifierAnnouncement,
            boundaries=list(self.boundaries),
            throughput=float(self.capacity.samples_per_second),
            certificate=self.certificate,
        )

    def describe_details(self) -> list[str]:
        mode = "checking" if self.checker.enabled else "relaying without checks"
        names = ", ".join(f"{b}|{b + 1}" for b in self.boundaries)
        return [
            f"verifier on boundaries {names}, {mode}; device: {self.settings.device}",
            f"check throughput: {self.capacity.samples_per_second:,.0f} checks/s (measured now)",
        ]

    def ready_line(self) -> str:
        mode = "verifying" if self.checker.enabled else "relaying without checks"
        names = ", ".join(f"{b}|{b + 1}" for b in self.boundaries)
        return f"verifier {self.peer_id} {mode} on boundaries {names}"

    async def stopping(self) -> None:
        await self.audits.stop()

    async def finish(self) -> None:
        await asyncio.to_thread(self.publisher.stop)

    def close(self) -> None:
        self.lane.close()

    def samples(self) -> list[Sample]:
        stats = self.stats
        samples = [
            Sample("sentinel_microbatches", stats.relayed, ("relayed",)),
            Sample("sentinel_microbatches", stats.malformed, ("malformed",)),
            Sample("sentinel_microbatches", stats.held, ("held",)),
            Sample("sentinel_peers_banned", len(self.checker.ledger.banned())),
        ]
        for outcome, count in self.audits.ledger.totals().items():
            if outcome != "run":
                samples.append(Sample("sentinel_audits", count, (outcome,)))
        for boundary in self.boundaries:
            for direction in ("activation", "gradient"):
                checks, flags, strikes = stats.by_boundary.get((boundary, direction), (0, 0, 0))
                labels = (str(boundary), direction)
                samples.append(Sample("sentinel_checks", checks, labels))
                samples.append(Sample("sentinel_flags", flags, labels))
                samples.append(Sample("sentinel_strikes_issued", strikes, labels))
        return samples

    def status(self) -> VerifierStatus:
        reach = self.reachability
        return VerifierStatus(
            peer_id=self.peer_id,
            boundaries=list(self.boundaries),
            verify=self.checker.enabled,
            ledger={
                sender: SenderCounts(strikes=r.strikes, checks=r.checks, flags=r.flags, banned=r.banned)
                for sender, r in self.checker.ledger.senders.items()
            },
            banned=sorted(self.checker.ledger.banned()),
            published=self.publisher.published,
            reachability=None if reach is None else ReachabilityStatus(**reach.as_dict()),
            time=time.time(),
            **self.stats.status_fields(),
            **self.audits.status_fields(),
            **NodeStatus.view_fields(self.views.view),
        )

    # --- who may call

    def _boundary_of(self, caller: str) -> int | None:
        stage = stage_of(self.views.view, caller)
        return stage if stage in self.boundaries else None

    async def _admit(self, caller: str) -> None:
        """Who may send this verifier activations (decided on the peer id alone, before reading the request)."""
        if self.checker.is_banned(caller):
            record = self.checker.ledger.senders[caller]
            raise HopBanned(f"this verifier banned {caller} after {record.strikes} strikes; it relays nothing for it")
        names = ", ".join(map(str, self.boundaries))
        await self.gate.require(
            caller,
            lambda view: self._boundary_of(caller) is not None,
            f"this verifier relays activations only from live replicas of stages {names}",
        )

    def _authorize(self, caller: str, metadata: PipelineRequest) -> None:
        if not metadata.route or metadata.route[0].boundary is not None:
            raise HopRefused("the route must name the next stage's replica after this verifier")

    # --- the relay

    async def _relay(self, incoming: Incoming[PipelineRequest]) -> Answer:
        meta, caller = incoming.metadata, incoming.caller
        boundary = self._boundary_of(caller)
        if boundary is None:  # the caller went away from the view since it was admitted
            raise HopRefused(f"{caller} is no longer a live replica of a stage this verifier serves")
        if len(incoming.tensors) != 2:
            raise HopMalformed(f"expected 2 tensors (activation, targets), got {len(incoming.tensors)}")
        activation, targets = incoming.tensors
        check_tensors([targets], [self.shapes.tokens])
        if int(targets.min()) < 0 or int(targets.max()) >= self.shapes.vocab:
            raise HopMalformed(f"targets must be token ids in [0, {self.shapes.vocab})")

        content = content_of(targets)  # near-copies of the same tokens are retries or duplicate computation
        verdict = await self._check(boundary, "activation", activation, caller, bool(meta.taint), content)
        if verdict.malformed:
            self.stats.malformed += 1
            struck = f"; a strike was recorded against {caller}" if verdict.struck else ""
            raise HopMalformed(f"activation at boundary {boundary}|{boundary + 1}: {verdict.reason}{struck}")
        if verdict.tensor is None:  # flagged and dropped by policy: the microbatch ends here
            return Answer([], MicrobatchReply(loss=None, taint=sorted({*meta.taint, boundary})))

        hop, next_meta = meta.advance()
        if verdict.flagged:
            next_meta = next_meta.tainted(boundary)
        else:
            self.audits.forwarded(meta, boundary, caller, verdict.tensor, targets)
        # Only the verifier of the last boundary names the last stage a loss ceiling, and it always sets the field:
        # a ceiling a stage wrote into the metadata it sent here never reaches the last stage.
        last = boundary == self.config.pipeline.n_stages - 2
        gate = self.checker.gate if last and meta.train and not next_meta.taint else None
        gated = None if gate is None else gate.before(content, targets)
        next_meta = next_meta.model_copy(update={"loss_ceiling": None if gated is None else gated.ceiling})
        reply = await call_hop(
            self.p2p,
            hop,
            self.views.view,
            self.blacklist,
            STAGE_FORWARD,
            [verdict.tensor, targets],
            next_meta,
            self.transport,
            nobody=f"no stage {boundary + 1} replica the route names is live and neither banned nor excluded",
            allowed=lambda peer: live_replica(self.views.view, peer, boundary + 1),
            skip=self.checker.is_banned,
            max_reply_bytes=self.shapes.activation_bytes,
            refresh=lambda: self.views.refresh(force=True),
        )
        self.stats.relayed += 1
        taint = sorted({*next_meta.taint, *reply.metadata.taint})
        loss, held = reply.metadata.loss, reply.metadata.held
        if gated is not None:
            expected = gate.expected(gated)  # what it predicted before this loss (as the simulator reports it)
            gate.after(gated, loss, held)
        else:
            expected = reply.metadata.expected
        back = MicrobatchReply(loss=loss, taint=taint, held=held, expected=expected)
        if meta.train and not verdict.flagged and not reply.tensors:
            # held back by the loss gate, or dropped further on: the flag is what this verifier can establish, not
            # what the replica that answered says (it could strip the flag to keep its work from being audited)
            held = await self.audits.unanswered(
                meta, boundary, reply.peer, taint, loss, expected, next_meta.route, claimed=held
            )
            self.stats.held += int(held)
            return Answer([], back.model_copy(update={"held": held}))
        if not meta.train or verdict.flagged or not reply.tensors:
            # nothing to pass back: a validation pass, our own replacement (its gradient says nothing about the
            # sender's computation), or a gradient dropped further on
            return Answer([], back)

        # more than one tensor is not a gradient: the core flags a non-tensor as malformed
        gradient = reply.tensors[0] if len(reply.tensors) == 1 else None
        # a middle stage's gradient is judged against rows of the one the next verifier passed back to it
        given = None if taint else await self.audits.passed_back(meta, boundary, reply.peer, next_meta.route)
        verdict = await self._check(boundary, "gradient", gradient, reply.peer, bool(taint), content, given)
        if verdict.flagged:
            taint = sorted({*taint, boundary})
            back = back.model_copy(update={"taint": taint})
        if verdict.kind is VerdictKind.PASSAGE:  # a suspicion: the replica's work on this microbatch is audited
            self.audits.failed_passage(meta, boundary, reply.peer, gradient, next_meta.route)
        if verdict.malformed:
            self.stats.malformed += 1
            logger.warning(
                f"malformed gradient from {reply.peer} at boundary {boundary}|{boundary + 1}: {verdict.reason}"
            )
            return Answer([], back)
        if verdict.tensor is None:
            return Answer([], back)
        if not verdict.flagged:
            self.audits.answered(meta, boundary, reply.peer, verdict.tensor)
        self.audits.settled(meta, boundary, taint, next_meta.route, loss, expected)
        return Answer([verdict.tensor], back)

    async def _check(
        self,
        boundary: int,
        direction: str,
        tensor: torch.Tensor | None,
        sender: str,
        tainted: bool,
        content: int,
        given: Given | None = None,
    ) -> Verdict:
        # the step as the swarm's replicas announce it (a robust median; the sender's metadata could claim any),
        # counted on while the view stands still (peers.step_clock)
        step = self.step_clock.read(self.views.view.step_estimate(), time.monotonic())
        verdict, cpu_s = await self.lane.run(
            self._timed_check, boundary, direction, tensor, sender, tainted, content, step, given
        )
        self.stats.cpu_s += cpu_s
        if verdict.skipped:
            self.stats.skipped += 1
        else:
            before = self._strikes_given.get(sender, 0)
            given = verdict.sender.strikes if verdict.sender is not None else before
            # a strike count that went down was forgiven, not given
            self.stats.count(boundary, direction, verdict.flagged, given > before)
            self._strikes_given[sender] = given
        if verdict.flagged:
            logger.info(
                f"flagged {direction} from {sender} at boundary {boundary}|{boundary + 1} in step {step}: "
                f"{verdict.reason}"
                + (f" [{verdict.evidence}]" if verdict.evidence else "")
                + (
                    f" (strikes {verdict.sender.strikes}{', banned' if verdict.banned else ''})"
                    if verdict.sender is not None
                    else ""
                )
            )
        if verdict.sender is not None:
            self._maybe_publish(boundary, direction, sender, verdict)
        return verdict

    def _timed_check(
        self,
        boundary: int,
        direction: str,
        tensor: torch.Tensor | None,
        sender: str,
        tainted: bool,
        content: int,
        step: int,
        given: Given | None = None,
    ) -> tuple[Verdict, float]:
        started = time.thread_time()
        verdict = self.checker.check(boundary, direction, tensor, sender, tainted, content, step, given)
        return verdict, time.thread_time() - started

    def _maybe_publish(self, boundary: int, direction: str, sender: str, verdict: Verdict) -> None:
        record = verdict.sender
        state = (record.strikes, record.flags, record.banned)
        if self._published.get(sender, (0, 0, False)) == state:
            return
        self._published[sender] = state
        # records hold finite numbers only (readers refuse others); a score that large says all there is to say
        metrics = {
            name: max(-1e12, min(1e12, float(value))) for name, value in verdict.scores.items() if math.isfinite(value)
        }
        thresholds = {
            name: max(-1e12, min(1e12, float(value)))
            for name, value in verdict.thresholds.items()
            if math.isfinite(value)
        }
        self.publish_record(boundary, direction, sender, record, metrics, thresholds)
        if record.banned:
            logger.warning(f"banned {sender} after {record.strikes} strikes; voting for its exclusion")

    def publish_record(
        self,
        boundary: int,
        direction: str,
        sender: str,
        record,
        metrics: dict[str, float] | None = None,
        thresholds: dict[str, float] | None = None,
    ) -> None:
        """Publishes this verifier's standing verdict on ``sender`` (its statistics and its audits); ``metrics``
        and ``thresholds`` default to those of its last check."""
        self._published[sender] = (record.strikes, record.flags, record.banned)
        metrics = self._metrics.setdefault(sender, {}) if metrics is None else metrics
        self._metrics[sender] = metrics
        thresholds = self._thresholds.setdefault(sender, {}) if thresholds is None else thresholds
        self._thresholds[sender] = thresholds
        self.publisher.submit(
            StrikeRecord(
                verifier=self.peer_id,
                accused=sender,
                boundary=boundary,
                direction=direction,
                strikes=record.strikes,
                checks=record.checks,
                flags=record.flags,
                metrics=metrics,
                thresholds=thresholds,
                banned=record.banned,
                certificate=self.certificate,
                config_hash=self.config.swarm_hash(),
                version=software_version(),
                time=get_dht_time(),
                **self.audits.record_fields(sender),
            )
        )
