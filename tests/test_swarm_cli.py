"""``sentinel-node join --role bootstrap`` as real processes, read with ``sentinel-node swarm ...``.

Nodes run as subprocesses, each in its own process group and stopped by its pid (SIGTERM, then SIGKILL to its
group); the ``swarm`` commands run in this process (click's runner), which saves importing hivemind each time.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import yaml
from click.testing import CliRunner, Result

from dht import StrikeRecord, ephemeral_identity
from peers import StrikeLedger, SwarmView
from sentinel_node.cli import main
from sentinel_node.cli.swarm_tables import render_bans, render_strikes, short_id, to_json
from sentinel_node.config import load_config
from sentinel_node.processes import alive, command_name, descendants

CLI = [sys.executable, "-c", "from sentinel_node.cli import main; main()"]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class Node:
    """A ``sentinel-node join`` process, its stdout read by a thread so reads can time out."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(
            [*CLI, "join", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, so the test can clean up everything it started
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.peer_id, self.maddrs = self._wait_ready(timeout=60)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def _wait_ready(self, timeout: float) -> tuple[str, list[str]]:
        deadline, peer_id, maddrs = time.monotonic() + timeout, None, []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                if maddrs:
                    return peer_id, maddrs
                continue
            if line.startswith("node "):
                peer_id = line.split()[1]
            elif "--initial-peers" in line:
                maddrs.append(line.split()[-1])
        self.stop()
        raise AssertionError(f"node did not print its multiaddrs; stderr:\n{self.proc.stderr.read()[-3000:]}")

    def stop(self, signum: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left in its group
        return self.proc.wait()


def swarm_cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["swarm", *args])


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("config") / "swarm.yaml"
    swarm = {"prefix": "cli-test", "announce_period": 0.5, "announce_ttl": 4.0, "request_timeout": 5.0}
    swarm |= {"open_trainers": True, "open_verifiers": True}  # lifecycles under test here, not admission
    path.write_text(yaml.safe_dump({"swarm": swarm}))
    return str(path)


@pytest.fixture(scope="module")
def bootstraps(config_path, tmp_path_factory) -> Iterator[list[Node]]:
    identity = tmp_path_factory.mktemp("identity") / "first.key"
    nodes = [
        Node(["--role", "bootstrap", "--config", config_path, "--identity", str(identity), "--host-maddrs", LOOPBACK])
    ]
    try:
        joining = [
            threading.Thread(
                target=lambda: nodes.append(
                    Node(
                        [
                            "--role",
                            "bootstrap",
                            "--config",
                            config_path,
                            "--host-maddrs",
                            LOOPBACK,
                            "--initial-peers",
                            *nodes[0].maddrs,
                        ]
                    )
                )
            )
            for _ in range(2)
        ]
        for thread in joining:
            thread.start()
        for thread in joining:
            thread.join()
        assert oct(identity.stat().st_mode & 0o777) == oct(0o600)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def status(config_path: str, node: Node, section: str = "status") -> dict:
    result = swarm_cli(
        section, "--json", "--config", config_path, "--initial-peers", node.maddrs[0], "--timeout", "20"
    )
    assert result.exit_code == 0, result.output[-3000:]
    return json.loads(result.stdout)


@pytest.mark.slow
def test_swarm_status_json_reflects_every_bootstrap(bootstraps, config_path):
    assert len(bootstraps) == 3
    expected = {n.peer_id for n in bootstraps}
    deadline = time.monotonic() + 60  # announcements spread within seconds; a loaded machine may need more
    while True:
        report = status(config_path, bootstraps[2])  # ask through a node that joined through another
        if {b["peer_id"] for b in report["bootstraps"]} == expected or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {b["peer_id"] for b in report["bootstraps"]} == expected
    assert all(b["state"] == "online" and b["live"] for b in report["bootstraps"])
    assert report["swarm"] == "cli-test" and report["n_stages"] == 4
    assert report["health"]["ok"] is False and report["health"]["stages_without_replica"] == [0, 1, 2, 3]
    assert report["bans"] == {} and report["strikes"] == {}

    table = swarm_cli("status", "--config", config_path, "--initial-peers", bootstraps[0].maddrs[0])
    assert table.exit_code == 0, table.output[-3000:]
    assert all(n.peer_id in table.stdout for n in bootstraps)
    assert "health: broken: no live replica for stage 0, 1, 2, 3" in table.stdout
    assert "0 tok/s" in table.stdout and "0 checks/s" in table.stdout  # every figure has its unit
    # a node given nothing but an address reads the swarm's own config (this swarm's is not the default one)
    fetched = swarm_cli("status", "--json", "--initial-peers", bootstraps[1].maddrs[0], "--timeout", "20")
    assert fetched.exit_code == 0, fetched.output[-3000:]
    assert json.loads(fetched.stdout)["swarm"] == "cli-test"
    assert swarm_cli("status", "--check", "--initial-peers", bootstraps[1].maddrs[0]).exit_code == 2  # broken


@pytest.mark.slow
def test_unreachable_or_missing_bootstrap_gives_a_clear_error_quickly(bootstraps, config_path):
    port = bootstraps[0].maddrs[0].split("/tcp/")[1].split("/")[0]
    dead = bootstraps[0].maddrs[0].replace(f"/tcp/{port}/", "/tcp/1/")  # nothing listens on port 1
    started = time.monotonic()
    result = swarm_cli("status", "--config", config_path, "--initial-peers", dead, "--timeout", "5")
    assert result.exit_code == 1
    assert "none of the --initial-peers answered" in result.stderr
    assert time.monotonic() - started < 5

    result = swarm_cli("status", "--initial-peers", "not-a-multiaddr")
    assert result.exit_code == 2 and "--initial-peers" in result.stderr and "not a multiaddr" in result.stderr
    result = swarm_cli("status", "--initial-peers", dead.split("/p2p/")[0])
    assert result.exit_code == 2 and "must end in /p2p/<peer id>" in result.stderr
    result = swarm_cli("bans", "--config", config_path)
    assert result.exit_code == 2 and "pass --initial-peers" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("role", "signum"), [("bootstrap", signal.SIGTERM), ("bootstrap", signal.SIGINT), ("trainer", signal.SIGINT)]
)
def test_a_stopped_node_leaves_no_child_behind_and_goes_offline(bootstraps, config_path, role, signum):
    # a trainer in a swarm without stages waits for them: it must stop cleanly meanwhile too
    node = Node(
        [
            "--role",
            role,
            "--config",
            config_path,
            "--host-maddrs",
            LOOPBACK,
            "--initial-peers",
            *bootstraps[0].maddrs,
        ]
    )
    children = descendants(node.proc.pid)
    names = {command_name(pid) for pid in children}
    assert "p2pd" in names, names  # the DHT child and its daemon are there to be cleaned up
    try:
        if signum == signal.SIGINT:
            os.killpg(node.proc.pid, signum)  # Ctrl-C in a terminal reaches the whole process group
        else:
            node.proc.send_signal(signum)
        assert node.proc.wait(timeout=15) == 0
        stderr = node.proc.stderr.read()
        assert "Traceback" not in stderr, stderr[-3000:]  # Ctrl-C reaches p2pd too: no lost-connection noise
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in children):
            time.sleep(0.1)
        assert [command_name(pid) for pid in children if alive(pid)] == []
    finally:
        node.stop()
        for pid in children:  # only if the assertion above failed: never leak what this test started
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    # its withdrawal is usually read at once; where Ctrl-C ended its p2pd before the withdrawal was stored (the
    # signal reaches the whole group; one make test run, 2026-12-04), its announcement lapses within its ttl
    deadline = time.monotonic() + load_config(config_path).swarm.announce_ttl + 5.0
    while True:
        peers = status(config_path, bootstraps[0], "peers")["peers"]
        mine = [p for p in peers if p["peer_id"] == node.peer_id]
        if mine == [] or mine[0]["state"] == "offline" or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert mine == [] or mine[0]["state"] == "offline", mine


def test_strikes_and_bans_render_with_their_verifiers():
    config = load_config(None).with_overrides(swarm={"trusted_verifiers": [], "ban_quorum": 2, "open_verifiers": True})
    verifiers, accused = [ephemeral_identity().peer_id for _ in range(3)], ephemeral_identity().peer_id
    records = [
        StrikeRecord(
            verifier=v,
            accused=accused,
            boundary=1,
            direction="gradient",
            strikes=3 if banned else 1,
            checks=40,
            flags=3,
            metrics={"l2": 7.5},
            banned=banned,
            config_hash=config.swarm_hash(),
            version="test",
            time=100.0,
        )
        for v, banned in zip(verifiers, [True, True, False], strict=True)
    ]
    ledger = StrikeLedger.from_records(records)
    policy = config.swarm.exclusion_policy()
    voters = frozenset(verifiers)  # seen long enough by this reader (an open set's rule)
    view = SwarmView(
        config.pipeline.n_stages,
        ledger=ledger,
        excluded=policy.excluded(ledger, voters),
        time=110.0,
        open_voters=voters,
    )

    strikes = render_strikes(view, config, wide=True)
    assert all(v in strikes for v in verifiers) and "1|2" in strikes and "l2=7.5" in strikes and "10s" in strikes
    assert all(short_id(v) in render_strikes(view, config) for v in verifiers)
    bans = render_bans(view, config, wide=True)
    assert accused in bans and "2/2" in bans and "open set" in bans
    report = to_json(view, config, "bans")["bans"]
    assert set(report[accused]["voters"]) == set(verifiers[:2])
    assert [s["vote"] for s in to_json(view, config, "strikes")["strikes"][accused]].count(True) == 2
    # strict JSON even for a record that holds what no valid record may (built in memory, not read from the DHT)
    odd = records[0].copy(update={"metrics": {"l2": float("nan"), "l1": float("inf")}})
    odd_view = SwarmView(config.pipeline.n_stages, ledger=StrikeLedger.from_records([odd]), time=110.0)
    text = json.dumps(to_json(odd_view, config, "strikes"), allow_nan=False)
    assert (
        "NaN" not in text
        and "Infinity" not in text
        and json.loads(text)["strikes"][accused][0]["metrics"]
        == {
            "l2": None,
            "l1": None,
        }
    )


@pytest.mark.slow
def test_a_taken_metrics_port_is_a_clear_error_and_leaves_nothing_behind(bootstraps, config_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*CLI, "join", "--role", "bootstrap", "--config", config_path, "--host-maddrs", LOOPBACK]
            + ["--initial-peers", bootstraps[0].maddrs[0], "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
    assert result.returncode == 1
    assert f"--metrics-port {port}: cannot listen" in result.stderr and "choose a free port" in result.stderr


@pytest.mark.slow
def test_a_taken_host_port_is_a_clear_error(bootstraps, config_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*CLI, "join", "--role", "bootstrap", "--config", config_path]
            + ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
    assert result.returncode == 1
    assert f"--host-maddrs /ip4/127.0.0.1/tcp/{port}: cannot listen" in result.stderr, result.stderr[-2000:]
    assert "choose a free port" in result.stderr and "Traceback" not in result.stderr


def test_a_device_this_machine_lacks_is_a_clear_error():
    for device, message in (("cuda:7", "--device cuda:7: "), ("tpu-ish", "unknown device 'tpu-ish'")):
        result = subprocess.run(
            [*CLI, "join", "--role", "stage", "--stage", "0", "--device", device],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_metrics_port_and_relay_options_are_checked_before_anything_starts():
    result = CliRunner().invoke(main, ["join", "--role", "bootstrap", "--metrics-port", "70000"])
    assert result.exit_code == 2 and "--metrics-port" in result.output
    help_text = CliRunner().invoke(main, ["join", "--help"]).output
    for option in ("--use-relay / --no-use-relay", "--use-auto-relay", "--state-dir", "--metrics-port"):
        assert option in help_text


def test_a_bootstrap_on_a_random_port_with_a_kept_identity_warns(tmp_path):
    """Issue 16: a bootstrap restarted on port 0 came back alone (the nodes that knew its old port could not find
    it). The README's line gives it a fixed port; one started without says so."""
    import dataclasses

    from sentinel_node.roles.bootstrap import random_port_warning
    from sentinel_node.roles.common import JoinOptions

    options = JoinOptions(
        config=load_config(None), identity_path=str(tmp_path / "boot.key"), host_maddrs=("/ip4/0.0.0.0/tcp/0",)
    )
    warning = random_port_warning(options)
    assert warning is not None and "random port" in warning and "--host-maddrs /ip4/0.0.0.0/tcp/31337" in warning
    assert random_port_warning(dataclasses.replace(options, host_maddrs=("/ip4/0.0.0.0/tcp/31337",))) is None
    assert random_port_warning(dataclasses.replace(options, identity_path=None)) is None  # a new peer id anyway
