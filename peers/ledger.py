"""The strike ledger: every live strike record, by accused peer and by the verifier that issued it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from dht.records import StrikeRecord


@dataclass(frozen=True)
class StrikeLedger:
    """``records[accused][verifier]`` is that verifier's current verdict on that peer."""

    records: Mapping[str, Mapping[str, StrikeRecord]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for accused, by_verifier in self.records.items():
            for verifier, record in by_verifier.items():
                if record.accused != accused or record.verifier != verifier:
                    raise ValueError(
                        f"ledger entry [{accused}][{verifier}] holds a record by {record.verifier} "
                        f"about {record.accused}"
                    )

    @classmethod
    def from_records(cls, records: Iterable[StrikeRecord]) -> StrikeLedger:
        """A ledger of ``records``; of two by the same verifier about the same peer, the newer wins."""
        table: dict[str, dict[str, StrikeRecord]] = {}
        for record in records:
            current = table.setdefault(record.accused, {}).get(record.verifier)
            if current is None or record.time >= current.time:
                table[record.accused][record.verifier] = record
        return cls(table)

    def accused(self) -> list[str]:
        """Peers with at least one strike record, sorted."""
        return sorted(peer for peer, by_verifier in self.records.items() if by_verifier)

    def about(self, peer: str) -> list[StrikeRecord]:
        """The records about ``peer``, one per verifier, sorted by verifier."""
        by_verifier = self.records.get(peer, {})
        return [by_verifier[verifier] for verifier in sorted(by_verifier)]

    def __iter__(self) -> Iterator[StrikeRecord]:
        for peer in self.accused():
            yield from self.about(peer)

    def __len__(self) -> int:
        return sum(len(by_verifier) for by_verifier in self.records.values())
