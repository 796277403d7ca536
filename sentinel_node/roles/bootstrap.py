"""The bootstrap role: a DHT node that stores and relays the swarm's records and is its entry point.

It announces itself under ``{prefix}.bootstraps`` like any other node, so ``sentinel-node swarm status`` lists
every bootstrap of the swarm, answers the reachability checks of nodes that join through it, and runs until
SIGTERM/SIGINT, when it says it is going offline and shuts its DHT and p2pd down.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from hivemind.utils import get_dht_time, get_logger

from dht import Announcer, BootstrapAnnouncement
from sentinel_node.roles.common import JoinOptions, software_version
from sentinel_node.roles.metrics import serve_metrics
from sentinel_node.roles.runtime import (
    NodeContext,
    bounded,
    pipeline_node,
    reachability,
    replicate_p2p,
    transport_settings,
    wait_for_stop,
)
from sentinel_node.transport import TensorServer

logger = get_logger(__name__)


def run_bootstrap(
    options: JoinOptions, on_ready: Callable[[str, list[str]], None], stop_event: threading.Event | None = None
) -> None:
    """Serves until SIGTERM/SIGINT (or ``stop_event``); calls ``on_ready(peer_id, maddrs)`` once others can join
    through it."""
    with pipeline_node(options, stop_event) as context:
        asyncio.run(_serve(context, on_ready))


async def _serve(context: NodeContext, on_ready: Callable[[str, list[str]], None]) -> None:
    config = context.config
    # first: a taken port fails the start at once
    metrics = serve_metrics(context, "bootstrap")
    p2p = await replicate_p2p(context)
    server = TensorServer(p2p, transport_settings(config))
    reached = await reachability(context, p2p, server)
    record = BootstrapAnnouncement(
        peer_id=context.peer_id,
        maddrs=context.maddrs,
        state="online",
        relayed=reached.relayed,
        throughput=0.0,
        config_hash=config.swarm_hash(),
        version=software_version(),
        time=get_dht_time(),
    )
    announcer = Announcer(context.store, record, config.swarm.announce_period, config.swarm.announce_ttl).start()
    logger.info(f"bootstrap {context.peer_id} serving swarm {config.swarm.prefix} ({config.swarm_hash()})")
    on_ready(context.peer_id, context.maddrs)
    try:
        await wait_for_stop(context)
        received = context.stop.received
        logger.info(f"{received.name if received else 'asked to stop'}: shutting down")
    finally:
        announcer.stop(offline=context.dht.is_alive())
        if metrics is not None:
            metrics.stop()
        if context.dht.is_alive():
            await bounded(server.remove_handlers(), 5, "removing the handlers")
        await bounded(p2p.shutdown(), 5, "closing the libp2p handle")
