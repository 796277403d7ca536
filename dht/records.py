"""The records of the swarm, as strictly typed pydantic.v1 models (hivemind's validators speak pydantic.v1).

Every record names its author (``peer_id``, or ``verifier`` for a strike record); the DHT accepts it only under
the author's own owner-tag subkey and only under the key its content implies (:meth:`SwarmRecord.key`). Types are
strict: an int where a float is due is refused rather than converted, so a record means the same to every reader.

Records evolve without splitting the swarm: each carries the ``schema`` version its writer knows (:data:`SCHEMA`).
A reader accepts fields it does not know only in a record of a newer schema than its own, and ignores them (as
Petals' ``from_tuple`` ignores trailing fields); every field it does know is checked as strictly as ever. The
signature covers the whole value, unknown fields included, so nobody can add or change one on the way.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

import pydantic.v1 as pydantic
from pydantic.v1 import StrictBool, StrictFloat, confloat, conint, conlist, constr

from dht.keys import MAX_STAGES, SwarmKeys

PeerIdStr = constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")  # base58, as libp2p prints peer ids
ShortStr = constr(strict=True, max_length=128)
Maddr = constr(strict=True, min_length=1, max_length=512)
Throughput = confloat(strict=True, ge=0)  # NaN fails ge=0, which is what we want
Count = conint(strict=True, ge=0)
StageIndex = conint(strict=True, ge=0, lt=MAX_STAGES)

State = Literal["joining", "online", "offline"]
Direction = Literal["activation", "gradient"]

MAX_METRICS = 64

# The record schema this code writes and understands in full. Raise it when a record type gains a field; readers
# of an older schema then accept the newer records and ignore the field, and this code reads records of an older
# schema without the fields added since (:data:`ADDED_IN`), which take their defaults.
SCHEMA = 2
MAX_UNKNOWN_FIELDS = 16
MAX_FIELD_NAME = 64


class SwarmRecord(pydantic.BaseModel):
    """Fields every record carries."""

    author_field: ClassVar[str] = "peer_id"

    kind: str
    schema_: conint(strict=True, ge=1) = pydantic.Field(SCHEMA, alias="schema")
    config_hash: ShortStr
    version: ShortStr  # the writer's software version, for people
    time: StrictFloat  # the author's hivemind.get_dht_time() when it wrote the record

    class Config:
        extra = pydantic.Extra.forbid
        allow_mutation = False
        allow_population_by_field_name = True

    def dict(self, **kwargs) -> dict:
        """The record as it goes on the wire (``schema`` under its own name)."""
        return super().dict(by_alias=True, **kwargs)

    @property
    def author(self) -> str:
        return getattr(self, self.author_field)

    def key(self, keys: SwarmKeys) -> str:
        """The only DHT key under which this record may be stored."""
        raise NotImplementedError

    def replace(self, **changes) -> SwarmRecord:
        """A validated copy with some fields changed (pydantic.v1's ``copy(update=...)`` does not validate)."""
        return type(self).parse_obj({**self.dict(), **changes})


class Announcement(SwarmRecord):
    """A live node saying where it is and how fast it works; refreshed while the node lives."""

    peer_id: PeerIdStr
    maddrs: conlist(Maddr, max_items=32)
    state: State
    relayed: StrictBool  # reachable only through a relay: slower, routed to only when no direct peer is left
    throughput: Throughput


class StageAnnouncement(Announcement):
    kind: Literal["stage"] = "stage"
    stage: StageIndex
    # the last global step the replica applied (-1: none yet); a trainer joining a swarm whose trainers have all
    # gone resumes after it, since stages apply each global step once
    last_step: conint(strict=True, ge=-1) = -1

    def key(self, keys: SwarmKeys) -> str:
        return keys.stage(self.stage)


class VerifierAnnouncement(Announcement):
    kind: Literal["verifier"] = "verifier"
    boundaries: conlist(StageIndex, max_items=MAX_STAGES)  # boundary b sits between stage b and stage b+1

    def key(self, keys: SwarmKeys) -> str:
        return keys.verifiers


class TrainerAnnouncement(Announcement):
    kind: Literal["trainer"] = "trainer"
    global_step: Count
    loss: Optional[StrictFloat] = None

    def key(self, keys: SwarmKeys) -> str:
        return keys.trainers


class BootstrapAnnouncement(Announcement):
    kind: Literal["bootstrap"] = "bootstrap"

    def key(self, keys: SwarmKeys) -> str:
        return keys.bootstraps


Digest = constr(strict=True, regex=r"^[0-9a-f]{64}$")  # SHA-256, hex
DigestName = Literal["input", "output", "grad_output", "grad_input"]
MicrobatchId = constr(strict=True, min_length=1, max_length=128, regex=r"^[A-Za-z0-9_.:-]+$")


class AuditEvidence(pydantic.BaseModel):
    """What a failed recomputation audit found (schema 2): the microbatch and its global step, the digests of the
    stage's four tensors as the verifiers relayed them, the auditor replicas that recomputed it (the first, then the
    one that confirmed), their relative errors, and the digest of the reference parameters they used."""

    microbatch: MicrobatchId
    step: Count
    stage: StageIndex
    finding: Literal["mismatch", "skipped", "frozen"]
    direction: Direction  # the tensor that failed: the output (activation) or the input gradient
    error: confloat(strict=True, ge=0)  # the first auditor's relative error of the stage's contribution
    confirmed_error: Optional[confloat(strict=True, ge=0)]  # the confirming auditor's
    auditors: conlist(PeerIdStr, min_items=1, max_items=2)
    digests: dict[DigestName, Digest]
    parameters: constr(strict=True, regex=r"^[0-9a-f]{16}$")

    class Config:
        extra = pydantic.Extra.forbid
        allow_mutation = False


class StrikeRecord(SwarmRecord):
    """One verifier's standing verdict on one peer; a newer record from the same verifier replaces it.

    Schema 2 adds the peer's recomputation audits as this verifier ran them (``audits_passed``,
    ``audits_failed``) and the evidence of the last failed one (``audit``)."""

    author_field: ClassVar[str] = "verifier"

    kind: Literal["strike"] = "strike"
    verifier: PeerIdStr
    accused: PeerIdStr
    boundary: StageIndex
    direction: Direction
    strikes: Count
    checks: Count
    flags: Count
    metrics: dict[constr(strict=True, max_length=64), StrictFloat]
    banned: StrictBool
    audits_passed: Count = 0
    audits_failed: Count = 0
    audit: Optional[AuditEvidence] = None

    @pydantic.validator("metrics")
    def _few_metrics(cls, metrics: dict) -> dict:
        if len(metrics) > MAX_METRICS:
            raise ValueError(f"at most {MAX_METRICS} metrics, got {len(metrics)}")
        return metrics

    def key(self, keys: SwarmKeys) -> str:
        return keys.strikes(self.accused)


# Fields by the schema that added them: a record of an older schema may lack them (they take their defaults).
ADDED_IN: dict[str, dict[str, int]] = {"strike": {"audits_passed": 2, "audits_failed": 2, "audit": 2}}

RECORD_TYPES: dict[str, type[SwarmRecord]] = {
    "stage": StageAnnouncement,
    "verifier": VerifierAnnouncement,
    "trainer": TrainerAnnouncement,
    "bootstrap": BootstrapAnnouncement,
    "strike": StrikeRecord,
}

# Caps on how long a record may claim to live, against records that would never expire; generous because
# validators must agree across the swarm without reading its config.
MAX_TTL: dict[str, float] = {
    "stage": 86400.0,
    "verifier": 86400.0,
    "trainer": 86400.0,
    "bootstrap": 86400.0,
    "strike": 30 * 86400.0,
}


def parse_record(value: object) -> SwarmRecord:
    """The record a DHT value holds, exactly as written; ValueError if it is not a well-formed record.

    Beyond pydantic's checks, the value must equal the parsed record field for field, so defaults filled in or
    values converted on parsing count as malformed (the same rule as hivemind's SchemaValidator). Fields this
    reader does not know are allowed only in a record of a newer schema, at most :data:`MAX_UNKNOWN_FIELDS` of
    them, and are left out of the record it returns.
    """
    if not isinstance(value, dict):
        raise ValueError(f"a record is a dict, got {type(value).__name__}")
    kind = value.get("kind")
    record_type = RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if record_type is None:
        raise ValueError(f"unknown record kind {str(kind)[:40]!r}; expected one of {sorted(RECORD_TYPES)}")
    schema = value.get("schema")
    if type(schema) is not int or schema < 1:
        raise ValueError(f"a {kind} record must carry its schema version (an integer of at least 1)")
    fields = {field.alias for field in record_type.__fields__.values()}
    newer = {name for name, since in ADDED_IN.get(kind, {}).items() if since > schema and name not in value}
    unknown = [name for name in value if name not in fields]
    if unknown:
        if schema <= SCHEMA:
            raise ValueError(f"a schema-{schema} {kind} record has fields it may not have: {unknown[:5]}")
        if len(unknown) > MAX_UNKNOWN_FIELDS or not all(
            isinstance(name, str) and len(name) <= MAX_FIELD_NAME for name in unknown
        ):
            raise ValueError(f"a {kind} record of schema {schema} has too many or too long unknown fields")
        value = {name: item for name, item in value.items() if name in fields}
    try:
        record = record_type.parse_obj(value)
    except pydantic.ValidationError as e:
        raise ValueError(f"malformed {kind} record: {e}") from None
    if record.dict(exclude=newer) != value:
        raise ValueError(f"{kind} record needs conversions or defaults to fit its schema: {value}")
    return record
