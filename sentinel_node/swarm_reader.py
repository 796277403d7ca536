"""A client-only peer that reads a swarm from the DHT: what ``swarm status|peers|strikes|bans`` (once, or every few
seconds with ``--watch``), ``swarm serve`` and a node joining without ``--config`` use.

One DHT node is started for the reader's whole life; the swarm's config comes from the DHT when none is given
(and is checked against the DHT's when one is); every read is bounded by the reader's timeout. Reads never hang:
an unreachable swarm is a :class:`~sentinel_node.roles.common.NodeStartError` naming the addresses tried.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dht import DHTUnavailable, ephemeral_identity
from peers import SwarmView, SwarmWatcher
from sentinel_node.config import Config
from sentinel_node.roles.common import NodeStartError, record_store, start_dht, stop_dht
from sentinel_node.swarm_config import describe_where, read_published, resolve


class SwarmReader:
    """``with SwarmReader(peers, config=None, timeout=10) as reader: reader.refresh()``."""

    def __init__(
        self,
        initial_peers: Sequence[str],
        config: Config | None = None,
        timeout: float = 10.0,
        config_name: str = "--config",
    ) -> None:
        if not initial_peers:
            raise NodeStartError("no --initial-peers given: pass the multiaddrs a bootstrap node printed")
        self.initial_peers, self.timeout = list(initial_peers), timeout
        self.where = describe_where(self.initial_peers)
        deadline = time.monotonic() + timeout
        self.identity = ephemeral_identity()  # a reader signs nothing; hivemind's signature validator needs a key
        # signatures only: the reader may not know the swarm's prefix yet, and re-checks every record it reads
        self.dht = start_dht(None, self.identity, initial_peers=self.initial_peers, client_mode=True, timeout=timeout)
        try:
            self.config = self._swarm_config(config, config_name, deadline)
            self.store = record_store(self.dht, self.config, identity=None, timeout=timeout)
            self.watcher = SwarmWatcher(
                self.store, self.config.pipeline.n_stages, self.config.swarm.exclusion_policy()
            )
        except BaseException:
            stop_dht(self.dht)
            raise

    def _swarm_config(self, given: Config | None, given_name: str, deadline: float) -> Config:
        probe = record_store(self.dht, given or Config(), identity=None, timeout=max(0.5, deadline - time.monotonic()))
        try:
            published = read_published(probe, initial_peers=self.initial_peers)
        except DHTUnavailable as e:
            if given is not None:
                return given  # nothing to compare with; the reads that follow say whether the swarm answers
            raise NodeStartError(f"joined the DHT at {self.where} but it gave no swarm config in time: {e}") from None
        return resolve(published, given, self.where, given_name)

    def __enter__(self) -> SwarmReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def refresh(self, timeout: float | None = None) -> SwarmView:
        """A fresh snapshot within ``timeout`` (default: the reader's); NodeStartError when the swarm does not
        answer in time."""
        if timeout is not None:
            self.store.timeout = timeout
        try:
            return self.watcher.refresh()
        except DHTUnavailable as e:
            raise NodeStartError(f"joined the swarm at {self.where} but it did not answer in time: {e}") from None

    def close(self) -> None:
        stop_dht(self.dht)


def fetch_swarm_config(
    initial_peers: Sequence[str], given: Config | None = None, timeout: float = 30.0, given_name: str = "--config"
) -> Config:
    """The config of the swarm at ``initial_peers`` (checked against ``given`` when there is one), read through a
    client-only DHT peer that is gone when this returns."""
    with SwarmReader(initial_peers, given, timeout, given_name) as reader:
        return reader.config


def read_swarm(config: Config | None, initial_peers: Sequence[str], timeout: float) -> tuple[Config, SwarmView]:
    """The swarm's config and one snapshot of it, read through a client-only DHT peer that is gone when this
    returns."""
    started = time.monotonic()
    with SwarmReader(initial_peers, config, timeout) as reader:
        return reader.config, reader.refresh(max(0.5, timeout - (time.monotonic() - started)))
