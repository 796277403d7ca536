"""Swarm records in a real DHT on loopback: announcements come and go; forged, malformed, unadmitted, oversized or
shape-breaking records never land.

Rejection is always checked from a peer other than the writer: a writer caches its own value whatever the
others decided. The attacks of issue 16 run here as an attacker would: honest software storing hand-made bytes
straight into its peers' storage (``raw_store``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hivemind
import pytest
import raw_dht
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from raw_dht import signed_value

from dht import (
    Announcer,
    CappedStorage,
    Identity,
    RecordError,
    RecordStore,
    RoleCertificate,
    StageAnnouncement,
    StrikeRecord,
    SwarmKeys,
    SwarmRules,
    TrainerAnnouncement,
    TrustRoots,
    VerifierAnnouncement,
    cap_subkeys,
    create_identity_file,
    ephemeral_identity,
    issue_certificate,
    load_identity_file,
    parse_record,
    swarm_validators,
)

PREFIX, CONFIG_HASH = "test-records", "c0ffee"
KEYS = SwarmKeys(PREFIX)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
N_STAGES = 4
ORGANISER = RSAPrivateKey()
ANNOUNCE_TTL, STRIKE_TTL = 120.0, 600.0


def rules(config_hash: str = CONFIG_HASH, **changes) -> SwarmRules:
    trust = TrustRoots(organiser=ORGANISER.get_public_key().to_bytes())
    fields = dict(trust=trust, announce_ttl=ANNOUNCE_TTL, strike_ttl=STRIKE_TTL)
    return SwarmRules(PREFIX, config_hash, N_STAGES, **{**fields, **changes})


def certificate(identity: Identity, role: str = "verifier", **changes) -> RoleCertificate:
    fields = dict(swarm=PREFIX, subject=identity.peer_id, role=role, expires=time.time() + 3600)
    fields.update(changes)
    return issue_certificate(ORGANISER, **fields)


@dataclasses.dataclass
class Node:
    dht: hivemind.DHT
    identity: Identity
    store: RecordStore

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id


def start_node(directory: Path, initial_peers=(), config_hash: str = CONFIG_HASH, **rule_changes) -> Node:
    identity = create_identity_file(directory / f"id-{time.monotonic_ns()}.key")
    node_rules = rules(config_hash, **rule_changes)
    dht = hivemind.DHT(
        initial_peers=list(initial_peers),
        start=True,
        host_maddrs=LOOPBACK,
        identity_path=str(identity.path),
        check_if_identity_free=False,  # fresh keys cannot collide; the check costs a second per node
        record_validators=swarm_validators(node_rules, identity),
    )
    cap_subkeys(dht, node_rules.max_subkeys)
    return Node(dht, identity, RecordStore(dht, node_rules, identity, timeout=10.0))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[list[Node]]:
    directory = tmp_path_factory.mktemp("identities")
    first = start_node(directory)
    nodes = [first] + [start_node(directory, first.dht.get_visible_maddrs()) for _ in range(2)]
    yield nodes
    for node in nodes:
        node.dht.shutdown()


@pytest.fixture
def new_node(swarm, tmp_path) -> Iterator[Callable[..., Node]]:
    started: list[Node] = []

    def start(**kwargs) -> Node:
        started.append(start_node(tmp_path, swarm[0].dht.get_visible_maddrs(), **kwargs))
        return started[-1]

    yield start
    for node in started:
        node.dht.shutdown()


def common(node: Node | Identity, **changes) -> dict:
    identity = node.identity if isinstance(node, Node) else node
    maddrs = [str(m) for m in node.dht.get_visible_maddrs()] if isinstance(node, Node) else []
    fields = dict(
        peer_id=identity.peer_id,
        maddrs=maddrs,
        state="online",
        relayed=False,
        throughput=10.0,
        config_hash=CONFIG_HASH,
        version="test",
        time=get_dht_time(),
    )
    return {**fields, **changes}


def stage(node: Node | Identity, **changes) -> StageAnnouncement:
    return StageAnnouncement(**common(node, **{"stage": 0, **changes}))


def verifier_announcement(node: Node | Identity, **changes) -> VerifierAnnouncement:
    identity = node.identity if isinstance(node, Node) else node
    fields = {"boundaries": [0, 1, 2], "certificate": certificate(identity), **changes}
    return VerifierAnnouncement(**common(node, **fields))


def trainer_announcement(node: Node | Identity, **changes) -> TrainerAnnouncement:
    identity = node.identity if isinstance(node, Node) else node
    fields = {"global_step": 0, "certificate": certificate(identity, "trainer"), **changes}
    return TrainerAnnouncement(**common(node, **fields))


def strike(verifier: Node | Identity, accused: str, **changes) -> StrikeRecord:
    identity = verifier.identity if isinstance(verifier, Node) else verifier
    fields = dict(
        verifier=identity.peer_id,
        accused=accused,
        boundary=0,
        direction="activation",
        strikes=1,
        checks=10,
        flags=1,
        metrics={"l1": 0.5, "sliced_wasserstein": 1.25},
        banned=False,
        config_hash=CONFIG_HASH,
        version="test",
        time=get_dht_time(),
        certificate=certificate(identity),
    )
    return StrikeRecord(**{**fields, **changes})


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def test_identity_file_is_private_and_names_the_peer(tmp_path):
    identity = create_identity_file(tmp_path / "node.key")
    assert (tmp_path / "node.key").stat().st_mode & 0o777 == 0o600
    again = load_identity_file(tmp_path / "node.key")
    assert again.peer_id == identity.peer_id and again.public_key == identity.public_key
    dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, identity_path=str(identity.path))
    try:
        assert dht.peer_id.to_base58() == identity.peer_id
    finally:
        dht.shutdown()


def test_announcement_is_read_by_another_node_and_expires_after_its_node_stops(swarm, new_node):
    writer, reader = new_node(), swarm[1]
    announcer = Announcer(writer.store, stage(writer, stage=1), period=0.3, ttl=1.5).start()
    assert wait_for(lambda: writer.peer_id in reader.store.stages(2)[1], timeout=3)
    seen = reader.store.stages(2)[1][writer.peer_id]
    assert seen.state == "online" and seen.throughput == 10.0 and seen.maddrs

    announcer.update(throughput=25.0)
    assert wait_for(lambda: reader.store.stages(2)[1][writer.peer_id].throughput == 25.0, timeout=3)

    announcer.stop(offline=False)  # as if it died: nothing tells readers, the record must expire on its own
    writer.dht.shutdown()
    assert writer.peer_id in reader.store.stages(2)[1]
    assert wait_for(lambda: writer.peer_id not in reader.store.stages(2)[1], timeout=1.5 + 2)


def test_a_clean_stop_announces_offline_at_once(swarm, new_node):
    writer, reader = new_node(), swarm[2]
    announcer = Announcer(writer.store, stage(writer, stage=0), period=0.3, ttl=30).start()
    assert wait_for(lambda: writer.peer_id in reader.store.stages(1)[0], timeout=3)
    announcer.stop(offline=True)
    assert reader.store.stages(1)[0][writer.peer_id].state == "offline"


def test_strike_record_round_trip(swarm):
    verifier, reader = swarm[0], swarm[1]
    record = strike(verifier, swarm[2].peer_id, banned=True, strikes=3, flags=3, metrics={"l1": 7.5, "l2": 0.1})
    verifier.store.put(record, ttl=30)
    got = reader.store.strikes(swarm[2].peer_id)
    assert got[verifier.peer_id].banned and got[verifier.peer_id].metrics["l1"] == 7.5
    assert got[verifier.peer_id].certificate == record.certificate


def test_writer_refuses_records_peers_would_refuse(swarm):
    node, other = swarm[0], swarm[1]
    with pytest.raises(RecordError, match="speaks for"):
        node.store.put(stage(other), ttl=5)  # a record in another peer's name
    with pytest.raises(RecordError, match="config"):
        node.store.put(stage(node, config_hash="other"), ttl=5)
    with pytest.raises(ValueError):
        stage(node, throughput=3)  # strict types: an int is not a throughput
    with pytest.raises(RecordError, match="not admitted as a verifier"):
        node.store.put(verifier_announcement(node, certificate=None), ttl=5)
    with pytest.raises(RecordError, match="may live 120s"):
        node.store.put(stage(node), ttl=86400)
    read_only = RecordStore(node.dht, node.store.rules, identity=None)
    with pytest.raises(RecordError, match="read-only"):
        read_only.put(stage(node), ttl=5)


# --- an attacker running the honest software but storing hand-made bytes straight into its peers' storage ---


def raw_store(attacker: Node, key: str, subkey: object, value: bytes, expiration: float) -> list:
    return raw_dht.raw_store(attacker.dht, key, subkey, value, expiration)


def raw_store_signed(attacker: Node, signer: Identity, record: dict, key: str, expiration: float) -> list:
    """Stores ``record`` signed by ``signer`` under its owner tag, as hivemind would, skipping every check of ours."""
    value = signed_value(signer, key, signer.owner_tag, record, expiration)
    return raw_store(attacker, key, signer.owner_tag, value, expiration)


def raw_subkeys(node: Node, key: str) -> dict:
    found = node.dht.get(key, latest=True, return_future=True).result(timeout=10)
    return {} if found is None else {subkey: item.value for subkey, item in found.value.items()}


def raw_value(node: Node, key: str) -> object:
    found = node.dht.get(key, latest=True, return_future=True).result(timeout=10)
    return None if found is None else found.value


@pytest.fixture(scope="module")
def attacker(swarm, tmp_path_factory) -> Iterator[Node]:
    node = start_node(tmp_path_factory.mktemp("attacker"), swarm[0].dht.get_visible_maddrs())
    yield node
    node.dht.shutdown()


def test_strike_under_another_verifiers_name_never_lands(swarm, attacker):
    verifier, reader = swarm[0], swarm[1]
    accused = swarm[2].peer_id
    honest = strike(verifier, accused, banned=False, time=get_dht_time())
    verifier.store.put(honest, ttl=60)
    # The attacker writes a ban under the verifier's owner tag, signed with its own key, expiring later (so it
    # would win if accepted).
    forged = honest.replace(banned=True, strikes=9, flags=9).dict()
    expiration = get_dht_time() + 120
    key = KEYS.strikes(accused)
    stored = raw_store(
        attacker,
        key,
        verifier.identity.owner_tag,
        signed_value(attacker.identity, key, verifier.identity.owner_tag, forged, expiration),
        expiration,
    )
    assert not any(stored)
    assert reader.store.strikes(accused)[verifier.peer_id].banned is False
    assert raw_subkeys(reader, key)[verifier.identity.owner_tag]["banned"] is False


def test_tampered_value_never_lands(swarm, attacker):
    reader = swarm[1]
    accused = swarm[2].peer_id
    key = KEYS.strikes(accused)
    expiration = get_dht_time() + 60
    value = signed_value(
        attacker.identity, key, attacker.identity.owner_tag, strike(attacker, accused).dict(), expiration
    )
    tampered = value.replace(b"\xc2", b"\xc3", 1)  # msgpack False -> True: banned flips after signing
    assert tampered != value
    assert not any(raw_store(attacker, key, attacker.identity.owner_tag, tampered, expiration))
    assert attacker.identity.owner_tag not in raw_subkeys(reader, key)
    # the untampered bytes are accepted: the rejection above is the signature's doing
    assert all(raw_store(attacker, key, attacker.identity.owner_tag, value, expiration))
    assert reader.store.strikes(accused)[attacker.peer_id].banned is False


def test_record_whose_owner_is_not_the_peer_it_speaks_for_never_lands(swarm, attacker):
    victim, reader = swarm[0], swarm[2]
    key = KEYS.stage(3)
    expiration = get_dht_time() + 60
    lie = stage(victim, stage=3, state="offline").dict()  # validly signed by the attacker, in the victim's name
    value = signed_value(attacker.identity, key, attacker.identity.owner_tag, lie, expiration)
    assert not any(raw_store(attacker, key, attacker.identity.owner_tag, value, expiration))
    assert raw_subkeys(reader, key) == {}
    assert reader.store.stages(4)[3] == {}


@pytest.mark.parametrize(
    "breakage",
    [
        {"throughput": 10},  # int where a float is due
        {"state": "hacked"},
        {"stage": -1},
        {"extra": "field"},
        {"stage": 2},  # a stage-2 announcement under the stage-1 key
        {"throughput": math.inf},  # issue 16, attack 4: +inf crashed every trainer's random.choices
        {"throughput": math.nan},
        {"throughput": 1e300},
        {"time": math.inf},
        {"time": get_dht_time() + 3600},  # written in the future
        {"last_step": 2**62},
    ],
)
def test_record_that_breaks_the_schema_never_lands(swarm, attacker, breakage):
    reader = swarm[1]
    key = KEYS.stage(1)
    expiration = get_dht_time() + 60
    broken = {**stage(attacker, stage=1).dict(), **breakage}
    value = signed_value(attacker.identity, key, attacker.identity.owner_tag, broken, expiration)
    assert not any(raw_store(attacker, key, attacker.identity.owner_tag, value, expiration))
    assert attacker.identity.owner_tag not in raw_subkeys(reader, key)
    assert attacker.peer_id not in reader.store.stages(2)[1]


@pytest.mark.parametrize(
    "breakage",
    [
        {"metrics": {"l1": math.nan}},  # issue 16, attack 9: NaN/inf metrics were stored and shown
        {"metrics": {"l1": math.inf}},
        {"time": math.inf},
        {"strikes": 2**63 - 1, "flags": 2**63 - 1, "checks": 2**63 - 1},
        {"boundary": 1023},  # a boundary the 4-stage swarm does not have
        {"boundary": N_STAGES - 1},  # one past the last boundary
        {"flags": 20, "checks": 10},  # more flags than checks
    ],
)
def test_strike_record_out_of_range_never_lands(swarm, attacker, breakage):
    reader, accused = swarm[2], swarm[0].peer_id
    key = KEYS.strikes(accused)
    record = {**strike(attacker, accused).dict(), **breakage}
    expiration = get_dht_time() + 60
    assert not any(raw_store_signed(attacker, attacker.identity, record, key, expiration))
    assert attacker.identity.owner_tag not in raw_subkeys(reader, key)


def test_unsigned_junk_is_refused_under_fixed_keys_and_strike_keys_alike(swarm, attacker):
    reader = swarm[2]
    expiration = get_dht_time() + 60
    junk = MSGPackSerializer.dumps({"kind": "nonsense"})
    assert not any(raw_store(attacker, KEYS.verifiers, b"plain-subkey", junk, expiration))
    assert b"plain-subkey" not in raw_subkeys(reader, KEYS.verifiers)
    # The DHT sees only key hashes, but the namespace is closed: a key that is not a fixed one can only be a strike
    # key, and takes only strike records (it once took anything).
    key = KEYS.strikes(swarm[0].peer_id)
    assert not any(raw_store(attacker, key, b"plain-subkey", junk, expiration))
    assert b"plain-subkey" not in raw_subkeys(reader, key)
    unrelated = "some-other-application.key"
    assert not any(raw_store(attacker, unrelated, b"x", junk, expiration))


def test_records_of_another_config_never_land_and_the_refusal_is_logged_once(swarm, new_node, capfd):
    stranger, reader = new_node(config_hash="another"), swarm[1]
    for _ in range(3):
        stranger.store.put(stage(stranger, stage=2, config_hash="another"), ttl=30)
    assert stranger.identity.owner_tag not in raw_subkeys(reader, KEYS.stage(2))
    assert stranger.peer_id not in reader.store.stages(3)[2]
    # the refusing validators run in the DHT processes, which log to this process's stderr
    wait_for(lambda: "refusing records of swarm config another" in capfd.readouterr().err, timeout=10)


def test_a_record_of_a_newer_schema_is_read_and_its_new_field_ignored_but_not_tampered_with(swarm, new_node):
    """A writer of a later release adds a field: today's nodes store and read its records (they would otherwise
    split the swarm), and the signature still covers the new field."""
    from dht.records import SCHEMA

    newer, reader = new_node(), swarm[2]
    key = KEYS.strikes(swarm[0].peer_id)
    expiration = get_dht_time() + 60
    record = {**strike(newer, swarm[0].peer_id).dict(), "schema": SCHEMA + 1, "evidence": "mb 12.3"}
    value = signed_value(newer.identity, key, newer.identity.owner_tag, record, expiration)
    tampered = value.replace(b"mb 12.3", b"mb 99.9", 1)  # the new field changed after signing
    assert tampered != value
    assert not any(raw_store(newer, key, newer.identity.owner_tag, tampered, expiration))
    assert newer.identity.owner_tag not in raw_subkeys(reader, key)
    assert all(raw_store(newer, key, newer.identity.owner_tag, value, expiration))
    read = reader.store.strikes(swarm[0].peer_id)[newer.peer_id]
    assert read.schema_ == SCHEMA + 1 and read.strikes == 1 and not hasattr(read, "evidence")
    # the same field in a record that claims today's schema is a malformed record, not an extension
    other = swarm[1].peer_id
    same_schema = {**strike(newer, other).dict(), "schema": SCHEMA, "evidence": "mb 12.3"}
    value = signed_value(newer.identity, KEYS.strikes(other), newer.identity.owner_tag, same_schema, expiration)
    assert not any(raw_store(newer, KEYS.strikes(other), newer.identity.owner_tag, value, expiration))
    assert newer.peer_id not in reader.store.strikes(other)


# --- issue 16, attack 1: a plain value erasing a key's dictionary ---


def every_key(accused: str) -> list[str]:
    return [
        KEYS.strikes(accused),
        KEYS.stage(0),
        KEYS.verifiers,
        KEYS.trainers,
        KEYS.bootstraps,
        KEYS.averager_group(0),
        KEYS.averager_state(0),
    ]


def test_a_plain_value_cannot_erase_a_ban(swarm, attacker, new_node):
    """A plain value with a far-future expiration once replaced the dictionary of a strike key on every peer, and
    every later ban on that peer was refused: the banned attacker dropped out of every exclusion."""
    verifier, reader = swarm[0], swarm[1]
    accused = ephemeral_identity().peer_id
    verifier.store.put(strike(verifier, accused, banned=True, strikes=3, flags=3), ttl=STRIKE_TTL)
    assert reader.store.strikes(accused)[verifier.peer_id].banned
    key = KEYS.strikes(accused)
    far = get_dht_time() + 365 * 86400
    plain = MSGPackSerializer.dumps("nothing to see here")
    stored = raw_store(attacker, key, DHTProtocol.IS_REGULAR_VALUE, plain, far)
    assert not any(stored), stored
    # the ban survives on every node, and a later ban (another verifier's) still lands beside it
    for node in swarm:
        assert isinstance(raw_value(node, key), dict)
        assert node.store.strikes(accused)[verifier.peer_id].banned
    second = new_node()
    second.store.put(strike(second, accused, banned=True, strikes=3, flags=3), ttl=STRIKE_TTL)
    assert wait_for(lambda: second.peer_id in reader.store.strikes(accused), timeout=10)
    assert verifier.peer_id in reader.store.strikes(accused)


@pytest.mark.parametrize("which", range(7))
def test_no_key_of_the_swarm_takes_a_plain_value(swarm, attacker, which):
    """The same attack on every key of the namespace (fixed keys, strike keys, the averagers' keys)."""
    key = every_key(swarm[2].peer_id)[which]
    far = get_dht_time() + 365 * 86400
    assert not any(raw_store(attacker, key, DHTProtocol.IS_REGULAR_VALUE, MSGPackSerializer.dumps(1), far))
    assert not isinstance(raw_value(swarm[1], key), int | bytes | str)


def test_no_record_may_claim_to_live_longer_than_its_type(swarm, attacker):
    """A valid, admitted record that claims a year (it would outlive every honest refresh, or a ban's TTL)."""
    reader, accused = swarm[1], ephemeral_identity().peer_id
    far = get_dht_time() + 365 * 86400
    assert not any(
        raw_store_signed(attacker, attacker.identity, strike(attacker, accused).dict(), KEYS.strikes(accused), far)
    )
    assert not any(raw_store_signed(attacker, attacker.identity, stage(attacker).dict(), KEYS.stage(0), far))
    assert attacker.peer_id not in reader.store.strikes(accused)
    assert attacker.identity.owner_tag not in raw_subkeys(reader, KEYS.stage(0))


# --- roles are admitted, never self-asserted ---


@pytest.mark.parametrize(
    "make",
    [
        lambda who: verifier_announcement(who, certificate=None),  # no certificate, not listed
        lambda who: trainer_announcement(who, certificate=None),
        lambda who: strike(who, ephemeral_identity().peer_id, certificate=None, banned=True, strikes=3, flags=3),
        lambda who: verifier_announcement(who, certificate=certificate(who, "trainer")),  # the wrong role
        lambda who: trainer_announcement(who, certificate=certificate(ephemeral_identity(), "trainer")),  # not its
        lambda who: verifier_announcement(who, certificate=certificate(who, swarm="another-swarm")),
        lambda who: verifier_announcement(who, certificate=certificate(who, boundaries=[1])),  # announces 0, 1, 2
        lambda who: strike(who, ephemeral_identity().peer_id, certificate=certificate(who, boundaries=[2])),
        lambda who: verifier_announcement(who, certificate=certificate(who, expires=time.time() - 600)),  # expired
        lambda who: verifier_announcement(
            who, certificate=issue_certificate(RSAPrivateKey(), PREFIX, who.peer_id, "verifier", time.time() + 3600)
        ),  # signed by someone who is not the organiser
    ],
)
def test_unadmitted_roles_never_land(swarm, attacker, make):
    reader = swarm[2]
    record = make(attacker.identity)
    key = record.key(KEYS)
    expiration = get_dht_time() + 60
    assert not any(raw_store_signed(attacker, attacker.identity, record.dict(), key, expiration))
    assert attacker.identity.owner_tag not in raw_subkeys(reader, key)


def test_admitted_roles_land_and_are_read(swarm, new_node):
    node, reader = new_node(), swarm[1]
    node.store.put(verifier_announcement(node), ttl=30)
    node.store.put(trainer_announcement(node), ttl=30)
    assert wait_for(lambda: node.peer_id in reader.store.verifiers(), timeout=10)
    assert node.peer_id in reader.store.trainers()


def test_a_forged_certificate_signature_never_lands(swarm, attacker):
    real = certificate(attacker.identity, boundaries=[0])
    forged = RoleCertificate(**{**real.dict(), "boundaries": None})  # widened after signing
    record = verifier_announcement(attacker, certificate=forged).dict()
    expiration = get_dht_time() + 60
    assert not any(raw_store_signed(attacker, attacker.identity, record, KEYS.verifiers, expiration))


# --- issue 16, attack 7: an oversize key ---


def test_junk_subkeys_cannot_make_a_key_unreadable(swarm, attacker, new_node):
    """3,600 junk subkeys of 2 KiB under a verifier's strike key were once accepted: the key grew past the 4 MiB
    message cap, every holder answered nothing for it (real strikes there became invisible) and holders grew
    without bound."""
    honest = new_node()
    accused = attacker.peer_id  # the attacker buries the strikes against itself
    honest.store.put(strike(honest, accused, banned=True, strikes=3, flags=3), ttl=STRIKE_TTL)
    key = KEYS.strikes(accused)
    expiration = get_dht_time() + 3600
    accepted = sum(raw_dht.raw_store_junk(attacker.dht, key, 900, 2048, expiration, f"junk-{b}") for b in range(4))
    assert accepted == 0
    for node in swarm:
        records = node.store.strikes(accused)
        assert records[honest.peer_id].banned
        assert len(raw_subkeys(node, key)) <= 8


def test_an_oversize_record_never_lands(swarm, attacker):
    maddrs = [f"/dns4/{'a' * 300}{i}.example/tcp/1" for i in range(30)]  # within the schema, over the byte cap
    record = {**stage(attacker, stage=2).dict(), "maddrs": maddrs}
    assert not any(raw_store_signed(attacker, attacker.identity, record, KEYS.stage(2), get_dht_time() + 60))
    with pytest.raises(RecordError, match="bytes"):
        attacker.store.put(StageAnnouncement.parse_obj(record), ttl=30)


def test_capped_storage_keeps_the_entries_expiring_last():
    storage = CappedStorage(max_subkeys=3)
    key = DHTID.generate(source="k")
    now = get_dht_time()
    for i in range(6):
        assert storage.store(key, b"v", now + 100 + i, subkey=f"s{i}")
    held = storage.get(key).value
    assert isinstance(held, DictionaryDHTValue) and sorted(subkey for subkey, _ in held.items()) == ["s3", "s4", "s5"]
    assert not storage.store(key, b"v", now + 50, subkey="early")  # would be the first to go: not kept
    # a whole dictionary stored at once (the cache does this with search results) is capped too
    big = DictionaryDHTValue()
    for i in range(10):
        big.store(f"t{i}", b"v", now + 10 + i)
    other = DHTID.generate(source="other")
    storage.store(other, big, now + 20)
    assert len(storage.get(other).value) == 3


def test_every_node_caps_a_keys_subkeys(tmp_path):
    """A key of an open role (stage announcements: any volunteer may write one) cannot outgrow its cap on any node,
    however many keys write to it."""
    nodes = [start_node(tmp_path, max_subkeys=8)]
    nodes += [start_node(tmp_path, nodes[0].dht.get_visible_maddrs(), max_subkeys=8) for _ in range(2)]
    *holders, writer_node = nodes
    try:
        writers = [ephemeral_identity() for _ in range(12)]
        expiration = get_dht_time() + 60
        for i, writer in enumerate(writers):
            stored = raw_store_signed(
                writer_node, writer, stage(writer, stage=3).dict(), KEYS.stage(3), expiration + i
            )
            assert all(stored), stored  # each one is a valid record; the cap is what limits them
        for node in holders:
            held = node.dht.run_coroutine(functools.partial(_held_subkeys, key=KEYS.stage(3)))
            assert held == 8, held
        # the ones kept are those expiring last, and a reader gets no more than the cap either
        read = writer_node.store.stages(N_STAGES)[3]
        assert len(read) <= 8 and {w.peer_id for w in writers[-8:]} >= set(read), read
    finally:
        for node in nodes:
            node.dht.shutdown()


async def _held_subkeys(_dht, node, key: str) -> int:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return 0 if found is None else len(found.value)


EVIDENCE = dict(
    microbatch="s12:m3:a0",
    step=12,
    stage=1,
    finding="mismatch",
    direction="gradient",
    error=2.0,
    confirmed_error=2.0,
    auditors=[ephemeral_identity().peer_id, ephemeral_identity().peer_id],
    digests={"input": "a" * 64, "output": "b" * 64, "grad_output": "c" * 64, "grad_input": "d" * 64},
    parameters="0123456789abcdef",
)


def test_a_strike_record_carries_the_evidence_of_a_failed_audit_within_bounds():
    verifier, accused = ephemeral_identity(), ephemeral_identity().peer_id
    record = strike(verifier, accused, audits_passed=4, audits_failed=1, audit=EVIDENCE, banned=True, strikes=3)
    assert parse_record(record.dict()) == record and record.audit.auditors == EVIDENCE["auditors"]
    for bad in (
        {"auditors": EVIDENCE["auditors"] * 2},  # at most two: the accuser and the one that confirmed it
        {"auditors": []},
        {"digests": {**EVIDENCE["digests"], "weights": "e" * 64}},  # only the stage's four tensors
        {"digests": {"input": "not-a-digest"}},
        {"microbatch": "x" * 129},
        {"error": -1.0},
        {"error": 2},  # strict: an int is not a float
        {"finding": "suspicious"},
    ):
        with pytest.raises(ValueError):
            parse_record({**record.dict(), "audit": {**EVIDENCE, **bad}})


def test_a_strike_record_of_the_previous_schema_is_read_without_the_audit_fields():
    from dht.records import SCHEMA

    verifier, accused = ephemeral_identity(), ephemeral_identity().peer_id
    old = {k: v for k, v in strike(verifier, accused).dict().items() if not k.startswith("audit")}
    read = parse_record({**old, "schema": 1})
    assert read.audits_passed == 0 and read.audit is None and SCHEMA == 2
    with pytest.raises(ValueError):  # a writer of today's schema must write them
        parse_record({**old, "schema": SCHEMA})
