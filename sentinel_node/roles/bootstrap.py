"""The bootstrap role: a DHT node that stores and relays the swarm's records and is its entry point.

It announces itself under ``{prefix}.bootstraps`` like any other node, so ``sentinel-node swarm status`` lists
every bootstrap of the swarm, answers the reachability checks of nodes that join through it, and runs until
SIGTERM/SIGINT, when it says it is going offline and shuts its DHT and p2pd down.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from dht import BootstrapAnnouncement
from sentinel_node.roles.common import JoinOptions
from sentinel_node.roles.node import Node, started_node


class BootstrapNode(Node):
    role = "bootstrap"
    keeps_view = False  # it serves records; it has no use for the swarm's verdicts

    def announcement(self) -> BootstrapAnnouncement:
        return self.announced(BootstrapAnnouncement)

    def ready_line(self) -> str:
        return f"bootstrap {self.peer_id} serving swarm {self.config.swarm.prefix} ({self.config.swarm_hash()})"


def run_bootstrap(
    options: JoinOptions, on_ready: Callable[[str, list[str]], None], stop_event: threading.Event | None = None
) -> None:
    """Serves until SIGTERM/SIGINT (or ``stop_event``); calls ``on_ready(peer_id, maddrs)`` once others can join
    through it."""
    with started_node(options, stop_event) as context:
        asyncio.run(BootstrapNode(context).serve(on_ready))
