"""One peer of tests/test_netns_relay.py, run in a host's namespace: ``python relay_peer.py ROLE IP [BOOTSTRAP]``.

- ``bootstrap``: a DHT node as ``sentinel-node join --role bootstrap`` starts one.
- ``hidden``: a DHT node behind the NAT, started as with ``--use-auto-relay``, answering reachability checks on the
  node's transport (the handler every role serves).
- ``caller``: a DHT node on the hub that, once a second, asks the hidden node (its peer id the first line on stdin)
  for a reachability check over the transport, and when it is answered pushes 1 MiB through a stream to it.

Each prints one JSON object per line on stdout (its addresses as its daemon reports them, what it saw), and runs
until stdin closes or SIGTERM; it stops its DHT and p2pd on the way out.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time

from hivemind.p2p import PeerID

from dht import ephemeral_identity
from sentinel_node.roles.common import NodeStartError, start_dht, stop_dht
from sentinel_node.roles.reachability import REACH_CHECK, ReachReply, ReachRequest, serve_reachability
from sentinel_node.transport import TensorServer, TransportSettings, call_peer


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def connections(p2p) -> dict[str, list[str]]:
    return {str(info.peer_id): [str(a) for a in info.addrs] for info in await p2p.list_peers()}


async def ask(p2p, peer: str) -> dict:
    """A reachability check of a closed port on the caller's loopback: the hidden node answers that it failed."""
    request = ReachRequest(deadline=time.time() + 10, maddrs=["/ip4/127.0.0.1/tcp/9"])
    try:
        reply = await call_peer(
            p2p, peer, REACH_CHECK, [], request, settings=TransportSettings(), reply_model=ReachReply
        )
    except Exception as e:
        return {"answered": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"answered": True, "failed": reply.metadata.failed, "connections": await connections(p2p)}


SINK = "relay_peer.sink"
BULK_BYTES = 1 << 20  # 8 times go-libp2p's default relay data limit (128 KiB): only p2pd's relay service passes it


async def sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads the 12-digit byte count, then that many bytes; answers with the count it read."""
    want, got = int(await reader.readexactly(12)), 0
    while got < want:
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    writer.write(b"%012d" % got)
    await writer.drain()
    writer.close()


async def send_bulk(p2p, peer: str) -> int | str:
    """How many of BULK_BYTES the peer's sink says it read, or why none."""
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), SINK)
        writer.write(b"%012d" % BULK_BYTES + bytes(BULK_BYTES))
        await writer.drain()
        return int(await asyncio.wait_for(reader.readexactly(12), 30))
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]


async def run(role: str, dht, stop: threading.Event, target: str | None) -> None:
    p2p = await dht.replicate_p2p()
    if role == "hidden":
        server = TensorServer(p2p, TransportSettings())
        await serve_reachability(server, interval=0.0)
        await p2p.add_binary_stream_handler(SINK, sink)
    while not await asyncio.to_thread(stop.wait, 1.0):
        if role == "hidden":
            maddrs = await asyncio.to_thread(dht.get_visible_maddrs, latest=True)
            say(maddrs=[str(m) for m in maddrs], connections=await connections(p2p))
        elif role == "caller":
            answer = await ask(p2p, target)
            if answer["answered"]:
                answer["bulk"] = await send_bulk(p2p, target)
            say(**answer)


def main() -> None:
    role, ip = sys.argv[1], sys.argv[2]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for attempt in range(2):
        try:
            dht = start_dht(
                None,
                ephemeral_identity(),
                initial_peers=sys.argv[3:4],
                host_maddrs=[f"/ip4/{ip}/tcp/31337"],
                check_identity=False,
                use_auto_relay=role == "hidden",
            )
            break
        except NodeStartError:
            # p2pd gives up on its first dial of the bootstrap within its own deadline: seen once on a loaded
            # machine, for the hidden host; what this peer is for (relays) starts once it has joined
            if attempt == 1 or stop.is_set():
                raise
            time.sleep(2.0)
    try:
        say(role=role, maddrs=[str(m) for m in dht.get_visible_maddrs()], peer_id=str(dht.peer_id))
        target = sys.stdin.readline().strip() if role == "caller" else None
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        if role == "bootstrap":
            stop.wait()
        else:
            asyncio.run(run(role, dht, stop, target))
    finally:
        stop_dht(dht)


if __name__ == "__main__":
    main()
