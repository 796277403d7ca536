"""The record validators every node of the swarm must run, and the check they share with writers.

Every node must run the same validators: a node lacking the signature validator hangs in ``get()`` on signed
keys, and one disagreeing with the others rejects whole dictionaries it is sent. So nothing here reads the swarm
config beyond its prefix.
"""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time, get_logger

from dht.identity import Identity, IdentityError, peer_id_from_public_key, public_key_from_owner_tag
from dht.keys import CONFIG_KEY, MAX_STAGES, SwarmKeys
from dht.records import MAX_TTL, RECORD_TYPES, SwarmRecord, parse_record

logger = get_logger(__name__)

# Peers' clocks may disagree by a few seconds (hivemind allows 3); a record's lifetime is checked with this slack.
CLOCK_SLACK = 60.0


class RecordError(ValueError):
    """A record the swarm's validators would reject; the message says why."""


def key_id(key: str) -> bytes:
    """The DHT's name for a key: validators see only this hash, never the key itself."""
    return DHTID.generate(source=key).to_bytes()


def check_record(keys: SwarmKeys, record_key_id: bytes, subkey: object, value: object) -> SwarmRecord:
    """The record, if ``value`` is a well-formed record whose author owns ``subkey`` and whose content implies
    the key; RecordError otherwise. Signatures are checked separately, by hivemind's RSASignatureValidator."""
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
    expected_key = record.key(keys)
    if key_id(expected_key) != record_key_id:
        raise RecordError(f"a {record.kind} record about its content belongs under {expected_key!r} only")
    return record


class SwarmRecordValidator(RecordValidatorBase):
    """Accepts a record under a swarm key only if :func:`check_record` does.

    The DHT hashes keys, so strike keys (one per accused peer) cannot be recognised; a record under an unknown
    key is checked when it claims to be a swarm record (owner-tag subkey, known ``kind``) and let through
    otherwise, for the other users of the DHT. Readers drop what does not parse (see ``dht.store``).
    """

    def __init__(self, prefix: str):
        self._keys = SwarmKeys(prefix)
        fixed = [self._keys.stage(k) for k in range(MAX_STAGES)]
        fixed += [self._keys.verifiers, self._keys.trainers, self._keys.bootstraps]
        fixed.append(CONFIG_KEY)  # the one key shared by every swarm (dht.keys)
        self._fixed_key_ids = frozenset(key_id(key) for key in fixed)

    def validate(self, record: DHTRecord) -> bool:
        ours = record.key in self._fixed_key_ids
        try:
            subkey = None
            if record.subkey not in DHTProtocol.RESERVED_SUBKEYS:
                subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # msgpack raises many types on garbage
            return not ours
        if not ours and not _claims_swarm_record(subkey, value):
            return True
        try:
            parsed = check_record(self._keys, record.key, subkey, value)
        except RecordError as e:
            logger.debug(f"rejected a record: {e}")
            return False
        if record.expiration_time > get_dht_time() + MAX_TTL[parsed.kind] + CLOCK_SLACK:
            logger.debug(f"rejected a {parsed.kind} record from {parsed.author}: it claims to live too long")
            return False
        return True

    @property
    def priority(self) -> int:
        # Validators run by decreasing priority: the signature validator (10) must check and strip first.
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # Two instances for one prefix are one validator; for different prefixes both must apply.
        return isinstance(other, SwarmRecordValidator) and other._keys == self._keys


def _claims_swarm_record(subkey: object, value: object) -> bool:
    return (
        isinstance(subkey, bytes)
        and public_key_from_owner_tag(subkey) is not None
        and isinstance(value, dict)
        and value.get("kind") in RECORD_TYPES
    )


def swarm_validators(prefix: str | None, identity: Identity) -> list[RecordValidatorBase]:
    """The validators to pass to ``hivemind.DHT(record_validators=...)`` on every node of the swarm.

    ``prefix=None`` is for a client-mode reader that does not know the swarm yet (it is about to read the swarm's
    config): signatures only. It stores nothing for others, and every record it reads is checked again by
    :class:`~dht.RecordStore`."""
    if prefix is None:
        return [RSASignatureValidator(identity.private_key)]
    return [RSASignatureValidator(identity.private_key), SwarmRecordValidator(prefix)]
