"""The node's view of the swarm, rebuilt from DHT records: who serves what, who is struck, who is excluded."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hivemind.utils import get_dht_time

from dht.keys import MAX_STAGES
from dht.records import (
    Announcement,
    BootstrapAnnouncement,
    StageAnnouncement,
    StrikeRecord,
    TrainerAnnouncement,
    VerifierAnnouncement,
)
from dht.store import DHTUnavailable, RecordStore
from peers.health import Health
from peers.ledger import StrikeLedger
from peers.policy import Exclusion, ExclusionPolicy


@dataclass(frozen=True)
class SwarmView:
    """A snapshot of the swarm. Boundary ``b`` sits between stage ``b`` and stage ``b + 1``.

    Announcements are listed whatever their state; "live" means online and not excluded.
    """

    n_stages: int
    stages: Mapping[int, Mapping[str, StageAnnouncement]] = field(default_factory=dict)
    verifiers: Mapping[str, VerifierAnnouncement] = field(default_factory=dict)
    trainers: Mapping[str, TrainerAnnouncement] = field(default_factory=dict)
    bootstraps: Mapping[str, BootstrapAnnouncement] = field(default_factory=dict)
    ledger: StrikeLedger = field(default_factory=StrikeLedger)
    excluded: Mapping[str, Exclusion] = field(default_factory=dict)
    time: float = 0.0  # hivemind.get_dht_time() when the reads finished

    def is_excluded(self, peer: str) -> bool:
        return peer in self.excluded

    def is_live(self, announcement: Announcement) -> bool:
        return announcement.state == "online" and not self.is_excluded(announcement.peer_id)

    def live_replicas(self, stage: int) -> list[StageAnnouncement]:
        return [a for _, a in sorted(self.stages.get(stage, {}).items()) if self.is_live(a)]

    def live_verifiers(self, boundary: int) -> list[VerifierAnnouncement]:
        return [a for _, a in sorted(self.verifiers.items()) if boundary in a.boundaries and self.is_live(a)]

    def announcements(self) -> list[Announcement]:
        """Every announcement, bootstraps first, then stages in order, verifiers, trainers."""
        found: list[Announcement] = [a for _, a in sorted(self.bootstraps.items())]
        for stage in sorted(self.stages):
            found += [a for _, a in sorted(self.stages[stage].items())]
        found += [a for _, a in sorted(self.verifiers.items())]
        found += [a for _, a in sorted(self.trainers.items())]
        return found

    def health(self) -> Health:
        return Health.of(
            [len(self.live_replicas(k)) for k in range(self.n_stages)],
            [len(self.live_verifiers(b)) for b in range(self.n_stages - 1)],
        )


class SwarmWatcher:
    """Builds :class:`SwarmView` snapshots from the DHT; each :meth:`refresh` is two bounded rounds of reads.

    Strike records are kept per accused peer, so the watcher asks about every announced peer, plus peers it saw
    accused before (a banned peer that stops announcing stays excluded while the bans live).
    """

    def __init__(self, store: RecordStore, n_stages: int, policy: ExclusionPolicy):
        if not 1 <= n_stages <= MAX_STAGES:
            raise ValueError(f"n_stages must be in [1, {MAX_STAGES}], got {n_stages}")
        self.store, self.n_stages, self.policy = store, n_stages, policy
        self._view = SwarmView(n_stages)
        self._accused: set[str] = set()
        self._lock = threading.Lock()

    @property
    def view(self) -> SwarmView:
        """The latest snapshot (empty before the first refresh)."""
        with self._lock:
            return self._view

    def refresh(self, also_ask_about: Iterable[str] = ()) -> SwarmView:
        """Reads the swarm anew within the store's timeout; DHTUnavailable (and the previous view kept) if the DHT
        does not answer in time."""
        deadline = time.monotonic() + self.store.timeout
        keys = self.store.keys
        stage_keys = [keys.stage(k) for k in range(self.n_stages)]
        found = self.store.fetch([*stage_keys, keys.verifiers, keys.trainers, keys.bootstraps])
        stages = {k: _of_type(found[key], StageAnnouncement) for k, key in enumerate(stage_keys)}
        verifiers = _of_type(found[keys.verifiers], VerifierAnnouncement)
        trainers = _of_type(found[keys.trainers], TrainerAnnouncement)
        bootstraps = _of_type(found[keys.bootstraps], BootstrapAnnouncement)

        with self._lock:
            suspects = set(self._accused)
        for replicas in stages.values():
            suspects.update(replicas)
        suspects.update(verifiers, trainers, also_ask_about)
        strike_keys = {peer: keys.strikes(peer) for peer in sorted(suspects)}
        try:
            strikes = self.store.fetch(list(strike_keys.values()), timeout=max(0.5, deadline - time.monotonic()))
        except DHTUnavailable as e:
            # a partial answer beats none: peers whose strike records did not come in time keep the last ones seen
            previous = self.view.ledger
            strikes = dict(e.found)
            for peer, key in strike_keys.items():
                if key not in strikes:
                    strikes[key] = {record.verifier: record for record in previous.about(peer)}
        ledger = StrikeLedger.from_records(
            record for key in strike_keys.values() for record in _of_type(strikes[key], StrikeRecord).values()
        )

        view = SwarmView(
            n_stages=self.n_stages,
            stages=stages,
            verifiers=verifiers,
            trainers=trainers,
            bootstraps=bootstraps,
            ledger=ledger,
            excluded=self.policy.excluded(ledger),
            time=get_dht_time(),
        )
        with self._lock:
            self._accused = set(ledger.accused())
            self._view = view
        return view


def _of_type(records: Mapping[str, object], record_type: type) -> dict:
    return {author: record for author, record in records.items() if isinstance(record, record_type)}
