"""Loopback round-trip time of activations through the transport's own helpers.

``python -m sentinel_node.transport.latency [--sizes 1 16] [--compression none float16]``: two P2P daemons on
this machine, an echo handler, and :func:`call_peer` timing request, both encodings and the reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
from hivemind.p2p import P2P

from sentinel_node.transport.client import call_peer
from sentinel_node.transport.messages import MicrobatchReply, RequestMetadata
from sentinel_node.transport.server import Answer, Incoming, TensorServer
from sentinel_node.transport.settings import TransportSettings

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _echo(incoming: Incoming) -> Answer:
    return Answer(incoming.tensors, MicrobatchReply())


async def measure(sizes_mib: list[float], compressions: list[str], repeats: int = 10) -> list[dict]:
    """Round trips of a (8, 64, hidden) float32 activation per size and compression, in milliseconds."""
    server_p2p = await P2P.create(host_maddrs=LOOPBACK)
    client_p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=await server_p2p.get_visible_maddrs())
    results = []
    try:
        for compression in compressions:
            settings = TransportSettings(compression=compression)
            server = TensorServer(server_p2p, settings)
            await server.add_handler("echo", _echo)
            for mib in sizes_mib:
                activation = torch.randn(8, 64, max(1, round(mib * 2**20 / (8 * 64 * 4))))
                times = []
                for _ in range(repeats + 1):  # the first call also dials the connection: not counted
                    started = time.perf_counter()
                    metadata = RequestMetadata(deadline=time.time() + 30)
                    await call_peer(client_p2p, server_p2p.peer_id, "echo", [activation], metadata, settings=settings)
                    times.append(1000 * (time.perf_counter() - started))
                times = sorted(times[1:])
                results.append(
                    {
                        "mib": mib,
                        "compression": compression,
                        "streamed": activation.numel() * 4 > settings.stream_threshold_bytes,
                        "median_ms": round(statistics.median(times), 1),
                        "min_ms": round(times[0], 1),
                        "max_ms": round(times[-1], 1),
                    }
                )
            await server.remove_handlers()
    finally:
        await client_p2p.shutdown()
        await server_p2p.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 16.0], help="activation sizes in MiB")
    parser.add_argument("--compression", nargs="+", default=["none", "float16"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    for row in asyncio.run(measure(args.sizes, args.compression, args.repeats)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
