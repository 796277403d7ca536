"""Reachability: other peers dial a node's announced addresses from their side, on real DHT nodes and p2pd
daemons on loopback; a node that nobody can reach says what to open and is announced as relayed."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import Iterator

import pytest

from dht import create_identity_file
from sentinel_node.config import load_config
from sentinel_node.demo import DEMO_CONFIG_PATH
from sentinel_node.roles.common import start_dht, stop_dht
from sentinel_node.roles.reachability import (
    CheckRateLimit,
    addresses_to_check,
    check_reachability,
    serve_reachability,
    tcp_endpoint,
)
from sentinel_node.roles.wire import transport_settings
from sentinel_node.supervisor import CLI, LocalSwarm
from sentinel_node.transport import HopRefused, TensorServer

PEER = "QmYmjRMDzTJYFwFd27VsbA8YJm79zcZDjWAQdQwG2m8sXR"


def closed_port() -> int:
    """A loopback port nothing listens on (bound a moment ago, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_direct_tcp_addresses_are_dialed_and_loopback_only_when_alone():
    assert tcp_endpoint(f"/ip4/10.0.0.5/tcp/31337/p2p/{PEER}") == ("10.0.0.5", 31337)
    assert tcp_endpoint("/ip6/::1/tcp/4001") == ("::1", 4001)
    assert tcp_endpoint(f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}/p2p-circuit") is None
    assert tcp_endpoint("/ip4/1.2.3.4/udp/1/quic") is None
    assert tcp_endpoint("not a multiaddr") is None
    mixed = ["/ip4/127.0.0.1/tcp/5", "/ip4/192.168.1.7/tcp/5", "/ip4/192.168.1.7/tcp/5", "/ip4/1.2.3.4/udp/5/quic"]
    assert addresses_to_check(mixed) == ["/ip4/192.168.1.7/tcp/5"]
    assert addresses_to_check(["/ip4/127.0.0.1/tcp/5"]) == ["/ip4/127.0.0.1/tcp/5"]


def test_a_caller_gets_one_check_per_interval():
    limit = CheckRateLimit(interval=60)
    limit(PEER)
    with pytest.raises(HopRefused, match="one reachability check per 60s"):
        limit(PEER)
    limit("QmOtherPeerOtherPeerOtherPeerOtherPeer")  # others are not held back
    unlimited = CheckRateLimit(interval=0)
    unlimited(PEER)
    unlimited(PEER)  # no refusal


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple]:
    """Two DHT nodes: ``a`` answers checks, ``b`` asks; and a third, ``mute``, that serves no check."""
    config = load_config(DEMO_CONFIG_PATH)
    directory = tmp_path_factory.mktemp("reach")
    identities = [create_identity_file(directory / f"{name}.key") for name in ("a", "b", "mute")]
    a = start_dht(config, identities[0], check_identity=False)
    peers = [str(m) for m in a.get_visible_maddrs()]
    b = start_dht(config, identities[1], initial_peers=peers, check_identity=False)
    mute = start_dht(config, identities[2], initial_peers=peers, check_identity=False)
    loop = asyncio.new_event_loop()
    p2p_a, p2p_b = loop.run_until_complete(a.replicate_p2p()), loop.run_until_complete(b.replicate_p2p())
    settings = transport_settings(config)
    server = TensorServer(p2p_a, settings)
    loop.run_until_complete(serve_reachability(server, interval=0))  # the tests below ask again at once
    try:
        yield loop, p2p_b, settings, identities, [str(m) for m in b.get_visible_maddrs()]
    finally:
        loop.run_until_complete(server.remove_handlers())
        for p2p in (p2p_a, p2p_b):
            loop.run_until_complete(p2p.shutdown())
        loop.close()
        for dht in (a, b, mute):
            stop_dht(dht)


def test_a_peer_reaches_an_open_address(pair):
    loop, p2p, settings, identities, maddrs = pair
    result = loop.run_until_complete(check_reachability(p2p, maddrs, [identities[0].peer_id], settings))
    assert result.reachable is True and not result.relayed
    assert result.answered_by == (identities[0].peer_id,)
    assert set(result.reachable_at) == set(addresses_to_check(maddrs))


def test_a_closed_address_is_unreachable_and_says_why(pair):
    loop, p2p, settings, identities, _ = pair
    closed = f"/ip4/127.0.0.1/tcp/{closed_port()}"
    result = loop.run_until_complete(check_reachability(p2p, [closed], [identities[0].peer_id], settings))
    assert result.reachable is False and result.relayed
    assert result.checked == (closed,) and not result.reachable_at
    assert "refused" in result.failures[0].lower()


def test_nobody_to_ask_or_nobody_answering_is_unknown_not_unreachable(pair):
    loop, p2p, settings, identities, maddrs = pair
    assert loop.run_until_complete(check_reachability(p2p, maddrs, [], settings)).reachable is None
    silent = loop.run_until_complete(check_reachability(p2p, maddrs, [identities[2].peer_id], settings))
    assert silent.reachable is None and not silent.relayed
    assert silent.asked == (identities[2].peer_id,)


@pytest.mark.slow
def test_an_unreachable_node_says_what_to_open_and_is_announced_relayed(tmp_path, forkserver):
    port = closed_port()
    with LocalSwarm(tmp_path, DEMO_CONFIG_PATH, forkserver=forkserver) as swarm:
        bootstrap = swarm.start("bootstrap", "bootstrap")
        swarm.wait_ready([bootstrap], 60)
        hidden = swarm.start("verifier", "verifier", "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
        open_ = swarm.start("verifier2", "verifier")
        swarm.wait_ready([hidden, open_], 90)
        log = hidden.log_tail(20000)
        assert "other peers cannot connect to this node" in log
        assert f"forward TCP port(s) {port}" in log and "--use-auto-relay" in log
        hidden_status = hidden.status()
        assert hidden_status is not None and hidden_status.reachability.reachable is False
        assert open_.status().reachability.reachable is True
        peers = subprocess.run(
            [
                *CLI,
                "swarm",
                "peers",
                "--json",
                "--config",
                str(DEMO_CONFIG_PATH),
                "--initial-peers",
                *swarm.initial_peers,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert peers.returncode == 0, peers.stderr
        relayed = {row["peer_id"]: row["relayed"] for row in json.loads(peers.stdout)["peers"]}
        assert relayed[hidden.peer_id] is True and relayed[open_.peer_id] is False


def test_connections_through_a_relay_are_told_from_direct_ones():
    from sentinel_node.roles.node import classify_connections

    relay = "QmRelayRelayRelayRelayRelayRelayRelayRelayRel"
    circuit = f"/ip4/10.213.0.1/tcp/4001/p2p/{relay}/p2p-circuit"
    listed = classify_connections(
        [
            (PEER, [circuit]),
            (relay, ["/ip4/10.213.0.1/tcp/4001"]),
            ("QmBoth", [circuit]),
            ("QmBoth", ["/ip4/10.213.0.9/tcp/5"]),  # one direct connection besides the relayed one: direct
            ("QmNone", []),
        ]
    )
    assert listed.relayed == [PEER]
    assert listed.direct == sorted(["QmBoth", "QmNone", relay])


async def _forget_everyone(_dht, node) -> int:
    """As a partition leaves a node's routing table: every neighbour dropped (hivemind drops one per failed call)."""
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.uid_to_peer_id)


async def _neighbours(_dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def test_a_node_that_lost_every_neighbour_rejoins_through_its_initial_peers(tmp_path):
    from sentinel_node.roles.common import rejoin_if_alone

    config = load_config(DEMO_CONFIG_PATH)
    a = start_dht(config, create_identity_file(tmp_path / "a.key"), check_identity=False)
    peers = [str(m) for m in a.get_visible_maddrs()]
    b = start_dht(config, create_identity_file(tmp_path / "b.key"), initial_peers=peers, check_identity=False)
    try:
        assert b.run_coroutine(_neighbours) >= 1
        assert rejoin_if_alone(b, peers) is None  # not alone: nothing done
        assert b.run_coroutine(_forget_everyone) == 0
        assert rejoin_if_alone(b, peers) == 1
        assert b.run_coroutine(_neighbours) >= 1
        assert rejoin_if_alone(b, []) is None  # nobody to rejoin through
    finally:
        for dht in (b, a):
            stop_dht(dht)
