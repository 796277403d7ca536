"""Stage choice and rebalancing (peers.placement) and the health verdicts (peers.health), as pure functions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dht import StageAnnouncement, StrikeRecord, ephemeral_identity
from peers import ExclusionParams, ExclusionPolicy, StrikeLedger, SwarmView, Verdict
from peers.health import Health
from peers.placement import BALANCE_QUALITY, StageLoad, choose_stage, plan_move, should_yield, stage_loads

IDS = [ephemeral_identity().peer_id for _ in range(6)]


def replica(peer: str, stage: int, throughput: float, state: str = "online") -> StageAnnouncement:
    return StageAnnouncement(
        peer_id=peer,
        maddrs=["/ip4/127.0.0.1/tcp/1"],
        state=state,
        relayed=False,
        throughput=throughput,
        stage=stage,
        config_hash="h",
        version="test",
        time=1.0,
    )


def view_of(*replicas: StageAnnouncement, n_stages: int = 3, excluded=()) -> SwarmView:
    stages: dict[int, dict[str, StageAnnouncement]] = {}
    for a in replicas:
        stages.setdefault(a.stage, {})[a.peer_id] = a
    ledger = StrikeLedger.from_records(
        StrikeRecord(
            verifier=IDS[5],
            accused=peer,
            boundary=0,
            direction="activation",
            strikes=3,
            checks=10,
            flags=3,
            metrics={},
            banned=True,
            config_hash="h",
            version="test",
            time=1.0,
        )
        for peer in excluded
    )
    policy = ExclusionPolicy(ExclusionParams((IDS[5],), 1))
    return SwarmView(n_stages, stages=stages, ledger=ledger, excluded=policy.excluded(ledger))


def loads(*totals_and_counts: tuple[float, int]) -> list[StageLoad]:
    return [StageLoad(k, t, n, n) for k, (t, n) in enumerate(totals_and_counts)]


def test_loads_count_online_and_joining_replicas_that_are_not_excluded():
    view = view_of(
        replica(IDS[0], 0, 100.0),
        replica(IDS[1], 0, 50.0, state="joining"),
        replica(IDS[2], 1, 70.0, state="offline"),
        replica(IDS[3], 2, 90.0),
        replica(IDS[4], 2, 10.0),
        excluded=[IDS[4]],
    )
    found = stage_loads(view)
    assert [(s.throughput, s.replicas, s.online) for s in found] == [(150.0, 2, 1), (0.0, 0, 0), (90.0, 1, 1)]
    assert stage_loads(view, leave_out={IDS[0]})[0].throughput == 50.0


def test_a_joiner_takes_the_weakest_stage_then_the_emptiest():
    rng = random.Random(0)
    assert choose_stage(loads((300.0, 2), (100.0, 1), (250.0, 1)), rng).stage == 1
    choice = choose_stage(loads((300.0, 2), (0.0, 0), (250.0, 1)), rng)
    assert choice.stage == 1 and "nobody serves it yet" in choice.reason
    # equal totals: the stage with fewer replicas
    assert choose_stage(loads((200.0, 2), (200.0, 1), (500.0, 1)), rng).stage == 1
    assert "the least compute" in choose_stage(loads((300.0, 2), (100.0, 1)), rng).reason


def test_joiners_reading_the_same_view_spread_over_stages_within_the_jitter():
    tied = loads((0.0, 0), (0.0, 0), (0.0, 0))
    picks = Counter(choose_stage(tied, random.Random(seed)).stage for seed in range(300))
    assert set(picks) == {0, 1, 2} and min(picks.values()) > 60, picks
    close = loads((100.0, 1), (105.0, 1), (200.0, 1))  # within 10%: either; far above: never
    picks = Counter(choose_stage(close, random.Random(seed)).stage for seed in range(200))
    assert set(picks) == {0, 1}, picks


def test_a_replica_moves_to_cover_a_stage_nobody_serves():
    move = plan_move(loads((200.0, 2), (100.0, 1), (0.0, 0)), source=0, own=100.0)
    assert move is not None and move.target == 2 and move.before == 0 and move.after == 100.0
    assert "covers a stage nobody serves" in move.reason


def test_a_replica_never_leaves_its_stage_without_another_online_replica():
    assert plan_move(loads((100.0, 1), (300.0, 2), (0.0, 0)), source=0, own=100.0) is None
    # a joining replica is not yet another live one
    joining = [StageLoad(0, 200.0, 2, 1), StageLoad(1, 100.0, 1, 1), StageLoad(2, 0.0, 0, 0)]
    assert plan_move(joining, source=0, own=100.0) is None


def test_a_replica_moves_only_for_a_gain_beyond_the_balance_quality():
    # slowest 100 -> 140 (x1.4 > 1/0.75): move
    assert plan_move(loads((240.0, 2), (100.0, 1), (300.0, 1)), source=0, own=100.0).target == 1
    # slowest 100 -> 120 (x1.2 < 1/0.75): stay
    assert plan_move(loads((220.0, 2), (100.0, 1), (300.0, 1)), source=0, own=20.0) is None
    assert plan_move(loads((220.0, 2), (100.0, 1), (300.0, 1)), source=0, own=20.0, balance_quality=1.0).target == 1
    assert plan_move(loads((240.0, 2), (100.0, 1), (300.0, 1)), 0, 100.0, balance_quality=0.0) is None
    assert BALANCE_QUALITY == 0.75
    with pytest.raises(ValueError, match="balance_quality"):
        plan_move(loads((1.0, 2), (1.0, 1)), 0, 1.0, balance_quality=1.5)


def test_a_move_is_weighed_by_the_stages_costs():
    # stage 1 has twice the layers: 100 tok/s here are 50 there, slowest 40 -> 90 is still worth it; at 4x, not
    base = loads((200.0, 2), (40.0, 1), (300.0, 1))
    assert plan_move(base, 0, 100.0, costs=[1.0, 2.0, 1.0]).after == 90.0
    assert plan_move(base, 0, 100.0, costs=[1.0, 8.0, 1.0]) is None


def test_health_verdicts_per_stage_boundary_and_swarm():
    health = Health.of([2, 1, 0], [2, 2])
    assert [health.stage(k) for k in range(3)] == [Verdict.HEALTHY, Verdict.DEGRADED, Verdict.BROKEN]
    assert health.verdict is Verdict.BROKEN and not health.ok
    assert health.summary() == "broken: no live replica for stage 2; one replica left on stage 1"
    degraded = Health.of([2, 2], [1])
    assert degraded.verdict is Verdict.DEGRADED and degraded.ok
    assert "one verifier left on boundary 0|1" in degraded.summary()
    assert Health.of([2, 3], [2]).verdict is Verdict.HEALTHY
    assert view_of(replica(IDS[0], 0, 1.0), n_stages=2).health().stages_without_replica == (1,)


def test_of_two_replicas_that_would_make_the_same_move_only_one_moves():
    from peers.placement import plan_rebalance

    a, b = sorted(IDS[:2])
    view = view_of(replica(a, 0, 100.0), replica(b, 0, 100.0), replica(IDS[2], 1, 100.0))  # stage 2: nobody
    assert plan_rebalance(view, a).target == 2
    assert plan_rebalance(view, b) is None  # a makes the move; b looks again later
    assert plan_rebalance(view, IDS[2]) is None  # its stage has no other replica
    assert plan_rebalance(view, IDS[3]) is None  # not in the view


def test_of_two_joiners_that_chose_the_same_stage_while_one_is_empty_the_larger_id_chooses_again():
    a, b, c, d = sorted(ephemeral_identity().peer_id for _ in range(4))
    both = view_of(replica(a, 0, 0.0, "joining"), replica(b, 0, 0.0, "joining"), replica(c, 2, 10.0))
    assert should_yield(both, b, 0) and not should_yield(both, a, 0)
    # nothing to gain when every other stage has a replica already
    full = view_of(
        replica(a, 0, 0.0, "joining"), replica(b, 0, 0.0, "joining"), replica(c, 1, 1.0), replica(d, 2, 1.0)
    )
    assert not should_yield(full, b, 0)
