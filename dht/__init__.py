"""The swarm's records in the hivemind DHT: key schema, signed record models, validators, typed get/put."""

from dht.admission import AdmissionError, RoleCertificate, TrustRoots, admission_problem, issue_certificate
from dht.announcer import Announcer
from dht.capacity import CappedStorage, cap_subkeys
from dht.identity import (
    Identity,
    IdentityError,
    create_identity_file,
    ephemeral_identity,
    is_rsa_peer_id,
    load_identity_file,
    peer_id_from_entry,
    peer_id_from_public_key,
)
from dht.keys import CONFIG_KEY, MAX_STAGES, SwarmKeys
from dht.records import (
    Announcement,
    AuditEvidence,
    BootstrapAnnouncement,
    StageAnnouncement,
    StrikeRecord,
    SwarmConfigRecord,
    SwarmRecord,
    TrainerAnnouncement,
    VerifierAnnouncement,
    parse_record,
)
from dht.rules import CLOCK_SLACK, MAX_RECORD_BYTES, MAX_SUBKEYS, SwarmRules
from dht.store import DHTUnavailable, RecordStore
from dht.validation import (
    ForeignConfigError,
    RecordError,
    SwarmRecordValidator,
    check_record,
    key_id,
    swarm_validators,
)

__all__ = [
    "CLOCK_SLACK",
    "MAX_RECORD_BYTES",
    "CONFIG_KEY",
    "MAX_STAGES",
    "MAX_SUBKEYS",
    "AdmissionError",
    "CappedStorage",
    "ForeignConfigError",
    "RoleCertificate",
    "SwarmRules",
    "TrustRoots",
    "admission_problem",
    "cap_subkeys",
    "is_rsa_peer_id",
    "issue_certificate",
    "key_id",
    "peer_id_from_entry",
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
    "SwarmConfigRecord",
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
