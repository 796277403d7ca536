"""Memory before admission, measured: a verifier-like handler in a process of its own, and a peer that no handler
admits streaming hundreds of MiB into it (issue 16, attack 6).

``python tests/stream_flood.py serve`` starts a TensorServer whose relay handler refuses every caller (as a
verifier refuses a peer that is no live replica of its stages) and answers ``rss`` on stdin with its memory, in
KiB: its own resident set now and at peak (VmRSS, VmHWM), and its p2pd's. :func:`flood` is the attacker; the test
in ``test_transport.py`` and the figures in docs/decisions.md use both. The server also runs on an older tree
(it passes ``admit`` only where the server takes it).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

HANDLER = "sentinel.verifier.relay"
MIB = 2**20


def memory_kib(pid: int) -> dict[str, int]:
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            found[name] = int(value.split()[0])
    return found


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


async def serve(admitted: bool = False) -> None:
    from hivemind.p2p import P2P

    from sentinel_node.transport import Answer, HopRefused, TensorServer, TransportSettings

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    server = TensorServer(p2p, TransportSettings())

    def refuse(caller: str, *_metadata) -> None:
        raise HopRefused(f"{caller} is not a live replica of a stage this verifier serves")

    kwargs = {} if admitted else {"authorize": refuse}
    if "admit" in inspect.signature(server.add_handler).parameters and not admitted:
        kwargs["admit"] = refuse
    await server.add_handler(HANDLER, lambda incoming: Answer([]), require_finite=False, **kwargs)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    print(json.dumps({"peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "quit":
            break
        daemons = {pid: memory_kib(pid) for pid in children(os.getpid())}
        print(json.dumps({"self": memory_kib(os.getpid()), "p2pd": daemons}), flush=True)
    await p2p.shutdown()


class Server:
    """The serving process, started with the Python path ``root`` (a tree of sentinel-node)."""

    def __init__(self, root: str, admitted: bool = False, python: str = sys.executable) -> None:
        env = {**os.environ, "PYTHONPATH": root}
        self.process = subprocess.Popen(
            [python, __file__, "serve", *(["admitted"] if admitted else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        info = json.loads(self.process.stdout.readline())
        self.peer_id, self.maddrs = info["peer_id"], info["maddrs"]

    def memory(self) -> dict:
        self.process.stdin.write("rss\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.flush()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


async def _one_stream(p2p, peer, total: int, one_message: bool, chunk: bytes) -> str:
    """Streams ``total`` bytes to the relay: as one message declaring all of it, or as messages of ``chunk``."""
    from hivemind.p2p import P2P

    _, reader, writer = await p2p.call_binary_stream_handler(peer, HANDLER + ".stream")
    sent = 0
    try:
        if one_message:
            writer.write(P2P.MESSAGE_MARKER + total.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            while sent < total:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
        else:
            while sent < total:
                writer.write(P2P.MESSAGE_MARKER + len(chunk).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + chunk)
                await writer.drain()
                sent += len(chunk)
        return f"sent all {sent // MIB} MiB"
    except Exception as e:
        return f"cut off after {sent // MIB} MiB ({type(e).__name__})"
    finally:
        writer.close()


async def _flood(maddrs: list[str], peer_id: str, streams: int, mib_each: int, one_message: bool) -> list[str]:
    from hivemind.p2p import P2P, PeerID

    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
    try:
        chunk = b"\x00" * MIB
        peer = PeerID.from_base58(peer_id)
        jobs = [_one_stream(p2p, peer, mib_each * MIB, one_message, chunk) for _ in range(streams)]
        return list(await asyncio.wait_for(asyncio.gather(*jobs), 600))
    finally:
        await p2p.shutdown()


def flood(server: Server, streams: int, mib_each: int, one_message: bool) -> list[str]:
    """The attack; what happened to each stream."""
    return asyncio.run(_flood(server.maddrs, server.peer_id, streams, mib_each, one_message))


def measure(root: str, streams: int, mib_each: int, one_message: bool, admitted: bool = False) -> dict:
    """RSS of the serving process (MiB) before, at peak, and after a flood of ``streams`` x ``mib_each`` MiB (from a
    caller the handler refuses, or with ``admitted`` one it serves)."""
    server = Server(root, admitted)
    try:
        before = server.memory()
        outcome = flood(server, streams, mib_each, one_message)
        after = server.memory()
    finally:
        server.stop()
    return {
        "rss_before_mib": round(before["self"]["VmRSS"] / 1024),
        "rss_peak_mib": round(after["self"]["VmHWM"] / 1024),
        "rss_after_mib": round(after["self"]["VmRSS"] / 1024),
        "p2pd_peak_mib": round(max((m["VmHWM"] for m in after["p2pd"].values()), default=0) / 1024),
        "streams": outcome,
    }


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve(admitted=sys.argv[2:] == ["admitted"]))
    else:  # ROOT STREAMS MIB_EACH one|many [admitted]
        root, streams, mib, how = sys.argv[1:5]
        print(json.dumps(measure(root, int(streams), int(mib), how == "one", sys.argv[5:] == ["admitted"])))
