"""The life of a node, written once for every role: start, serve, stop in one order.

:func:`started_node` traps SIGTERM/SIGINT, loads the identity and starts the DHT (and its p2pd), and shuts them
down however the node ends. A :class:`Node` then runs on it:

1. its metrics server (first: a port already taken fails the start at once),
2. a libp2p handle on the DHT's own daemon (so the peer id that answers is the one that signs the records),
3. the role's own preparation (a stage syncs its state and measures its throughput),
4. its handlers, and the reachability check with its initial peers (for roles that serve),
5. its announcement, kept alive by an :class:`~dht.Announcer`, the swarm view refreshed in the background and the
   role's own periodic tasks,
6. the role's main coroutine (by default: until asked to stop, or until its DHT process dies),

and then the teardown, always in this order: background tasks cancelled, the role stops taking work, handlers
removed, a last ``offline`` announcement, the role's final work (a checkpoint, pending strike records), a final
status file, the compute lane, metrics, the libp2p handle. Every step that talks to p2pd is bounded
(:func:`bounded`): once p2pd is gone (a signal sent to the whole process group reaches it too), such a call never
returns. A role subclasses :class:`Node` and keeps only its own handlers and logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import hivemind
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time, get_logger

from dht import Announcement, Announcer, DHTUnavailable, Identity, RecordStore
from peers import LivenessBlacklist
from sentinel_node.config import Config
from sentinel_node.processes import alive
from sentinel_node.roles.common import (
    JoinOptions,
    NodeDiedError,
    StopSignals,
    node_identity,
    p2pd_of,
    peer_ids_of,
    record_store,
    rejoin_if_alone,
    software_version,
    start_dht,
    stop_dht,
)
from sentinel_node.roles.metrics import serve_metrics
from sentinel_node.roles.reachability import Reachability, check_reachability, report, serve_reachability
from sentinel_node.roles.status import MAX_LISTED, ConnectionsStatus, NodeStatus, write_status
from sentinel_node.roles.views import ViewKeeper
from sentinel_node.roles.wire import transport_settings
from sentinel_node.transport import TensorServer

logger = get_logger(__name__)

_HEALTH_CHECK_PERIOD = 1.0
# The most a shutdown step that talks to p2pd may take.
SHUTDOWN_STEP_S = 5.0
CONNECTIONS_PERIOD_S = 2.0  # how often a node with a status file lists its libp2p connections
CONNECTIONS_TIMEOUT_S = 5.0
REJOIN_PERIOD_S = 3.0  # how often a node checks that its DHT still has a neighbour


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
    p2pd: int | None = None  # the pid of the DHT's daemon
    # the libp2p handle and the handlers' server, kept across the nodes this process serves one after the other (a
    # stage that moves): p2pd ties handler names to the client that registered them
    p2p: P2P | None = None
    server: TensorServer | None = None

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def reachable(self) -> bool:
        """Whether the DHT and its p2pd still run, so that calls through them can return (a signal sent to the
        whole process group, Ctrl-C in a terminal, ends p2pd before the node has stopped)."""
        return self.dht.is_alive() and (self.p2pd is None or alive(self.p2pd))


@contextlib.contextmanager
def started_node(options: JoinOptions, stop_event: threading.Event | None = None) -> Iterator[NodeContext]:
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
        p2pd = p2pd_of(dht)
        try:
            maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
            store = record_store(dht, config, identity)
            if options.initial_peers and not options.config_from_swarm:
                check_swarm_config(store, options)
            yield NodeContext(config, identity, dht, store, stop, maddrs, options, p2pd)
        finally:
            stop_dht(dht, p2pd)


def check_swarm_config(store: RecordStore, options: JoinOptions) -> None:
    """SwarmConfigError when the swarm this node joins publishes another config than the one it was given."""
    from sentinel_node.swarm_config import describe_where, read_published, resolve

    try:
        published = read_published(store, initial_peers=options.initial_peers)
    except DHTUnavailable:
        logger.warning("the swarm's published config could not be read in time; not checked against --config")
        return
    resolve(published, options.config, describe_where(options.initial_peers), options.config_name)


async def wait_for_stop(context: NodeContext, also: Callable[[], bool] = lambda: False) -> None:
    """Returns when the node is asked to stop (or ``also()`` is true); NodeDiedError if its DHT process ends."""
    next_check = time.monotonic() + _HEALTH_CHECK_PERIOD
    while not context.stop.event.is_set() and not also():
        await asyncio.sleep(0.1)
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + _HEALTH_CHECK_PERIOD
            if not context.dht.is_alive():
                raise NodeDiedError("the DHT process ended unexpectedly; see the log above for its last words")


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


def _rss_mib() -> float:
    """This process's resident memory, in MiB (its DHT and p2pd are processes of their own)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)


def _quiet_lost_connections(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The event loop's handler of errors nobody awaited: a connection to p2pd that was lost (p2pd stopped, e.g.
    by the Ctrl-C that also stops this node) is one debug line, not a traceback; anything else as usual."""
    error = context.get("exception")
    if isinstance(error, (ConnectionError, asyncio.IncompleteReadError, EOFError)):
        logger.debug(f"a connection to p2pd was lost: {type(error).__name__}: {error}")
        return
    loop.default_exception_handler(context)


def classify_connections(connections: Iterable[tuple[str, list[str]]]) -> ConnectionsStatus:
    """Peers by how this node is connected to them, from (peer id, remote addresses) per connection as p2pd lists
    them: relayed when every connection to the peer runs through a relay (its address a ``/p2p-circuit``)."""
    addresses: dict[str, list[str]] = {}
    for peer, addrs in connections:
        addresses.setdefault(peer, []).extend(addrs)
    relayed = sorted(p for p, addrs in addresses.items() if addrs and all("/p2p-circuit" in a for a in addrs))
    direct = sorted(p for p in addresses if p not in relayed)
    return ConnectionsStatus(direct=direct[:MAX_LISTED], relayed=relayed[:MAX_LISTED])


class Node:
    """One role on a started node; :meth:`serve` runs the lifecycle above. Subclasses set :attr:`role` and
    override the hooks they need; every hook has a do-nothing default."""

    role: ClassVar[str]
    serves: ClassVar[bool] = True  # registers handlers and answers reachability checks (a trainer only calls out)
    keeps_view: ClassVar[bool] = True  # refreshes the swarm view in the background (a bootstrap does not need it)
    announces_joining: ClassVar[bool] = False  # announced as "joining" from before prepare() (a stage syncing)

    def __init__(self, context: NodeContext, status_file: str | None = None) -> None:
        self.context, self.config, self.status_file = context, context.config, status_file
        self.transport = transport_settings(self.config)
        self.views = ViewKeeper(context.store, self.config)
        # peers that just failed to answer, skipped for a while; one that left the view and came back starts afresh
        self.blacklist = LivenessBlacklist()
        self.views.listeners.append(lambda view: self.blacklist.seen({a.peer_id for a in view.announcements()}))
        self.p2p: P2P | None = None
        self.server: TensorServer | None = None
        self.reachability: Reachability | None = None
        self.announcer: Announcer | None = None
        self.connections: ConnectionsStatus | None = None  # as last listed (status files only)

    @property
    def peer_id(self) -> str:
        return self.context.peer_id

    # --- hooks

    async def prepare(self) -> None:
        """Before the handlers are added and the node is announced (the libp2p handle exists)."""

    async def add_handlers(self, server: TensorServer) -> None:
        """Registers the role's handlers."""

    def announcement(self) -> Announcement:
        """The record that announces this node (see :meth:`announced`)."""
        raise NotImplementedError

    def background(self) -> list[Coroutine[Any, Any, None]]:
        """The role's periodic tasks besides the view refresh (default: the status file every announce period)."""
        if self.status_file is None:
            return []
        return [periodically(self.config.swarm.announce_period, self.write_status)]

    def ready_line(self) -> str:
        return f"{self.role} {self.peer_id} serving swarm {self.config.swarm.prefix}"

    async def main(self) -> Any:
        """What the node does once announced; its result is :meth:`serve`'s. Default: serve until asked to stop."""
        await wait_for_stop(self.context)
        received = self.context.stop.received
        logger.info(f"{received.name if received else 'asked to stop'}: shutting down")

    async def stopping(self) -> None:
        """The role stops taking work (before its handlers are removed)."""

    async def finish(self) -> None:
        """The role's last work after it went offline (a checkpoint, pending records)."""

    def close(self) -> None:
        """Releases what the role holds (its compute lane)."""

    def samples(self) -> list:
        """The role's own Prometheus samples (:class:`~sentinel_node.roles.metrics.Sample`)."""
        return []

    def status(self) -> NodeStatus | None:
        """The role's status file contents, or None for a role that writes none."""
        return None

    # --- shared by the roles

    def announced(self, cls: type[Announcement], **fields) -> Announcement:
        """An announcement of ``cls`` with the fields every announcement carries filled in."""
        common = {
            "peer_id": self.peer_id,
            "maddrs": self.context.maddrs,
            "state": "online",
            "relayed": self.reachability.relayed if self.reachability is not None else False,
            "throughput": 0.0,
            "name": self.context.options.name,
            "config_hash": self.config.swarm_hash(),
            "version": software_version(),
            "time": get_dht_time(),
        }
        return cls(**{**common, **fields})

    def write_status(self) -> None:
        status = self.status() if self.status_file is not None else None
        if status is not None:
            if self.connections is not None:
                status = status.model_copy(update={"connections": self.connections})
            write_status(self.status_file, status)

    async def _rejoin(self) -> None:
        """Back in touch with the swarm through the initial peers once the DHT lost every neighbour (a partition)."""
        if not self.context.reachable():
            return
        store = self.context.store
        answered = await asyncio.to_thread(
            rejoin_if_alone, self.context.dht, self.context.options.initial_peers, lock=store.send_lock
        )
        if answered:  # none answering (still cut off) is tried again, quietly
            logger.warning(
                f"this node's DHT had lost every neighbour (cut off from the swarm?); {answered} of "
                f"{len(self.context.options.initial_peers)} initial peers answered its rejoin"
            )

    async def list_connections(self) -> None:
        """Which peers this node is connected to directly and which only through a relay (for the status file: a
        node behind a NAT shows how it is reached)."""
        if self.p2p is None or not self.context.reachable():
            return
        infos = await asyncio.wait_for(self.p2p.list_peers(), CONNECTIONS_TIMEOUT_S)
        self.connections = classify_connections((str(info.peer_id), [str(a) for a in info.addrs]) for info in infos)

    async def serve(self, on_ready: Callable[[str, list[str]], None]) -> Any:
        context = self.context
        for role in self.config.swarm.unadmittable_roles():
            logger.warning(
                f"the swarm config admits no {role}: list peer ids in it, name an organiser, or make the role open "
                "(docs/security.md); until then the pipeline cannot run"
            )
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_quiet_lost_connections)
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread (in-process tests): no signal
            loop.add_signal_handler(signal.SIGUSR1, _log_tasks)
        metrics = serve_metrics(
            context, self.role, self.samples, view=(lambda: self.views.view) if self.keeps_view else None
        )
        tasks: list[asyncio.Task] = []
        try:
            if context.p2p is None:
                context.p2p = await context.dht.replicate_p2p()
            self.p2p = context.p2p
            if self.announces_joining:
                self.announcer = self._announcer(state="joining")
            await self.prepare()
            if self.serves:
                if context.server is None:
                    context.server = TensorServer(self.p2p, self.transport)
                self.server = context.server
                await self.add_handlers(self.server)
                await serve_reachability(self.server)
                self.reachability = self.reachability or await self._check_reachability()
            if self.announcer is None:
                self.announcer = self._announcer()
            else:
                fresh = self.announcement()
                self.announcer.update(**{k: v for k, v in fresh.dict().items() if k not in ("time", "schema")})
            if self.keeps_view:
                tasks.append(asyncio.create_task(self.views.run()))
            tasks += [asyncio.create_task(coroutine) for coroutine in self.background()]
            if self.status_file is not None:
                tasks.append(asyncio.create_task(periodically(CONNECTIONS_PERIOD_S, self.list_connections)))
            if context.options.initial_peers:
                tasks.append(asyncio.create_task(periodically(REJOIN_PERIOD_S, self._rejoin)))
            logger.info(self.ready_line())
            for line in self.describe():
                logger.info(line)
            on_ready(context.peer_id, context.maddrs)
            try:
                return await self.main()
            finally:
                await self._teardown(tasks)
        finally:
            if metrics is not None:
                metrics.stop()
            if self.p2p is not None and context.reachable():
                await bounded(self.p2p.shutdown(), SHUTDOWN_STEP_S, "closing the libp2p handle")

    def _announcer(self, **changes) -> Announcer:
        swarm = self.config.swarm
        record = self.announcement()
        if changes:
            record = record.replace(**changes)
        return Announcer(self.context.store, record, swarm.announce_period, swarm.announce_ttl).start()

    def describe(self) -> list[str]:
        """What the node tells its owner once it serves: what it is, where it can be reached, what it uses.
        Roles add their own lines (:meth:`describe_details`)."""
        reach = self.reachability
        if reach is None or reach.reachable is None:
            reachable = "not checked"
        elif reach.reachable:
            reachable = "reachable by other peers"
        else:
            reachable = "NOT reachable by other peers (see the warning above); announced as relayed"
        name = f" '{self.context.options.name}'" if self.context.options.name else ""
        config = self.config
        lines = [
            f"this node: {self.role}{name} {self.peer_id} in swarm {config.swarm.prefix} "
            f"(config {config.swarm_hash()}, {self.context.options.config_name})",
            *self.describe_details(),
            f"memory in use: {_rss_mib():.0f} MiB resident",
            "announced addresses: " + (" ".join(self.context.maddrs) or "none"),
            f"reachability: {reachable}",
        ]
        return lines

    @property
    def moving(self) -> bool:
        """Whether this process serves another node right after this one (a stage replica moving)."""
        return False

    def describe_details(self) -> list[str]:
        """The role's own lines of :meth:`describe` (its stage, device, model, throughput...)."""
        return []

    async def _check_reachability(self) -> Reachability:
        """Checks this node's reachability with its initial peers."""
        peers = peer_ids_of(self.context.options.initial_peers)
        result = await check_reachability(self.p2p, self.context.maddrs, peers, self.server.settings)
        report(result, self.context.options.use_auto_relay)
        return result

    async def _teardown(self, tasks: list[asyncio.Task]) -> None:
        for task in tasks:
            task.cancel()
        dht_alive = self.context.reachable()  # else nothing can be removed or announced through p2pd
        try:
            await self.stopping()
            if self.server is not None and dht_alive:
                unregister = not self.moving  # a node that serves again in this process keeps the names
                await bounded(self.server.remove_handlers(unregister), SHUTDOWN_STEP_S, "removing the handlers")
            self.announcer.stop(offline=dht_alive, wait=None if dht_alive else 0.2)
            await self.finish()
            self.write_status()
        finally:
            self.close()


def _log_tasks() -> None:
    """``kill -USR1 <pid>``: every pending task of the node's event loop and where it waits, innermost last, in its
    log (for a node that seems stuck)."""
    for task in asyncio.all_tasks():
        frames, awaited = [], task.get_coro()
        while awaited is not None and len(frames) < 32:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                frames.append(
                    f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
                )
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        logger.warning(f"task {task.get_name()}: {' -> '.join(frames) or 'not started'}")
