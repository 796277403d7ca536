"""The swarm's records in the hivemind DHT: key schema, signed record models, validators, typed get/put."""

from dht.announcer import Announcer
from dht.identity import (
    Identity,
    IdentityError,
    create_identity_file,
    ephemeral_identity,
    load_identity_file,
    peer_id_from_public_key,
)
from dht.keys import MAX_STAGES, SwarmKeys
from dht.records import (
    Announcement,
    AuditEvidence,
    BootstrapAnnouncement,
    StageAnnouncement,
    StrikeRecord,
    SwarmRecord,
    TrainerAnnouncement,
    VerifierAnnouncement,
    parse_record,
)
from dht.store import DHTUnavailable, RecordStore
from dht.validation import RecordError, SwarmRecordValidator, check_record, swarm_validators

__all__ = [
    "MAX_STAGES",
    "Announcement",
    "Announcer",
    "AuditEvidence",
    "BootstrapAnnouncement",
    "DHTUnavailable",
    "Identity",
    "IdentityError",
    "RecordError",
    "RecordStore",
    "StageAnnouncement",
    "StrikeRecord",
    "SwarmKeys",
    "SwarmRecord",
    "SwarmRecordValidator",
    "TrainerAnnouncement",
    "VerifierAnnouncement",
    "check_record",
    "create_identity_file",
    "ephemeral_identity",
    "load_identity_file",
    "parse_record",
    "peer_id_from_public_key",
    "swarm_validators",
]
