"""What the pipeline roles (stage, verifier, trainer) share on top of :mod:`sentinel_node.roles.common`.

- the wire contract between them: handler names, :class:`PipelineRequest` (a microbatch's nested call),
  :class:`StepRequest`/:class:`StepReply` (the trainer's global step), and the tensor shapes every hop expects;
- :func:`pipeline_node`: a node's identity, DHT, record store and clean stop, plus a libp2p handle on the DHT's own
  daemon (so the peer id that calls and answers is the one that signs the node's records);
- :class:`ViewKeeper`: the swarm view refreshed in the background, and refreshed at once (rate-limited) when a
  caller is not in it yet; :class:`Gatekeeper`: who may call a handler, decided from that view;
- :class:`ComputeLane`: the one thread in which a node runs torch, so the event loop keeps moving tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import hivemind
import torch
from hivemind.p2p import P2P
from hivemind.utils import get_logger
from pydantic import Field

from dht import DHTUnavailable, Identity, RecordStore
from peers import LivenessBlacklist, SwarmView, SwarmWatcher
from sentinel_node.config import Config
from sentinel_node.roles.common import (
    JoinOptions,
    NodeDiedError,
    StopSignals,
    node_identity,
    peer_ids_of,
    record_store,
    start_dht,
    stop_dht,
)
from sentinel_node.roles.reachability import Reachability, check_reachability, report, serve_reachability
from sentinel_node.swarm_view import exclusion_policy
from sentinel_node.transport import (
    Hop,
    HopBanned,
    HopError,
    HopRefused,
    MicrobatchMetadata,
    RequestMetadata,
    TensorServer,
    TensorSpec,
    TransportSettings,
    WireModel,
)

logger = get_logger(__name__)

T = TypeVar("T")

# Handler names on every node's libp2p daemon (the transport adds a ".stream" twin for each).
STAGE_FORWARD = "sentinel.stage.forward"
STAGE_STEP = "sentinel.stage.step"
VERIFIER_RELAY = "sentinel.verifier.relay"

# A caller missing from the view is looked up again at most this often (an unknown peer must not flood the DHT).
_FORCED_REFRESH_INTERVAL = 1.0
_HEALTH_CHECK_PERIOD = 1.0


class PipelineRequest(MicrobatchMetadata):
    """One microbatch's nested call. ``route`` holds the hops after the callee; ``taint`` the boundaries whose
    tensor a verifier replaced on the way forward. ``train=False`` is a validation pass: forward and loss only."""

    train: bool = True


class StepRequest(RequestMetadata):
    """The trainer's global step ``step`` is complete: apply the gradients accumulated for it."""

    step: int = Field(ge=0)


class StepReply(WireModel):
    stepped: bool
    microbatches: int = Field(ge=0)
    averaging: bool = False


@dataclass(frozen=True)
class Shapes:
    """The fixed tensor shapes of this swarm's microbatches, and the wire dtype of its hidden states."""

    batch: int
    seq_len: int
    hidden: int
    vocab: int
    dtype: torch.dtype = torch.float32  # pipeline.wire_dtype: activations and gradients

    @classmethod
    def of(cls, config: Config) -> Shapes:
        pipe = config.pipeline
        wire = getattr(torch, pipe.wire_dtype)
        return cls(pipe.microbatch_size, pipe.seq_len, config.model.hidden_size, config.model.vocab_size, wire)

    @property
    def activation(self) -> tuple[int, int, int]:
        return (self.batch, self.seq_len, self.hidden)

    @property
    def tokens(self) -> TensorSpec:
        return TensorSpec((self.batch, self.seq_len), torch.int64)

    @property
    def hidden_spec(self) -> TensorSpec:
        return TensorSpec(self.activation, self.dtype)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.batch * self.seq_len


def transport_settings(config: Config) -> TransportSettings:
    return TransportSettings(compression=config.pipeline.compression, max_tensor_mib=config.pipeline.max_tensor_mib)


@dataclass
class NodeContext:
    """A started node: its config, identity, DHT, record store and stop signal."""

    config: Config
    identity: Identity
    dht: hivemind.DHT
    store: RecordStore
    stop: StopSignals
    maddrs: list[str]
    options: JoinOptions

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id


@contextlib.contextmanager
def pipeline_node(options: JoinOptions, stop_event: threading.Event | None = None) -> Iterator[NodeContext]:
    """Traps SIGTERM/SIGINT, loads the identity, starts the DHT; shuts the DHT (and its p2pd) down on exit."""
    config = options.config
    with StopSignals(stop_event) as stop, node_identity(options.identity_path) as (identity, fresh):
        dht = start_dht(
            config,
            identity,
            initial_peers=options.initial_peers,
            host_maddrs=options.host_maddrs,
            announce_maddrs=options.announce_maddrs,
            check_identity=not fresh,
            timeout=options.start_timeout,
            use_relay=options.use_relay,
            use_auto_relay=options.use_auto_relay,
        )
        try:
            maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
            yield NodeContext(config, identity, dht, record_store(dht, config, identity), stop, maddrs, options)
        finally:
            stop_dht(dht)


async def wait_for_stop(context: NodeContext, also: Callable[[], bool] = lambda: False) -> None:
    """Returns when the node is asked to stop (or ``also()`` is true); NodeDiedError if its DHT process ends."""
    next_check = time.monotonic() + _HEALTH_CHECK_PERIOD
    while not context.stop.event.is_set() and not also():
        await asyncio.sleep(0.1)
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + _HEALTH_CHECK_PERIOD
            if not context.dht.is_alive():
                raise NodeDiedError("the DHT process ended unexpectedly; see the log above for its last words")


class ComputeLane:
    """One worker thread for all of a node's torch work: a stage's forward, backward and optimizer step never
    overlap (they share parameters and gradients), and the event loop stays free for the network."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class ViewKeeper:
    """The node's swarm view, refreshed every ``period`` seconds in the background.

    ``listeners`` are called (in the event loop) with each new view, e.g. to tell an averager whom to leave out.
    """

    def __init__(self, context: NodeContext, period: float | None = None) -> None:
        config = context.config
        self.watcher = SwarmWatcher(context.store, config.pipeline.n_stages, exclusion_policy(config))
        self.period = config.swarm.announce_period if period is None else period
        self.listeners: list[Callable[[SwarmView], None]] = []
        self._refreshing: asyncio.Task | None = None
        self._last_refresh = 0.0

    @property
    def view(self) -> SwarmView:
        return self.watcher.view

    async def refresh(self, force: bool = False) -> SwarmView:
        """A fresh view; without ``force``, or within the rate limit, the latest one (joining a refresh already
        under way)."""
        if self._refreshing is None:
            recent = time.monotonic() - self._last_refresh < _FORCED_REFRESH_INTERVAL
            if self._last_refresh and (not force or recent):
                return self.view
            self._refreshing = asyncio.create_task(self._refresh())
        return await asyncio.shield(self._refreshing)

    async def _refresh(self) -> SwarmView:
        try:
            view = await asyncio.to_thread(self.watcher.refresh)
        except DHTUnavailable as e:
            logger.debug(f"swarm view not refreshed: {e}")
            view = self.view
        finally:
            self._last_refresh = time.monotonic()
            self._refreshing = None
        for listener in self.listeners:
            try:
                listener(view)
            except Exception:
                logger.warning("a swarm view listener failed", exc_info=True)
        return view

    async def run(self) -> None:
        """Refreshes forever (cancel the task to stop)."""
        while True:
            if self._refreshing is None:
                self._refreshing = asyncio.create_task(self._refresh())
            await asyncio.shield(self._refreshing)
            await asyncio.sleep(self.period)


def live_trainer(view: SwarmView, peer: str) -> bool:
    announcement = view.trainers.get(peer)
    return announcement is not None and view.is_live(announcement)


def live_verifier(view: SwarmView, peer: str, boundary: int) -> bool:
    return any(v.peer_id == peer for v in view.live_verifiers(boundary))


def stage_of(view: SwarmView, peer: str) -> int | None:
    """The stage ``peer`` serves as a live replica, or None."""
    for k in range(view.n_stages):
        if any(a.peer_id == peer for a in view.live_replicas(k)):
            return k
    return None


class Gatekeeper:
    """Decides from the swarm view whether a caller may use a handler; raises a coded refusal when not."""

    def __init__(self, views: ViewKeeper) -> None:
        self.views = views

    async def require(self, caller: str, allowed: Callable[[SwarmView], bool], what: str) -> SwarmView:
        """The view in which ``allowed(view)`` held. HopBanned for an excluded caller; HopRefused, saying ``what``
        the handler accepts, for any other caller it does not allow (after one refresh: it may have just joined)."""
        view = self.views.view
        for attempt in range(2):
            if view.is_excluded(caller):
                voters = ", ".join(view.excluded[caller].voters)
                raise HopBanned(f"{caller} is excluded from the swarm (banned by {voters}); nothing accepted from it")
            if allowed(view):
                return view
            if attempt == 0:
                view = await self.views.refresh(force=True)
        raise HopRefused(f"{what}; the caller {caller} is not one")


def order_candidates(
    hop: Hop, view: SwarmView, blacklist: LivenessBlacklist, skip: Callable[[str], bool] = lambda _: False
) -> list[str]:
    """The peers that may serve ``hop``: the chosen one, then its alternates; never excluded or skipped peers,
    and peers that just failed only after the others."""
    peers = [p for p in dict.fromkeys([hop.peer_id, *hop.alternates]) if not view.is_excluded(p) and not skip(p)]
    return [p for p in peers if p not in blacklist] + [p for p in peers if p in blacklist]


def note_failures(blacklist: LivenessBlacklist, errors: Sequence[HopError]) -> None:
    """Suspends the peers that failed to answer (not those that refused or were refused)."""
    for error in errors:
        if error.cause.unresponsive and error.culprit:
            blacklist.register_failure(error.culprit)


def write_status(path: str | os.PathLike | None, data: dict) -> None:
    """Writes ``data`` as JSON to ``path`` atomically (readers never see half a file); no-op without a path."""
    if path is None:
        return
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(data, sort_keys=True, default=str))
        temporary.replace(path)
    except OSError as e:
        logger.warning(f"cannot write status file {path}: {e}")


def view_summary(view: SwarmView) -> dict:
    """What a node knows of the swarm's verdicts, for status files."""
    return {
        "excluded": sorted(view.excluded),
        "strikes": {
            peer: {record.verifier: record.strikes for record in view.ledger.about(peer)}
            for peer in view.ledger.accused()
        },
    }


async def periodically(period: float, fn: Callable[[], Awaitable[None] | None]) -> None:
    """Calls ``fn`` every ``period`` seconds until cancelled; a failure is logged, not fatal."""
    while True:
        try:
            result = fn()
            if asyncio.iscoroutine(result):
                await result
        except Exception:
            logger.warning("a periodic task failed", exc_info=True)
        await asyncio.sleep(period)


async def bounded(awaitable: Awaitable, seconds: float, what: str) -> None:
    """Awaits a shutdown step for at most ``seconds``: once the node's ``p2pd`` is gone (a signal sent to the
    whole process group reaches it too, e.g. Ctrl-C in a terminal), a libp2p call never returns."""
    try:
        await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        logger.warning(f"{what} did not finish within {seconds:.0f}s (is p2pd gone?); going on")
    except Exception as e:
        logger.debug(f"{what} failed: {type(e).__name__}: {e}")


async def reachability(context: NodeContext, p2p: P2P, server: TensorServer) -> Reachability:
    """Answers other nodes' reachability checks from now on, and checks this node's own with its initial peers."""
    await serve_reachability(server)
    peers = peer_ids_of(context.options.initial_peers)
    result = await check_reachability(p2p, context.maddrs, peers, server.settings)
    report(result, context.options.use_auto_relay)
    return result


async def replicate_p2p(context: NodeContext) -> P2P:
    """A libp2p handle on the DHT's own daemon: the node's handlers answer under its identity's peer id."""
    return await context.dht.replicate_p2p()
