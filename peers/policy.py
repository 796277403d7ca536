"""The exclusion policy: when a peer is shut out of the swarm (docs/architecture.md section 6).

A peer is excluded while ``ban_quorum`` distinct verifiers that the swarm trusts hold a live ban on it. With an
open verifier set (no trusted list) any verifier's ban counts, so the quorum must be at least 2: one lying verifier
must not be able to frame an honest peer. Exclusion lifts when the ban records expire.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from dht.identity import IdentityError, peer_id_from_public_key, public_key_from_owner_tag
from dht.records import StrikeRecord
from peers.ledger import StrikeLedger

_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")


def verifier_peer_id(entry: str) -> str:
    """The peer id named by a trusted-verifier entry: a peer id, an OpenSSH RSA public key, or an owner tag."""
    text = entry.strip()
    public_key = public_key_from_owner_tag(text.encode())
    if public_key is None and text.startswith("ssh-rsa "):
        public_key = text.encode()
    if public_key is not None:
        try:
            return peer_id_from_public_key(public_key)
        except IdentityError as e:
            raise ValueError(f"trusted verifier {entry[:40]!r}... is not a valid RSA public key: {e}") from None
    if _PEER_ID.match(text):
        return text
    raise ValueError(
        f"trusted verifier {entry[:60]!r} is neither a peer id (base58, e.g. Qm...) nor an RSA public key "
        "('ssh-rsa AAAA...'); copy the verifier's peer id from `sentinel-node swarm peers`"
    )


@dataclass(frozen=True)
class ExclusionParams:
    """Who may vote and how many votes exclude; checked on creation, with the offending value named."""

    trusted_verifiers: tuple[str, ...] = ()
    ban_quorum: int = 2
    trusted_peer_ids: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trusted_verifiers", tuple(self.trusted_verifiers))
        object.__setattr__(self, "trusted_peer_ids", frozenset(map(verifier_peer_id, self.trusted_verifiers)))
        if isinstance(self.ban_quorum, bool) or not isinstance(self.ban_quorum, int) or self.ban_quorum < 1:
            raise ValueError(f"ban_quorum must be an integer of at least 1, got {self.ban_quorum!r}")
        if not self.trusted_peer_ids and self.ban_quorum < 2:
            raise ValueError(
                "ban_quorum must be at least 2 with an open verifier set (trusted_verifiers empty), "
                "so that one lying verifier cannot frame an honest peer"
            )
        if self.trusted_peer_ids and self.ban_quorum > len(self.trusted_peer_ids):
            raise ValueError(
                f"ban_quorum={self.ban_quorum} exceeds the {len(self.trusted_peer_ids)} distinct trusted verifiers: "
                "no peer could ever be excluded; lower ban_quorum or trust more verifiers"
            )

    @property
    def open(self) -> bool:
        return not self.trusted_peer_ids


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

    def counts(self, record: StrikeRecord) -> bool:
        """Whether ``record`` is a vote for exclusion: a ban by a verifier this swarm listens to."""
        if not record.banned or record.verifier == record.accused:
            return False
        return self.params.open or record.verifier in self.params.trusted_peer_ids

    def votes(self, ledger: StrikeLedger, peer: str) -> tuple[StrikeRecord, ...]:
        """The counted bans on ``peer``, one per verifier (the ledger holds one record per verifier)."""
        return tuple(record for record in ledger.about(peer) if self.counts(record))

    def excluded(self, ledger: StrikeLedger) -> Mapping[str, Exclusion]:
        """Every peer with at least ``ban_quorum`` counted bans, with those bans."""
        exclusions = {}
        for peer in ledger.accused():
            votes = self.votes(ledger, peer)
            if len(votes) >= self.params.ban_quorum:
                exclusions[peer] = Exclusion(peer, votes)
        return exclusions
