"""Fuzzed DHT records against the validator chain every node runs, and against the typed reads.

For every record type, hypothesis writes honest records (any values the schema allows, signed by an author the
swarm admits) and forgeries: wrong types, missing and extra fields, huge strings and lists, negative, NaN and
infinite numbers, times far in the past and future, expirations beyond the type's TTL, stages and boundaries the
swarm lacks, another config, wrong owners and garbage owner tags, truncated, bit-flipped, missing and doubled
signatures, valid signatures over altered values, records under another key, unadmitted authors and bad
certificates. Each goes through hivemind's ``CompositeValidator`` built from :func:`dht.swarm_validators` exactly as
``hivemind.DHT`` builds it (signature check and strip, then the swarm's own), then, if accepted, through the
reader's typed decoding (:class:`dht.RecordStore`).

What must hold: every honest record accepted and read back exactly as signed; no forgery accepted; no exception out
of a validator or a typed read, whatever the bytes. The typed read is also fed every forgery's value directly, as
if the signature check had been skipped: it must never raise, and must refuse everything but the forgeries whose
only fault is their signature (those only the signature check can catch).

``make fuzz`` runs the same tests with 10,000 examples per record type (tests/fuzzing.py); one loopback test at the
end shows the same at the network edge, through a real DHT node.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import time
from collections.abc import Callable

import hivemind
import pytest
import raw_dht
from fuzzing import Tally, fuzz_settings
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import ValueWithExpiration
from hypothesis import given
from hypothesis import strategies as st

from dht import (
    CLOCK_SLACK,
    Identity,
    RecordError,
    RecordStore,
    SwarmRules,
    TrustRoots,
    cap_subkeys,
    check_record,
    create_identity_file,
    ephemeral_identity,
    issue_certificate,
    key_id,
    swarm_validators,
)
from dht.once import OncePer
from dht.records import MAX_COUNT, RECORD_TYPES

PREFIX, CONFIG_HASH, N_STAGES = "fuzz", "c0ffee", 4
N_BOUNDARIES = N_STAGES - 1
ORGANISER = RSAPrivateKey()
ORGANISER_KEY = ORGANISER.get_public_key().to_bytes()

LISTED_VERIFIER, CERT_VERIFIER, NARROW_VERIFIER = ephemeral_identity(), ephemeral_identity(), ephemeral_identity()
LISTED_TRAINER, CERT_TRAINER = ephemeral_identity(), ephemeral_identity()
STAGE, VICTIM, ATTACKER = ephemeral_identity(), ephemeral_identity(), ephemeral_identity()

RULES = SwarmRules(
    PREFIX,
    CONFIG_HASH,
    N_STAGES,
    trust=TrustRoots(
        organiser=ORGANISER_KEY,
        trainers=frozenset({LISTED_TRAINER.peer_id}),
        verifiers=frozenset({LISTED_VERIFIER.peer_id}),
    ),
    announce_ttl=120.0,
    strike_ttl=600.0,
)
KEYS = RULES.keys
CERT_EXPIRES = time.time() + 30 * 86400


def _certificate(identity: Identity, role: str, boundaries=None, **changes) -> dict:
    fields = dict(swarm=PREFIX, subject=identity.peer_id, role=role, expires=CERT_EXPIRES, boundaries=boundaries)
    return issue_certificate(ORGANISER, **{**fields, **changes}).dict()


# each admitted author, the certificate it shows (None: the config lists it) and the boundaries it may verify
VERIFIERS = [
    (LISTED_VERIFIER, None, list(range(N_BOUNDARIES))),
    (CERT_VERIFIER, _certificate(CERT_VERIFIER, "verifier"), list(range(N_BOUNDARIES))),
    (NARROW_VERIFIER, _certificate(NARROW_VERIFIER, "verifier", [0]), [0]),
]
TRAINERS = [(LISTED_TRAINER, None), (CERT_TRAINER, _certificate(CERT_TRAINER, "trainer"))]
OPEN_AUTHORS = [STAGE, VICTIM, ATTACKER]  # stages and bootstraps need no admission
# swarm_config (issue 13) came after these generators: its validation is tested in test_swarm_config.py
KINDS = sorted(set(RECORD_TYPES) - {"swarm_config"})

TALLY = Tally("records")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    TALLY.dump()


def chain() -> CompositeValidator:
    """The validators as a node holds them: hivemind.DHT wraps ``record_validators`` in one CompositeValidator."""
    return CompositeValidator(swarm_validators(RULES, ephemeral_identity()))


VALIDATOR = chain()
READER = RecordStore.__new__(RecordStore)  # only the typed decoding is used: no DHT behind it
READER.rules, READER._warned_authors = RULES, OncePer(256)


# --- honest records ---------------------------------------------------------------------------------------------

short_text = st.text(max_size=24)
finite = dict(allow_nan=False, allow_infinity=False)


@dataclasses.dataclass
class Case:
    """A record as it reaches a validator, and what is known about it by construction."""

    kind: str
    value: dict  # what the author meant to sign (honest), or the forged value
    key: str
    expiration: float
    signer: Identity
    tag: bytes  # the subkey: an owner tag, or whatever a forger put there
    category: str = "honest"
    signature_only: bool = False  # a forgery whose value and place are fine: only the signature check can catch it
    value_bytes: bytes | None = None  # set by forgeries that alter the bytes after signing
    signature: Callable[[bytes], bytes] | None = None  # set by forgeries of the signature itself

    @property
    def honest(self) -> bool:
        return self.category == "honest"

    def dht_record(self) -> DHTRecord:
        key = key_id(self.key)
        subkey = MSGPackSerializer.dumps(self.tag)
        signed_bytes = MSGPackSerializer.dumps(self.value)
        unsigned = DHTRecord(key, subkey, signed_bytes, self.expiration)
        signature = self.signer.private_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(unsigned)))
        self.real_signature = signature
        signature = b"[signature:" + signature + b"]" if self.signature is None else self.signature(signature)
        body = signed_bytes if self.value_bytes is None else self.value_bytes
        return DHTRecord(key, subkey, body + signature, self.expiration)


@st.composite
def honest(draw, kind: str) -> Case:
    now = get_dht_time()
    ttl = RULES.ttl(kind)
    expiration = now + draw(st.floats(1.0, ttl))
    value = {
        "schema": draw(st.sampled_from([1, 2, 2, 2])),
        "config_hash": CONFIG_HASH,
        "version": draw(short_text),
        "time": now - draw(st.floats(0.0, 30.0)),
        "kind": kind,
    }
    if kind == "strike":
        author, cert, boundaries = draw(st.sampled_from(VERIFIERS))
        checks = draw(st.integers(0, MAX_COUNT))
        flags = draw(st.integers(0, checks))
        strikes = draw(st.integers(0, flags))
        value.update(
            verifier=author.peer_id,
            accused=draw(st.sampled_from(OPEN_AUTHORS)).peer_id,
            boundary=draw(st.sampled_from(boundaries)),
            direction=draw(st.sampled_from(["activation", "gradient"])),
            strikes=strikes,
            checks=checks,
            flags=flags,
            metrics=draw(st.dictionaries(st.text(max_size=64), st.floats(-1e12, 1e12, **finite), max_size=8)),
            banned=draw(st.booleans()),
            certificate=cert,
        )
        return Case(kind, _complete(value), KEYS.strikes(value["accused"]), expiration, author, author.owner_tag)
    if kind == "verifier":
        author, cert, boundaries = draw(st.sampled_from(VERIFIERS))
        value.update(boundaries=sorted(set(draw(st.lists(st.sampled_from(boundaries))))), certificate=cert)
    elif kind == "trainer":
        author, cert = draw(st.sampled_from(TRAINERS))
        loss = draw(st.none() | st.floats(0.0, 1e6, **finite))
        value.update(global_step=draw(st.integers(0, MAX_COUNT)), loss=loss, certificate=cert)
    else:
        author = draw(st.sampled_from(OPEN_AUTHORS))
    if kind == "stage":
        value.update(
            stage=draw(st.integers(0, N_STAGES - 1)),
            last_step=draw(st.integers(-1, MAX_COUNT)),
            checkpoint_problem=draw(st.none() | st.text(max_size=256)),
        )
    value.update(
        peer_id=author.peer_id,
        maddrs=draw(st.lists(st.text(min_size=1, max_size=64), max_size=4)),
        state=draw(st.sampled_from(["joining", "online", "offline"])),
        relayed=draw(st.booleans()),
        throughput=draw(st.floats(0.0, 1e12, **finite)),
    )
    key = KEYS.stage(value["stage"]) if kind == "stage" else getattr(KEYS, kind + "s")
    return Case(kind, _complete(value), key, expiration, author, author.owner_tag)


def _as_signed(read: dict, signed: dict) -> dict:
    """A typed read without the defaults it filled in for the fields that came after the signed record's schema."""
    model = RECORD_TYPES[signed["kind"]]
    later = {model.__fields__[name].alias for name, since in model.since.items() if since > signed["schema"]}
    return {name: item for name, item in read.items() if name not in later - set(signed)}


def _complete(value: dict) -> dict:
    """What today's writer adds: every optional field its schema has, at its default (a record of an older schema
    lacks the fields that came later, dht.records: since)."""
    model = RECORD_TYPES[value["kind"]]
    for name, field in model.__fields__.items():
        if field.alias not in value and not field.required and model.since.get(name, 1) <= value["schema"]:
            value[field.alias] = field.get_default()
    return value


# --- forgeries ----------------------------------------------------------------------------------------------------

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),  # NaN and infinities included
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 1e300]),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**63 - 1), max_size=2),  # msgpack: 64 bits
)
huge = st.one_of(
    st.integers(129, 3000).map(lambda n: "x" * n),
    st.integers(10_000, 200_000).map(lambda n: "y" * n),
    st.integers(33, 20_000).map(lambda n: ["/ip4/127.0.0.1/tcp/1"] * n),
    st.integers(1025, 5000).map(lambda n: list(range(n))),
)


def _is_int(v) -> bool:
    return type(v) is int


def _is_float(v, lo=-math.inf, hi=math.inf) -> bool:
    return type(v) is float and math.isfinite(v) and lo <= v <= hi


def _str_within(v, n) -> bool:
    return type(v) is str and len(v) <= n


def valid_for(case: Case, field: str, v) -> bool:
    """Whether ``v`` in ``field`` could still make a valid record (so it is no forgery): deliberately generous."""
    original = case.value
    if field in ("peer_id", "verifier", "accused", "stage", "kind", "config_hash"):
        return v == original[field]  # any other value breaks the author, the key, the kind or the config
    if field == "version":
        return _str_within(v, 128)
    if field == "schema":
        return _is_int(v) and v >= 1
    if field == "time":
        ttl = RULES.ttl(case.kind)
        return _is_float(v, case.expiration - ttl - CLOCK_SLACK, get_dht_time() + CLOCK_SLACK)
    if field == "maddrs":
        return type(v) is list and len(v) <= 32 and all(type(m) is str and 1 <= len(m) <= 512 for m in v)
    if field == "state":
        return type(v) is str and v in ("joining", "online", "offline")
    if field in ("relayed", "banned"):
        return type(v) is bool
    if field == "throughput":
        return _is_float(v, 0, 1e12)
    if field in ("strikes", "checks", "flags", "global_step"):
        return _is_int(v) and 0 <= v <= MAX_COUNT
    if field == "last_step":
        return _is_int(v) and -1 <= v <= MAX_COUNT
    if field == "loss":
        return v is None or _is_float(v, 0, 1e6)
    if field == "checkpoint_problem":
        return v is None or _str_within(v, 256)
    if field == "boundary":
        return _is_int(v) and 0 <= v < N_BOUNDARIES
    if field == "boundaries":
        return type(v) is list and all(_is_int(b) and 0 <= b < N_BOUNDARIES for b in v) and v == sorted(set(v))
    if field == "direction":
        return type(v) is str and v in ("activation", "gradient")
    if field == "metrics":
        return (
            type(v) is dict
            and len(v) <= 64
            and all(_str_within(k, 64) and _is_float(x, -1e12, 1e12) for k, x in v.items())
        )
    if field == "certificate":
        return v == original[field]
    raise AssertionError(field)


def _bad_value(draw, case: Case, field: str):
    return draw(st.one_of(junk, huge).filter(lambda v: not valid_for(case, field, v)))


def _flip(data: bytes, draw) -> bytes:
    position = draw(st.integers(0, len(data) - 1))
    bit = draw(st.integers(0, 7))
    return data[:position] + bytes([data[position] ^ (1 << bit)]) + data[position + 1 :]


FORGERIES = [
    "field",
    "missing",
    "extra",
    "huge",
    "time",
    "expiration",
    "place",
    "owner",
    "signature",
    "altered",
    "key",
]
ROLE_FORGERIES = ["unadmitted", "certificate"]


@st.composite
def forged(draw, kind: str) -> Case:
    how = draw(st.sampled_from(FORGERIES + ROLE_FORGERIES * (kind in ("verifier", "trainer", "strike"))))
    if how == "certificate":  # an author the config lists needs no certificate: forge those of certified ones
        case = draw(honest(kind).filter(lambda c: c.value["certificate"] is not None))
    else:
        case = draw(honest(kind))
    value = dict(case.value)
    changes: dict = {"category": how}
    if how == "field":
        field = draw(st.sampled_from(sorted(value)))
        value[field] = _bad_value(draw, case, field)
        changes["category"] = f"field:{field}"
    elif how == "missing":
        del value[draw(st.sampled_from(sorted(value)))]
    elif how == "extra":
        names = st.text(min_size=1, max_size=80).filter(lambda name: name not in value)
        extra = draw(st.dictionaries(names, junk, min_size=1, max_size=24))
        if draw(st.booleans()):  # a newer schema may add fields, but not this many nor this long
            value["schema"] = 3
            extra = {**extra, **{f"f{i}": 0 for i in range(17)}} if draw(st.booleans()) else {"n" * 65: 0}
            changes["category"] = "extra:newer-schema"
        value.update(extra)
    elif how == "huge":
        field = draw(st.sampled_from(sorted(value)))
        n = draw(st.integers(10_000, 100_000))
        value[field] = "z" * n if draw(st.booleans()) else [0] * n
    elif how == "time":
        ttl, now = RULES.ttl(kind), get_dht_time()
        far = draw(st.floats(120.0, 1e300, **finite))
        value["time"] = draw(st.sampled_from([now + far, case.expiration - ttl - far, math.nan, math.inf, -math.inf]))
    elif how == "expiration":
        beyond = get_dht_time() + RULES.ttl(kind) + CLOCK_SLACK + draw(st.floats(1.0, 1e300, **finite))
        changes["expiration"] = draw(st.sampled_from([beyond, math.inf, math.nan]))
    elif how == "place":
        if kind == "stage":
            value["stage"] = draw(st.integers(N_STAGES, 2**63 - 1))
            if value["stage"] < 1024:  # under the key its content implies: only the range check stops it
                changes["key"] = KEYS.stage(value["stage"])
        elif kind == "strike":
            value["boundary"] = draw(st.integers(N_BOUNDARIES, 2**63 - 1) | st.integers(-(2**63), -1))
        elif kind == "verifier":
            value["boundaries"] = sorted({*value["boundaries"], draw(st.integers(N_BOUNDARIES, 5000))})
        else:
            value["config_hash"] = draw(st.text(max_size=128).filter(lambda h: h != CONFIG_HASH))
            changes["category"] = "place:config"
    elif how == "owner":
        forgery = draw(st.sampled_from(["speaks-for-another", "another-tag", "garbage-tag", "not-a-tag", "two-tags"]))
        changes.update(category=f"owner:{forgery}", signer=ATTACKER)
        author_field = RECORD_TYPES[kind].author_field
        if forgery == "speaks-for-another":  # the attacker's valid signature over a record in another's name
            changes["tag"] = ATTACKER.owner_tag
            if case.signer == ATTACKER:
                value[author_field] = VICTIM.peer_id
        elif forgery == "another-tag":  # under another's owner tag, signed by the attacker
            if case.signer == ATTACKER:
                changes["tag"] = VICTIM.owner_tag
            else:
                changes["signature_only"] = True  # the value is the author's own; its signature is not
        else:
            garbage = draw(st.binary(max_size=600))
            tags = {
                "garbage-tag": b"[owner:" + garbage + b"]",
                "not-a-tag": garbage,
                "two-tags": ATTACKER.owner_tag + case.signer.owner_tag,
            }
            changes["tag"] = draw(st.sampled_from([tags[forgery], b"[owner:ssh-rsa AAAA" + garbage + b"]"]))
    elif how == "signature":
        forgery = draw(st.sampled_from(["truncated", "bit-flipped", "missing", "doubled", "random", "other-record"]))
        changes.update(category=f"signature:{forgery}", signature_only=True)
        if forgery == "truncated":
            cut = draw(st.integers(0, 343))
            changes["signature"] = lambda s: b"[signature:" + s[:cut] + b"]"
        elif forgery == "bit-flipped":
            position, mask = draw(st.integers(0, 343)), 1 << draw(st.integers(0, 7))
            changes["signature"] = lambda s: (
                b"[signature:" + s[:position] + bytes([s[position] ^ mask]) + s[position + 1 :] + b"]"
            )
        elif forgery == "missing":
            changes["signature"] = lambda s: b""
        elif forgery == "doubled":
            changes["signature"] = lambda s: b"[signature:" + s + b"][signature:" + s + b"]"
        elif forgery == "random":
            noise = draw(st.binary(max_size=400))
            changes["signature"] = lambda s: b"[signature:" + noise + b"]"
        else:  # the author's real signature over the same value with another expiration
            other = DHTRecord(
                key_id(case.key),
                MSGPackSerializer.dumps(case.tag),
                MSGPackSerializer.dumps(value),
                case.expiration - draw(st.floats(1.0, 60.0)),
            )
            other_signature = case.signer.private_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(other)))
            changes["signature"] = lambda s: b"[signature:" + other_signature + b"]"
    elif how == "altered":  # the author's valid signature over its value; then the value changes on the way
        forgery = draw(st.sampled_from(["another-valid-value", "bit-flip"]))
        changes.update(category=f"altered:{forgery}", signature_only=True)
        signed = MSGPackSerializer.dumps(value)
        if forgery == "another-valid-value":
            altered = {**value, "version": draw(short_text.filter(lambda t: t != value["version"]))}
            for flag in ("relayed", "banned"):
                if flag in altered and draw(st.booleans()):
                    altered[flag] = not altered[flag]
            changes["value_bytes"] = MSGPackSerializer.dumps(altered)
        else:
            changes["value_bytes"] = _flip(signed, draw)
    elif how == "key":
        others = [KEYS.stage(k) for k in range(N_STAGES)] + [KEYS.verifiers, KEYS.trainers, KEYS.bootstraps]
        others += [KEYS.strikes(p.peer_id) for p in OPEN_AUTHORS] + [KEYS.strikes("x"), f"{PREFIX}_stage0.0b"]
        changes["key"] = draw(st.sampled_from([k for k in others if k != case.key]))
    elif how == "unadmitted":
        forgery = draw(st.sampled_from(["no-certificate", "self-signed", "another-subject", "another-role"]))
        changes.update(category=f"unadmitted:{forgery}", signer=ATTACKER, tag=ATTACKER.owner_tag)
        value[RECORD_TYPES[kind].author_field] = ATTACKER.peer_id
        role = "trainer" if kind == "trainer" else "verifier"
        if forgery == "no-certificate":
            value["certificate"] = None
        elif forgery == "self-signed":
            value["certificate"] = issue_certificate(
                RSAPrivateKey(), PREFIX, ATTACKER.peer_id, role, CERT_EXPIRES
            ).dict()
        elif forgery == "another-subject":
            value["certificate"] = _certificate(VICTIM, role)
        else:
            value["certificate"] = _certificate(ATTACKER, "verifier" if role == "trainer" else "trainer")
    elif how == "certificate":
        author, role = case.signer, "trainer" if kind == "trainer" else "verifier"
        forgery = draw(st.sampled_from(["expired-first", "narrower", "bit-flipped", "extra", "missing", "junk"]))
        changes["category"] = f"certificate:{forgery}"
        cert = dict(value["certificate"])
        if forgery == "expired-first":  # the record outlives its certificate
            bounds = cert["boundaries"]
            value["certificate"] = _certificate(author, role, bounds, expires=case.expiration - CLOCK_SLACK - 1)
        elif forgery == "narrower" and kind != "trainer":  # a verifier certified for boundary 0 only, on another
            value["certificate"] = _certificate(author, role, [0])
            if kind == "strike":
                value["boundary"] = N_BOUNDARIES - 1
            else:
                value["boundaries"] = [N_BOUNDARIES - 1]
        else:
            if forgery == "bit-flipped":
                cert["signature"] = _flip(cert["signature"], draw)
            elif forgery == "extra":
                cert["extra"] = draw(junk)
            elif forgery == "missing":
                del cert[draw(st.sampled_from(sorted(cert)))]
            elif forgery == "narrower":  # boundaries on a trainer certificate: not what the organiser signed
                cert["boundaries"] = [0]
            else:
                cert = draw(junk.filter(lambda v: v is not None))
            value["certificate"] = cert
    return dataclasses.replace(case, value=value, **changes)


def cases(kind: str):
    return st.one_of(honest(kind), forged(kind), forged(kind), forged(kind))


# --- the property -------------------------------------------------------------------------------------------------


def typed_read(key: str, subkey: object, value: object, expiration: float) -> dict:
    """What RecordStore's typed read makes of one DHT entry (it must never raise)."""
    found = ValueWithExpiration({subkey: ValueWithExpiration(value, expiration)}, expiration)
    return READER._decode(key, found)


def checked_alone(key: str, subkey: object, value: object, expiration: float) -> bool:
    """Whether the swarm's own checks (without the signature's) take the entry; anything but a RecordError out of
    them fails the test (the validator and the writer call them without a catch-all)."""
    try:
        check_record(RULES, key_id(key), subkey, value, expiration)
    except RecordError:
        return False
    return True


def _same_signature(record: DHTRecord, real: bytes) -> bool:
    sent = record.value.rsplit(b"[signature:", 1)[1][:-1]
    try:
        return base64.b64decode(sent) == base64.b64decode(real)
    except ValueError:
        return False


def check(case: Case) -> str:
    """Runs the case through the validator chain and the typed read; returns its outcome (asserting the
    property)."""
    record = case.dht_record()
    accepted = VALIDATOR.validate(record)  # an exception here fails the test: it would escape on a real node
    if accepted and case.category == "signature:bit-flipped" and _same_signature(record, case.real_signature):
        # base64 is malleable: the last character's spare bits (and, decoding leniently, characters outside the
        # alphabet) change the text, not the signature. The author's exact signature over its exact value: no forgery.
        return "same signature, another base64 spelling"
    if accepted:
        stripped = MSGPackSerializer.loads(VALIDATOR.strip_value(record))
        read = typed_read(case.key, case.tag, stripped, case.expiration)
        assert case.honest, f"forgery accepted ({case.category}): {case.value!r:.400}"
        author = case.value[RECORD_TYPES[case.kind].author_field]
        assert set(read) == {author}, f"an accepted record did not read back: {read}"
        # a record of an older schema reads with the defaults of the fields that came later (dht.records: since)
        shown = _as_signed(read[author].dict(), case.value)
        assert shown == case.value, "the typed read shows another value than the author signed"
        return "honest accepted"
    assert not case.honest, f"honest {case.kind} record refused: {case.value!r:.600}"
    # As if the signature check were skipped: the typed read alone must still refuse what is wrong with the value.
    try:
        direct = MSGPackSerializer.loads(case.value_bytes or MSGPackSerializer.dumps(case.value))
    except Exception:
        return "forged refused"  # bytes no node could even deserialize
    alone = checked_alone(case.key, case.tag, direct, case.expiration)
    read = typed_read(case.key, case.tag, direct, case.expiration)
    assert bool(read) == alone, "the typed read and the checks it relies on disagree"
    assert case.signature_only or not read, f"typed read took a {case.category} forgery: {read}"
    return "forged refused"


def _run(kind: str, case: Case) -> None:
    try:
        outcome = check(case)
    except AssertionError:
        TALLY.add(kind, f"FAILED {case.category}")
        raise
    except Exception:
        TALLY.add(kind, f"EXCEPTION {case.category}")
        raise
    TALLY.add(kind, "tried")
    TALLY.add(kind, outcome)
    if outcome == "forged refused":
        TALLY.add(kind, f"refused {case.category.split(':')[0]}")


@pytest.mark.parametrize("kind", KINDS)
def test_fuzzed_records_of_every_type(kind):
    """Honest records of ``kind`` land and read back as signed; forgeries never land nor read; nothing raises."""

    @fuzz_settings(50)
    @given(case=cases(kind))
    def run(case: Case) -> None:
        _run(kind, case)

    run()


GARBAGE_TAGS = [b"[owner:garbage]", b"[owner:ssh-rsa AAAA]", b"[owner:ssh-rsa AAAAB]", b"[owner:ssh-ed25519 AAAA]"]


@pytest.mark.parametrize("tag", GARBAGE_TAGS)
def test_an_owner_tag_without_an_rsa_key_is_refused_not_raised(tag):
    """Regression (found by this fuzzing): hivemind's signature validator raised ValueError or binascii.Error on
    an owner tag holding no RSA key, out of the validator and out of the node's rpc_store."""
    now = get_dht_time()
    value = MSGPackSerializer.dumps({"kind": "stage"}) + b"[signature:AAAA]"
    assert VALIDATOR.validate(DHTRecord(key_id(KEYS.stage(0)), MSGPackSerializer.dumps(tag), value, now + 5)) is False


# --- bytes from nowhere ---------------------------------------------------------------------------------------


record_like = st.recursive(
    junk,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["kind", "schema", "peer_id", "time", "stage", "x"]) | st.text(max_size=4),
            children,
            max_size=6,
        )
    ),
    max_leaves=12,
)
averager_keys = [KEYS.averager_group(k) for k in range(N_STAGES)] + [KEYS.averager_state(k) for k in range(N_STAGES)]
fixed_keys = [KEYS.stage(0), KEYS.verifiers, KEYS.trainers, KEYS.bootstraps, KEYS.strikes(VICTIM.peer_id)]


@fuzz_settings(150)
@given(
    key=st.sampled_from(averager_keys + fixed_keys).map(key_id) | st.binary(min_size=20, max_size=20),
    subkey=st.one_of(
        st.binary(max_size=40),
        st.binary(min_size=32, max_size=32).map(lambda b: b"\x12\x20" + b),
        st.sampled_from([VICTIM.owner_tag, b"[owner:]", b"[owner:ssh-rsa ]"]),
        st.binary(max_size=64).map(lambda b: b"[owner:" + b + b"]"),
    ),
    value=record_like,
    tail=st.binary(max_size=300) | st.binary(max_size=300).map(lambda b: b"[signature:" + b + b"]"),
    raw=st.booleans(),
    expiration=st.floats() | st.floats(-1e3, 1e3).map(lambda d: get_dht_time() + d),
)
def test_bytes_from_nowhere_never_land_nor_raise(key, subkey, value, tail, raw, expiration):
    """Arbitrary keys, subkeys (peer ids, owner tags of garbage), values and trailers: refused or, for hivemind's
    averager keys, accepted only in the shape hivemind writes; never an exception."""
    try:
        value_bytes = MSGPackSerializer.dumps(value)
    except Exception:
        value_bytes = b"\xc1"  # msgpack's one invalid byte
    record = DHTRecord(key, tail if raw else MSGPackSerializer.dumps(subkey), value_bytes + tail, expiration)
    accepted = VALIDATOR.validate(record)
    TALLY.add("bytes from nowhere", "tried")
    if accepted:
        # only an averager declaration may be unsigned: a peer id's bytes, holding a bool or a finite priority
        assert key in {key_id(k) for k in averager_keys}, (key, subkey, value)
        loaded = MSGPackSerializer.loads(record.subkey)
        assert isinstance(loaded, bytes) and len(loaded) == 34 and loaded[:2] == b"\x12\x20"
        TALLY.add("bytes from nowhere", "averager entry accepted")
    else:
        TALLY.add("bytes from nowhere", "refused")
    assert not checked_alone(KEYS.stage(0), subkey, value, expiration)
    assert typed_read(KEYS.stage(0), subkey, value, expiration) == {}


# --- the network edge ---------------------------------------------------------------------------------------------


LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _dht(identity_path, initial_peers=()) -> hivemind.DHT:
    identity = create_identity_file(identity_path)
    dht = hivemind.DHT(
        initial_peers=list(initial_peers),
        start=True,
        host_maddrs=LOOPBACK,
        identity_path=str(identity.path),
        check_if_identity_free=False,
        record_validators=swarm_validators(RULES, identity),
    )
    cap_subkeys(dht, RULES.max_subkeys)
    return dht, identity


def test_fuzzed_records_through_a_real_dht_node(tmp_path):
    """The same cases, stored by an attacker's DHT peer straight into an honest node on loopback: the honest node
    answers every store (True or False, never a failed call), stores no forgery, and its typed reads show exactly
    the honest records."""
    honest_node, honest_id = _dht(tmp_path / "honest.key")
    attacker, _ = _dht(tmp_path / "attacker.key", honest_node.get_visible_maddrs())
    reader_node, _ = _dht(tmp_path / "reader.key", honest_node.get_visible_maddrs())
    try:
        sent: list[Case] = []

        @fuzz_settings(1, 1)
        @given(data=st.data())
        def draw_cases(data) -> None:
            for kind in KINDS:
                sent.extend(data.draw(cases(kind)) for _ in range(8))

        draw_cases()
        # hypothesis' smallest lifetimes are a second: give honest records time to be read back
        sent = [
            dataclasses.replace(c, expiration=get_dht_time() + RULES.ttl(c.kind) / 2) if c.honest else c for c in sent
        ]
        garbage = dict(sent[0].value)
        sent.extend(  # owner tags without an RSA key once made the honest node fail the call instead of refusing
            dataclasses.replace(sent[0], value=garbage, tag=tag, signer=ATTACKER, category="owner:garbage-tag")
            for tag in GARBAGE_TAGS
        )
        # raw_store asks every peer the attacker knows: the honest node and the reader
        answers, times = [], []
        for case in sent:
            times.append(get_dht_time())
            record = case.dht_record()
            subkey = MSGPackSerializer.loads(record.subkey)
            answers.append(raw_dht.raw_store(attacker, case.key, subkey, record.value, case.expiration))
        stored_until: dict[tuple[str, str], float] = {}
        for case, answer, at in zip(sent, answers, times, strict=True):
            assert all(ok is not None for ok in answer), f"a node failed the call for {case.category}: {answer}"
            if not case.honest:
                assert not any(answer), (case.category, answer)
                continue
            # an honest record lands unless it expired on the way (a loaded machine) or one of the same author
            # under the same key with a later expiration is already there (the DHT keeps the latest)
            place = (case.key, case.value[RECORD_TYPES[case.kind].author_field])
            if case.expiration > at + 1.0 and case.expiration > stored_until.get(place, -math.inf):
                assert any(answer), (case.category, answer)
            if any(answer):
                stored_until[place] = max(case.expiration, stored_until.get(place, -math.inf))

        store = RecordStore(reader_node, RULES, timeout=10.0)
        found = store.fetch(sorted({case.key for case in sent}))
        shown = {(key, author): record.dict() for key, records in found.items() for author, record in records.items()}
        latest: dict[tuple[str, str], Case] = {}
        for case in sent:
            if case.honest:
                author = case.value[RECORD_TYPES[case.kind].author_field]
                best = latest.get((case.key, author))
                if best is None or case.expiration >= best.expiration:
                    latest[(case.key, author)] = case
        # every record shown is the honest one its author signed last (the DHT keeps the latest expiration)
        for place, value in shown.items():
            assert place in latest and _as_signed(value, latest[place].value) == latest[place].value, place
        assert set(shown) == set(latest), "an honest record stored was not read back"
        assert honest_id.peer_id  # the honest node served throughout
        TALLY.figures["network edge"] = {"stored": len(sent), "honest": len(latest), "shown": len(shown)}
    finally:
        for node in (reader_node, attacker, honest_node):
            node.shutdown()
