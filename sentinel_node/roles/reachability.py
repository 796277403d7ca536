"""Whether other peers can open connections to this node, checked when it starts.

A node behind a home router, or in a container whose port is not published, can call out (its DHT joins, its own
requests work) but nobody can call in, so it cannot serve; libp2p hides that until the first peer fails to dial
it. So at start a node asks its initial peers to dial the addresses it announces, from their side of the network
(``sentinel.reach.check``: a TCP connect to each address), and when none can, it says what to open or to try, and
announces itself as relayed so trainers prefer direct peers.

Every node answers such requests. It dials only the addresses the caller gives for itself, at most
:data:`MAX_ADDRESSES`, each with a short timeout, only TCP over IPv4/IPv6, and once per caller every
:data:`CHECK_INTERVAL_S` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P
from hivemind.utils import get_logger
from hivemind.utils.multiaddr import Multiaddr
from pydantic import Field

from sentinel_node.transport import (
    Answer,
    HopError,
    HopRefused,
    Incoming,
    RequestMetadata,
    TensorServer,
    TransportSettings,
    WireModel,
    call_peer,
)

logger = get_logger(__name__)

REACH_CHECK = "sentinel.reach.check"
MAX_ADDRESSES = 8
DIAL_TIMEOUT_S = 3.0
CHECK_TIMEOUT_S = 8.0
CHECK_INTERVAL_S = 10.0


class ReachRequest(RequestMetadata):
    """Dial these addresses of mine."""

    maddrs: list[str] = Field(max_length=MAX_ADDRESSES)


class ReachReply(WireModel):
    reachable: list[str] = Field(max_length=MAX_ADDRESSES)  # the addresses that accepted a connection
    failed: list[str] = Field(max_length=MAX_ADDRESSES)  # "maddr: why", for the others


@dataclass(frozen=True)
class Reachability:
    """What a node learned of itself: ``reachable`` is None when no peer could be asked."""

    reachable: bool | None
    checked: tuple[str, ...]
    asked: tuple[str, ...] = ()
    answered_by: tuple[str, ...] = ()
    reachable_at: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()

    @property
    def relayed(self) -> bool:
        return self.reachable is False

    def as_dict(self) -> dict:
        return {
            "reachable": self.reachable,
            "checked": list(self.checked),
            "answered_by": list(self.answered_by),
            "reachable_at": list(self.reachable_at),
        }


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a direct TCP multiaddr, or None (relay circuits, DNS names, QUIC...)."""
    try:
        parsed = Multiaddr(maddr)
        protocols = [p.name for p in parsed.protocols()]
    except Exception:
        return None
    if "p2p-circuit" in protocols or "tcp" not in protocols:
        return None
    for family in ("ip4", "ip6"):
        if family in protocols:
            return parsed.value_for_protocol(family), int(parsed.value_for_protocol("tcp"))
    return None


def addresses_to_check(maddrs: Sequence[str]) -> list[str]:
    """The node's direct TCP addresses another host could dial: loopback ones only when there is nothing else
    (a swarm on one machine)."""
    direct = [m for m in dict.fromkeys(maddrs) if tcp_endpoint(m) is not None]
    outside = [m for m in direct if not ipaddress.ip_address(tcp_endpoint(m)[0]).is_loopback]
    return (outside or direct)[:MAX_ADDRESSES]


async def _dial(maddr: str) -> str | None:
    """None when ``maddr`` accepted a TCP connection, else why not."""
    endpoint = tcp_endpoint(maddr)
    if endpoint is None:
        return "not a direct TCP address"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*endpoint), DIAL_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"no answer within {DIAL_TIMEOUT_S:.0f}s"
    except OSError as e:  # asyncio's strerror is "Connect call failed (...)": the errno says why
        return os.strerror(e.errno) if e.errno else str(e) or type(e).__name__
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return None


async def _answer_check(incoming: Incoming[ReachRequest]) -> Answer:
    maddrs = list(dict.fromkeys(incoming.metadata.maddrs))
    results = await asyncio.gather(*(_dial(m) for m in maddrs))
    reachable = [m for m, error in zip(maddrs, results, strict=True) if error is None]
    failed = [f"{m}: {error}" for m, error in zip(maddrs, results, strict=True) if error is not None]
    return Answer([], ReachReply(reachable=reachable, failed=failed))


class CheckRateLimit:
    """One check per caller every ``interval`` seconds: a node checks itself once at start, and a peer must not
    turn this node into a port scanner."""

    def __init__(self, interval: float = CHECK_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}

    def __call__(self, caller: str, _metadata: ReachRequest | None = None) -> None:
        now = time.monotonic()
        if len(self._last) > 10_000:  # forget callers long gone
            self._last = {peer: t for peer, t in self._last.items() if now - t < self.interval}
        last = self._last.get(caller)
        if last is not None and now - last < self.interval:
            raise HopRefused(f"one reachability check per {self.interval:.0f}s; ask again later")
        self._last[caller] = now


async def serve_reachability(server: TensorServer, interval: float = CHECK_INTERVAL_S) -> None:
    """Answers other nodes' reachability checks on ``server``, once per caller every ``interval`` seconds."""
    limit = CheckRateLimit(interval)
    await server.add_handler(REACH_CHECK, _answer_check, ReachRequest, authorize=limit, expect=[])


async def check_reachability(
    p2p: P2P, maddrs: Sequence[str], peers: Sequence[str], settings: TransportSettings
) -> Reachability:
    """Asks ``peers`` (in parallel) to dial this node's ``maddrs``; reachable when any peer reached any address."""
    checked = tuple(addresses_to_check(maddrs))
    peers = list(dict.fromkeys(peers))
    if not checked or not peers:
        return Reachability(None, checked, tuple(peers))
    request = ReachRequest(deadline=time.time() + CHECK_TIMEOUT_S, maddrs=list(checked))
    replies = await asyncio.gather(
        *(call_peer(p2p, peer, REACH_CHECK, [], request, settings=settings, reply_model=ReachReply) for peer in peers),
        return_exceptions=True,
    )
    answered, reachable_at, failures = [], [], []
    for peer, reply in zip(peers, replies, strict=True):
        if isinstance(reply, HopError):
            logger.debug(f"{peer} did not check this node's reachability: {reply}")
            continue
        if isinstance(reply, BaseException):
            raise reply
        answered.append(peer)
        reachable_at += reply.metadata.reachable
        failures += [f"from {peer[:12]}: {failure}" for failure in reply.metadata.failed]
    if not answered:
        return Reachability(None, checked, tuple(peers))
    return Reachability(
        bool(reachable_at),
        checked,
        tuple(peers),
        tuple(answered),
        tuple(dict.fromkeys(reachable_at)),
        tuple(failures),
    )


def report(result: Reachability, use_auto_relay: bool) -> None:
    """Logs what the check found and, when nobody could reach the node, what to do about it."""
    if result.reachable is None:
        if not result.checked:
            why = "no direct TCP address to check"
        elif not result.asked:
            why = "no initial peer to ask"
        else:
            why = f"none of {', '.join(p[:12] for p in result.asked)} answered"
        logger.info(f"reachability not checked ({why})")
        return
    if result.reachable:
        logger.info(f"reachable by other peers at {', '.join(result.reachable_at)}")
        return
    ports = sorted({str(tcp_endpoint(m)[1]) for m in result.checked})
    relay = (
        "this node uses auto-relay: peers will reach it through a relay, more slowly, and trainers will prefer "
        "direct peers"
        if use_auto_relay
        else "or rejoin with --use-auto-relay to be reached through a relay (slower; trainers prefer direct peers)"
    )
    logger.warning(
        f"other peers cannot connect to this node at {', '.join(result.checked)} "
        f"({'; '.join(result.failures[:4])}). It can call out but cannot serve. Open or forward TCP port(s) "
        f"{', '.join(ports)} to this machine (in Docker: publish it, e.g. -p {ports[0]}:{ports[0]}), listen on a "
        f"fixed port with --host-maddrs /ip4/0.0.0.0/tcp/PORT and announce your public address with "
        f"--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT; {relay}"
    )
