"""The records of the swarm, as strictly typed pydantic.v1 models (hivemind's validators speak pydantic.v1).

Every record names its author (``peer_id``, or ``verifier`` for a strike record); the DHT accepts it only under
the author's own owner-tag subkey and only under the key its content implies (:meth:`SwarmRecord.key`). Types are
strict: an int where a float is due is refused rather than converted, so a record means the same to every reader.

Numbers are finite and in range (a throughput of +inf once crashed every trainer's routing); what a record may
claim beyond its own content (which stage exists, how long it lives, whether its author holds the role it claims)
is checked against the swarm's rules in :mod:`dht.validation`.

Records evolve without splitting the swarm: each carries the ``schema`` version its writer knows (:data:`SCHEMA`).
A reader accepts fields it does not know only in a record of a newer schema than its own, and ignores them (as
Petals' ``from_tuple`` ignores trailing fields); every field it does know is checked as strictly as ever. The
signature covers the whole value, unknown fields included, so nobody can add or change one on the way.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

import pydantic.v1 as pydantic
from pydantic.v1 import StrictBool, confloat, conint, conlist, constr

from dht.admission import RoleCertificate
from dht.keys import CONFIG_KEY, MAX_STAGES, PREFIX_PATTERN, SwarmKeys

PeerIdStr = constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")  # base58, as libp2p prints peer ids
ShortStr = constr(strict=True, max_length=128)
# what a node may call itself (`join --name`): shown in tables and on the status page, so plain printable ASCII
NodeName = constr(strict=True, regex=r"^[A-Za-z0-9_.@:+ -]{1,64}$")
Maddr = constr(strict=True, min_length=1, max_length=512)
# Generous bounds that no honest node reaches and that keep every sum and weight finite.
MAX_THROUGHPUT = 1e12  # tokens per second
MAX_COUNT = 2**53  # steps, checks, flags: exact in a float, far beyond any run
MAX_LOSS = 1e6
Throughput = confloat(strict=True, ge=0, le=MAX_THROUGHPUT, allow_inf_nan=False)
Count = conint(strict=True, ge=0, le=MAX_COUNT)
Step = conint(strict=True, ge=-1, le=MAX_COUNT)
StageIndex = conint(strict=True, ge=0, lt=MAX_STAGES)
FiniteFloat = confloat(strict=True, allow_inf_nan=False)
Loss = confloat(strict=True, ge=0, le=MAX_LOSS, allow_inf_nan=False)
MetricValue = confloat(strict=True, ge=-1e12, le=1e12, allow_inf_nan=False)

State = Literal["joining", "online", "offline"]
Direction = Literal["activation", "gradient"]

MAX_METRICS = 64

# The record schema this code writes and understands in full. Raise it when a record type gains a field (and name
# the field in the type's ``since``); readers of an older schema then accept the newer records and ignore the field,
# and readers of this one accept older records without it.
# 2: role certificates in trainer and verifier records and strike records; finite numbers; a node's ``name``, a
#    stage's ``network`` throughput and ``checkpoint_problem``, a trainer's ``val_loss``, a strike record's
#    ``thresholds`` and audits (passed, failed, the evidence of a failed one); the ``swarm_config`` record.
SCHEMA = 2
MAX_UNKNOWN_FIELDS = 16
MAX_FIELD_NAME = 64


class SwarmRecord(pydantic.BaseModel):
    """Fields every record carries."""

    author_field: ClassVar[str] = "peer_id"
    # the role the author must be admitted to (dht.admission) for the record to count; None: open to anyone
    role: ClassVar[Optional[str]] = None
    # field -> the schema that introduced it: a record of an older schema may lack it (and reads as the default)
    since: ClassVar[dict[str, int]] = {}

    kind: str
    schema_: conint(strict=True, ge=1) = pydantic.Field(SCHEMA, alias="schema")
    config_hash: ShortStr
    version: ShortStr  # the writer's software version, for people
    time: FiniteFloat  # the author's hivemind.get_dht_time() when it wrote the record

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
    since: ClassVar[dict[str, int]] = {"name": 2}

    state: State
    relayed: StrictBool  # reachable only through a relay: slower, routed to only when no direct peer is left
    throughput: Throughput  # stage: tokens/s of compute; verifier: checks/s it sustains; trainer: tokens/s trained
    name: Optional[NodeName] = None  # what the node's owner calls it (`join --name`), for people


class StageAnnouncement(Announcement):
    since: ClassVar[dict[str, int]] = {"name": 2, "network": 2, "checkpoint_problem": 2}

    kind: Literal["stage"] = "stage"
    stage: StageIndex
    # the last global step the replica applied (-1: none yet); a trainer joining a swarm whose trainers have all
    # gone resumes after it, since stages apply each global step once
    last_step: Step = -1
    # why its last checkpoint could not be written (disk full, ...), until one is; None: fine, or no checkpoints
    checkpoint_problem: Optional[constr(strict=True, max_length=256)] = None
    # tokens/s it actually served over the last report period (wall clock, waiting on peers included); the
    # announced ``throughput`` is what its compute alone sustains
    network: Throughput = 0.0

    def key(self, keys: SwarmKeys) -> str:
        return keys.stage(self.stage)


class VerifierAnnouncement(Announcement):
    role: ClassVar[Optional[str]] = "verifier"
    since: ClassVar[dict[str, int]] = {"name": 2, "certificate": 2}

    kind: Literal["verifier"] = "verifier"
    boundaries: conlist(StageIndex, max_items=MAX_STAGES)  # boundary b sits between stage b and stage b+1
    certificate: Optional[RoleCertificate] = None  # the organiser's; None for a verifier the config lists

    @pydantic.validator("boundaries")
    def _sorted_unique(cls, boundaries: list[int]) -> list[int]:
        if boundaries != sorted(set(boundaries)):
            raise ValueError("boundaries must be sorted and unique")
        return boundaries

    def key(self, keys: SwarmKeys) -> str:
        return keys.verifiers


class TrainerAnnouncement(Announcement):
    role: ClassVar[Optional[str]] = "trainer"
    since: ClassVar[dict[str, int]] = {"name": 2, "val_loss": 2, "certificate": 2}

    kind: Literal["trainer"] = "trainer"
    global_step: Count
    loss: Optional[Loss] = None
    val_loss: Optional[Loss] = None  # the last validation loss
    certificate: Optional[RoleCertificate] = None  # the organiser's; None for a trainer the config lists

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
    role: ClassVar[Optional[str]] = "verifier"
    since: ClassVar[dict[str, int]] = {
        "thresholds": 2,
        "certificate": 2,
        "audits_passed": 2,
        "audits_failed": 2,
        "audit": 2,
    }

    kind: Literal["strike"] = "strike"
    verifier: PeerIdStr
    accused: PeerIdStr
    boundary: StageIndex
    direction: Direction
    strikes: Count
    checks: Count
    flags: Count
    metrics: dict[constr(strict=True, max_length=64), MetricValue]
    banned: StrictBool
    certificate: Optional[RoleCertificate] = None  # the verifier's, as in its announcement
    # each metric's threshold when the record was written, beside its score in ``metrics``
    thresholds: dict[constr(strict=True, max_length=64), MetricValue] = pydantic.Field(default_factory=dict)
    audits_passed: Count = 0
    audits_failed: Count = 0
    audit: Optional[AuditEvidence] = None

    @pydantic.validator("metrics", "thresholds")
    def _few_metrics(cls, metrics: dict) -> dict:
        if len(metrics) > MAX_METRICS:
            raise ValueError(f"at most {MAX_METRICS} metrics, got {len(metrics)}")
        return metrics

    @pydantic.validator("flags")
    def _flags_within_checks(cls, flags: int, values: dict) -> int:
        # every flag is a check. Strikes are not bounded by flags: a blatant flag weighs two, and a convicting audit
        # sets them to the limit at once (sentinel_node.verification.strikes)
        if "checks" in values and flags > values["checks"]:
            raise ValueError(f"{flags} flags in {values['checks']} checks")
        return flags

    def key(self, keys: SwarmKeys) -> str:
        return keys.strikes(self.accused)


# the largest config a swarm_config record may carry: the record must fit a stored value's 8 KiB (dht.rules); the
# presets are about 2.5 KB as JSON
MAX_CONFIG_CHARS = 7 * 1024


class SwarmConfigRecord(SwarmRecord):
    """The swarm's config as a node of the swarm (its bootstrap) published it, for nodes that join with nothing
    but an address. ``config`` is the config as JSON and ``config_hash`` its swarm hash; the reader that turns it
    back into a config checks the one against the other (the hash is defined above this layer).

    It lives under one key for every swarm (:data:`~dht.keys.CONFIG_KEY`): a joiner does not know the swarm's
    prefix until it has read this record. Each publisher writes under its own owner tag; today any node may
    publish (any swarm's record is stored, within its size and lifetime), so a joiner takes the record of the
    bootstrap it dialed (the peer id in its ``--initial-peers`` address) and refuses to guess when it has none and
    publishers disagree.
    """

    kind: Literal["swarm_config"] = "swarm_config"
    peer_id: PeerIdStr  # the publisher
    prefix: constr(strict=True, regex=PREFIX_PATTERN.pattern, max_length=128)
    config: constr(strict=True, min_length=2, max_length=MAX_CONFIG_CHARS)

    def key(self, keys: SwarmKeys) -> str:
        return CONFIG_KEY


RECORD_TYPES: dict[str, type[SwarmRecord]] = {
    "stage": StageAnnouncement,
    "verifier": VerifierAnnouncement,
    "trainer": TrainerAnnouncement,
    "bootstrap": BootstrapAnnouncement,
    "strike": StrikeRecord,
    "swarm_config": SwarmConfigRecord,
}

ANNOUNCEMENT_KINDS = frozenset({"stage", "verifier", "trainer", "bootstrap"})


def parse_record(value: object) -> SwarmRecord:
    """The record a DHT value holds, exactly as written; ValueError if it is not a well-formed record.

    Beyond pydantic's checks, the value must equal the parsed record field for field, so defaults filled in or
    values converted on parsing count as malformed (the same rule as hivemind's SchemaValidator), except a field
    introduced after the record's schema (``since``), which an older writer could not know. Fields this reader
    does not know are allowed only in a record of a newer schema, at most :data:`MAX_UNKNOWN_FIELDS` of them,
    and are left out of the record it returns.
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
    newer = {
        field.alias
        for name, field in record_type.__fields__.items()
        if record_type.since.get(name, 1) > schema and field.alias not in value
    }
    if {name: item for name, item in record.dict().items() if name not in newer} != value:
        raise ValueError(f"{kind} record needs conversions or defaults to fit its schema: {str(value)[:500]}")
    return record
