"""Typed reads and writes of swarm records through one hivemind DHT, none of which can hang.

Writes are signed by the node's identity (hivemind's RSASignatureValidator signs values stored under the node's
owner tag). ``store()``'s boolean is only a hint: it reports the last replica that answered, and the writer
caches its own value even when every other peer refused it. So ``put`` checks a record with the very rules peers
apply before sending it, and the swarm relies on refreshing, not on acknowledgements.

Reads re-check every record against the swarm's rules (a reader cannot trust the peers that served it): records
of unadmitted authors, of another swarm config (with one warning per author), out of range or claiming to live too
long are dropped; reads give up at a deadline instead of waiting on an unresponsive DHT.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import hivemind
from hivemind.utils import get_dht_time, get_logger

from dht.identity import Identity
from dht.keys import SwarmKeys
from dht.records import (
    BootstrapAnnouncement,
    StageAnnouncement,
    StrikeRecord,
    SwarmRecord,
    TrainerAnnouncement,
    VerifierAnnouncement,
)
from dht.rules import SwarmRules
from dht.validation import ForeignConfigError, RecordError, check_record, key_id, record_bytes

logger = get_logger(__name__)

R = TypeVar("R", bound=SwarmRecord)


class DHTUnavailable(TimeoutError):
    """The DHT did not answer within the deadline; the message names what was asked."""


class RecordStore:
    """The swarm's records as seen through ``dht``; writes need ``identity`` (the key the DHT was started with)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        rules: SwarmRules,
        identity: Identity | None = None,
        timeout: float = 5.0,
    ):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.dht, self.rules, self.identity, self.timeout = dht, rules, identity, timeout
        # DHT calls write to one pipe; threads (an announcer, a watcher) must not interleave their messages.
        self._send_lock = threading.Lock()
        self._warned_authors: set[object] = set()
        self._warn_lock = threading.Lock()

    @property
    def keys(self) -> SwarmKeys:
        return self.rules.keys

    @property
    def config_hash(self) -> str:
        return self.rules.config_hash

    def put(self, record: SwarmRecord, ttl: float) -> bool:
        """Signs and stores ``record`` for ``ttl`` seconds; RecordError if peers would refuse it.

        Returns False when no DHT peer acknowledged it within the timeout, True when one did; True is a hint,
        not proof that the swarm holds it: keep records alive by refreshing them.
        """
        if self.identity is None:
            raise RecordError("this RecordStore was opened read-only (no identity); it cannot sign records")
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        if record.config_hash != self.config_hash:
            raise RecordError(f"record carries config hash {record.config_hash}, this swarm's is {self.config_hash}")
        key, value = record.key(self.keys), record.dict()
        now = get_dht_time()
        check_record(self.rules, key_id(key), self.identity.owner_tag, value, now + ttl, now)
        if record_bytes(value) > self.rules.max_record_bytes:
            raise RecordError(
                f"a {record.kind} record of {record_bytes(value)} bytes, over the {self.rules.max_record_bytes} "
                "bytes peers store (announce fewer addresses)"
            )

        with self._send_lock:
            future = self.dht.store(key, value, now + ttl, subkey=self.identity.owner_tag, return_future=True)
        try:
            acknowledged = bool(future.result(timeout=self.timeout))
        except FutureTimeout:
            future.cancel()
            acknowledged = False
        if not acknowledged:
            logger.debug(f"no DHT peer acknowledged {record.kind} record under {key!r} (will be refreshed)")
        return acknowledged

    def fetch(
        self, keys: Sequence[str], timeout: float | None = None, partial: bool = False
    ) -> dict[str, dict[str, SwarmRecord]]:
        """For each key, its valid records by author, all read in parallel; past the deadline, DHTUnavailable, or
        with ``partial`` the keys answered so far (the others left out)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._send_lock:
            futures = {key: self.dht.get(key, latest=True, return_future=True) for key in keys}
        results: dict[str, dict[str, SwarmRecord]] = {}
        try:
            for key, future in futures.items():
                try:
                    found = future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    if not partial:
                        raise
                    continue
                results[key] = self._decode(key, found)
            return results
        except FutureTimeout:
            missing = [key for key in keys if key not in results]
            raise DHTUnavailable(
                f"the DHT gave no answer within {self.timeout if timeout is None else timeout:.1f}s "
                f"for {len(missing)} of {len(keys)} keys (first: {missing[0]!r})"
            ) from None
        finally:
            for future in futures.values():
                future.cancel()

    def get(self, key: str, record_type: type[R]) -> dict[str, R]:
        """The valid records of one type under ``key``, by author."""
        return _only(self.fetch([key])[key], record_type)

    def stages(self, n_stages: int) -> dict[int, dict[str, StageAnnouncement]]:
        keys = [self.keys.stage(k) for k in range(n_stages)]
        found = self.fetch(keys)
        return {k: _only(found[key], StageAnnouncement) for k, key in enumerate(keys)}

    def verifiers(self) -> dict[str, VerifierAnnouncement]:
        return self.get(self.keys.verifiers, VerifierAnnouncement)

    def trainers(self) -> dict[str, TrainerAnnouncement]:
        return self.get(self.keys.trainers, TrainerAnnouncement)

    def bootstraps(self) -> dict[str, BootstrapAnnouncement]:
        return self.get(self.keys.bootstraps, BootstrapAnnouncement)

    def strikes(self, accused: str) -> dict[str, StrikeRecord]:
        """The strike records about ``accused``, by verifier."""
        return self.get(self.keys.strikes(accused), StrikeRecord)

    def _decode(self, key: str, found: object) -> dict[str, SwarmRecord]:
        if found is None or not isinstance(found.value, dict):
            return {}
        records: dict[str, SwarmRecord] = {}
        record_key_id = key_id(key)
        now = get_dht_time()
        for subkey, item in found.value.items():
            try:
                record = check_record(self.rules, record_key_id, subkey, item.value, item.expiration_time, now)
            except ForeignConfigError as e:
                self._warn_foreign_config(subkey, e.config_hash)
                continue
            except RecordError as e:
                logger.debug(f"dropped a record under {key!r}: {e}")
                continue
            except Exception as e:  # a reader never crashes on a record, whatever a peer sent
                logger.debug(f"dropped an unreadable record under {key!r}: {type(e).__name__}: {e}")
                continue
            records[record.author] = record
        return records

    def _warn_foreign_config(self, subkey: object, config_hash: str) -> None:
        with self._warn_lock:
            if subkey in self._warned_authors or len(self._warned_authors) > 256:
                return
            self._warned_authors.add(subkey)
        logger.warning(
            f"ignoring records of a peer of config {config_hash[:40]}, this node runs {self.config_hash} (that peer "
            "uses another swarm config; both must use the same file)"
        )


def _only(records: dict[str, SwarmRecord], record_type: type[R]) -> dict[str, R]:
    return {author: record for author, record in records.items() if isinstance(record, record_type)}
