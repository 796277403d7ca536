"""The bootstrap role: a DHT node that stores and relays the swarm's records and is its entry point.

It announces itself under ``{prefix}.bootstraps`` like any other node, so ``sentinel-node swarm status`` lists
every bootstrap of the swarm, publishes the swarm's config (:mod:`sentinel_node.swarm_config`) so that a node can
join with nothing but its address, answers the reachability checks of nodes that join through it, and runs until
SIGTERM/SIGINT, when it says it is going offline and shuts its DHT and p2pd down.

Other nodes find it again after a restart only at the same address: a bootstrap with a kept identity but a random
port (``tcp/0``) comes back alone, so it warns.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from hivemind.utils import get_logger
from hivemind.utils.multiaddr import Multiaddr

from dht import BootstrapAnnouncement
from sentinel_node.roles.common import JoinOptions
from sentinel_node.roles.node import Node, started_node
from sentinel_node.swarm_config import ConfigPublisher

logger = get_logger(__name__)


def random_port_warning(options: JoinOptions) -> str | None:
    """What to tell a bootstrap whose identity survives a restart but whose port does not, or None."""
    if options.identity_path is None:
        return None
    random = []
    for text in options.host_maddrs:
        try:
            if Multiaddr(text).value_for_protocol("tcp") == "0":
                random.append(text)
        except Exception:  # not a TCP address, or none at all
            continue
    if not random:
        return None
    return (
        f"this bootstrap keeps its identity ({options.identity_path}) but listens on a random port "
        f"({', '.join(random)}): after a restart it comes back on another port, and nodes holding its old address "
        "cannot find the swarm again. Give it a fixed port, e.g. --host-maddrs /ip4/0.0.0.0/tcp/31337"
    )


class BootstrapNode(Node):
    role = "bootstrap"
    keeps_view = False  # it serves records; it has no use for the swarm's verdicts

    async def prepare(self) -> None:
        self.publisher = ConfigPublisher(self.context.store, self.config, self.peer_id).start()

    async def finish(self) -> None:
        await asyncio.to_thread(self.publisher.stop, None if self.context.reachable() else 0.2)

    def announcement(self) -> BootstrapAnnouncement:
        return self.announced(BootstrapAnnouncement)

    def describe_details(self) -> list[str]:
        return [f"publishes the swarm's config {self.config.swarm_hash()}: a node can join with its address alone"]

    def ready_line(self) -> str:
        return f"bootstrap {self.peer_id} serving swarm {self.config.swarm.prefix} ({self.config.swarm_hash()})"


def run_bootstrap(
    options: JoinOptions, on_ready: Callable[[str, list[str]], None], stop_event: threading.Event | None = None
) -> None:
    """Serves until SIGTERM/SIGINT (or ``stop_event``); calls ``on_ready(peer_id, maddrs)`` once others can join
    through it."""
    warning = random_port_warning(options)
    if warning is not None:
        logger.warning(warning)
    with started_node(options, stop_event) as context:
        asyncio.run(BootstrapNode(context).serve(on_ready))
