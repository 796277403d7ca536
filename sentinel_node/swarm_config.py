"""The swarm's config in the DHT: what a bootstrap publishes, and how a node that joins with nothing but an address
finds the config it must run (or learns that the file it was given is another swarm's).

A bootstrap publishes its whole config as a signed :class:`~dht.SwarmConfigRecord` (the config as JSON, and its
:meth:`~sentinel_node.config.Config.swarm_hash`) under the key every swarm shares, and refreshes it while it runs.
A reader turns a record back into a :class:`~sentinel_node.config.Config` only when the JSON parses as a config
whose hash is the one the record states, and picks the swarm's config only when every publisher agrees.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hivemind.utils import get_dht_time, get_logger

from dht import RecordError, RecordStore, SwarmConfigRecord
from sentinel_node.config import Config, ConfigError, parse_config
from sentinel_node.roles.common import NodeStartError, software_version

logger = get_logger(__name__)

# A published config lives an hour unless refreshed, and its publisher refreshes it every minute: a swarm whose
# bootstraps all stopped can still be joined for a while, and a bootstrap restarted with another config replaces
# its own record at once.
CONFIG_TTL_S = 3600.0
CONFIG_REFRESH_S = 60.0


class SwarmConfigError(NodeStartError):
    """The swarm's config cannot be had, or is not the one this node was given; the message says what to do."""


def config_record(config: Config, peer_id: str) -> SwarmConfigRecord:
    """The record in which ``peer_id`` publishes ``config``."""
    return SwarmConfigRecord(
        peer_id=peer_id,
        prefix=config.swarm.prefix,
        config=json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":")),
        config_hash=config.swarm_hash(),
        version=software_version(),
        time=get_dht_time(),
    )


def config_of(record: SwarmConfigRecord) -> Config:
    """The config a record carries; SwarmConfigError unless it is a valid config whose hash is the stated one."""
    origin = f"the config published by {record.peer_id}"
    try:
        data = json.loads(record.config)
        config = parse_config(data, source=origin)
    except (ValueError, ConfigError) as e:  # json's and the config's own errors are both ValueErrors
        raise SwarmConfigError(f"{origin} is not a valid config: {e}") from None
    if config.swarm_hash() != record.config_hash or config.swarm.prefix != record.prefix:
        raise SwarmConfigError(
            f"{origin} claims hash {record.config_hash} (swarm {record.prefix}) but reads here as hash "
            f"{config.swarm_hash()} (swarm {config.swarm.prefix}): either it was altered, or its publisher runs "
            f"another version of sentinel-node ({record.version}; this one is {software_version()}) whose configs "
            "have other keys; ignoring it"
        )
    return config


@dataclass(frozen=True)
class Published:
    """The configs a swarm's publishers hold, by hash, and who published each."""

    configs: Mapping[str, Config]
    publishers: Mapping[str, tuple[str, ...]]  # hash -> publisher peer ids
    rejected: tuple[str, ...] = ()  # why records were ignored

    @classmethod
    def of(cls, records: Mapping[str, SwarmConfigRecord]) -> Published:
        configs: dict[str, Config] = {}
        publishers: dict[str, list[str]] = {}
        rejected = []
        for author, record in sorted(records.items()):
            try:
                config = config_of(record)
            except SwarmConfigError as e:
                rejected.append(str(e))
                continue
            configs[record.config_hash] = config
            publishers.setdefault(record.config_hash, []).append(author)
        return cls(configs, {h: tuple(p) for h, p in publishers.items()}, tuple(rejected))

    def describe(self) -> str:
        return "; ".join(
            f"{h} (swarm {self.configs[h].swarm.prefix}, published by {', '.join(p[:12] for p in peers)})"
            for h, peers in sorted(self.publishers.items())
        )


def resolve(published: Published, given: Config | None, where: str, given_name: str = "--config") -> Config:
    """The config a node joining the swarm at ``where`` runs: the one its publishers agree on, which ``given``
    (from ``given_name``) must equal when there is one. SwarmConfigError naming both hashes when they differ, and
    saying what to pass when the swarm publishes none or several."""
    hashes = sorted(published.configs)
    if given is not None:
        if not hashes or given.swarm_hash() in hashes and len(hashes) == 1:
            return given
        if given.swarm_hash() in hashes:
            logger.warning(f"the swarm at {where} publishes several configs: {published.describe()}")
            return given
        ours = given.swarm_hash()
        raise SwarmConfigError(
            f"{given_name} has config hash {ours} (swarm {given.swarm.prefix}), but the swarm at {where} runs "
            f"config hash {' or '.join(hashes)} ({published.describe()}). Join without {given_name} to run the "
            "swarm's own config, or point --initial-peers at the swarm this file is for"
        )
    if not hashes:
        why = f" ({'; '.join(published.rejected)})" if published.rejected else ""
        raise SwarmConfigError(
            f"the swarm at {where} publishes no config{why}: its bootstrap may be of an older version or still "
            "starting. Pass --config with the swarm's config file (ask its organiser), or try again in a minute"
        )
    if len(hashes) > 1:
        raise SwarmConfigError(
            f"the nodes at {where} publish {len(hashes)} different configs: {published.describe()}. Pass --config "
            "with the one you mean to join"
        )
    return published.configs[hashes[0]]


def read_published(store: RecordStore, timeout: float | None = None, initial_peers: Sequence[str] = ()) -> Published:
    """The configs published in the DHT ``store`` reads; DHTUnavailable past the timeout. When a peer named in
    ``initial_peers`` (the ``/p2p/<peer id>`` of an address this node dialed) publishes one, only those count: anyone
    may publish a config record, but a joiner trusts the bootstrap it was told to join, so a stranger's record can
    neither replace the swarm's config nor make the join ambiguous."""
    records = store.swarm_configs(timeout)
    dialed = dialed_peer_ids(initial_peers)
    chosen = {author: record for author, record in records.items() if author in dialed}
    return Published.of(chosen or records)


def dialed_peer_ids(initial_peers: Sequence[str]) -> set[str]:
    """The peer ids in multiaddrs (their ``/p2p/<id>`` parts)."""
    ids = set()
    for maddr in initial_peers:
        parts = maddr.split("/")
        ids.update(parts[i + 1] for i, part in enumerate(parts[:-1]) if part == "p2p")
    return ids


class ConfigPublisher:
    """Keeps this node's record of ``config`` in the DHT: at once, then every ``period`` seconds, until
    :meth:`stop`."""

    def __init__(self, store: RecordStore, config: Config, peer_id: str, period: float = CONFIG_REFRESH_S) -> None:
        self.store, self.config, self.peer_id, self.period = store, config, peer_id, period
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="config-publisher", daemon=True)
        self.published = 0

    def start(self) -> ConfigPublisher:
        self._thread.start()
        return self

    def stop(self, wait: float | None = None) -> None:
        """Stops refreshing, waiting up to ``wait`` seconds (default: the store's timeout) for a write under way."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.store.timeout + 1 if wait is None else wait)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                if self.store.put(config_record(self.config, self.peer_id), ttl=CONFIG_TTL_S):
                    self.published += 1
            except RecordError as e:
                logger.error(f"cannot publish the swarm's config, peers would refuse it: {e}")
                return
            except Exception as e:  # a dying DHT must not end the thread in the middle of a refresh
                logger.warning(f"publishing the swarm's config failed ({type(e).__name__}: {e}); retrying")
            self._stopped.wait(self.period)


def describe_where(initial_peers: Sequence[str]) -> str:
    return ", ".join(initial_peers[:2]) + (f" (+{len(initial_peers) - 2})" if len(initial_peers) > 2 else "")
