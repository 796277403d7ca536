"""A stage replica's state across restarts and joins: the checkpoints it keeps in ``--state-dir``, the state it
takes from a live replica before it serves, and the state it gives replicas that join later.

Parameters change only under :attr:`ReplicaState.lock` (the optimizer step and the merge of an averaging round), so
a state shared with a joining replica is never half a step. A periodic checkpoint is a copy taken between steps and
written by a thread of its own, so the replica serves on while it reaches the disk; the one on shutdown is written
at once.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from hivemind.utils import get_logger

from sentinel_node.pipeline import StageWorker
from sentinel_node.pipeline.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    CheckpointWriteError,
    capture_state,
    load_checkpoint,
    restore_state,
    snapshot_state,
    write_checkpoint,
)
from sentinel_node.pipeline.state_transfer import pack_state, unpack_state
from sentinel_node.roles.averaging import ReplicaAverager
from sentinel_node.roles.common import NodeError
from sentinel_node.roles.compute import ComputeLane

logger = get_logger(__name__)

# Joining: how long one replica's state may take to arrive, and how many rounds over the live replicas to try.
STATE_DOWNLOAD_TIMEOUT_S = 60.0
STATE_DOWNLOAD_ROUNDS = 3
# After those rounds, a replica whose own state is behind the swarm's keeps asking this long in all (then gives up
# as before), pausing twice as long each time up to the cap: long enough for a busy replica at a load average of 20
# to answer, short enough that a replica nobody can serve says so within minutes.
STATE_SYNC_PATIENCE_S = 300.0
STATE_SYNC_MAX_PAUSE_S = 30.0


class Behind(enum.Enum):
    """What a replica whose state is older than the swarm's step does before it serves (:func:`when_behind`)."""

    SERVE = "serve"  # not behind, or behind only because the swarm trained on while it downloaded a live state
    ADOPT_UNCOVERED = "adopt_uncovered"  # fresh weights on a stage no live replica holds: nothing newer exists
    ADOPT_LAST = "adopt_last"  # its own latest checkpoint on a stage no live replica holds: what a kill left
    ADOPT_TOLD = "adopt_told"  # --resume-behind
    REFUSE = "refuse"


def when_behind(
    last_step: int,
    swarm_step: int,
    *,
    resumed: bool,
    synced: bool,
    others: bool,
    resume_behind: bool,
    checkpoint_every: int,
) -> Behind:
    """Whether a replica at `last_step` may serve at the swarm's `swarm_step` (`resumed`: from its own checkpoint;
    `synced`: from a live replica's state; `others`: other live replicas of its stage exist).

    A state older than the swarm's is refused (issue 16: a restart from a checkpoint that a disk had lost the newer
    ones of served a state 944 steps old as current), with three exceptions that leave no newer state anywhere to
    take: fresh weights on a stage nobody else holds; a checkpoint fewer than `checkpoint_every` steps behind on such a
    stage (a replica killed after it lost the steps since, and nobody has them: the churn soak's only replica of a
    stage, SIGKILLed and restarted 3 steps behind, refused and left the stage uncovered for good); and being told."""
    if last_step >= swarm_step or synced:
        return Behind.SERVE
    if not others and not resumed:
        return Behind.ADOPT_UNCOVERED
    if not others and swarm_step - last_step < checkpoint_every:
        return Behind.ADOPT_LAST
    return Behind.ADOPT_TOLD if resume_behind else Behind.REFUSE


class ReplicaState:
    """The global step a replica's parameters are at, and what saves, restores and shares them."""

    def __init__(
        self, worker: StageWorker, config_hash: str, state_dir: str | None = None, checkpoint_every: int = 10
    ) -> None:
        self.worker, self.config_hash, self.state_dir = worker, config_hash, state_dir
        self.stage = worker.stage
        self.lock = threading.Lock()
        self.step = -1  # the global step the parameters are at
        self.resumed_from: int | None = None  # the checkpoint's step this replica started from
        self.synced_from: str | None = None  # the replica whose state this one took last (joining, or after a gap)
        self.resyncs = 0  # states taken after this replica missed steps while it served (cut off from the swarm)
        self.saved = 0
        self.failed = 0  # checkpoints that could not be written
        self.problem: str | None = None  # why the last one could not be written, until one is
        self.policy = CheckpointPolicy(checkpoint_every) if state_dir is not None else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"checkpoints{self.stage}")
        self._writing: Future | None = None

    # --- checkpoints

    def resume(self) -> int | None:
        """Loads the newest checkpoint of ``state_dir`` (None without one); NodeError for an unusable one."""
        if self.state_dir is None:
            return None
        try:
            resumed = load_checkpoint(self.worker, self.state_dir, self.config_hash)
        except CheckpointError as e:
            raise NodeError(str(e)) from None
        if resumed is not None:
            self.step = self.resumed_from = self.policy.last_saved = resumed
        return resumed

    def save(self, force: bool = True) -> None:
        """Checkpoints the current step: when due, in the background (skipped while the last one is still being
        written); with ``force`` (shutdown), now. A failure is logged, not raised. Call it where the parameters are
        not in use (the stage's compute lane)."""
        policy, step = self.policy, self.step
        if policy is None or step < 0 or step == policy.last_saved or not (force or policy.due(step)):
            return
        if not force and self._writing is not None and not self._writing.done():
            logger.info(f"stage {self.stage}: the last checkpoint is still being written; skipping step {step}")
            return
        self.flush()
        payload = snapshot_state(self.worker, step, self.config_hash)
        previous = policy.last_saved
        policy.saved(step)
        self._writing = self._writer.submit(self._write, payload, previous)
        if force:
            self.flush()

    def _write(self, payload: dict[str, Any], previous: int | None) -> None:
        try:
            write_checkpoint(payload, self.state_dir)
        except Exception as e:  # a full disk, a lost mount: the replica serves on and tries again
            problem = str(e) if isinstance(e, CheckpointWriteError) else f"{type(e).__name__}: {e}"
            if self.problem is None or _kind(problem) != _kind(self.problem):  # once per problem, not per step
                logger.error(f"stage {self.stage}: checkpoint at step {payload['step']} not saved: {problem}")
            self.problem = problem
            self.failed += 1
            self.policy.last_saved = previous  # due again at the next step
            return
        if self.problem is not None:
            logger.info(f"stage {self.stage}: checkpoints are written again (step {payload['step']})")
        self.problem = None
        self.saved += 1

    def flush(self) -> None:
        """Waits for a checkpoint being written."""
        if self._writing is not None:
            self._writing.result()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)

    # --- sharing with replicas that join later

    def current(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a joining replica downloads: copies, taken between optimizer steps (any thread)."""
        with self.lock:
            return pack_state(capture_state(self.worker, self.step, self.config_hash))

    # --- joining

    async def sync(
        self,
        sources: Callable[[], Awaitable[list[str]]],
        averager: ReplicaAverager,
        lane: ComputeLane,
        still_needed: Callable[[], Awaitable[bool]] | None = None,
        patience_s: float = STATE_SYNC_PATIENCE_S,
    ) -> None:
        """Takes the stage's state from a live replica (``sources()`` names them) when it is ahead of this one's.

        It asks every live replica, round after round, STATE_DOWNLOAD_ROUNDS times; then, while ``still_needed()``
        says this replica's own state will not do (it is behind the swarm's) and live replicas exist, it keeps
        asking with a backoff for up to ``patience_s`` in all: a download that fails while the other replica is
        busy or its connection is new must not end the node (the churn soak's restarted stage2-1 gave up after 4 s
        and exited, its checkpoint 59 steps old).

        NodeError when live replicas exist but none gave a usable state and no checkpoint was resumed: serving
        freshly initialised weights would drag the stage back."""
        attempted: list[str] = []
        began = time.monotonic()
        pause = 1.0
        attempt = 0
        while True:
            peers = await sources()
            if not peers:
                if attempt == 0:
                    where = "fresh (no step applied yet)" if self.step < 0 else f"from step {self.step}"
                    logger.info(f"stage {self.stage}: no other live replica; starting {where}")
                    return
                break
            for peer in peers:
                attempted.append(peer)
                if await self._take_from(peer, averager, lane):
                    return
            attempt += 1
            if attempt < STATE_DOWNLOAD_ROUNDS:
                await asyncio.sleep(pause)
                continue
            if still_needed is None or time.monotonic() - began + pause > patience_s or not await still_needed():
                break
            logger.warning(
                f"stage {self.stage}: no live replica ({', '.join(dict.fromkeys(peers))}) gave a usable state "
                f"yet, and this one's (step {self.step}) is behind the swarm's; asking again in {pause:.0f} s"
            )
            await asyncio.sleep(pause)
            pause = min(2 * pause, STATE_SYNC_MAX_PAUSE_S)
        if self.resumed_from is None:
            raise NodeError(
                f"stage {self.stage}: no live replica ({', '.join(dict.fromkeys(attempted))}) gave a usable state "
                "in time; serving fresh weights would set the stage back. Check the log above, then rejoin"
            )
        logger.warning(f"stage {self.stage}: no live replica gave a usable state; going on from step {self.step}")

    async def resync(self, peers: list[str], averager: ReplicaAverager, lane: ComputeLane, newer_than: int) -> bool:
        """Takes the stage's state from the first of ``peers`` whose state is newer than step ``newer_than`` (the last
        step this replica really applied before it missed some): whether one was taken."""
        for peer in peers:
            if await self._take_from(peer, averager, lane, newer_than) == "taken":
                self.resyncs += 1
                return True
        return False

    async def _take_from(
        self, peer: str, averager: ReplicaAverager, lane: ComputeLane, newer_than: int | None = None
    ) -> str | None:
        """ "taken" when ``peer``'s state was taken, "not newer" when it was not newer than step ``newer_than``
        (default: this replica's own step), None when it gave no usable state."""
        newer_than = self.step if newer_than is None else newer_than
        state = await asyncio.to_thread(averager.download_state, peer, STATE_DOWNLOAD_TIMEOUT_S, self._max_bytes())
        if state is None:
            return None
        origin = f"the state of stage {self.stage} replica {peer}"
        try:
            groups = self.worker.optimizer.state_dict()["param_groups"]
            payload = unpack_state(*state, origin=origin, param_groups=groups)
            step = payload["step"]
            if not isinstance(step, int) or step <= newer_than:
                logger.info(f"stage {self.stage}: {origin} is at step {step}, not ahead of this one's; keeping ours")
                return "not newer"
            fix = "it cannot be used; trying another replica"
            await lane.run(restore_state, self.worker, payload, origin, self.config_hash, fix, True)
        except CheckpointError as e:
            logger.warning(str(e))
            return None
        self.step, self.synced_from = step, peer
        logger.info(f"stage {self.stage}: took the state at step {step} from replica {peer}")
        return "taken"

    def _max_bytes(self) -> int:
        """A bound on what a peer may send: 4x this replica's parameters and moments (moments may not exist yet)."""
        tensors = list(self.worker.module.state_dict().values())
        for values in self.worker.optimizer.state_dict()["state"].values():
            tensors += [v for v in values.values() if isinstance(v, torch.Tensor)]
        return 4 * sum(t.numel() * t.element_size() for t in tensors) + (1 << 20)


def _kind(problem: str) -> str:
    """What a checkpoint problem is, whatever step or byte count it names ("disk full", ...)."""
    return problem.split(":", 1)[0]
