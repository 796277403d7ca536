"""Node processes forked from one that has already imported what a node needs.

A node spends its first seconds importing torch, hivemind and transformers' Llama blocks: about 6 CPU seconds for a
stage or a verifier on this project's 2-core machines, and 3 for a bootstrap, before it does anything. A
:class:`~sentinel_node.supervisor.LocalSwarm` of nine nodes spends most of its start there, and the demo, the
benches and the test suite start hundreds. A fork of a process that has imported them takes a few hundredths.

The server (:func:`serve`) is one process per :class:`ForkServer`, in its own session. It imports the roles, then
forks a child per request. The child becomes exactly what ``sentinel-node join ...`` would be:

- a session and process group of its own;
- the client's stdin, stdout and stderr, passed as file descriptors;
- the client's environment and working directory;
- fresh seeds for numpy's and torch's global generators (Python's ``random`` reseeds itself at fork);
- the CLI's ``main`` with the request's arguments, and the interpreter's exit: non-daemon threads joined, ``atexit``
  handlers run, the exit code of ``SystemExit``.

The server is the children's parent, so it reaps them and reports each exit code; :class:`ForkedProcess` gives the
client the part of :class:`subprocess.Popen` the supervisor uses (pid, stdout, poll, wait, send_signal).

Forking is safe here because the server forks from its only Python thread before any event loop, DHT, CUDA context or
torch thread pool exists; the two native threads its imports leave (OpenBLAS's pool, torch's) have fork handlers of
their own, and hivemind forks its DHT process from a node in the same state. A child cannot use a CUDA driver its
parent started, so the supervisor forks only where no GPU is visible; a node that must run behind a command prefix
(``ip netns exec``) is exec'd as before.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from sentinel_node.processes import alive

# What `join` imports for any role, so a fork has nothing left to import; the server's own cost is one node's start.
PRELOAD = (
    "sentinel_node.cli",
    "sentinel_node.roles.bootstrap",
    "sentinel_node.roles.stage",
    "sentinel_node.roles.verifier",
    "sentinel_node.roles.trainer",
)
_MESSAGE = 1 << 18  # bytes of one request or report (argv and environment; far above any node's)
_REAP_EVERY = 0.05  # seconds between the server's looks for exited children
_CLONE_NEWNET = 0x40000000  # sched.h


class ForkServerError(RuntimeError):
    """The fork server did not start, or stopped answering; the message says why."""


# --- the server ----------------------------------------------------------------------------------------------------


def serve(fd: int, preload: tuple[str, ...] = PRELOAD) -> None:
    """Runs the server on the socket ``fd`` until its client closes it; the entry point of the server process."""
    sock = socket.socket(fileno=fd)
    for module in preload:
        importlib.import_module(module)
    sock.send(json.dumps({"ready": os.getpid(), "threads": threading.active_count()}).encode())
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    children: set[int] = set()
    with contextlib.suppress(OSError):  # the client gone mid-report: the children live on, as a Popen's would
        _serve_requests(sock, selector, children)


def _serve_requests(sock: socket.socket, selector: selectors.BaseSelector, children: set[int]) -> None:
    while True:
        if selector.select(timeout=_REAP_EVERY):
            message, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 3)
            if not message:
                break  # the client is gone; the children live on, as a Popen's would
            request = json.loads(message)
            try:
                pid = os.fork()
            except OSError as e:
                for passed in fds:
                    os.close(passed)
                sock.send(json.dumps({"error": f"fork failed: {e}"}).encode())
                continue
            if pid == 0:
                _child(sock, fds, request)  # never returns
            for passed in fds:
                os.close(passed)
            children.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())
        for pid, code in _reap(children):
            sock.send(json.dumps({"exited": pid, "returncode": code}).encode())


def _reap(children: set[int]) -> list[tuple[int, int]]:
    exited = []
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            children.discard(pid)
            exited.append((pid, os.waitstatus_to_exitcode(status)))  # -N for signal N, as Popen.returncode
    return exited


def _child(sock: socket.socket, fds: list[int], request: dict) -> None:
    """The forked child: becomes ``sentinel-node ARGV`` and exits with its exit code, never returning."""
    code = 1
    try:
        os.setsid()
        sock.close()
        for target, passed in enumerate(fds):
            os.dup2(passed, target)
            os.close(passed)
        if request.get("netns"):
            try:
                _enter_netns(request["netns"])
            except OSError as e:
                print(f"sentinel-node: {e}", file=sys.stderr)
                return
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reseed()
        code = _run_cli(request["argv"])
    except BaseException:  # noqa: BLE001 (a child must exit here, whatever happened)
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()  # the interpreter's own exit: wait for non-daemon threads, then atexit
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _enter_netns(name: str) -> None:
    """Moves this (single-threaded) process into network namespace ``name``, as ``ip netns exec`` does before it
    execs: every socket opened from here on, and every process started, is in it. (``ip netns exec`` also remounts
    ``/sys`` and binds ``/etc/netns/NAME``; a node reads neither.)"""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    except OSError as e:
        raise OSError(e.errno, f"cannot enter network namespace {name}: {e.strerror}") from None
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot enter network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _reseed() -> None:
    import numpy as np
    import torch

    np.random.seed()
    torch.seed()


def _run_cli(argv: list[str]) -> int:
    """The CLI's ``main`` on ``argv``, and the exit code the interpreter would give it."""
    from sentinel_node.cli import main

    sys.argv = ["sentinel-node", *argv]
    try:
        main.main(args=argv, prog_name="sentinel-node")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0


# --- the client ----------------------------------------------------------------------------------------------------


class ForkedProcess:
    """A node forked by the server: what the supervisor uses of :class:`subprocess.Popen`."""

    def __init__(self, pid: int, stdout) -> None:
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked node {self.pid}", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class ForkServer:
    """A server process that forks ``sentinel-node`` nodes on request. :meth:`close` ends the server (not the nodes,
    which the supervisor stops); a server that dies marks its unreported children as exited with code -9 only
    once they are really gone."""

    def __init__(self, log_path: Path, timeout: float = 120.0, preload: tuple[str, ...] | None = None) -> None:
        """Starts the server, its own output appended to ``log_path``, and waits (at most ``timeout`` seconds) for its
        imports (``preload``, by default :data:`PRELOAD`); ForkServerError if it fails."""
        preload = PRELOAD if preload is None else tuple(preload)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()
        self._replies: list[dict] = []
        self._reply_ready = threading.Condition()
        self._state = threading.Lock()  # the children and the exits reported before spawn() saw their pid
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self.log_path = Path(log_path)
        try:
            log = open(log_path, "ab")  # noqa: SIM115 (closed below, once the server holds it)
            entry = f"from sentinel_node.forkserver import serve; serve({theirs.fileno()}, {preload!r})"
            self.process = subprocess.Popen(
                [sys.executable, "-c", entry],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        finally:
            theirs.close()
            log.close()
        ours.settimeout(timeout)
        try:
            hello = json.loads(ours.recv(_MESSAGE) or b"{}")
        except (OSError, ValueError) as e:
            hello = {"error": str(e)}
        if "ready" not in hello:
            self._kill_server()
            raise ForkServerError(
                f"the fork server did not start ({hello.get('error', 'no answer')}): {self._log_tail()}"
            )
        if hello.get("threads") != 1:
            self._kill_server()
            raise ForkServerError(f"the fork server has {hello.get('threads')} threads after its imports, not 1")
        ours.settimeout(None)
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def spawn(
        self, argv: list[str], stderr: Path, env: dict[str, str], timeout: float = 30.0, netns: str | None = None
    ) -> ForkedProcess:
        """Forks ``sentinel-node ARGV`` with its stdout on a pipe (the returned process's ``stdout``, text), its stderr
        appended to ``stderr`` and stdin empty; in network namespace ``netns`` (a name ``ip netns add`` made) if
        given."""
        read_end, write_end = os.pipe()
        with open(os.devnull, "rb") as devnull, open(stderr, "ab") as log, self._lock:
            request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "netns": netns}).encode()
            try:
                socket.send_fds(self._sock, [request], [devnull.fileno(), write_end, log.fileno()])
            except OSError as e:
                os.close(read_end)
                raise ForkServerError(f"the fork server is gone: {e}") from None
            finally:
                os.close(write_end)
            reply = self._next_reply(timeout)
            if "pid" not in reply:
                os.close(read_end)
                raise ForkServerError(reply.get("error", "the fork server did not answer"))
            child = ForkedProcess(reply["pid"], os.fdopen(read_end, "r"))
            with self._state:
                self._children[child.pid] = child
                if child.pid in self._early_exits:
                    child._exit(self._early_exits.pop(child.pid))
        return child

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Ends the server; nodes still running keep running."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._kill_server()
        self._sock.close()

    def _next_reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._reply_ready:
            while not self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    return {"error": "the fork server did not answer in time" if left <= 0 else "it stopped"}
                self._reply_ready.wait(min(left, 0.5))
            return self._replies.pop(0)

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(_MESSAGE)
            except OSError:
                message = b""
            if not message:
                break
            report = json.loads(message)
            if "exited" in report:
                with self._state:
                    child = self._children.pop(report["exited"], None)
                    if child is None:  # the exit came before spawn() saw the pid
                        self._early_exits[report["exited"]] = report["returncode"]
                    else:
                        child._exit(report["returncode"])
                continue
            with self._reply_ready:
                self._replies.append(report)
                self._reply_ready.notify_all()
        self._orphaned()

    def _orphaned(self) -> None:
        """The server is gone: its children were reparented and no one reports their exits; watch them by pid."""
        while self._children:
            with self._state:
                for pid, child in list(self._children.items()):
                    if not alive(pid):
                        self._children.pop(pid)
                        child._exit(-signal.SIGKILL)
            time.sleep(_REAP_EVERY)

    def _kill_server(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""
