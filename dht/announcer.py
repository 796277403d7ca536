"""Keeps one node's announcement alive in the DHT while the node lives.

The record is re-stored every ``period`` seconds with a lifetime of ``ttl``: a node that dies silently drops out
of the swarm within ``ttl``; one that stops cleanly writes a last ``offline`` record so readers know at once.
"""

from __future__ import annotations

import threading

from hivemind.utils import get_dht_time, get_logger

from dht.records import Announcement
from dht.store import RecordStore
from dht.validation import RecordError

logger = get_logger(__name__)


class Announcer:
    """A daemon thread re-putting ``record`` (with a fresh ``time``) until :meth:`stop`."""

    def __init__(self, store: RecordStore, record: Announcement, period: float, ttl: float):
        if not 0 < period < ttl:
            raise ValueError(
                f"announce period ({period}s) must be positive and shorter than the ttl ({ttl}s), "
                "or announcements expire between refreshes"
            )
        self.store, self.period, self.ttl = store, period, ttl
        self._record = record
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"announce-{record.kind}", daemon=True)

    @property
    def record(self) -> Announcement:
        with self._lock:
            return self._record

    def start(self) -> Announcer:
        """Announces at once, then every period; returns self."""
        self._thread.start()
        return self

    def update(self, **changes) -> None:
        """Changes fields of the announcement (validated now) and announces the change at once."""
        with self._lock:
            self._record = self._record.replace(**changes)
        self._wake.set()

    def stop(self, offline: bool = True, wait: float | None = None) -> None:
        """Stops refreshing; with ``offline``, first tells readers the node is gone (bounded by the store timeout).
        ``wait`` bounds how long a refresh under way is waited for (a DHT that is gone never answers it)."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(wait)
        if offline:
            self._announce(self.record.replace(state="offline"))

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._announce(self.record)
            self._wake.wait(self.period)
            self._wake.clear()

    def _announce(self, record: Announcement) -> None:
        try:
            self.store.put(record.replace(time=get_dht_time()), ttl=self.ttl)
        except RecordError as e:
            logger.error(f"cannot announce this node, peers would refuse its {record.kind} record: {e}")
        except Exception as e:  # a dying DHT must not kill the announcer thread silently in the middle of a refresh
            logger.warning(f"announcing failed ({type(e).__name__}: {e}); retrying in {self.period}s")
