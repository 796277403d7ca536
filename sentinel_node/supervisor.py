"""A swarm of ``sentinel-node join`` processes on this machine, supervised: what the demo, the benches and the
tests start and stop.

:class:`LocalSwarm` starts each node in its own process group, reads the lines ``join`` prints once the node
serves, and stops every one of them: SIGTERM, then SIGKILL of its group after a grace period, then SIGKILL of any
process it started that outlived it, each found by pid and start time (:mod:`sentinel_node.processes`), never by
name. A node's ``--status-file`` is read back as its typed status (:mod:`sentinel_node.roles.status`).
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hivemind.utils import get_logger

from sentinel_node.forkserver import ForkedProcess, ForkServer, ForkServerError
from sentinel_node.processes import alive, command_name, descendants, start_time
from sentinel_node.roles.status import StageStatus, TrainerStatus, VerifierStatus, read_status

CLI = [sys.executable, "-c", "from sentinel_node.cli import main; main()"]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# Nodes are forked from a process that has imported what they need (sentinel_node.forkserver) unless this is "0".
FORK_ENV = "SENTINEL_FORK_NODES"

logger = get_logger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where a node runs: in network namespace ``netns`` (made by ``ip netns add``) if given, after ``prefix`` if
    given (a command that execs the node in place, so the process and its group stay the node's own), listening on
    ``host`` (an IPv4 address)."""

    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    args: tuple[str, ...] = ()  # join options the place needs (e.g. --use-auto-relay behind a NAT)
    netns: str | None = None

    @property
    def command_prefix(self) -> tuple[str, ...]:
        """What goes before the node's command when it is exec'd (a forked node enters ``netns`` itself)."""
        return (*(("ip", "netns", "exec", self.netns) if self.netns else ()), *self.prefix)


class SwarmStartError(RuntimeError):
    """A node of the local swarm did not start; the message quotes the end of its log."""


@dataclass
class NodeProcess:
    """One ``sentinel-node join`` process of a local swarm."""

    name: str
    role: str
    process: subprocess.Popen | ForkedProcess
    log_path: Path
    status_path: Path
    identity_path: Path
    peer_id: str | None = None
    maddrs: list[str] = field(default_factory=list)
    metrics_port: int | None = None
    command: list[str] = field(default_factory=list, repr=False)
    netns: str | None = None
    lines: queue.Queue = field(default_factory=queue.Queue, repr=False)
    output: list[str] = field(default_factory=list, repr=False)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def status(self) -> StageStatus | VerifierStatus | TrainerStatus | None:
        """The node's last status (its counters and its view of the swarm), or None before it wrote one."""
        return read_status(self.status_path)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        """Waits for the lines ``sentinel-node join`` prints once the node serves; SwarmStartError if it dies or
        takes longer than ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.maddrs:
                    return  # the address lines come in one burst
                if not self.alive:
                    break
                continue
            if line.startswith("node ") and " is up" in line:
                self.peer_id = line.split()[1]
            elif line.strip().startswith("--initial-peers"):
                self.maddrs.append(line.split()[-1])
        state = f"exited with code {self.process.poll()}" if not self.alive else f"was not ready in {timeout:.0f}s"
        raise SwarmStartError(f"{self.name} ({self.role}) {state}; its log ends with:\n{self.log_tail()}")

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)


class LocalSwarm:
    """Nodes of one swarm started on this machine; :meth:`stop` (or leaving the ``with`` block) ends them all."""

    def __init__(
        self,
        workdir: Path,
        config_path: Path,
        placement: Callable[[str], Placement | None] | None = None,
        fork: bool | None = None,
        forkserver: ForkServer | None = None,
    ) -> None:
        """``placement`` says, by node name, where each node runs (None, or no placement: on loopback here).
        ``fork``: whether nodes without a command prefix are forked from a process that has already imported what
        they need (seconds of CPU less per node; :mod:`sentinel_node.forkserver`) instead of exec'd. By default
        they are where no GPU is visible (a process forked after the CUDA driver started cannot use it, and a node
        on a GPU is worth its import), unless the environment's SENTINEL_FORK_NODES is 0.
        ``forkserver``: a server shared with other swarms (its imports paid once for all of them), which this swarm
        forks from and leaves running: its owner closes it. None: the swarm starts its own on first use, and
        :meth:`stop` ends it."""
        self.workdir, self.config_path = Path(workdir), Path(config_path)
        self.placement = placement
        if fork is None:
            import torch

            fork = os.environ.get(FORK_ENV, "1") != "0" and not torch.cuda.is_available()
        self.fork = fork
        self._forkserver: ForkServer | None = forkserver
        self._owns_forkserver = forkserver is None
        self.nodes: dict[str, NodeProcess] = {}
        # pid -> start time: a pid seen once may later name another process, which must never be signalled
        self._descendants: dict[int, int] = {}

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def initial_peers(self) -> list[str]:
        bootstrap = self.nodes.get("bootstrap")
        return bootstrap.maddrs if bootstrap else []

    def identity(self, name: str) -> Path:
        return self.workdir / "identities" / f"{name}.key"

    def start(
        self, name: str, role: str, *args: str, metrics: bool = False, config: Path | None | bool = True
    ) -> NodeProcess:
        """Starts a node (without waiting for it); its stderr goes to ``logs/NAME.log``. With ``metrics``, it
        serves Prometheus metrics on a free port of this machine (``node.metrics_port``; on loopback, so only for
        nodes placed on this host's own network). ``config``: True for
        the swarm's config file, a path for another, False for none (the node runs the config the swarm
        publishes)."""
        if name in self.nodes:
            raise ValueError(f"a node named {name} was already started")
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (self.workdir / "status").mkdir(parents=True, exist_ok=True)
        status_path = self.workdir / "status" / f"{name}.json"
        metrics_port = free_port() if metrics else None
        placement = (self.placement(name) if self.placement else None) or Placement()
        command = [
            *placement.command_prefix,
            *CLI,
            "join",
            "--role",
            role,
            *(["--config", str(self.config_path if config is True else config)] if config else []),
            "--identity",
            str(self.identity(name)),
            "--host-maddrs",
            f"/ip4/{placement.host}/tcp/0",
            *(["--initial-peers", *self.initial_peers] if self.initial_peers else []),
            *([] if role == "bootstrap" else ["--status-file", str(status_path)]),
            *([] if metrics_port is None else ["--metrics-port", str(metrics_port)]),
            *placement.args,
            *args,
        ]
        node = self._launch(name, role, command, status_path, placement.netns)
        node.metrics_port = metrics_port
        return node

    def restart(self, name: str, *extra: str) -> NodeProcess:
        """Starts a stopped node again with the same command (identity, state directory, metrics port), plus
        ``extra`` arguments."""
        old = self.nodes.pop(name)
        if old.alive:
            self.nodes[name] = old
            raise ValueError(f"{name} is still running; stop it first")
        node = self._launch(name, old.role, [*old.command, *extra], old.status_path, old.netns)
        node.metrics_port = old.metrics_port
        return node

    def _launch(
        self, name: str, role: str, command: list[str], status_path: Path, netns: str | None = None
    ) -> NodeProcess:
        log_path = self.workdir / "logs" / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = self._fork(command, log_path, env, netns)
        if process is None:
            with log_path.open("a") as log:
                process = subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,  # its own process group: stopping it reaches its DHT child and p2pd
                    env=env,
                )
        node = NodeProcess(
            name, role, process, log_path, status_path, self.identity(name), command=command, netns=netns
        )
        threading.Thread(target=node._pump, name=f"pump-{name}", daemon=True).start()
        self.nodes[name] = node
        return node

    def _fork(
        self, command: list[str], log_path: Path, env: dict[str, str], netns: str | None = None
    ) -> ForkedProcess | None:
        """The node forked from the fork server (started on first use), in network namespace ``netns`` if given; or
        None where it must be exec'd: a command prefix other than the namespace's, forking turned off, or a server
        that failed (said once in the log)."""
        namespace = Placement(netns=netns).command_prefix
        if command[: len(namespace)] != list(namespace):
            return None
        command = command[len(namespace) :]
        if not self.fork or command[: len(CLI)] != CLI:
            return None
        try:
            if self._forkserver is None:
                self._forkserver = ForkServer(self.workdir / "logs" / "forkserver.log")
            return self._forkserver.spawn(command[len(CLI) :], log_path, env, netns=netns)
        except ForkServerError as e:
            logger.warning(f"nodes are exec'd from now on: {e}")
            self.fork = False
            return None

    def wait_ready(self, nodes: Sequence[NodeProcess], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for node in nodes:
            node.wait_ready(max(1.0, deadline - time.monotonic()))
            self._remember_descendants(node)

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        """Sends ``signum`` to a node's whole process group (SIGKILL: as if the machine lost power, so also to every
        process below the node that left its group: torch's ``torch_shm_manager``, which hivemind's ``file_system``
        sharing strategy starts, calls setsid, and the churn soak saw it outlive killed nodes)."""
        node = self.nodes[name]
        self._remember_descendants(node)
        below = {pid: start_time(pid) for pid in descendants(node.process.pid)}
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signum)
        if signum == signal.SIGKILL:
            for pid, started in below.items():
                if started is not None and alive(pid) and start_time(pid) == started:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            node.process.wait(timeout=10)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to every node, SIGKILL to the process groups of those still running after ``grace`` seconds,
        then SIGKILL to any process they started that outlived them."""
        for node in self.nodes.values():
            self._remember_descendants(node)
            if node.alive:
                with contextlib.suppress(ProcessLookupError):
                    node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for node in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for node in self.nodes.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=5)
        if self._forkserver is not None and self._owns_forkserver:
            self._forkserver.close()
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5  # a killed process takes a moment to die
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)

    def leftovers(self) -> dict[int, str]:
        """Processes this swarm started that are still alive, with their command names (none after :meth:`stop`)."""
        found = {}
        for pid, started in self._descendants.items():
            if alive(pid) and start_time(pid) == started:
                found[pid] = command_name(pid)
        for node in self.nodes.values():
            if node.process.poll() is None:
                found[node.process.pid] = command_name(node.process.pid)
        if self._forkserver is not None and self._owns_forkserver and self._forkserver.alive:
            found[self._forkserver.process.pid] = command_name(self._forkserver.process.pid)
        return dict(sorted(found.items()))

    def _remember_descendants(self, node: NodeProcess) -> None:
        for pid in descendants(node.process.pid):
            started = start_time(pid)
            if started is not None:
                self._descendants[pid] = started


def free_port() -> int:
    """A TCP port free on this machine a moment ago (the node binds it soon after; a clash fails its start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def follow_json_lines(path: Path, node: NodeProcess, poll: float = 0.2) -> Iterator[dict]:
    """The JSON lines appended to ``path`` until ``node`` exits (and the rest after it did)."""
    position = 0
    while True:
        running = node.alive
        try:
            with path.open("rb") as f:
                f.seek(position)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        complete = chunk[: chunk.rfind(b"\n") + 1]
        position += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                yield json.loads(line)
        if not running:
            return
        time.sleep(poll)
