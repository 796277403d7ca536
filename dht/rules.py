"""The rules of one swarm's namespace, as every node's DHT validator and every reader applies them.

All nodes of a swarm share one config (its hash is in every record, and records of another config are refused),
so validators may read it: the stage count bounds which keys exist, the TTLs bound how long a record may claim to
live, the trust roots say who holds a role. Every check here is monotone in time (a record valid when it was
stored stays valid until it expires): hivemind refuses a whole dictionary when one entry fails validation, so two
honest nodes must never disagree about a record they both hold merely because they check it at different moments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dht.admission import TrustRoots
from dht.keys import MAX_STAGES, SwarmKeys
from dht.records import ANNOUNCEMENT_KINDS

# Peers' clocks may disagree by a few seconds (hivemind assumes 3); lifetimes and times are checked with this slack.
CLOCK_SLACK = 60.0
# hivemind's averagers declare themselves for seconds (matchmaking) to half a minute (state sharing).
AVERAGER_MAX_TTL = 300.0
# A swarm's published config (dht.records.SwarmConfigRecord) is refreshed every minute and may live a few hours, so a
# swarm whose bootstraps all stopped can still be joined for a while.
CONFIG_MAX_TTL = 4 * 3600.0
# Bytes of one value as stored (record and signature). An honest announcement is about 1.5 KiB with a certificate.
MAX_RECORD_BYTES = 8 * 1024
# Subkeys per key. A DHT reply carries a key's whole dictionary in one message, capped at 4 MiB by the daemon:
# 256 entries of at most 8 KiB of value and about 0.5 KiB of subkey fit in 2.2 MiB.
MAX_SUBKEYS = 256
MAX_SUBKEY_BYTES = 1024
DHT_MESSAGE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class SwarmRules:
    """Everything a validator or a reader checks a record of swarm ``prefix`` against."""

    prefix: str
    config_hash: str
    n_stages: int
    trust: TrustRoots = field(default_factory=TrustRoots)
    announce_ttl: float = 20.0
    strike_ttl: float = 86400.0
    max_subkeys: int = MAX_SUBKEYS
    max_record_bytes: int = MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.n_stages <= MAX_STAGES:
            raise ValueError(f"n_stages must be in [1, {MAX_STAGES}], got {self.n_stages}")
        if self.announce_ttl <= 0 or self.strike_ttl <= 0:
            raise ValueError("record lifetimes must be positive")
        if not self.max_subkeys >= 1 or self.max_subkeys * (self.max_record_bytes + MAX_SUBKEY_BYTES) > (
            DHT_MESSAGE_BYTES * 3 // 4
        ):
            raise ValueError(
                f"{self.max_subkeys} subkeys of up to {self.max_record_bytes} bytes could outgrow a DHT message"
            )

    @property
    def keys(self) -> SwarmKeys:
        return SwarmKeys(self.prefix)

    @property
    def n_boundaries(self) -> int:
        return self.n_stages - 1

    def ttl(self, kind: str) -> float:
        """The longest a record of ``kind`` may live."""
        if kind == "swarm_config":
            return CONFIG_MAX_TTL
        return self.announce_ttl if kind in ANNOUNCEMENT_KINDS else self.strike_ttl
