"""Recomputation audits on the network (the comparison: :mod:`sentinel_node.verification.audit`; the case, the
judge and the cache, shared with the simulator: :mod:`sentinel_node.pipeline.audits` and
:mod:`sentinel_node.pipeline.relay_cache`).

- A stage replica serves ``sentinel.stage.recompute`` (:class:`StageRecompute`) to the live verifiers of the
  boundaries around it only: its work on a microbatch recomputed with its reference parameters (never its own),
  in its compute lane once that is idle (or after half the request's time), so its pending microbatches and
  accumulated gradients are untouched and training comes first.
- A verifier keeps what it relayed (:class:`~sentinel_node.pipeline.relay_cache.RelayCache`), serves
  ``sentinel.verifier.crossing`` to the verifiers of the boundary below (who audit the stage between them), and
  runs audits (:class:`VerifierAudits`): when a microbatch settles at its boundary b (it passed the gradient back,
  so stage b+1 has answered), it draws, with randomness of its own, whether to audit stage b+1 (and, on boundary 0,
  stage 0); an audit runs as a background task, never on the relay's path, at most ``audit_queue`` at once, each
  dropped after ``audit_timeout`` seconds.

Who draws and when: the verifier below the stage, after the stage answered, from the operating system's randomness;
nothing about the draw is sent anywhere until the recompute request, which goes to another replica, so the audited
stage cannot influence or observe the choice before it answered (docs/decisions.md, "Recomputation audits").
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

import torch
from hivemind.utils import get_logger

from sentinel_node.attacks import StageContext
from sentinel_node.pipeline.audits import AuditCase, AuditJudge, AuditResult, Recomputation, assemble
from sentinel_node.pipeline.recompute import NoReference, ReferenceVersion
from sentinel_node.pipeline.relay_cache import AuditDraw, Crossing, RelayCache
from sentinel_node.roles.views import live_verifier
from sentinel_node.roles.wire import (
    STAGE_RECOMPUTE,
    VERIFIER_CROSSING,
    CrossingReply,
    CrossingRequest,
    PipelineRequest,
    RecomputeReply,
    RecomputeRequest,
)
from sentinel_node.transport import (
    Answer,
    Hop,
    HopError,
    HopMalformed,
    HopRefused,
    HopUnavailable,
    Incoming,
    TensorServer,
    call_peer,
    expected_bytes,
)
from sentinel_node.verification.audit import AuditLedger, AuditOutcome, Drift, Work
from sentinel_node.verification.losses import LossEvidence
from sentinel_node.verification.passage import Given

if TYPE_CHECKING:
    from sentinel_node.roles.stage import StageNode
    from sentinel_node.roles.verifier import VerifierNode

logger = get_logger(__name__)

# A recompute request waits for the stage's compute lane to go idle at most this long (or half its time).
IDLE_WAIT_S = 5.0
# A verifier asks the next one whether a microbatch that came back without a gradient was held, this long at most.
CONFIRM_TIMEOUT_S = 5.0
# A verifier waits for the rows of the gradient the next verifier passed back this long at most before it judges a
# middle stage's gradient without them (the backward pass waits on it: a round trip and a few hundred KiB).
PASSAGE_TIMEOUT_S = 2.0
# Evidence of failed audits a verifier keeps for its status file.
KEPT_EVIDENCE = 16


class StageRecompute:
    """A stage replica's side of audits."""

    def __init__(self, node: StageNode) -> None:
        self.node = node
        self.stats = Counter()  # served, unavailable
        self.cpu_s = 0.0  # CPU time of the recomputations (the compute lane's thread)

    async def add_handler(self, server: TensorServer) -> None:
        full = self._expect(RecomputeRequest(deadline=0, microbatch_id="size", step=0))
        await server.add_handler(
            STAGE_RECOMPUTE,
            self._serve,
            RecomputeRequest,
            authorize=self._admit,
            expect=self._expect,
            max_bytes=expected_bytes(full),
        )

    def boundaries(self) -> list[int]:
        """The boundaries around this stage: their verifiers may ask."""
        stage, n_boundaries = self.node.stage, self.node.n_stages - 1
        return [b for b in (stage - 1, stage) if 0 <= b < n_boundaries]

    def _expect(self, request: RecomputeRequest):
        shapes, worker = self.node.shapes, self.node.worker
        if worker.is_first:
            return [shapes.tokens]
        if worker.is_last:
            return [shapes.hidden_spec, shapes.tokens]
        return [shapes.hidden_spec] if request.forward_only else [shapes.hidden_spec, shapes.hidden_spec]

    async def _admit(self, caller: str, metadata: RecomputeRequest) -> None:
        boundaries = self.boundaries()
        names = " or ".join(f"{b}|{b + 1}" for b in boundaries)
        await self.node.gate.require(
            caller,
            lambda view: any(live_verifier(view, caller, b) for b in boundaries),
            f"stage {self.node.stage} recomputes only for live verifiers of boundary {names}",
        )

    async def _serve(self, incoming: Incoming[RecomputeRequest]) -> Answer:
        node, meta = self.node, incoming.metadata
        worker = node.worker
        if worker.is_last and (
            int(incoming.tensors[1].min()) < 0 or int(incoming.tensors[1].max()) >= node.shapes.vocab
        ):
            raise HopRefused(f"targets must be token ids in [0, {node.shapes.vocab})")
        if worker.is_first and (
            int(incoming.tensors[0].min()) < 0 or int(incoming.tensors[0].max()) >= node.shapes.vocab
        ):
            raise HopRefused(f"tokens must be ids in [0, {node.shapes.vocab})")
        await node.lane.wait_idle(min(IDLE_WAIT_S, incoming.time_left() / 2))
        try:
            work, version, drift = await node.lane.run(self._recompute, meta.step, incoming.tensors)
            if node.lies_in_audits is not None:  # a red-team replica
                inputs, other = incoming.tensors[0], incoming.tensors[-1]
                context = StageContext(inputs=inputs, grad_output=other if other.is_floating_point() else None)
                work = node.lies_in_audits(work, meta.step, context)
        except NoReference as e:
            self.stats["unavailable"] += 1
            logger.debug(f"stage {node.stage}: no recomputation for microbatch {meta.microbatch_id}: {e}")
            return Answer([], RecomputeReply(available=False))
        self.stats["served"] += 1
        tensors = [
            t for t in (work.output, work.embedding if worker.is_first else None, work.grad_input) if t is not None
        ]
        return Answer(
            tensors,
            RecomputeReply(
                available=True,
                round_step=version.round_step,
                applies_from=version.applies_from,
                digest=version.digest,
                members=None if version.members is None else list(version.members),
                drift_steps=drift.steps,
                drift={d: min(float(e), 1e9) for d, e in drift.errors.items() if math.isfinite(e)},
            ),
        )

    def _recompute(self, step: int, tensors: list[torch.Tensor]) -> tuple[Work, ReferenceVersion, Drift]:
        started = time.thread_time()
        try:
            return self._recompute_with(step, tensors)
        finally:
            self.cpu_s += time.thread_time() - started

    def _recompute_with(self, step: int, tensors: list[torch.Tensor]) -> tuple[Work, ReferenceVersion, Drift]:
        worker = self.node.worker
        if worker.is_first:
            return worker.recompute(step, tensors[0])
        if worker.is_last:
            return worker.recompute(step, tensors[0], targets=tensors[1])
        return worker.recompute(step, tensors[0], grad_output=tensors[1] if len(tensors) > 1 else None)


class VerifierAudits:
    """A verifier's side of audits: its relay cache, the crossing handler, the draw and the audits themselves."""

    def __init__(self, node: VerifierNode) -> None:
        self.node = node
        config = node.config.verification
        self.config = config
        self.n_stages = node.config.pipeline.n_stages
        self.cache = RelayCache(int(config.audit_cache_mib * 2**20))
        self.draw = AuditDraw(
            config.audit_rate, probation_rate=config.probation_audit_rate, suspect_rate=config.suspect_audit_rate
        )
        self.ledger = AuditLedger(config.audit_refusal_limit)
        self.judge = AuditJudge(
            config.audit_tolerances(), node.checker.ledger, self.ledger, self.cache.completed_between
        )
        self.tasks: set[asyncio.Task] = set()
        self.rows = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)  # passage rows
        self.stats = Counter()  # drawn, busy, timed_out, incomplete, incomparable, no_auditor
        self.failures: deque[dict] = deque(maxlen=KEPT_EVIDENCE)
        self.evidence: dict[str, dict] = {}  # accused -> evidence of its last failed audit (for its strike record)
        self.losses: dict[tuple[int, int], LossEvidence] = {}  # (boundary, audited stage) -> higher-loss evidence

    @property
    def enabled(self) -> bool:
        return self.node.checker.enabled and self.node.settings.audit and self.config.audit_rate > 0

    async def add_handler(self, server: TensorServer) -> None:
        await server.add_handler(VERIFIER_CROSSING, self._serve_crossing, CrossingRequest, authorize=self._admit)

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    # --- the relay's hooks (cheap, synchronous: the relay never waits for an audit)

    def forwarded(
        self,
        meta: PipelineRequest,
        boundary: int,
        sender: str,
        activation: torch.Tensor,
        targets: torch.Tensor,
    ) -> None:
        """The activation ``sender`` (a stage ``boundary`` replica) sent was checked and is passed on as is."""
        if not self.enabled or not meta.train or meta.taint:
            return
        tokens = None
        if boundary == 0 and len(meta.first_tokens) == targets.shape[0]:
            first = torch.tensor(meta.first_tokens, dtype=targets.dtype).unsqueeze(1)
            tokens = torch.cat([first, targets[:, :-1]], dim=1)  # targets are the inputs shifted by one
        last_boundary = boundary == self.n_stages - 2
        self.cache.open(
            Crossing(
                meta.microbatch_id,
                meta.step,
                boundary,
                sender,
                activation,
                targets=targets if last_boundary else None,
                tokens=tokens,
            )
        )

    def _suspect(self, peer: str, boundary: int, direction: str) -> bool:
        """Whether ``peer`` holds a strike here or in a record another verifier published (a replica flagged at
        the next boundary, its activations, is audited at this one, whose gradients it sends, all the same), or
        this verifier's peer test has gathered `suspect_evidence` against what it sends across ``boundary``."""
        checker = self.node.checker
        if checker.ledger.suspect(peer):
            return True
        if checker.suspicious(peer, boundary, direction, self.config.suspect_evidence):
            return True
        return any(record.strikes > 0 for record in self.node.views.view.ledger.about(peer))

    def _losses(self, boundary: int, stage: int) -> LossEvidence:
        key = (boundary, stage)
        if key not in self.losses:
            c = self.config
            self.losses[key] = LossEvidence(c.peer_pool, c.loss_kappa, c.loss_limit, c.loss_evidence, c.max_senders)
        return self.losses[key]

    def answered(self, meta: PipelineRequest, boundary: int, receiver: str, gradient: torch.Tensor) -> None:
        """``receiver`` (a stage ``boundary + 1`` replica) answered with ``gradient``, passed back as is: it ran its
        backward pass."""
        if not self.enabled or not meta.train:
            return
        self.cache.answer(meta.microbatch_id, boundary, receiver, gradient)
        self.cache.completed(receiver, meta.step)

    def settled(
        self,
        meta: PipelineRequest,
        boundary: int,
        taint: list[int],
        route: list[Hop],
        loss: float | None = None,
        expected: float | None = None,
    ) -> None:
        """The gradient goes back to the stage ``boundary`` replica: the microbatch is complete here, with the
        ``loss`` the last stage reported (and the loss its text predicts, ``expected``). Adds the loss to the
        evidence about the replicas it audits and draws audits of stage ``boundary + 1`` (and of stage 0 on
        boundary 0); ``route`` holds the hops after the stage ``boundary + 1`` replica (first: the verifier of the
        next boundary)."""
        if not self.enabled or not meta.train:
            return
        crossing = self.cache.settle(meta.microbatch_id, boundary, tainted=bool(taint))
        if crossing is None or crossing.tainted or crossing.gradient is None:
            return
        if boundary == 0:
            self.cache.completed(crossing.sender, meta.step)
        stages = [boundary + 1] + ([0] if boundary == 0 else [])
        ledger = self.node.checker.ledger
        for stage in stages:
            audited = crossing.receiver if stage == boundary + 1 else crossing.sender
            probation = audited is not None and ledger.on_probation(audited)
            direction = "gradient" if stage == boundary + 1 else "activation"  # what this verifier checks of it
            if audited is not None:
                self._losses(boundary, stage).observe(audited, loss, expected)
            suspect = audited is not None and (
                self._suspect(audited, boundary, direction) or self._losses(boundary, stage).suspicious(audited)
            )
            if not self.draw(probation=probation, suspect=suspect):
                continue
            self.stats["drawn"] += 1
            next_verifier = route[0] if route and stage == boundary + 1 and stage < self.n_stages - 1 else None
            self._start(stage, meta.microbatch_id, next_verifier)

    async def unanswered(
        self,
        meta: PipelineRequest,
        boundary: int,
        receiver: str,
        taint: list[int],
        loss: float | None,
        expected: float | None,
        route: list[Hop],
        claimed: bool,
    ) -> bool:
        """A training microbatch this verifier passed on came back from ``receiver`` (the stage ``boundary + 1``
        replica that answered) without a gradient: the last stage held its update back (the loss gate), or a verifier
        further on dropped it. Returns whether it was held, as this verifier can establish it: from the last stage,
        its word (``claimed``); from any other, what the next verifier on the route (``route[0]``) recorded, since the
        replica between the two could strip the flag from the reply to keep its own work from being audited; the
        word of the reply itself is kept too (a verifier that does not audit records nothing to ask). A held
        microbatch that this verifier can establish is settled here (:meth:`_held`)."""
        if not self.enabled or not meta.train:
            return claimed
        if boundary == self.n_stages - 2:
            confirmed = claimed and not taint
        else:
            below = self.cache.get(meta.microbatch_id, boundary)
            try:
                above = await asyncio.wait_for(
                    self._fetch(meta.microbatch_id, boundary + 1, route[0] if route else None, below),
                    CONFIRM_TIMEOUT_S,
                )
            except asyncio.TimeoutError:
                above = None
            confirmed = above is not None and above.held and above.sender == receiver
        if confirmed:
            self._held(meta, boundary, receiver, loss, expected, route)
        return claimed or confirmed

    async def passed_back(self, meta: PipelineRequest, boundary: int, receiver: str, route: list[Hop]) -> Given | None:
        """Rows of the gradient the verifier of ``boundary + 1`` (``route[0]``) passed back to ``receiver``, a middle
        stage replica whose input gradient this verifier is about to judge (its passage, :mod:`passage`). The rows
        are drawn here, at random, per microbatch: the stage cannot know which will be compared. A verifier that
        relayed the next boundary itself (it serves both) reads them from its own relay cache. None where there is
        nothing to compare: the last stage (the loss gave it its gradient), no next verifier, audits off (verifiers
        keep no crossings), a reply that does not come within ``PASSAGE_TIMEOUT_S``, or one about another sender."""
        if not self.enabled or not meta.train or boundary + 1 >= self.n_stages - 1 or not route:
            return None
        if self.node.config.verification.passage_floor <= 0:
            return None
        batch, seq, hidden = self.node.shapes.activation
        n_rows = self.node.config.verification.passage_rows
        n_rows = batch * seq if n_rows <= 0 else min(n_rows, batch * seq)
        rows = torch.randperm(batch * seq, generator=self.rows)[:n_rows].sort().values
        local = self.cache.get(meta.microbatch_id, boundary + 1)
        # this verifier may serve the next boundary too, and have relayed the microbatch there itself
        if (
            local is not None
            and local.settled
            and not local.tainted
            and local.gradient is not None
            and local.sender == receiver
            and tuple(local.gradient.shape) == (batch, seq, hidden)
        ):
            self.stats["passage_rows"] += 1
            return Given(local.gradient.reshape(-1, hidden)[rows].float(), rows)
        request = CrossingRequest(
            deadline=time.time() + PASSAGE_TIMEOUT_S,
            microbatch_id=meta.microbatch_id,
            boundary=boundary + 1,
            rows=rows.tolist(),
        )
        hop = route[0]
        for peer in dict.fromkeys([hop.peer_id, *hop.alternates]):
            if peer == self.node.peer_id:
                continue
            try:
                reply = await asyncio.wait_for(
                    call_peer(
                        self.node.p2p,
                        peer,
                        VERIFIER_CROSSING,
                        [],
                        request,
                        settings=self.node.transport,
                        reply_model=CrossingReply,
                        expect=None,
                        stream=n_rows * hidden * 4 > self.node.transport.stream_threshold_bytes,
                        max_reply_bytes=n_rows * hidden * 4,
                    ),
                    PASSAGE_TIMEOUT_S,
                )
            except (HopError, asyncio.TimeoutError) as e:
                logger.debug(f"passed-back rows of {meta.microbatch_id}@{boundary + 1} from {peer}: {e!r}")
                continue
            found = reply.metadata
            if not found.found or found.held or found.sender != receiver or len(reply.tensors) != 1:
                continue  # not relayed there (an alternate relayed it), or not the replica that answered here
            values = reply.tensors[0]
            if tuple(values.shape) != (n_rows, hidden) or not values.is_floating_point():
                continue
            self.stats["passage_rows"] += 1
            return Given(values.float(), rows)
        self.stats["passage_missing"] += 1
        return None

    def failed_passage(
        self, meta: PipelineRequest, boundary: int, receiver: str, gradient: torch.Tensor, route: list[Hop]
    ) -> None:
        """``gradient``, the answer of ``receiver`` (a middle stage replica), failed its passage and was dropped: a
        suspicion, not a strike, since a replica computing honestly on parameters an attacker disturbed through
        averaging fails it too. Its work on this very microbatch is audited as a suspect's is (the crossing is kept
        as the stages sent it; the rows it was judged on came from ``route[0]``, which holds the other half): a
        failed audit, confirmed by a second auditor, bans; one the auditors bear out clears it."""
        if not self.enabled or not meta.train or not route:
            return
        crossing = self.cache.suspected(meta.microbatch_id, boundary, receiver, gradient)
        if crossing is None or not self.draw(suspect=True):
            return
        self.stats["drawn"] += 1
        self.stats["passage_drawn"] += 1
        self._start(boundary + 1, meta.microbatch_id, route[0])

    def _held(
        self,
        meta: PipelineRequest,
        boundary: int,
        receiver: str,
        loss: float | None,
        expected: float | None,
        route: list[Hop],
    ) -> None:
        """The microbatch was held back: the forward half of the crossing is all there is. The loss is evidence
        about the replicas this verifier audits, and each of them that sent an output (stage ``boundary + 1`` below
        the last, stage 0 on boundary 0) is audited on it as a suspect is: the gate saw damage, an audit says
        whose."""
        crossing = self.cache.hold(meta.microbatch_id, boundary, receiver)
        if crossing is None or crossing.tainted:
            return
        stages = [boundary + 1] + ([0] if boundary == 0 else [])
        for stage in stages:
            audited = receiver if stage == boundary + 1 else crossing.sender
            self._losses(boundary, stage).observe(audited, loss, expected)
            if stage == self.n_stages - 1 or not self.draw(suspect=True):
                continue  # the last stage sends no output: a forward pass alone leaves nothing of it to check
            self.stats["drawn"] += 1
            self.stats["held_drawn"] += 1
            next_verifier = route[0] if route and stage == boundary + 1 else None
            self._start(stage, meta.microbatch_id, next_verifier)

    def _start(self, stage: int, microbatch: str, next_verifier: Hop | None) -> None:
        if len(self.tasks) >= self.config.audit_queue:
            self.stats["busy"] += 1  # a verifier short of capacity audits less, it never waits
            return
        task = asyncio.create_task(self._audit(stage, microbatch, next_verifier))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # --- the crossing handler

    async def _admit(self, caller: str, metadata: CrossingRequest) -> None:
        below = metadata.boundary - 1
        await self.node.gate.require(
            caller,
            lambda view: below >= 0 and live_verifier(view, caller, below),
            f"crossings of boundary {metadata.boundary} go only to live verifiers of boundary {below}|{below + 1}",
        )

    async def _serve_crossing(self, incoming: Incoming[CrossingRequest]) -> Answer:
        meta = incoming.metadata
        crossing = self.cache.get(meta.microbatch_id, meta.boundary)
        if crossing is None or not crossing.settled or crossing.tainted or crossing.dropped:
            return Answer([], CrossingReply(found=False))
        if crossing.held:
            reply = CrossingReply(
                found=True, step=crossing.step, sender=crossing.sender, receiver=crossing.receiver, held=True
            )
            return Answer([crossing.activation], reply)
        if crossing.gradient is None:
            return Answer([], CrossingReply(found=False))
        reply = CrossingReply(found=True, step=crossing.step, sender=crossing.sender, receiver=crossing.receiver)
        if meta.rows is not None:  # the verifier below judges the passage of the stage between us on these rows
            flat = crossing.gradient.reshape(-1, crossing.gradient.shape[-1])
            if max(meta.rows) >= flat.shape[0]:
                raise HopMalformed(f"rows must index the {flat.shape[0]} rows of the gradient (token positions)")
            return Answer([flat[torch.tensor(meta.rows)].contiguous()], reply)
        return Answer([crossing.activation, crossing.gradient], reply)

    # --- one audit, in the background

    async def _audit(self, stage: int, microbatch: str, next_verifier: Hop | None) -> None:
        try:
            await asyncio.wait_for(self._run(stage, microbatch, next_verifier), self.config.audit_timeout)
        except asyncio.TimeoutError:
            self.stats["timed_out"] += 1  # dropped, never retried
            logger.info(f"audit of stage {stage} on microbatch {microbatch} timed out; dropped")
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.warning(f"audit of stage {stage} on microbatch {microbatch} failed", exc_info=True)

    async def _run(self, stage: int, microbatch: str, next_verifier: Hop | None) -> None:
        below = self.cache.get(microbatch, stage - 1) if stage > 0 else None
        if stage == self.n_stages - 1:
            above = None
        elif stage == 0:
            above = self.cache.get(microbatch, 0)
        else:
            above = await self._fetch(microbatch, stage, next_verifier, below)
        case = assemble(stage, self.n_stages, below, above)
        if case is None:
            self.stats["incomplete"] += 1
            return
        view = self.node.views.view
        live = [a.peer_id for a in view.live_replicas(stage) if a.peer_id != case.audited]
        candidates = self.draw.shuffle(live)
        if not candidates:
            self.stats["no_auditor"] += 1
            return
        first, rest = await self._recompute(case, candidates, None)
        if first is None:
            self.stats["incomparable"] += 1
            return
        judge = self.judge
        recomputations, comparisons = [first], [judge.compare(case, first)]
        while judge.wants_another(recomputations, comparisons):
            another, rest = await self._recompute(case, rest, first.version.round_step)
            if another is None:
                break
            recomputations.append(another)
            comparisons.append(judge.compare(case, another))
        self._after(judge.settle(case, recomputations, comparisons))

    async def _fetch(self, microbatch: str, boundary: int, hop: Hop | None, below: Crossing | None) -> Crossing | None:
        """The crossing of ``boundary`` from the verifier that relayed it (this one, or the route's next)."""
        local = self.cache.get(microbatch, boundary)
        if local is not None:
            return local
        if hop is None or below is None:
            return None
        request = CrossingRequest(
            deadline=time.time() + self.config.audit_timeout, microbatch_id=microbatch, boundary=boundary
        )
        for peer in dict.fromkeys([hop.peer_id, *hop.alternates]):
            if peer == self.node.peer_id:
                continue
            try:
                reply = await call_peer(
                    self.node.p2p,
                    peer,
                    VERIFIER_CROSSING,
                    [],
                    request,
                    settings=self.node.transport,
                    reply_model=CrossingReply,
                    expect=None,
                    stream=True,
                )
            except HopError as e:
                logger.debug(f"crossing {microbatch}@{boundary} from {peer}: {e.code}: {e.detail}")
                continue
            meta = reply.metadata
            if not meta.found or len(reply.tensors) != (1 if meta.held else 2):
                continue
            if meta.sender is None or meta.receiver is None:
                continue
            activation, gradient = reply.tensors[0], None if meta.held else reply.tensors[1]
            if tuple(activation.shape) != self.node.shapes.activation:
                continue
            if gradient is not None and gradient.shape != activation.shape:
                continue
            crossing = Crossing(microbatch, meta.step, boundary, meta.sender, activation, receiver=meta.receiver)
            crossing.gradient, crossing.settled, crossing.held = gradient, True, meta.held
            return crossing
        return None

    async def _recompute(
        self, case: AuditCase, candidates: list[str], round_step: int | None
    ) -> tuple[Recomputation | None, list[str]]:
        """The first candidate's recomputation that the audited replica can be compared with (and, given
        ``round_step``, from that averaging round), with the candidates after it. Refusals and failures are noted
        against the auditor (repeated ones are a strike)."""
        tensors = [case.inputs]
        if case.grad_output is not None and case.stage > 0:  # stage 0 recomputes its forward alone: no gradient in
            tensors.append(case.grad_output)  # (its handler takes exactly the tensors it uses, transport/server.py)
        if case.targets is not None:
            tensors.append(case.targets)
        # a middle stage's case without an output gradient: a microbatch the loss gate held back
        forward_only = case.grad_output is None and case.targets is None and case.inputs.is_floating_point()
        request = RecomputeRequest(
            deadline=time.time() + self.config.audit_timeout / 2,
            microbatch_id=case.microbatch,
            step=case.step,
            forward_only=forward_only,
        )
        for index, peer in enumerate(candidates):
            try:
                reply = await call_peer(
                    self.node.p2p,
                    peer,
                    STAGE_RECOMPUTE,
                    tensors,
                    request,
                    settings=self.node.transport,
                    reply_model=RecomputeReply,
                    require_finite=False,
                    stream=True,
                )
            except HopError as e:
                logger.info(f"auditor {peer} did not recompute microbatch {case.microbatch}: {e.code}: {e.detail}")
                # a peer that cannot be reached, or answers too late (HopDeadlineExceeded is one), is gone or busy,
                # not refusing: a replica killed in a swarm test stayed in the audit draw until its announcement
                # expired, and was struck for the dials that failed
                if not isinstance(e, HopUnavailable) and self.judge.refused(peer):
                    self._publish_strike(peer, case, "auditor refusals")
                continue
            meta = reply.metadata
            if not meta.available:
                continue
            version = ReferenceVersion(
                meta.round_step, meta.applies_from, meta.digest, None if meta.members is None else tuple(meta.members)
            )
            if not version.includes(case.audited) or (round_step is not None and version.round_step != round_step):
                continue
            work = self._work(case, reply.tensors)
            if work is None:
                if self.judge.refused(peer):
                    self._publish_strike(peer, case, "malformed recomputations")
                continue
            drift = Drift(meta.drift_steps, dict(meta.drift))
            return Recomputation(peer, work, version, drift), candidates[index + 1 :]
        return None, []

    def _work(self, case: AuditCase, tensors: list[torch.Tensor]) -> Work | None:
        shape = self.node.shapes.activation
        if any(tuple(t.shape) != shape or t.dtype != torch.float32 for t in tensors):
            return None
        if case.stage == 0:
            return Work(output=tensors[0], embedding=tensors[1]) if len(tensors) == 2 else None
        if case.stage == self.n_stages - 1:
            return Work(grad_input=tensors[0]) if len(tensors) == 1 else None
        if case.grad_output is None:  # a held microbatch: the output alone
            return Work(output=tensors[0]) if len(tensors) == 1 else None
        return Work(output=tensors[0], grad_input=tensors[1]) if len(tensors) == 2 else None

    # --- what an audit leaves behind

    def _after(self, result: AuditResult) -> None:
        case, outcome = result.case, result.outcome
        if outcome is not AuditOutcome.PASSED:
            self.failures.append({**result.evidence, "audited": case.audited, "outcome": outcome.value})
        if outcome is AuditOutcome.CONVICTED:
            self.evidence[case.audited] = result.evidence
            logger.warning(
                f"audit convicted {case.audited} (stage {case.stage}) on microbatch {case.microbatch}: "
                f"{result.first.finding.value} {result.first.direction}, error {result.first.error:.3g} "
                f"(auditors {', '.join(result.auditors)}); banning it"
            )
        elif outcome is not AuditOutcome.PASSED:
            logger.info(
                f"audit of {case.audited} on microbatch {case.microbatch}: {outcome.value} "
                f"(auditors {', '.join(result.auditors)}, first error {result.first.error:.3g}); no strike for it"
            )
        self._publish(case.audited, case, result.first.direction)
        for auditor in result.contradicted:
            self._publish_strike(auditor, case, "a recomputation two other replicas contradicted")

    def _publish_strike(self, peer: str, case: AuditCase, why: str) -> None:
        logger.info(f"a strike for auditor {peer} ({why})")
        self._publish(peer, case, "activation" if case.stage < self.n_stages - 1 else "gradient")

    def _publish(self, peer: str, case: AuditCase, direction: str) -> None:
        self.node.publish_record(max(0, case.stage - 1), direction, peer, self.node.checker.ledger.peek(peer))

    def record_fields(self, peer: str) -> dict:
        """The audit fields of ``peer``'s strike record."""
        counts = self.ledger.peers.get(peer)
        return {
            "audits_passed": counts.passed if counts else 0,
            "audits_failed": counts.failed if counts else 0,
            "audit": self.evidence.get(peer),
        }

    def status_fields(self) -> dict:
        totals = self.ledger.totals()
        return {
            "audits": {**totals, **{k: int(v) for k, v in self.stats.items()}},
            "audit_failures": list(self.failures),
        }
