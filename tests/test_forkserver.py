"""Nodes forked from the fork server: each is what ``sentinel-node ...`` exec'd would be (its own session, its
output, its exit code, its signals), and nothing outlives the swarm that started them."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from sentinel_node import forkserver
from sentinel_node.demo import DEMO_CONFIG_PATH
from sentinel_node.forkserver import ForkedProcess, ForkServer
from sentinel_node.processes import alive
from sentinel_node.supervisor import CLI, LocalSwarm, Placement

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ForkServer:
    server = ForkServer(tmp_path_factory.mktemp("forkserver") / "forkserver.log")
    yield server
    server.close()
    assert not server.alive


def test_a_forked_command_prints_and_exits_as_the_cli_does(server: ForkServer, tmp_path: Path):
    child = server.spawn(["--help"], tmp_path / "help.log", dict(os.environ))
    out = child.stdout.read()
    assert child.wait(timeout=30) == 0
    assert "Usage: sentinel-node" in out and "join" in out


def test_a_bad_argument_is_the_cli_s_usage_error_with_its_exit_code(server: ForkServer, tmp_path: Path):
    log = tmp_path / "bad.log"
    child = server.spawn(["join", "--role", "nobody"], log, dict(os.environ))
    assert child.wait(timeout=30) == 2
    assert "Invalid value for '--role'" in log.read_text()
    assert "Traceback" not in log.read_text()


def test_a_forked_node_has_its_own_session_and_the_environment_it_was_given(server: ForkServer, tmp_path: Path):
    env = {**os.environ, "SENTINEL_FORK_TEST": "given"}
    config = tmp_path / "no-such.yaml"
    child = server.spawn(["join", "--role", "bootstrap", "--config", str(config)], tmp_path / "e.log", env)
    assert child.wait(timeout=30) != 0  # a missing config is a clear error
    assert "no-such.yaml" in (tmp_path / "e.log").read_text()
    node = LocalSwarm(tmp_path, DEMO_CONFIG_PATH, fork=True)
    with node:
        boot = node.start("bootstrap", "bootstrap")
        node.wait_ready([boot], timeout=90)
        assert isinstance(boot.process, ForkedProcess)
        assert os.getpgid(boot.process.pid) == boot.process.pid == os.getsid(boot.process.pid)
        environ = Path(f"/proc/{boot.process.pid}/environ").read_bytes().split(b"\0")
        assert b"PYTHONUNBUFFERED=1" in environ  # what the supervisor passed, set in the child's own environment
        node.stop(grace=15)
        assert node.leftovers() == {}
        assert boot.process.returncode == 0  # SIGTERM: it shut its DHT down itself


def test_a_node_killed_by_a_signal_reports_it_as_popen_does(server: ForkServer, tmp_path: Path):
    argv = ["join", "--role", "bootstrap", "--config", str(DEMO_CONFIG_PATH)]
    child = server.spawn(argv, tmp_path / "k.log", dict(os.environ))
    ready = child.stdout.readline()  # the node is up: it printed its first ready line
    assert ready.startswith("node "), (tmp_path / "k.log").read_text()
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert not alive(child.pid)


def test_children_do_not_share_the_server_s_random_state():
    np.random.seed(0)
    torch.manual_seed(0)
    forkserver._reseed()
    first = (np.random.randint(2**31), torch.initial_seed())
    forkserver._reseed()
    assert first != (np.random.randint(2**31), torch.initial_seed())


def test_a_swarm_whose_server_cannot_start_execs_its_nodes(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(forkserver, "PRELOAD", ("sentinel_node.no_such_module",))
    swarm = LocalSwarm(tmp_path, DEMO_CONFIG_PATH, fork=True)
    with swarm:
        boot = swarm.start("bootstrap", "bootstrap")
        swarm.wait_ready([boot], timeout=90)
        assert not isinstance(boot.process, ForkedProcess) and not swarm.fork
    assert swarm.leftovers() == {}
    assert "no_such_module" in (tmp_path / "logs" / "forkserver.log").read_text()


def test_a_node_behind_a_command_prefix_is_execd(tmp_path: Path):
    swarm = LocalSwarm(tmp_path, DEMO_CONFIG_PATH, fork=True)
    assert swarm._fork(["env", *CLI, "--help"], tmp_path / "x.log", {}) is None


def test_a_node_forked_into_a_namespace_that_does_not_exist_says_so(server: ForkServer, tmp_path: Path):
    log = tmp_path / "ns.log"
    child = server.spawn(["--help"], log, dict(os.environ), netns="sentinel-no-such-namespace")
    assert child.wait(timeout=30) == 1
    assert "cannot enter network namespace sentinel-no-such-namespace" in log.read_text()
    assert "Traceback" not in log.read_text()


def test_a_node_forked_into_a_namespace_serves_there(tmp_path: Path):
    import netns

    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    with netns.Network() as network:
        host = network.add("bootstrap", hidden=False)
        swarm = LocalSwarm(tmp_path, DEMO_CONFIG_PATH, lambda name: Placement(host=host.ip, netns=host.namespace))
        with swarm:
            boot = swarm.start("bootstrap", "bootstrap")
            swarm.wait_ready([boot], timeout=90)
            assert isinstance(boot.process, ForkedProcess)
            assert os.readlink(f"/proc/{boot.process.pid}/ns/net") != os.readlink("/proc/self/ns/net")
            assert any(f"/ip4/{host.ip}/" in maddr for maddr in boot.maddrs), boot.maddrs
        assert swarm.leftovers() == {}
