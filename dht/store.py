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

import asyncio
import functools
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time, get_logger

from dht.identity import Identity
from dht.keys import CONFIG_KEY, SwarmKeys
from dht.once import OncePer
from dht.records import (
    BootstrapAnnouncement,
    StageAnnouncement,
    StrikeRecord,
    SwarmConfigRecord,
    SwarmRecord,
    TrainerAnnouncement,
    VerifierAnnouncement,
)
from dht.rules import SwarmRules
from dht.validation import ForeignConfigError, RecordError, check_record, key_id, record_bytes

logger = get_logger(__name__)

R = TypeVar("R", bound=SwarmRecord)


class DHTUnavailable(TimeoutError):
    """The DHT did not answer within the deadline; the message names what was asked. ``found`` holds the keys
    that did answer, decoded as :meth:`RecordStore.fetch` would have returned them."""

    def __init__(self, message: str, found: dict | None = None) -> None:
        super().__init__(message)
        self.found = found or {}


async def _latest_values(_dht: hivemind.DHT, node, keys: tuple[str, ...], timeout: float) -> dict:
    """Runs in the DHT's process: the latest value of each key that was found within ``timeout`` seconds, from
    one traversal of the DHT for all of them (one request per DHT node carries every key); keys still searched
    at the deadline are left out, keys found empty map to None."""
    ids = {DHTID.generate(source=key): key for key in keys}
    futures = await node.get_many_by_id(list(ids), sufficient_expiration_time=float("inf"), return_futures=True)
    done, pending = await asyncio.wait(list(futures.values()), timeout=timeout) if futures else (set(), set())
    for future in pending:
        future.cancel()
    return {
        ids[key_id]: future.result()
        for key_id, future in futures.items()
        if future in done and not future.cancelled() and future.exception() is None
    }


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
        self._warned_authors = OncePer(256)

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

    @property
    def send_lock(self) -> threading.Lock:
        """Held while a call is sent to the DHT's process: whoever else sends one through the same DHT takes it."""
        return self._send_lock

    def fetch(
        self, keys: Sequence[str], timeout: float | None = None, partial: bool = False
    ) -> dict[str, dict[str, SwarmRecord]]:
        """For each key, its valid records by author, read in one traversal of the DHT; DHTUnavailable (holding
        the keys that did answer in ``found``) when some key found no answer before the deadline, or with
        ``partial`` the keys answered so far (the others left out)."""
        timeout = self.timeout if timeout is None else timeout
        keys = tuple(dict.fromkeys(keys))
        if not keys:
            return {}
        # The search gives up a little before the caller does, so its partial answer still comes back in time.
        search_s = max(0.05, 0.9 * timeout - 0.05)
        coroutine = functools.partial(_latest_values, keys=keys, timeout=search_s)
        with self._send_lock:
            future = self.dht.run_coroutine(coroutine, return_future=True)
        try:
            values = future.result(timeout=max(0.1, timeout))
        except FutureTimeout:
            # Not cancelled: the search ends on its own at its deadline, and setting the result of a cancelled
            # future would make the DHT process log a traceback. Once dropped here, its answer is ignored.
            values = {}
        results = {key: self._decode(key, values[key]) for key in keys if key in values}
        missing = [key for key in keys if key not in results]
        if missing and not partial:
            raise DHTUnavailable(
                f"the DHT gave no answer within {timeout:.1f}s for {len(missing)} of {len(keys)} keys "
                f"(first: {missing[0]!r})",
                found=results,
            )
        return results

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

    def swarm_configs(self, timeout: float | None = None) -> dict[str, SwarmConfigRecord]:
        """Every well-formed swarm config record, by publisher, whatever config this store was opened with (a
        node reads them to learn which config to run)."""
        found = self.fetch([CONFIG_KEY], timeout)[CONFIG_KEY]
        return _only(found, SwarmConfigRecord)

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
        if not self._warned_authors.first(subkey):
            return
        logger.warning(
            f"ignoring records of a peer of config {config_hash[:40]}, this node runs {self.config_hash} (that peer "
            "uses another swarm config; both must use the same file)"
        )


def _only(records: dict[str, SwarmRecord], record_type: type[R]) -> dict[str, R]:
    return {author: record for author, record in records.items() if isinstance(record, record_type)}
