"""Swarm records in a real DHT on loopback: announcements come and go, forged or malformed records never land.

Rejection is always checked from a peer other than the writer: a writer caches its own value whatever the
others decided.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from dht import (
    Announcer,
    Identity,
    RecordError,
    RecordStore,
    StageAnnouncement,
    StrikeRecord,
    SwarmKeys,
    create_identity_file,
    ephemeral_identity,
    load_identity_file,
    parse_record,
    swarm_validators,
)

PREFIX, CONFIG_HASH = "test-records", "c0ffee"
KEYS = SwarmKeys(PREFIX)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@dataclasses.dataclass
class Node:
    dht: hivemind.DHT
    identity: Identity
    store: RecordStore

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id


def start_node(directory: Path, initial_peers=(), config_hash: str = CONFIG_HASH) -> Node:
    identity = create_identity_file(directory / f"id-{time.monotonic_ns()}.key")
    dht = hivemind.DHT(
        initial_peers=list(initial_peers),
        start=True,
        host_maddrs=LOOPBACK,
        identity_path=str(identity.path),
        check_if_identity_free=False,  # fresh keys cannot collide; the check costs a second per node
        record_validators=swarm_validators(PREFIX, identity),
    )
    return Node(dht, identity, RecordStore(dht, KEYS, config_hash, identity, timeout=5.0))


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


def stage(node: Node, **changes) -> StageAnnouncement:
    fields = dict(
        peer_id=node.peer_id,
        maddrs=[str(m) for m in node.dht.get_visible_maddrs()],
        state="online",
        relayed=False,
        throughput=10.0,
        stage=0,
        config_hash=CONFIG_HASH,
        version="test",
        time=get_dht_time(),
    )
    return StageAnnouncement(**{**fields, **changes})


def strike(verifier: str, accused: str, **changes) -> StrikeRecord:
    fields = dict(
        verifier=verifier,
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
    record = strike(verifier.peer_id, swarm[2].peer_id, banned=True, metrics={"l1": float("inf"), "l2": 0.1})
    verifier.store.put(record, ttl=30)
    got = reader.store.strikes(swarm[2].peer_id)
    assert got[verifier.peer_id].banned and got[verifier.peer_id].metrics["l1"] == float("inf")


def test_writer_refuses_records_peers_would_refuse(swarm):
    node, other = swarm[0], swarm[1]
    with pytest.raises(RecordError, match="speaks for"):
        node.store.put(stage(other), ttl=5)  # a record in another peer's name
    with pytest.raises(RecordError, match="config hash"):
        node.store.put(stage(node, config_hash="other"), ttl=5)
    with pytest.raises(ValueError):
        stage(node, throughput=3)  # strict types: an int is not a throughput
    read_only = RecordStore(node.dht, KEYS, CONFIG_HASH, identity=None)
    with pytest.raises(RecordError, match="read-only"):
        read_only.put(stage(node), ttl=5)


# --- an attacker running the honest software but storing hand-made bytes straight into its peers' storage ---


async def _raw_store(_dht, node, key: str, subkey: object, value: bytes, expiration: float) -> list:
    """Runs inside the attacker's DHT process: asks every known peer to store exactly these bytes."""
    peers = list(node.protocol.routing_table.peer_id_to_uid)
    results = [
        await node.protocol.call_store(peer, [DHTID.generate(source=key)], [value], expiration, [subkey])
        for peer in peers
    ]
    return [r[0] if r else None for r in results]


def signed_value(signer: Identity, key: str, subkey: bytes, value: dict, expiration: float) -> bytes:
    """The bytes hivemind's RSASignatureValidator would send for ``value``, signed by ``signer``."""
    value_bytes = MSGPackSerializer.dumps(value)
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey), value_bytes, expiration)
    signature = signer.private_key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
    return value_bytes + b"[signature:" + signature + b"]"


def raw_store(attacker: Node, key: str, subkey: object, value: bytes, expiration: float) -> list:
    return attacker.dht.run_coroutine(
        functools.partial(_raw_store, key=key, subkey=subkey, value=value, expiration=expiration)
    )


def raw_subkeys(node: Node, key: str) -> dict:
    found = node.dht.get(key, latest=True, return_future=True).result(timeout=5)
    return {} if found is None else {subkey: item.value for subkey, item in found.value.items()}


@pytest.fixture(scope="module")
def attacker(swarm, tmp_path_factory) -> Iterator[Node]:
    node = start_node(tmp_path_factory.mktemp("attacker"), swarm[0].dht.get_visible_maddrs())
    yield node
    node.dht.shutdown()


def test_strike_under_another_verifiers_name_never_lands(swarm, attacker):
    verifier, reader = swarm[0], swarm[1]
    accused = swarm[2].peer_id
    honest = strike(verifier.peer_id, accused, banned=False, time=get_dht_time())
    verifier.store.put(honest, ttl=60)
    # The attacker writes a ban under the verifier's owner tag, signed with its own key, expiring later (so it
    # would win if accepted).
    forged = honest.replace(banned=True, strikes=9).dict()
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
        attacker.identity, key, attacker.identity.owner_tag, strike(attacker.peer_id, accused).dict(), expiration
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


def test_unsigned_junk_is_refused_under_fixed_keys_and_dropped_by_readers_elsewhere(swarm, attacker):
    reader = swarm[2]
    expiration = get_dht_time() + 60
    junk = MSGPackSerializer.dumps({"kind": "nonsense"})
    assert not any(raw_store(attacker, KEYS.verifiers, b"plain-subkey", junk, expiration))
    assert b"plain-subkey" not in raw_subkeys(reader, KEYS.verifiers)
    # Strike keys are per peer and the DHT sees only key hashes, so it cannot recognise them: junk without an
    # owner tag lands, and the typed reads drop it.
    key = KEYS.strikes(swarm[0].peer_id)
    raw_store(attacker, key, b"plain-subkey", junk, expiration)
    assert b"plain-subkey" in raw_subkeys(reader, key)
    assert all(record.verifier != "plain-subkey" for record in reader.store.strikes(swarm[0].peer_id).values())


def test_records_of_another_config_are_ignored_with_one_warning(swarm, new_node, caplog):
    stranger, reader = new_node(config_hash="another"), swarm[1]
    stranger.store.put(stage(stranger, stage=2, config_hash="another"), ttl=30)
    assert raw_subkeys(reader, KEYS.stage(2))  # it is in the DHT ...
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert stranger.peer_id not in reader.store.stages(3)[2]  # ... but ignored
    warnings = [r for r in caplog.records if stranger.peer_id in r.getMessage()]
    assert len(warnings) == 1 and "config hash" in warnings[0].getMessage()


def test_a_record_of_a_newer_schema_is_read_and_its_new_field_ignored_but_not_tampered_with(swarm, new_node):
    """A writer of a later release adds a field: today's nodes store and read its records (they would otherwise
    split the swarm), and the signature still covers the new field."""
    from dht.records import SCHEMA

    newer, reader = new_node(), swarm[2]
    key = KEYS.strikes(swarm[0].peer_id)
    expiration = get_dht_time() + 60
    record = {**strike(newer.peer_id, swarm[0].peer_id).dict(), "schema": SCHEMA + 1, "evidence": "mb 12.3"}
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
    same_schema = {**strike(newer.peer_id, other).dict(), "schema": SCHEMA, "evidence": "mb 12.3"}
    value = signed_value(newer.identity, KEYS.strikes(other), newer.identity.owner_tag, same_schema, expiration)
    assert not any(raw_store(newer, KEYS.strikes(other), newer.identity.owner_tag, value, expiration))
    assert newer.peer_id not in reader.store.strikes(other)


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
    verifier, accused = ephemeral_identity().peer_id, ephemeral_identity().peer_id
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

    verifier, accused = ephemeral_identity().peer_id, ephemeral_identity().peer_id
    old = {k: v for k, v in strike(verifier, accused).dict().items() if not k.startswith("audit")}
    read = parse_record({**old, "schema": 1})
    assert read.audits_passed == 0 and read.audit is None and SCHEMA == 2
    with pytest.raises(ValueError):  # a writer of today's schema must write them
        parse_record({**old, "schema": SCHEMA})
