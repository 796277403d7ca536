"""The bootstrap role: a DHT node that stores and relays the swarm's records and is its entry point.

It announces itself under ``{prefix}.bootstraps`` like any other node, so ``sentinel-node swarm status`` lists
every bootstrap of the swarm, and runs until SIGTERM/SIGINT, when it says it is going offline and shuts its DHT
and p2pd down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hivemind.utils import get_dht_time, get_logger

from dht import Announcer, BootstrapAnnouncement
from sentinel_node.roles.common import (
    JoinOptions,
    NodeDiedError,
    StopSignals,
    node_identity,
    record_store,
    software_version,
    start_dht,
    stop_dht,
)
from sentinel_node.roles.metrics import DHTPeerCount, Sample, serve_metrics

logger = get_logger(__name__)

# How often the node checks that its DHT process is still alive while it waits for a signal.
_HEALTH_CHECK_PERIOD = 1.0


def run_bootstrap(
    options: JoinOptions, on_ready: Callable[[str, list[str]], None], stop_event: threading.Event | None = None
) -> None:
    """Serves until SIGTERM/SIGINT (or ``stop_event``); calls ``on_ready(peer_id, maddrs)`` once others can join
    through it."""
    config = options.config
    with StopSignals(stop_event) as stop, node_identity(options.identity_path) as (identity, fresh):
        dht = start_dht(
            config,
            identity,
            initial_peers=options.initial_peers,
            host_maddrs=options.host_maddrs,
            announce_maddrs=options.announce_maddrs,
            check_identity=not fresh,  # a key made a moment ago cannot be in use elsewhere
            timeout=options.start_timeout,
        )
        announcer = metrics = None
        try:
            peers = DHTPeerCount(dht)
            metrics = serve_metrics(
                options.metrics_port,
                lambda: [
                    Sample("sentinel_node_info", 1, ("bootstrap", identity.peer_id)),
                    Sample("sentinel_dht_peers", peers()),
                ],
            )
            maddrs = [str(maddr) for maddr in dht.get_visible_maddrs()]
            record = BootstrapAnnouncement(
                peer_id=identity.peer_id,
                maddrs=maddrs,
                state="online",
                relayed=False,
                throughput=0.0,
                config_hash=config.swarm_hash(),
                version=software_version(),
                time=get_dht_time(),
            )
            store = record_store(dht, config, identity)
            announcer = Announcer(store, record, config.swarm.announce_period, config.swarm.announce_ttl).start()
            logger.info(f"bootstrap {identity.peer_id} serving swarm {config.swarm.prefix} ({config.swarm_hash()})")
            on_ready(identity.peer_id, maddrs)
            while not stop.event.wait(_HEALTH_CHECK_PERIOD):
                if not dht.is_alive():
                    raise NodeDiedError("the DHT process ended unexpectedly; see the log above for its last words")
            logger.info(f"{stop.received.name if stop.received else 'asked to stop'}: shutting down")
        finally:
            if announcer is not None:
                announcer.stop(offline=dht.is_alive())
            if metrics is not None:
                metrics.stop()
            stop_dht(dht)
