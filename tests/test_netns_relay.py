"""A node behind a NAT that may open connections to its bootstrap alone (a strict firewall) is reached through the
bootstrap's relay: its daemon reserves a slot there at start, announces a ``/p2p-circuit`` address, and a peer on
the hub that cannot dial it calls its transport through the circuit (roles.relays says how it is set up).

Three real DHT nodes started as the roles start them (tests/relay_peer.py), each with its p2pd, in namespaces of
its own (tests/netns.py): the bootstrap on the hub, the hidden node behind the NAT router, a caller on the hub.
The hidden node joins once the bootstrap's relay service runs: p2pd starts it on the bootstrap's first public
AutoNAT verdict (its first probe comes 15 s after start, and the caller answers it), and a reservation made with
the relay that answered before is lost with it (roles.relays).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import netns
import pytest

from sentinel_node.processes import command_name, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PEER = Path(__file__).with_name("relay_peer.py")
CIRCUIT_WITHIN_S = 60.0  # measured: the circuit address is there in the daemon's first answer (static relays)
ANSWER_WITHIN_S = 90.0
RELAY_SERVICE_AFTER_S = 30.0  # the bootstrap's AutoNAT probes 15 s after it starts; twice that, for a loaded machine


class Peer:
    """A relay_peer.py process in a host's namespace; its JSON lines gathered as they come."""

    def __init__(self, host: netns.Host, log: Path, *args: str) -> None:
        self.lines: list[dict] = []
        self.started = time.monotonic()
        self.log = log
        self.process = subprocess.Popen(
            [*host.prefix, sys.executable, str(PEER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def wait_for(self, what, within: float) -> dict | None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and self.process.poll() is None:
            found = next((line for line in list(self.lines) if what(line)), None)
            if found is not None:
                return found
            time.sleep(0.5)
        return next((line for line in list(self.lines) if what(line)), None)

    def said(self) -> str:
        """What it logged (the last lines): what an assertion about it says when it fails."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])

    def daemon_arguments(self) -> list[str]:
        """The command line of the p2pd under this peer."""
        daemons = [pid for pid in descendants(self.process.pid) if command_name(pid) == "p2pd"]
        return Path(f"/proc/{daemons[0]}/cmdline").read_text().split("\0") if daemons else []

    def stop(self) -> None:
        """Closes its stdin (it stops its DHT and p2pd), then its process group if it lingers."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def test_a_node_behind_a_nat_is_called_through_its_bootstraps_relay(tmp_path):
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    with netns.Network() as network:
        hub = network.add("bootstrap")
        hidden_host = network.add("hidden", hidden=True, dials=[hub.ip])
        caller_host = network.add("caller")
        peers: list[Peer] = []
        try:
            bootstrap = Peer(hub, tmp_path / "bootstrap.log", "bootstrap", hub.ip)
            peers.append(bootstrap)
            first = bootstrap.wait_for(lambda line: "peer_id" in line, 60)
            assert first is not None, bootstrap.said()
            boot_maddr = next(m for m in first["maddrs"] if hub.ip in m)
            boot_id = first["peer_id"]

            caller = Peer(caller_host, tmp_path / "caller.log", "caller", caller_host.ip, boot_maddr)
            peers.append(caller)
            assert caller.wait_for(lambda line: "peer_id" in line, 60) is not None, caller.said()
            time.sleep(max(0.0, RELAY_SERVICE_AFTER_S - (time.monotonic() - bootstrap.started)))

            hidden = Peer(hidden_host, tmp_path / "hidden.log", "hidden", hidden_host.ip, boot_maddr)
            peers.append(hidden)
            started = hidden.wait_for(lambda line: "peer_id" in line, 60)
            assert started is not None, hidden.said()
            hidden_id = started["peer_id"]
            circuit = f"/ip4/{hub.ip}/tcp/31337/p2p/{boot_id}/p2p-circuit/p2p/{hidden_id}"
            announced = hidden.wait_for(lambda line: circuit in line["maddrs"], CIRCUIT_WITHIN_S)
            assert announced is not None, (circuit, hidden.lines[-1:], hidden.said())

            caller.process.stdin.write(hidden_id + "\n")
            caller.process.stdin.flush()
            answer = caller.wait_for(lambda line: line.get("answered"), ANSWER_WITHIN_S)
            assert answer is not None, (caller.lines[-3:], caller.said(), hidden.said())
            # the check ran on the hidden node (it tried the closed port it was given) and came back
            assert len(answer["failed"]) == 1 and answer["failed"][0].startswith("/ip4/127.0.0.1/tcp/9: ")
            # the caller reaches the hidden node only through the bootstrap's circuit, and the hidden node sees the
            # caller only through it (it may not dial the caller itself)
            via = answer["connections"][hidden_id]
            assert via and all(f"/p2p/{boot_id}/p2p-circuit" in a for a in via), via
            caller_id = next(line["peer_id"] for line in caller.lines if "peer_id" in line)
            seen = hidden.wait_for(lambda line: caller_id in line.get("connections", {}), 10)
            assert seen is not None and all("/p2p-circuit" in a for a in seen["connections"][caller_id]), seen
            assert seen["connections"][boot_id] == [f"/ip4/{hub.ip}/tcp/31337"]
            # and the circuit carries tensors' sizes: 1 MiB, where go-libp2p's default relay resets at 128 KiB
            assert answer["bulk"] == 1 << 20, answer["bulk"]

            # what set it up: its initial peer as a static relay, its reachability private (roles.relays)
            hidden_argv = hidden.daemon_arguments()
            assert "-autoRelay=1" in hidden_argv and "-relayDiscovery=0" in hidden_argv, hidden_argv
            assert f"-trustedRelays={boot_maddr}" in hidden_argv and "-forceReachabilityPrivate=1" in hidden_argv
        finally:
            for peer in reversed(peers):
                peer.stop()
    assert not network.leftovers()
