"""One peer of tests/test_netns_relay.py, run in a host's namespace: ``python relay_peer.py ROLE IP [BOOTSTRAP]``.

- ``bootstrap``: a DHT node as ``sentinel-node join --role bootstrap`` starts one (``relay_service``).
- ``hidden``: a DHT node behind the NAT, started as with ``--use-auto-relay``, answering reachability checks on the
  node's transport (the handler every role serves).
- ``caller``: a DHT node on the hub that, once a second, asks the hidden node (``python relay_peer.py caller IP
  BOOTSTRAP HIDDEN_PEER_ID``) for a reachability check over the transport.

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

from dht import ephemeral_identity
from sentinel_node.roles.common import start_dht, stop_dht
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


async def run(role: str, dht, stop: threading.Event) -> None:
    p2p = await dht.replicate_p2p()
    if role == "hidden":
        server = TensorServer(p2p, TransportSettings())
        await serve_reachability(server, interval=0.0)
    target = sys.argv[4] if role == "caller" else None
    while not await asyncio.to_thread(stop.wait, 1.0):
        if role == "hidden":
            maddrs = await asyncio.to_thread(dht.get_visible_maddrs, latest=True)
            say(maddrs=[str(m) for m in maddrs], connections=await connections(p2p))
        elif role == "caller" and target:
            say(**await ask(p2p, target))


def main() -> None:
    role, ip = sys.argv[1], sys.argv[2]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = start_dht(
        None,
        ephemeral_identity(),
        initial_peers=sys.argv[3:4],
        host_maddrs=[f"/ip4/{ip}/tcp/31337"],
        check_identity=False,
        use_auto_relay=role == "hidden",
        relay_service=role == "bootstrap",
    )
    try:
        say(role=role, maddrs=[str(m) for m in dht.get_visible_maddrs()], peer_id=str(dht.peer_id))
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        if role == "bootstrap":
            stop.wait()
        else:
            asyncio.run(run(role, dht, stop))
    finally:
        stop_dht(dht)


if __name__ == "__main__":
    main()
