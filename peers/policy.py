"""The exclusion policy: when a peer is shut out of the swarm (docs/architecture.md section 6, docs/security.md).

A peer is excluded while ``ban_quorum`` distinct admitted verifiers hold a live ban on it. A verifier is admitted by
the swarm's trust roots: the config lists it (``trusted_verifiers``), or it holds a certificate signed by the
organiser covering the boundary of its ban (carried in the strike record itself, so any reader checks it offline).

An open verifier set (``open_verifiers``, an explicit opt-in) also counts other verifiers, but only those that the
reader has itself seen announced for at least ``min_voter_age`` seconds and that are not excluded themselves; the
quorum must then be at least 2, so that one lying verifier cannot frame an honest peer. What an open set cannot stop
(an attacker who runs ``ban_quorum`` patient verifiers) is said in docs/security.md. Exclusion lifts when the ban
records expire.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from dht.admission import TrustRoots, admission_problem
from dht.identity import peer_id_from_entry
from dht.records import StrikeRecord
from peers.ledger import StrikeLedger

# An open set's voters must have been seen announced this long by the reader (several announce periods, and more
# than a throwaway key that was never announced can show).
DEFAULT_MIN_VOTER_AGE = 120.0


def verifier_peer_id(entry: str) -> str:
    """The peer id named by a trusted-verifier entry: a peer id, an OpenSSH RSA public key, or an owner tag."""
    return peer_id_from_entry(entry, "trusted verifier")


@dataclass(frozen=True)
class ExclusionParams:
    """Who may vote and how many votes exclude; checked on creation, with the offending value named.

    ``organiser`` is the organiser's OpenSSH public key (certificates it signed admit verifiers); ``prefix`` the
    swarm that certificates must name.
    """

    trusted_verifiers: tuple[str, ...] = ()
    ban_quorum: int = 2
    open_verifiers: bool = False
    organiser: str | None = None
    prefix: str = ""
    min_voter_age: float = DEFAULT_MIN_VOTER_AGE
    trusted_peer_ids: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trusted_verifiers", tuple(self.trusted_verifiers))
        object.__setattr__(self, "trusted_peer_ids", frozenset(map(verifier_peer_id, self.trusted_verifiers)))
        if isinstance(self.ban_quorum, bool) or not isinstance(self.ban_quorum, int) or self.ban_quorum < 1:
            raise ValueError(f"ban_quorum must be an integer of at least 1, got {self.ban_quorum!r}")
        if self.min_voter_age < 0:
            raise ValueError(f"min_voter_age must not be negative, got {self.min_voter_age}")
        if self.open_verifiers and self.ban_quorum < 2:
            raise ValueError(
                "ban_quorum must be at least 2 with an open verifier set (open_verifiers: true), "
                "so that one lying verifier cannot frame an honest peer"
            )
        # (a swarm that admits no verifier at all is valid here: nodes that need one say so when they join)
        if (
            not self.open_verifiers
            and self.organiser is None
            and self.trusted_peer_ids
            and self.ban_quorum > len(self.trusted_peer_ids)
        ):
            raise ValueError(
                f"ban_quorum={self.ban_quorum} exceeds the {len(self.trusted_peer_ids)} distinct trusted verifiers: "
                "no peer could ever be excluded; lower ban_quorum or trust more verifiers"
            )

    @property
    def open(self) -> bool:
        return self.open_verifiers

    @property
    def closed_trust(self) -> TrustRoots:
        """The verifiers this swarm admits without an open set: listed ones and certificate holders."""
        organiser = None if self.organiser is None else self.organiser.strip().encode()
        return TrustRoots(organiser=organiser, verifiers=self.trusted_peer_ids)


@dataclass(frozen=True)
class Exclusion:
    """A peer shut out of the swarm and the live bans (one per verifier) that did it."""

    peer: str
    votes: tuple[StrikeRecord, ...]

    @property
    def voters(self) -> tuple[str, ...]:
        return tuple(vote.verifier for vote in self.votes)


class ExclusionPolicy:
    """Turns a strike ledger into the set of excluded peers."""

    def __init__(self, params: ExclusionParams):
        self.params = params
        self._trust = params.closed_trust

    def admitted(self, record: StrikeRecord) -> bool:
        """Whether the record's verifier is admitted for the record's boundary without an open set."""
        problem = admission_problem(
            self._trust, self.params.prefix, "verifier", record.verifier, record.certificate, [record.boundary]
        )
        return problem is None

    def counts(self, record: StrikeRecord, open_voters: Collection[str] = ()) -> bool:
        """Whether ``record`` is a vote for exclusion: a ban, not on its own author, by an admitted verifier or
        (open set) by one of ``open_voters``, the verifiers the reader has seen long enough in good standing."""
        if not record.banned or record.verifier == record.accused:
            return False
        if self.admitted(record):
            return True
        return self.params.open and record.verifier in open_voters

    def votes(self, ledger: StrikeLedger, peer: str, open_voters: Collection[str] = ()) -> tuple[StrikeRecord, ...]:
        """The counted bans on ``peer``, one per verifier (the ledger holds one record per verifier)."""
        return tuple(record for record in ledger.about(peer) if self.counts(record, open_voters))

    def excluded(self, ledger: StrikeLedger, open_voters: Collection[str] = ()) -> Mapping[str, Exclusion]:
        """Every peer with at least ``ban_quorum`` counted bans, with those bans. An open voter that is itself
        excluded loses its vote (repeated until nothing changes)."""
        voters = set(open_voters)
        while True:
            exclusions = {}
            for peer in ledger.accused():
                votes = self.votes(ledger, peer, voters)
                if len(votes) >= self.params.ban_quorum:
                    exclusions[peer] = Exclusion(peer, votes)
            standing = voters - set(exclusions)
            if standing == voters:
                return exclusions
            voters = standing
