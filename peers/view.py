"""The node's view of the swarm, rebuilt from DHT records: who serves what, who is struck, who is excluded."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
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
    # open verifier set: the verifiers whose bans count, having been seen announced long enough (peers.policy)
    open_voters: frozenset[str] = frozenset()

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

    def step_estimate(self, exclude: str | None = None) -> int:
        """The swarm's last applied global step as its live stage replicas announce it, robust to a minority of
        liars: the lower median over stages of each stage's lower median (``exclude``: a replica asking about the
        others). -1 when no replica has applied a step (or none is announced)."""
        per_stage = []
        for k in range(self.n_stages):
            steps = sorted(a.last_step for a in self.live_replicas(k) if a.peer_id != exclude)
            if steps:
                per_stage.append(steps[(len(steps) - 1) // 2])
        if not per_stage:
            return -1
        return sorted(per_stage)[(len(per_stage) - 1) // 2]

    def health(self) -> Health:
        return Health.of(
            [len(self.live_replicas(k)) for k in range(self.n_stages)],
            [len(self.live_verifiers(b)) for b in range(self.n_stages - 1)],
        )


class SwarmWatcher:
    """Builds :class:`SwarmView` snapshots from the DHT; each :meth:`refresh` is one bounded round of reads (two
    when peers were announced that the last one did not know).

    The store has already dropped every record the swarm's rules refuse (unadmitted trainers and verifiers among
    them). Strike records are kept per accused peer, so the watcher asks about every announced peer, plus peers it
    saw accused before (a banned peer that stops announcing stays excluded while the bans live); strike keys that
    do not answer in time keep the records last read from them, so a flood of announcements slows a refresh down
    but never blanks the ledger. With an open verifier set it remembers when it first saw each verifier announced
    (``clock``: seconds), for the policy's minimum voter age.
    """

    def __init__(
        self,
        store: RecordStore,
        n_stages: int,
        policy: ExclusionPolicy,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 1 <= n_stages <= MAX_STAGES:
            raise ValueError(f"n_stages must be in [1, {MAX_STAGES}], got {n_stages}")
        self.store, self.n_stages, self.policy, self.clock = store, n_stages, policy, clock
        self._view = SwarmView(n_stages)
        self._accused: set[str] = set()
        self._first_seen: dict[str, float] = {}
        self._turn = 0  # refreshes so far: whose strike keys a rotating refresh reads
        self._read_all_once = False  # whether one refresh has had an answer from every strike key it asked
        self._lock = threading.Lock()

    @property
    def view(self) -> SwarmView:
        """The latest snapshot (empty before the first refresh)."""
        with self._lock:
            return self._view

    def refresh(self, also_ask_about: Iterable[str] = (), rotation: int = 1) -> SwarmView:
        """Reads the swarm anew within the store's timeout; DHTUnavailable (and the previous view kept) if the DHT
        does not answer in time.

        With ``rotation`` n > 1 the strike keys of peers nobody has accused yet are read one n-th at a time, in
        turn, so every one is read once in n refreshes; accused peers and ``also_ask_about`` are read every time.
        Most peers are never accused, and reading each one's strike key on every refresh was most of an idle
        node's work (docs/decisions.md, "The suite's time"); a first ban is then seen up to n refreshes later.
        Until one refresh has had an answer from every strike key it asked, every refresh asks them all: a node that
        just started, whose first reads time out on a loaded machine, must not wait n turns for a ban."""
        deadline = time.monotonic() + self.store.timeout
        keys = self.store.keys
        stage_keys = [keys.stage(k) for k in range(self.n_stages)]
        fixed = [*stage_keys, keys.verifiers, keys.trainers, keys.bootstraps]
        with self._lock:
            suspects = set(self._accused)
            before = self._view
            previous = before.ledger
        self._turn += 1
        # one traversal reads the announcements and the strike keys of the peers announced last time: in a steady
        # swarm nobody is new, and a second traversal only for the strike keys doubled an idle node's reads
        known = set(before.verifiers) | set(before.trainers) | {p for r in before.stages.values() for p in r}
        asked = suspects | set(also_ask_about) | self._turn_of(known - suspects, rotation)
        strike_keys = {peer: keys.strikes(peer) for peer in sorted(asked)}
        found = self.store.fetch([*fixed, *strike_keys.values()], partial=True)
        missing = [key for key in fixed if key not in found]
        if missing:
            raise DHTUnavailable(
                f"the DHT gave no answer within {self.store.timeout:.1f}s for {len(missing)} of {len(fixed)} keys "
                f"(first: {missing[0]!r})",
                found={key: found[key] for key in fixed if key in found},
            )
        now = get_dht_time()
        stages = {
            k: self._kept(before.stages.get(k, {}), _of_type(found[key], StageAnnouncement), now)
            for k, key in enumerate(stage_keys)
        }
        verifiers = self._kept(before.verifiers, _of_type(found[keys.verifiers], VerifierAnnouncement), now)
        trainers = self._kept(before.trainers, _of_type(found[keys.trainers], TrainerAnnouncement), now)
        bootstraps = self._kept(before.bootstraps, _of_type(found[keys.bootstraps], BootstrapAnnouncement), now)

        announced: set[str] = set(verifiers) | set(trainers)
        for replicas in stages.values():
            announced.update(replicas)
        new = {peer: keys.strikes(peer) for peer in sorted(self._turn_of(announced - known - suspects, rotation))}
        if new:  # peers first announced now: their strike keys in a second traversal, before they are trusted
            found.update(
                self.store.fetch(list(new.values()), timeout=max(0.0, deadline - time.monotonic()), partial=True)
            )
            strike_keys.update(new)
        self._read_all_once |= all(key in found for key in strike_keys.values())
        records = []
        now = get_dht_time()
        for peer, key in strike_keys.items():
            if key in found:
                records += _of_type(found[key], StrikeRecord).values()
            else:  # no answer in time: what this key said last time still stands (records expire on their own)
                records += [r for r in previous.about(peer) if r.time >= now - self.store.rules.strike_ttl]
        ledger = StrikeLedger.from_records(records)
        open_voters = self._open_voters(verifiers)

        view = SwarmView(
            n_stages=self.n_stages,
            stages=stages,
            verifiers=verifiers,
            trainers=trainers,
            bootstraps=bootstraps,
            ledger=ledger,
            excluded=self.policy.excluded(ledger, open_voters),
            time=get_dht_time(),
            open_voters=open_voters,
        )
        with self._lock:
            self._accused = set(ledger.accused())
            self._view = view
        return view

    def _turn_of(self, unaccused: set[str], rotation: int) -> set[str]:
        """The unaccused peers whose strike keys this refresh reads: all of them, or with ``rotation`` n > 1 (once
        one refresh read every key) those of this turn's slot."""
        if rotation > 1 and self._read_all_once:
            return {peer for peer in unaccused if _slot(peer, rotation) == self._turn % rotation}
        return set(unaccused)

    def _kept(self, before: Mapping[str, Announcement], read: dict[str, Announcement], now: float) -> dict:
        """What a key holds: the announcements just read, and those read before that this read missed but that
        cannot have expired yet (a DHT read on a loaded machine may miss a record; its node has not gone, which
        it would have said with an ``offline`` record, or by letting it expire). A newer record always wins."""
        ttl = self.store.rules.announce_ttl
        kept = dict(read)
        for peer, announcement in before.items():
            if peer not in kept and announcement.time + ttl > now:
                kept[peer] = announcement
        return kept

    def _open_voters(self, verifiers: Mapping[str, VerifierAnnouncement]) -> frozenset[str]:
        """Verifiers announced online in every refresh since at least ``min_voter_age`` seconds ago (open sets)."""
        if not self.policy.params.open:
            return frozenset()
        now = self.clock()
        online = {peer for peer, a in verifiers.items() if a.state == "online"}
        with self._lock:
            self._first_seen = {peer: self._first_seen.get(peer, now) for peer in online}
            age = self.policy.params.min_voter_age
            return frozenset(peer for peer, seen in self._first_seen.items() if now - seen >= age)


def _of_type(records: Mapping[str, object], record_type: type) -> dict:
    return {author: record for author, record in records.items() if isinstance(record, record_type)}


def _slot(peer: str, rotation: int) -> int:
    """Which of ``rotation`` turns reads ``peer``'s strike key (stable for a peer, spread over peers)."""
    return zlib.crc32(peer.encode()) % rotation
