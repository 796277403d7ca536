"""The record validator every node of the swarm runs, and the checks it shares with writers and readers.

The swarm's namespace is closed. The DHT hashes keys, but every key of a swarm is known: the fixed keys (stage k
for k < n_stages, verifiers, trainers, bootstraps) and hivemind's averager keys of each stage are enumerated
from the rules, and every other key can only be a strike key, ``{prefix}.strikes.{accused}``, whose hash a strike
record implies by its content. So every key accepts exactly one value shape:

- swarm records (:func:`check_record`): a dictionary of records, each under its author's owner-tag subkey,
  signed, of this swarm's config, finite and in range, living no longer than its type's TTL, written by an
  author admitted to the record's role (dht.admission), at most ``max_record_bytes`` each;
- averager keys (:func:`check_averager_entry`): hivemind's own unsigned entries, under a peer id's bytes, a bool or
  a finite number, living minutes at most;
- never a plain (non-dictionary) value: one with a later expiration replaces a key's whole dictionary, which is
  how a ban was once erased.

Every node must run the same validator over the same config: a node lacking the signature validator hangs in
``get()`` on signed keys, and one that disagrees with the others refuses whole dictionaries it is sent.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time, get_logger

from dht.admission import admission_problem
from dht.identity import Identity, IdentityError, peer_id_from_public_key, public_key_from_owner_tag
from dht.once import OncePer
from dht.records import (
    StageAnnouncement,
    StrikeRecord,
    SwarmConfigRecord,
    SwarmRecord,
    VerifierAnnouncement,
    parse_record,
)
from dht.rules import AVERAGER_MAX_TTL, CLOCK_SLACK, MAX_SUBKEY_BYTES, SwarmRules

logger = get_logger(__name__)

# hivemind's signature suffix on a stored value: b"[signature:" + 256 bytes + b"]"
SIGNATURE_BYTES = 268


class RecordError(ValueError):
    """A record the swarm's validators would reject; the message says why."""


class ForeignConfigError(RecordError):
    """A well-formed record written under another swarm config (``config_hash`` names it)."""

    def __init__(self, message: str, config_hash: str) -> None:
        super().__init__(message)
        self.config_hash = config_hash


def key_id(key: str) -> bytes:
    """The DHT's name for a key: validators see only this hash, never the key itself."""
    return DHTID.generate(source=key).to_bytes()


@dataclass(frozen=True)
class AveragerEntry:
    """One of hivemind's averager declarations: ``peer`` (a peer id's bytes) in the group or state key of
    ``stage``."""

    stage: int
    kind: str  # "group" (looking for a group: bool) or "state" (offering its state: priority or None)
    peer: bytes
    value: object


class Namespace:
    """The key ids of one swarm: fixed, averager, and (everything else) strike keys."""

    def __init__(self, rules: SwarmRules) -> None:
        keys = rules.keys
        fixed = [keys.stage(k) for k in range(rules.n_stages)] + [keys.verifiers, keys.trainers, keys.bootstraps]
        self.fixed = frozenset(key_id(key) for key in fixed)
        self.averager: dict[bytes, tuple[int, str]] = {}
        for k in range(rules.n_stages):
            self.averager[key_id(keys.averager_group(k))] = (k, "group")
            self.averager[key_id(keys.averager_state(k))] = (k, "state")


def check_record(
    rules: SwarmRules,
    record_key_id: bytes,
    subkey: object,
    value: object,
    expiration: float,
    now: float | None = None,
) -> SwarmRecord:
    """The record, if ``value`` is one that this swarm's validators accept under ``record_key_id`` and ``subkey``
    with ``expiration``; RecordError (ForeignConfigError for another config's record) saying why otherwise.
    Signatures are checked separately, by hivemind's RSASignatureValidator. A swarm config record of any swarm
    passes (it is what a joiner reads to learn the swarm; hivemind validates what a node stores and what it reads
    alike), within its shape, size and lifetime; the joiner picks its bootstrap's (sentinel_node.swarm_config)."""
    now = get_dht_time() if now is None else now
    public_key = public_key_from_owner_tag(subkey) if isinstance(subkey, bytes) else None
    if public_key is None:
        raise RecordError("the subkey must be exactly the author's owner tag [owner:<public key>]")
    try:
        record = parse_record(value)
        owner = peer_id_from_public_key(public_key)
    except (ValueError, IdentityError) as e:
        raise RecordError(str(e)) from None
    if record.author != owner:
        raise RecordError(f"the record speaks for {record.author} but is owned by {owner}")
    foreign_ok = isinstance(record, SwarmConfigRecord)
    if not foreign_ok:
        _check_place(rules, record)
    expected_key = record.key(rules.keys)
    if key_id(expected_key) != record_key_id:
        raise RecordError(f"a {record.kind} record about its content belongs under {expected_key!r} only")
    if record.config_hash != rules.config_hash and not foreign_ok:
        raise ForeignConfigError(
            f"a {record.kind} record of config {record.config_hash}, this swarm's is {rules.config_hash}",
            record.config_hash,
        )
    _check_times(rules, record, expiration, now)
    _check_admission(rules, record, expiration)
    return record


def _check_place(rules: SwarmRules, record: SwarmRecord) -> None:
    """Stages and boundaries that this swarm has."""
    if isinstance(record, StageAnnouncement) and record.stage >= rules.n_stages:
        raise RecordError(f"stage {record.stage} does not exist: the swarm has {rules.n_stages} stages")
    if isinstance(record, VerifierAnnouncement) and any(b >= rules.n_boundaries for b in record.boundaries):
        raise RecordError(f"boundaries {record.boundaries}: the swarm has {rules.n_boundaries} boundaries")
    if isinstance(record, StrikeRecord) and record.boundary >= rules.n_boundaries:
        raise RecordError(f"boundary {record.boundary} does not exist: the swarm has {rules.n_boundaries}")


def _check_times(rules: SwarmRules, record: SwarmRecord, expiration: float, now: float) -> None:
    ttl = rules.ttl(record.kind)
    if not expiration <= now + ttl + CLOCK_SLACK:
        raise RecordError(f"a {record.kind} record may live {ttl:.0f}s, this one claims {expiration - now:.0f}s")
    if not record.time <= now + CLOCK_SLACK:
        raise RecordError(f"a {record.kind} record written {record.time - now:.0f}s in the future")
    if not record.time >= expiration - ttl - CLOCK_SLACK:
        raise RecordError(f"a {record.kind} record written long before the lifetime it claims began")


def _check_admission(rules: SwarmRules, record: SwarmRecord, expiration: float) -> None:
    if record.role is None:
        return
    if isinstance(record, VerifierAnnouncement):
        boundaries = record.boundaries
    elif isinstance(record, StrikeRecord):
        boundaries = [record.boundary]
    else:
        boundaries = []
    certificate = record.certificate
    problem = admission_problem(rules.trust, rules.prefix, record.role, record.author, certificate, boundaries)
    if problem is not None:
        raise RecordError(problem)
    listed = record.author in rules.trust.listed(record.role)
    if certificate is not None and not listed and expiration > certificate.expires + CLOCK_SLACK:
        raise RecordError(f"a {record.kind} record of {record.author} outlives its certificate")


def check_averager_entry(
    stage_and_kind: tuple[int, str], subkey: object, value: object, expiration: float, now: float
) -> AveragerEntry:
    """An averager declaration as hivemind writes it; RecordError otherwise."""
    stage, kind = stage_and_kind
    # RSA peer ids are sha2-256 multihashes: 0x12 0x20 and 32 bytes
    if not (isinstance(subkey, bytes) and len(subkey) == 34 and subkey[:2] == b"\x12\x20"):
        raise RecordError("an averager entry's subkey is a peer id's bytes")
    if kind == "group" and not isinstance(value, bool):
        raise RecordError("an averager's group entry is a bool")
    if kind == "state" and not (value is None or (type(value) in (int, float) and abs(value) < 1e12)):
        raise RecordError("an averager's state entry is a finite priority or None")
    if not expiration <= now + AVERAGER_MAX_TTL + CLOCK_SLACK:
        raise RecordError(f"an averager entry may live {AVERAGER_MAX_TTL:.0f}s")
    return AveragerEntry(stage, kind, subkey, value)


class _Remembered:
    """The last `size` values by a record's digest, the oldest forgotten first; safe to share between threads."""

    def __init__(self, size: int) -> None:
        self._values: OrderedDict[bytes, object] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def get(self, name: bytes) -> object | None:
        with self._lock:
            value = self._values.get(name)
            if value is not None:
                self._values.move_to_end(name)
            return value

    def put(self, name: bytes, value: object) -> None:
        with self._lock:
            self._values[name] = value
            while len(self._values) > self._size:
                self._values.popitem(last=False)


class SwarmRecordValidator(RecordValidatorBase):
    """Accepts a DHT record only if it fits this swarm's namespace (see the module docstring).

    Like :class:`SignatureValidator` it remembers what it accepted, for the last `remember` records: everything
    :func:`check_record` checks is a function of the record's bytes except its times against the clock, so a record
    read again (every node reads the whole swarm every announce period) is only checked for those. Parsing it again
    was a fifth of an idle loopback node's DHT process (docs/decisions.md, "The suite's time"). Refusals are not
    remembered: a garbage record costs its sender as much to send as it costs here to refuse."""

    def __init__(self, rules: SwarmRules, remember: int = 4096):
        self.rules = rules
        self._namespace = Namespace(rules)
        self._warned = OncePer(64)
        self._accepted = _Remembered(remember)  # digest -> the SwarmRecord it parsed to

    def validate(self, record: DHTRecord) -> bool:
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            logger.debug("refused a plain value: every key of the swarm holds a dictionary")
            return False
        if len(record.subkey) > MAX_SUBKEY_BYTES or len(record.value) > self.rules.max_record_bytes:
            logger.debug(f"refused a record of {len(record.value)} bytes (subkey {len(record.subkey)})")
            return False
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # msgpack raises many types on garbage
            return False
        now = get_dht_time()
        try:
            averager = self._namespace.averager.get(record.key)
            if averager is not None:
                check_averager_entry(averager, subkey, value, record.expiration_time, now)
            else:
                self._check(record, subkey, value, now)
        except ForeignConfigError as e:
            self._warn_foreign(e.config_hash)
            return False
        except RecordError as e:
            logger.debug(f"refused a record: {e}")
            return False
        return True

    def _check(self, record: DHTRecord, subkey: object, value: object, now: float) -> None:
        name = _record_digest(record)
        known = self._accepted.get(name)
        if known is not None:
            _check_times(self.rules, known, record.expiration_time, now)
            return
        self._accepted.put(name, check_record(self.rules, record.key, subkey, value, record.expiration_time, now))

    def _warn_foreign(self, config_hash: str) -> None:
        if not self._warned.first(config_hash):
            return
        logger.warning(
            f"refusing records of swarm config {config_hash[:40]}: this node runs {self.rules.config_hash} (a peer "
            "uses another swarm config file under the same prefix; every node of a swarm must use the same file)"
        )

    @property
    def priority(self) -> int:
        # Validators run by decreasing priority: the signature validator (10) must check and strip first.
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # Two instances with the same rules are one validator; with different rules both must apply.
        return isinstance(other, SwarmRecordValidator) and other.rules == self.rules


def record_bytes(value: object) -> int:
    """The bytes a record's value takes in the DHT once signed."""
    return len(MSGPackSerializer.dumps(value)) + SIGNATURE_BYTES


class SignatureValidator(RSASignatureValidator):
    """hivemind's signature validator, refusing instead of raising on an owner tag that holds no RSA key, and
    remembering its verdicts.

    hivemind's ``validate`` parses the key inside ``[owner:...]`` with ``load_ssh_public_key``, which raises on
    garbage (found by fuzzing, tests/test_fuzz_records.py): the exception escaped ``rpc_store``, so the node
    answered a failed call instead of a refusal, and a reply holding such an entry failed the whole lookup.

    Every node reads the whole swarm every few seconds, and every record it reads arrives signed: in an idle loopback
    swarm of ten nodes a third of each DHT process's CPU went to parsing keys and verifying RSA signatures of the
    same records again and again. The verdict is a pure function of the record's bytes (key, subkey, value and
    expiration are what the signature covers), so it is kept for the last `remember` records, by a SHA-256 of those
    bytes; a changed byte is a new record, checked afresh."""

    def __init__(self, private_key=None, remember: int = 4096):
        super().__init__(private_key)
        self._verdicts = _Remembered(remember)  # digest -> True or False

    def validate(self, record: DHTRecord) -> bool:
        name = _record_digest(record)
        verdict = self._verdicts.get(name)
        if verdict is not None:
            return verdict
        try:
            verdict = super().validate(record)
        except Exception as e:  # cryptography raises ValueError, UnsupportedAlgorithm, binascii.Error, ...
            logger.debug(f"refused a record whose owner tag holds no RSA key: {type(e).__name__}")
            verdict = False
        self._verdicts.put(name, verdict)
        return verdict


def _record_digest(record: DHTRecord) -> bytes:
    hasher = hashlib.sha256()
    for part in (record.key, record.subkey or b"", record.value):
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    hasher.update(repr(float(record.expiration_time)).encode())
    return hasher.digest()


def swarm_validators(rules: SwarmRules | None, identity: Identity) -> list[RecordValidatorBase]:
    """The validators to pass to ``hivemind.DHT(record_validators=...)`` on every node of the swarm.

    ``rules=None`` is for a client-mode reader that does not know the swarm yet (it is about to read the swarm's
    config): signatures only. It stores nothing for others, and every record it reads is checked again by
    :class:`~dht.RecordStore`."""
    if rules is None:
        return [SignatureValidator(identity.private_key)]
    return [SignatureValidator(identity.private_key), SwarmRecordValidator(rules)]
