"""What every node role shares: its identity file, its DHT with the swarm's validators, its record store, and a
clean stop on SIGTERM/SIGINT.

A DHT runs in a forked child that starts its own ``p2pd``; if the main process dies without shutting the DHT
down, both keep running and hold their ports. So roles trap SIGTERM/SIGINT and always shut the DHT down.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_logger
from hivemind.utils.multiaddr import Multiaddr

from dht import (
    MAX_SUBKEYS,
    Identity,
    RecordStore,
    cap_subkeys,
    create_identity_file,
    load_identity_file,
    swarm_validators,
)
from sentinel_node.config import Config
from sentinel_node.processes import alive, command_name, descendants
from sentinel_node.roles.relays import p2p_options

logger = get_logger(__name__)


class NodeError(RuntimeError):
    """A node cannot go on; the message says what to check."""


class NodeStartError(NodeError):
    """A node could not start or reach the swarm."""


class NodeDiedError(NodeError):
    """A node's DHT process ended on its own."""


@dataclass(frozen=True)
class JoinOptions:
    """What ``sentinel-node join`` passes to every role."""

    config: Config
    identity_path: str | None = None
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    start_timeout: float = 60.0
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any free port)
    metrics_host: str = "127.0.0.1"  # the address the metrics server binds (0.0.0.0: every interface)
    name: str | None = None  # what the node is called in tables and on the status page
    config_name: str = "--config"  # where the config came from, for messages (a path, or "the swarm's config")
    config_from_swarm: bool = False  # read from the swarm's DHT: nothing to check it against
    use_relay: bool = True  # may reach peers that are themselves reachable only through a relay
    use_auto_relay: bool = False  # behind NAT: reserve a slot at the initial peers and be reachable through them
    certificate_path: str | None = None  # the organiser's role certificate (trainers, verifiers)


def peer_ids_of(maddrs: Iterable[str]) -> list[str]:
    """The peer ids that multiaddrs name (``.../p2p/<id>``), in order, once each."""
    found = []
    for maddr in maddrs:
        with contextlib.suppress(Exception):
            found.append(Multiaddr(maddr).value_for_protocol("p2p"))
    return list(dict.fromkeys(found))


def software_version() -> str:
    try:
        return importlib.metadata.version("sentinel-node")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def parse_maddrs(values: Iterable[str], option: str, need_peer_id: bool = False) -> tuple[str, ...]:
    """Multiaddrs from option values, each of which may hold several separated by spaces or commas."""
    maddrs = []
    for value in values:
        for text in value.replace(",", " ").split():
            try:
                maddr = Multiaddr(text)
            except Exception as e:  # the multiaddr package raises several types
                raise ValueError(
                    f"{option}: {text!r} is not a multiaddr ({e}); expected e.g. /ip4/203.0.113.5/tcp/31337/p2p/Qm..."
                ) from None
            if need_peer_id and "p2p" not in maddr:
                raise ValueError(
                    f"{option}: {text!r} names no peer; it must end in /p2p/<peer id>, "
                    "as in the lines a bootstrap node prints when it starts"
                )
            maddrs.append(text)
    return tuple(maddrs)


@contextlib.contextmanager
def node_identity(path: str | Path | None) -> Iterator[tuple[Identity, bool]]:
    """The node's identity and whether it was just created.

    A path that does not exist yet gets a new identity (owner-only, 0600); ``None`` gets a throwaway one in a
    private temporary directory, removed on exit (the node then has a new peer id on every start).
    """
    if path is None:
        directory = tempfile.mkdtemp(prefix="sentinel-identity-")
        try:
            logger.info("no --identity given: using a throwaway identity (pass --identity PATH to keep a peer id)")
            yield create_identity_file(Path(directory) / "identity.key"), True
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    path = Path(path).expanduser()
    if path.exists():
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                f"identity file {path} is readable by others (mode {oct(mode & 0o777)}); run chmod 600 {path}"
            )
        yield load_identity_file(path), False
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    identity = create_identity_file(path)
    logger.info(f"created identity {identity.peer_id} in {path}")
    yield identity, True


def start_dht(
    config: Config | None,
    identity: Identity,
    *,
    initial_peers: Iterable[str] = (),
    host_maddrs: Iterable[str] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Iterable[str] = (),
    client_mode: bool = False,
    check_identity: bool = True,
    timeout: float = 60.0,
    use_relay: bool = True,
    use_auto_relay: bool = False,
) -> hivemind.DHT:
    """A running DHT node of the swarm (its libp2p identity is ``identity`` when that has a file), validating every
    record by the swarm's rules and capping every key's subkeys (dht.capacity); NodeStartError within ``timeout``
    seconds if it cannot start or reach ``initial_peers``. ``config=None`` is for a client-mode reader that does
    not know the swarm's config yet (signature checks only). ``use_auto_relay`` (behind a NAT): reachable through
    the initial peers' relays, as roles.relays says."""
    initial_peers, announce_maddrs, host_maddrs = list(initial_peers), list(announce_maddrs), list(host_maddrs)
    rules = config.swarm_rules() if config is not None else None
    dht = hivemind.DHT(
        initial_peers=initial_peers,
        start=False,
        record_validators=swarm_validators(rules, identity),
        client_mode=client_mode,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs or None,
        identity_path=str(identity.path) if identity.path is not None else None,
        check_if_identity_free=check_identity,
        **p2p_options(use_auto_relay, initial_peers, use_relay),
    )
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
    except FutureTimeout:
        stop_dht(dht)
        raise NodeStartError(
            f"the DHT node did not start within {timeout:.0f}s; check that --initial-peers are reachable"
        ) from None
    except Exception as e:
        stop_dht(dht)
        if "address already in use" in str(e).lower():
            raise NodeStartError(
                f"--host-maddrs {' '.join(host_maddrs)}: cannot listen, the address is already in use (another "
                "node on this machine?); choose a free port, or tcp/0 for any"
            ) from None
        if initial_peers and "bootstrap" in str(e):
            raise NodeStartError(
                f"none of the --initial-peers answered ({', '.join(initial_peers)}): {e}. "
                "Check that a bootstrap node is running there and that the addresses end in /p2p/<its peer id>"
            ) from None
        raise NodeStartError(f"the DHT node failed to start: {e}") from None
    try:
        cap_subkeys(dht, rules.max_subkeys if rules is not None else MAX_SUBKEYS, timeout=timeout)
    except Exception as e:
        stop_dht(dht)
        raise NodeStartError(f"the DHT node did not take its storage limits: {type(e).__name__}: {e}") from None
    return dht


def p2pd_of(dht: hivemind.DHT) -> int | None:
    """The pid of the p2pd daemon a DHT process started, or None."""
    if dht.pid is None:
        return None
    return next((pid for pid in descendants(dht.pid) if command_name(pid) == "p2pd"), None)


async def _rejoin(initial_peers: list[str], _dht: hivemind.DHT, node) -> int | None:
    """In the DHT's process: when its routing table is empty, pings the initial peers (which puts each in the table
    and this node in theirs); returns how many answered, None when the table was not empty."""
    table = node.protocol.routing_table
    if table.uid_to_peer_id:
        return None
    answered = 0
    for peer in peer_ids_of(initial_peers):
        answered += await node.protocol.call_ping(PeerID.from_base58(peer), validate=False, strict=False) is not None
    return answered


def rejoin_if_alone(
    dht: hivemind.DHT, initial_peers: Iterable[str], timeout: float = 10.0, lock: threading.Lock | None = None
) -> int | None:
    """Puts a DHT node whose routing table emptied back in touch with the swarm through its initial peers.

    hivemind drops a peer from the routing table on its first unanswered request and never falls back on the
    initial peers, so a node cut off for a while (a partition longer than a few requests) ends with an empty table:
    healed, it stores its announcements only locally and reads only its own records, and the others, who dropped it
    too, never call it again (seen: a verifier healed after 16 s relayed nothing for the rest of the run). Returns how
    many initial peers answered, or None when the table was not empty. ``lock``: the one the node's record store
    sends DHT calls under (the DHT's pipe takes one message at a time; threads must not interleave theirs)."""
    peers = list(initial_peers)
    if not peers:
        return None
    with lock if lock is not None else contextlib.nullcontext():
        future = dht.run_coroutine(partial(_rejoin, peers), return_future=True)
    return future.result(timeout=timeout)


def stop_dht(dht: hivemind.DHT, p2pd: int | None = None) -> None:
    """Shuts the DHT process (and its p2pd) down; kills what a stuck shutdown leaves behind. When its ``p2pd`` is
    known to be gone already (Ctrl-C reaches the whole process group), a graceful shutdown would only wait on it:
    the DHT process is terminated at once."""
    if dht.pid is None:
        return  # never started
    orphans = descendants(dht.pid)
    if p2pd is not None and not alive(p2pd) and dht.is_alive():
        dht.terminate()
    else:
        dht.shutdown()
    dht.join(timeout=5)
    deadline = time.monotonic() + 2
    while orphans and time.monotonic() < deadline:
        orphans = [pid for pid in orphans if alive(pid)]
        time.sleep(0.05)
    for pid in orphans:
        logger.warning(f"process {pid} outlived its DHT; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def record_store(
    dht: hivemind.DHT, config: Config, identity: Identity | None, timeout: float | None = None
) -> RecordStore:
    """The swarm's records through ``dht``; ``identity=None`` makes it read-only. Reads time out after
    ``timeout`` seconds (default: the config's request_timeout)."""
    timeout = config.swarm.request_timeout if timeout is None else timeout
    return RecordStore(dht, config.swarm_rules(), identity, timeout=timeout)


class StopSignals:
    """While entered, SIGTERM and SIGINT set :attr:`event` instead of killing the process.

    Processes forked meanwhile (the DHT) inherit the handler; in them it restores the default and re-raises, so a
    signal sent to a whole process group still ends them. Outside the main thread (a role run in-process, e.g. by
    a demo) no handler can be installed, and only ``event.set()`` stops the role.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, event: threading.Event | None = None) -> None:
        self.event = event or threading.Event()
        self.received: signal.Signals | None = None
        self._pid = os.getpid()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum)
        self.event.set()
