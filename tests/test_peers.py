"""The peer society: exclusion policy, ledger, liveness blacklist and routing, then exclusion through a real DHT."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
from hivemind.utils import get_dht_time

from dht import (
    Identity,
    RecordStore,
    StageAnnouncement,
    StrikeRecord,
    SwarmKeys,
    VerifierAnnouncement,
    create_identity_file,
    ephemeral_identity,
    swarm_validators,
)
from peers import (
    BackoffParams,
    ExclusionParams,
    ExclusionPolicy,
    LivenessBlacklist,
    NoRouteError,
    StrikeLedger,
    SwarmView,
    SwarmWatcher,
    choose_route,
    pick_replica,
    verifier_peer_id,
)

PREFIX, CONFIG_HASH = "test-peers", "feed"
KEYS = SwarmKeys(PREFIX)


@pytest.fixture(scope="module")
def ids() -> list[Identity]:
    return [ephemeral_identity() for _ in range(6)]


def strike(verifier: str, accused: str, banned: bool = True, **changes) -> StrikeRecord:
    fields = dict(
        verifier=verifier,
        accused=accused,
        boundary=0,
        direction="gradient",
        strikes=3 if banned else 1,
        checks=50,
        flags=3,
        metrics={"spectral": 0.9},
        banned=banned,
        config_hash=CONFIG_HASH,
        version="test",
        time=get_dht_time(),
    )
    return StrikeRecord(**{**fields, **changes})


def stage(peer: str, k: int, throughput: float = 1.0, **changes) -> StageAnnouncement:
    fields = dict(
        peer_id=peer,
        maddrs=[],
        state="online",
        relayed=False,
        throughput=throughput,
        stage=k,
        config_hash=CONFIG_HASH,
        version="test",
        time=0.0,
    )
    return StageAnnouncement(**{**fields, **changes})


def verifier(peer: str, boundaries: list[int], throughput: float = 1.0, **changes) -> VerifierAnnouncement:
    fields = dict(
        peer_id=peer,
        maddrs=[],
        state="online",
        relayed=False,
        throughput=throughput,
        boundaries=boundaries,
        config_hash=CONFIG_HASH,
        version="test",
        time=0.0,
    )
    return VerifierAnnouncement(**{**fields, **changes})


# --- exclusion policy ---


def test_params_reject_a_quorum_of_one_with_an_open_verifier_set():
    with pytest.raises(ValueError, match="at least 2 with an open verifier set"):
        ExclusionParams(trusted_verifiers=(), ban_quorum=1)
    with pytest.raises(ValueError, match="exceeds the 1 distinct trusted"):
        ExclusionParams(trusted_verifiers=("QmPcCHg2Dfc8Ncd45EFH3Y9nRWjEoy7SN4m3LcJmznH1LB",), ban_quorum=2)
    with pytest.raises(ValueError, match="neither a peer id"):
        ExclusionParams(trusted_verifiers=("not a key!",), ban_quorum=1)
    with pytest.raises(ValueError, match="integer of at least 1"):
        ExclusionParams(ban_quorum=0)


def test_trusted_verifiers_may_be_named_by_public_key_owner_tag_or_peer_id(ids):
    params = ExclusionParams(
        trusted_verifiers=(ids[0].public_key.decode(), ids[1].owner_tag.decode(), ids[2].peer_id), ban_quorum=3
    )
    assert params.trusted_peer_ids == {ids[0].peer_id, ids[1].peer_id, ids[2].peer_id}
    assert verifier_peer_id(ids[0].peer_id) == ids[0].peer_id


def test_exclusion_happens_exactly_at_the_quorum_of_trusted_verifiers(ids):
    trusted, untrusted, accused = ids[:3], ids[3:5], ids[5].peer_id
    policy = ExclusionPolicy(ExclusionParams(tuple(i.peer_id for i in trusted), ban_quorum=2))
    records = [strike(u.peer_id, accused) for u in untrusted]  # untrusted bans count for nothing
    records.append(strike(trusted[2].peer_id, accused, banned=False))  # strikes short of a ban are no vote
    records.append(strike(trusted[0].peer_id, accused))
    assert policy.excluded(StrikeLedger.from_records(records)) == {}
    records.append(strike(trusted[1].peer_id, accused))
    excluded = policy.excluded(StrikeLedger.from_records(records))
    assert set(excluded) == {accused}
    assert set(excluded[accused].voters) == {trusted[0].peer_id, trusted[1].peer_id}


def test_an_open_verifier_set_counts_any_verifier_but_no_self_ban(ids):
    accused = ids[5].peer_id
    policy = ExclusionPolicy(ExclusionParams((), ban_quorum=2))
    one = [strike(ids[0].peer_id, accused), strike(accused, accused)]
    assert policy.excluded(StrikeLedger.from_records(one)) == {}
    assert accused in policy.excluded(StrikeLedger.from_records([*one, strike(ids[1].peer_id, accused)]))


def test_the_ledger_keeps_each_verifiers_newest_record(ids):
    old = strike(ids[0].peer_id, ids[1].peer_id, banned=True, time=1.0)
    new = strike(ids[0].peer_id, ids[1].peer_id, banned=False, time=2.0)
    ledger = StrikeLedger.from_records([new, old])
    assert ledger.about(ids[1].peer_id) == [new] and len(ledger) == 1 and ledger.accused() == [ids[1].peer_id]
    with pytest.raises(ValueError, match="holds a record by"):
        StrikeLedger({ids[2].peer_id: {ids[0].peer_id: new}})


# --- liveness blacklist ---


def test_liveness_blacklist_backs_off_exponentially_and_forgets_on_success():
    now = [0.0]
    blacklist = LivenessBlacklist(BackoffParams(base_time=1.0, backoff_rate=2.0, max_time=5.0), clock=lambda: now[0])
    assert blacklist.register_failure("p") == 1.0 and "p" in blacklist
    assert blacklist.register_failure("p") == 1.0  # already suspended: no extra penalty
    now[0] = 1.01
    assert "p" not in blacklist
    assert blacklist.register_failure("p") == 2.0
    now[0] = 3.02
    assert blacklist.register_failure("p") == 4.0
    now[0] = 7.03
    assert blacklist.register_failure("p") == 5.0  # capped
    blacklist.register_success("p")
    assert "p" not in blacklist and blacklist.register_failure("p") == 1.0
    with pytest.raises(ValueError, match="backoff_rate"):
        BackoffParams(backoff_rate=0.5)


# --- routing ---


def view_of(ids, excluded_peer: str | None = None) -> SwarmView:
    stages = {
        0: {ids[0].peer_id: stage(ids[0].peer_id, 0, 1.0), ids[1].peer_id: stage(ids[1].peer_id, 0, 3.0)},
        1: {
            ids[2].peer_id: stage(ids[2].peer_id, 1, 1.0),
            ids[3].peer_id: stage(ids[3].peer_id, 1, 100.0, relayed=True),
            ids[4].peer_id: stage(ids[4].peer_id, 1, 100.0, state="joining"),
        },
    }
    verifiers = {ids[5].peer_id: verifier(ids[5].peer_id, [0])}
    ledger = StrikeLedger()
    excluded = {}
    if excluded_peer:
        records = [strike(v.peer_id, excluded_peer) for v in ids[2:4]]
        ledger = StrikeLedger.from_records(records)
        excluded = ExclusionPolicy(ExclusionParams((), 2)).excluded(ledger)
    return SwarmView(2, stages, verifiers, ledger=ledger, excluded=excluded)


def test_routing_weights_by_throughput_and_prefers_direct_peers(ids):
    view = view_of(ids)
    rng = random.Random(0)
    routes = [choose_route(view, rng) for _ in range(4000)]
    first = Counter(route.stages[0].peer_id for route in routes)
    assert 0.70 < first[ids[1].peer_id] / len(routes) < 0.80  # throughput 3 against 1
    # the relayed replica is 100x faster but a direct one exists; the joining one is not live
    assert {route.stages[1].peer_id for route in routes} == {ids[2].peer_id}
    assert {route.verifiers[0].peer_id for route in routes} == {ids[5].peer_id}
    assert routes[0].peers == (routes[0].stages[0].peer_id, ids[5].peer_id, ids[2].peer_id)


def test_routing_never_picks_an_excluded_or_blacklisted_peer(ids):
    view = view_of(ids, excluded_peer=ids[1].peer_id)
    blacklist = LivenessBlacklist()
    blacklist.register_failure(ids[2].peer_id)
    rng = random.Random(1)
    for _ in range(200):
        route = choose_route(view, rng, blacklist)
        assert route.stages[0].peer_id == ids[0].peer_id
        assert route.stages[1].peer_id == ids[3].peer_id  # only the relayed one is left
    with pytest.raises(NoRouteError, match="stage 0: 2 announced .*1 excluded"):
        pick_replica(view, 0, rng, avoid={ids[0].peer_id})
    health = view.health()
    assert health.ok
    blind = SwarmView(3, view.stages, {})
    assert blind.health().stages_without_replica == (2,)
    assert blind.health().boundaries_without_verifier == (0, 1)
    assert "no live replica for stage 2" in blind.health().summary()
    assert "no verifier on boundary 0|1, 1|2" in blind.health().summary()


# --- exclusion through a real DHT ---


def start_node(directory: Path, initial_peers=()) -> tuple[hivemind.DHT, RecordStore]:
    identity = create_identity_file(directory / f"id-{time.monotonic_ns()}.key")
    dht = hivemind.DHT(
        initial_peers=list(initial_peers),
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(identity.path),
        check_if_identity_free=False,
        record_validators=swarm_validators(PREFIX, identity),
    )
    return dht, RecordStore(dht, KEYS, CONFIG_HASH, identity, timeout=5.0)


@pytest.fixture(scope="module")
def five_nodes(tmp_path_factory) -> Iterator[list[RecordStore]]:
    """Node 0 is an accused stage replica, 1-3 are verifiers (1 and 2 trusted), 4 only reads."""
    directory = tmp_path_factory.mktemp("peers")
    first = start_node(directory)
    nodes = [first] + [start_node(directory, first[0].get_visible_maddrs()) for _ in range(4)]
    yield [store for _, store in nodes]
    for dht, _ in nodes:
        dht.shutdown()


def policy_for(stores: list[RecordStore]) -> ExclusionPolicy:
    return ExclusionPolicy(ExclusionParams((stores[1].identity.peer_id, stores[2].identity.peer_id), ban_quorum=2))


def test_exclusion_through_the_dht_follows_trusted_bans_and_lifts_when_they_expire(five_nodes):
    accused, v1, v2, untrusted, reader = five_nodes
    accused_id = accused.identity.peer_id
    accused.put(stage(accused_id, 0, time=get_dht_time()), ttl=30)
    watcher = SwarmWatcher(reader, n_stages=1, policy=policy_for(five_nodes))
    assert [a.peer_id for a in watcher.refresh().live_replicas(0)] == [accused_id]

    untrusted.put(strike(untrusted.identity.peer_id, accused_id), ttl=30)
    v1.put(strike(v1.identity.peer_id, accused_id), ttl=30)
    view = watcher.refresh()
    assert len(view.ledger.about(accused_id)) == 2 and not view.is_excluded(accused_id)

    v2.put(strike(v2.identity.peer_id, accused_id), ttl=1.5)
    view = watcher.refresh()
    assert view.is_excluded(accused_id) and view.live_replicas(0) == []
    assert set(view.excluded[accused_id].voters) == {v1.identity.peer_id, v2.identity.peer_id}
    assert view.health().stages_without_replica == (0,)

    time.sleep(1.6)  # v2's ban expires: one trusted vote left, below the quorum
    view = watcher.refresh()
    assert not view.is_excluded(accused_id) and len(view.ledger.about(accused_id)) == 2


def time_exclusion(watchers: list[SwarmWatcher], v1: RecordStore, v2: RecordStore) -> tuple[float, float]:
    """Seconds from writing the quorum-reaching ban until every watcher sees it, and how long the write took."""
    accused = ephemeral_identity().peer_id
    v1.put(strike(v1.identity.peer_id, accused), ttl=60)
    seen_at: dict[int, float] = {}
    go = threading.Event()

    def watch(i: int) -> None:
        go.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if watchers[i].refresh(also_ask_about=[accused]).is_excluded(accused):
                seen_at[i] = time.monotonic()
                return

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(len(watchers))]
    for thread in threads:
        thread.start()
    written_at = time.monotonic()
    go.set()
    v2.put(strike(v2.identity.peer_id, accused), ttl=60)
    put_took = time.monotonic() - written_at
    for thread in threads:
        thread.join()
    assert len(seen_at) == len(watchers), "some node never saw the exclusion"
    return max(seen_at.values()) - written_at, put_took


@pytest.mark.slow
def test_measure_time_until_every_node_of_five_sees_an_exclusion(five_nodes, capsys):
    """Writes the quorum-reaching ban and times until all five nodes' watchers, refreshing back to back, agree."""
    policy = policy_for(five_nodes)
    watchers = [SwarmWatcher(store, n_stages=1, policy=policy) for store in five_nodes]
    trials = [time_exclusion(watchers, five_nodes[1], five_nodes[2]) for _ in range(7)]
    seen, puts = [t for t, _ in trials], [p for _, p in trials]
    started = time.monotonic()
    watchers[4].refresh()
    one_refresh = time.monotonic() - started
    with capsys.disabled():
        print(
            f"\nban written -> excluded on all 5 nodes: median {statistics.median(seen) * 1000:.0f} ms, "
            f"max {max(seen) * 1000:.0f} ms over {len(seen)} trials (watchers refreshing back to back; "
            f"the put itself took {statistics.median(puts) * 1000:.0f} ms, one idle refresh "
            f"{one_refresh * 1000:.0f} ms)"
        )
    assert max(seen) < 5.0
