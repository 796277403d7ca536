"""The pipeline roles' decisions, without a network: accounting, who may call, candidates, attacks, strikes."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from click.testing import CliRunner
from hivemind.utils import get_dht_time

from dht import DHTUnavailable, StageAnnouncement, StrikeRecord, TrainerAnnouncement, VerifierAnnouncement
from peers import Exclusion, LivenessBlacklist, SwarmView, order_candidates
from sentinel_node.attacks import AttackError
from sentinel_node.cli import main
from sentinel_node.config import ModelConfig, PipelineConfig, load_config
from sentinel_node.demo import DEMO_CONFIG_PATH
from sentinel_node.pipeline import StageWorker
from sentinel_node.roles.compute import ComputeLane
from sentinel_node.roles.replica_state import STATE_DOWNLOAD_ROUNDS, Behind, ReplicaState, when_behind
from sentinel_node.roles.stage import AttackOptions
from sentinel_node.roles.trainer import Accounting, AccountingError, _dropped_sender
from sentinel_node.roles.verifier import StrikePublisher
from sentinel_node.roles.views import Gatekeeper, ViewKeeper, live_trainer, live_verifier, shows_others, stage_of
from sentinel_node.transport import Hop, HopBanned, HopRefused
from sentinel_node.verification import Verdict, VerdictKind


def peer(name: str) -> str:
    return "Qm" + (name * 44)[:44]


TRAINER, STAGE0, STAGE1, VERIFIER, OUTSIDER, CHEAT = (peer(c) for c in "TSsVuC")


def fields(peer_id: str, state: str = "online") -> dict:
    return dict(
        peer_id=peer_id,
        maddrs=[],
        state=state,
        relayed=False,
        throughput=1.0,
        config_hash="x",
        version="test",
        time=1.0,
    )


def strike(accused: str) -> StrikeRecord:
    return StrikeRecord(
        verifier=VERIFIER,
        accused=accused,
        boundary=0,
        direction="activation",
        strikes=3,
        checks=9,
        flags=3,
        metrics={},
        banned=True,
        config_hash="x",
        version="test",
        time=1.0,
    )


def view() -> SwarmView:
    return SwarmView(
        n_stages=2,
        stages={
            0: {
                STAGE0: StageAnnouncement(stage=0, **fields(STAGE0)),
                CHEAT: StageAnnouncement(stage=0, **fields(CHEAT)),
            },
            1: {STAGE1: StageAnnouncement(stage=1, **fields(STAGE1, "offline"))},
        },
        verifiers={VERIFIER: VerifierAnnouncement(boundaries=[0], **fields(VERIFIER))},
        trainers={TRAINER: TrainerAnnouncement(global_step=0, **fields(TRAINER))},
        excluded={CHEAT: Exclusion(CHEAT, (strike(CHEAT),))},
    )


def test_roles_are_read_from_the_view():
    swarm = view()
    assert live_trainer(swarm, TRAINER) and not live_trainer(swarm, STAGE0)
    assert live_verifier(swarm, VERIFIER, 0) and not live_verifier(swarm, VERIFIER, 1)
    assert stage_of(swarm, STAGE0) == 0
    assert stage_of(swarm, STAGE1) is None  # offline
    assert stage_of(swarm, CHEAT) is None  # excluded


class FixedViews:
    """A ViewKeeper that never changes and counts how often it is asked to refresh."""

    def __init__(self, swarm: SwarmView) -> None:
        self.view, self.refreshes = swarm, 0

    async def refresh(self, force: bool = False) -> SwarmView:
        self.refreshes += 1
        return self.view


class FlakyWatcher:
    """A SwarmWatcher whose first reads fail, as on a node that just started on a loaded machine (the watcher then
    keeps its previous view: the empty one)."""

    def __init__(self, fails: int, swarm: SwarmView) -> None:
        self.fails, self.swarm, self.reads = fails, swarm, 0
        self.view = SwarmView(n_stages=swarm.n_stages)

    def refresh(self, also_ask_about=(), rotation: int = 1) -> SwarmView:
        self.reads += 1
        if self.reads <= self.fails:
            raise DHTUnavailable("the DHT gave no answer")
        self.view = self.swarm
        return self.swarm


def flaky_keeper(fails: int, swarm: SwarmView) -> ViewKeeper:
    keeper = ViewKeeper(store=None, config=load_config(DEMO_CONFIG_PATH))
    keeper.watcher = FlakyWatcher(fails, swarm)
    return keeper


def test_a_read_view_is_never_the_empty_one_a_failed_read_leaves():
    """The churn soak's defect: a SIGKILLed replica, restarted while its sibling served, decided from the empty view
    of its failed first reads that it had no live sibling and that the swarm was at step -1, served its step-0
    checkpoint as step 48 and was banned. refresh() hands that view back; read() waits for one the DHT answered."""
    swarm = view()

    async def first_views() -> tuple[SwarmView, SwarmView | None]:
        keeper = flaky_keeper(2, swarm)
        refreshed = await keeper.refresh(force=True)
        return refreshed, await flaky_keeper(2, swarm).read(timeout=10)

    refreshed, read = asyncio.run(first_views())
    assert refreshed.announcements() == [] and refreshed.step_estimate() == -1  # what the replica went by
    assert read is swarm

    async def never(timeout: float) -> tuple[SwarmView | None, int]:
        keeper = flaky_keeper(10**6, swarm)
        return await keeper.read(timeout=timeout), keeper.watcher.reads

    started = time.monotonic()
    found, reads = asyncio.run(never(2.5))
    assert found is None and 2 <= reads <= 4 and time.monotonic() - started < 6  # once a second, then gives up


def test_a_view_showing_only_this_node_is_no_view_of_the_swarm():
    swarm = view()
    assert shows_others(swarm, STAGE0)
    alone = SwarmView(n_stages=2, stages={0: {STAGE0: StageAnnouncement(stage=0, **fields(STAGE0))}})
    assert not shows_others(alone, STAGE0) and not shows_others(SwarmView(n_stages=2), STAGE0)

    async def read_alone() -> SwarmView | None:
        return await flaky_keeper(0, alone).read(timeout=1.5, shows=lambda v: shows_others(v, STAGE0))

    assert asyncio.run(read_alone()) is None


def test_a_replica_behind_the_swarm_serves_only_where_no_newer_state_exists():
    def verdict(last: int, swarm: int, **kw) -> Behind:
        fields = dict(resumed=True, synced=False, others=False, resume_behind=False, checkpoint_every=10) | kw
        return when_behind(last, swarm, **fields)

    assert verdict(50, 50) is verdict(51, 50) is Behind.SERVE
    assert verdict(40, 50, synced=True, others=True) is Behind.SERVE  # a live state, the swarm trained on meanwhile
    # the only replica of its stage, killed and restarted from its last checkpoint (the churn soak: 3 steps behind)
    assert verdict(47, 50) is verdict(41, 50) is Behind.ADOPT_LAST
    # issue 16: a checkpoint older than a kill can explain (the disk lost the newer ones) is refused, told or not
    assert verdict(40, 50) is verdict(6, 950) is Behind.REFUSE
    assert verdict(40, 50, resume_behind=True) is Behind.ADOPT_TOLD
    # while another replica lives, its state is newer: even a step behind is refused
    assert verdict(49, 50, others=True) is Behind.REFUSE
    assert verdict(-1, 50, resumed=False) is Behind.ADOPT_UNCOVERED
    assert verdict(-1, 50, resumed=False, others=True) is Behind.REFUSE


def test_gatekeeper_admits_refuses_and_bans():
    views = FixedViews(view())
    gate = Gatekeeper(views)

    async def admit(caller: str) -> None:
        await gate.require(caller, lambda v: live_verifier(v, caller, 0), "only verifiers of boundary 0")

    asyncio.run(admit(VERIFIER))
    assert views.refreshes == 0  # a known caller costs no DHT read
    with pytest.raises(HopRefused, match=f"only verifiers of boundary 0; the caller {STAGE0} is not one"):
        asyncio.run(admit(STAGE0))
    assert views.refreshes == 1  # an unknown caller gets one fresh look (it may have just joined)
    with pytest.raises(HopBanned, match="is excluded from the swarm"):
        asyncio.run(admit(CHEAT))


def test_candidates_skip_excluded_and_try_suspended_peers_last():
    blacklist = LivenessBlacklist()
    blacklist.register_failure(STAGE0)
    alternates = [CHEAT, OUTSIDER]
    assert order_candidates(STAGE0, alternates, view(), blacklist) == [OUTSIDER, STAGE0]
    assert order_candidates(STAGE0, alternates, view(), blacklist, skip=lambda p: p == OUTSIDER) == [STAGE0]


def test_a_dropped_activation_names_its_sender_for_the_retry():
    """The trainer sends a microbatch whose activation a verifier dropped again around the replica that sent it:
    the forward pass stopped at the last tainted boundary, whose sender is the stage hop before its verifier."""
    v0, v1 = peer("A"), peer("B")
    hops = [Hop(peer_id=STAGE0), Hop(peer_id=v0, boundary=0), Hop(peer_id=STAGE1), Hop(peer_id=v1, boundary=1)]
    hops.append(Hop(peer_id=CHEAT))
    assert _dropped_sender(hops, [1]) == STAGE1
    assert _dropped_sender(hops, [0, 1]) == STAGE1  # boundary 0 replaced its tensor (ema/zero), boundary 1 dropped
    assert _dropped_sender(hops, [0]) == STAGE0
    assert _dropped_sender(hops, []) is None  # no verifier dropped anything: nothing to route around
    assert _dropped_sender(hops, [5]) is None  # a boundary the route does not cross


def test_accounting_settles_each_microbatch_exactly_once():
    accounting = Accounting()
    for name in ("0.0", "0.1", "0.2"):
        accounting.start(name)
    assert not accounting.consistent and accounting.in_flight == 3
    accounting.retried += 2
    accounting.held += 1  # an attempt the loss gate held back: counted apart, the microbatch still settles once
    accounting.settle("0.0", "succeeded")
    accounting.settle("0.1", "dropped")
    accounting.settle("0.2", "failed")
    assert accounting.consistent
    assert accounting.as_dict() == {
        "sent": 3,
        "succeeded": 1,
        "dropped": 1,
        "failed": 1,
        "retried": 2,
        "held": 1,
        "in_flight": 0,
        "consistent": True,
    }
    with pytest.raises(AccountingError):
        accounting.settle("0.0", "succeeded")
    with pytest.raises(AccountingError):
        accounting.start("0.1")


def test_attack_options_build_what_a_stage_can_send():
    config = load_config("configs/demo.yaml")
    middle = AttackOptions(name="scale", target="both", start=5).build(config, 1, seed=0)
    assert sorted(middle) == ["activation", "gradient"] and middle["activation"].start == 5
    assert sorted(AttackOptions(name="random").build(config, 0, seed=0)) == ["activation"]
    assert sorted(AttackOptions(name="random").build(config, 2, seed=0)) == ["gradient"]
    with pytest.raises(AttackError, match="stage 0 sends no gradient"):
        AttackOptions(name="random", target="gradient").build(config, 0, seed=0)
    with pytest.raises(AttackError, match="exactly one of"):
        AttackOptions().build(config, 1, seed=0)
    with pytest.raises(AttackError, match="unknown attack"):
        AttackOptions(name="nonsense").build(config, 1, seed=0)


def test_malformed_tensors_are_told_from_statistical_flags_by_kind_not_by_reason():
    malformed = Verdict(VerdictKind.MALFORMED, None, struck=True, problem="non-finite values")
    assert malformed.malformed and malformed.flagged and malformed.reason == "non-finite values"
    metric = Verdict(VerdictKind.METRIC, None, struck=True, over=("l2", "wasserstein"))
    assert not metric.malformed and metric.flagged and metric.reason == "metric:l2,wasserstein"
    peer = Verdict(VerdictKind.PEER, None, struck=True, over=("l2",))
    assert not peer.malformed and peer.flagged and peer.reason.startswith("peer:l2 ")
    # a malformed tensor of a tainted microbatch is replaced without being judged
    skipped = Verdict(VerdictKind.SKIPPED, None, problem="shape (1, 2) is not (batch, tokens, 8)")
    assert skipped.malformed and not skipped.flagged and skipped.skipped
    assert not Verdict(VerdictKind.ACCEPTED, None).malformed


class SlowStore:
    def __init__(self) -> None:
        self.puts: list[StrikeRecord] = []
        self.gate = threading.Event()

    def put(self, record: StrikeRecord, ttl: float) -> bool:
        self.gate.wait(5)
        self.puts.append(record)
        return True


def test_strike_publisher_writes_the_latest_record_per_peer():
    store = SlowStore()
    publisher = StrikePublisher(store, ttl=60.0)
    first = strike(STAGE0)
    publisher.submit(first)
    time.sleep(0.1)  # the thread is now blocked in the first put
    for strikes in (1, 2, 3):
        publisher.submit(StrikeRecord(**{**first.dict(), "strikes": strikes}))
    store.gate.set()
    publisher.stop()
    assert [r.strikes for r in store.puts] == [3, 3]  # the first write, then only the newest of those queued


class RecordingStore:
    def __init__(self) -> None:
        self.puts: list[tuple[StrikeRecord, float]] = []  # each record written and the expiration it claimed

    def put(self, record: StrikeRecord, ttl: float) -> bool:
        self.puts.append((record, get_dht_time() + ttl))
        return True


def test_strike_publisher_rewrites_its_standing_records_unchanged_until_they_expire():
    """A write made while part of the DHT was out of reach is missing there for good unless it is written again
    (roles/verifier.py, StrikePublisher); written again, it must claim no more than it did: same time, same end."""
    store = RecordingStore()
    publisher = StrikePublisher(store, ttl=60.0, republish_every=0.2)
    # a record written 59.5 s ago has half a second left: it is not written again
    publisher._standing[STAGE1] = strike(STAGE1).replace(time=get_dht_time() - 59.5)
    publisher.submit(strike(STAGE0))
    time.sleep(0.9)
    publisher.stop()
    writes = [record for record, _ in store.puts if record.accused == STAGE0]
    assert len(writes) >= 3 and publisher.published == 1 and publisher.republished == len(writes) - 1
    assert len({record.time for record in writes}) == 1  # every rewrite carries the first write's time
    ends = [end for record, end in store.puts if record.accused == STAGE0]
    assert max(ends) - min(ends) < 0.05 and abs(ends[0] - writes[0].time - 60.0) < 0.05  # and so its expiration
    assert all(record.accused != STAGE1 for record, _ in store.puts) and STAGE1 not in publisher._standing


class SubmittingStore(RecordingStore):
    """Submits a newer verdict on STAGE1 to the publisher while the first rewrite (of STAGE0) is being written."""

    def __init__(self) -> None:
        super().__init__()
        self.publisher: StrikePublisher | None = None
        self.newer = strike(STAGE1).replace(strikes=2)

    def put(self, record: StrikeRecord, ttl: float) -> bool:
        if self.publisher is not None and record.accused == STAGE0 and len(self.puts) == 2:
            self.publisher.submit(self.newer)
        return super().put(record, ttl)


def test_a_verdict_that_comes_during_a_rewrite_is_written_at_once_and_the_older_record_never_again():
    """Rewriting every standing record can take seconds of DHT writes: a newer verdict that comes meanwhile must
    not wait for the whole round, nor be overwritten by the older record the round was about to write again."""
    store = SubmittingStore()
    publisher = StrikePublisher(store, ttl=60.0, republish_every=0.3)
    store.publisher = publisher
    publisher.submit(strike(STAGE0))
    publisher.submit(strike(STAGE1))  # the standing record on STAGE1: three strikes
    time.sleep(0.45)  # the first round: STAGE0 (whose write submits the newer STAGE1), then STAGE1
    publisher.stop()
    on_stage1 = [record.strikes for record, _ in store.puts if record.accused == STAGE1]
    # the first write (3 strikes), then the newer verdict at once, and the older record never again
    assert on_stage1[:2] == [3, 2] and set(on_stage1[1:]) == {2}, on_stage1
    assert publisher._standing[STAGE1].strikes == 2


def test_join_stage_needs_a_stage_of_the_config_and_a_valid_attack():
    result = CliRunner().invoke(main, ["join", "--role", "stage", "--stage", "9"])
    assert result.exit_code == 1 and "--stage 9 is outside 0..3" in result.output
    result = CliRunner().invoke(main, ["join", "--role", "verifier", "--boundaries", "zero"])
    assert result.exit_code == 2 and "integers, e.g. --boundaries 0,1" in result.output


def test_a_verifier_learns_a_stage_afresh_once_every_sender_it_learned_from_has_left():
    """A stage whose last replica died is covered by a replica with fresh weights (roles/stage.py): its tensors are
    honest but unlike the old baseline, which once banned it on its second tensor."""
    import torch

    from sentinel_node.pipeline import BoundaryVerifier

    config = load_config()
    shape = (config.pipeline.microbatch_size, config.pipeline.seq_len, config.model.hidden_size)
    checker = BoundaryVerifier(config.verification, [0], config.model.hidden_size, shape, seed=0)
    old = checker.monitors[(0, "activation")]
    for _ in range(3):
        checker.check(0, "activation", torch.randn(shape), "old-replica", tainted=False)
    assert not checker.restart_if_replaced(0, "activation", {"old-replica", "newcomer"})  # one it knows is live
    assert not checker.restart_if_replaced(0, "activation", set())  # nobody serves the stage yet: nothing to learn
    assert checker.restart_if_replaced(0, "activation", {"newcomer"})
    fresh = checker.monitors[(0, "activation")]
    assert fresh is not old and fresh.warming_up and fresh.ledger is checker.ledger  # strikes and bans are kept
    assert checker.monitors[(0, "gradient")] is not fresh and not checker.restart_if_replaced(0, "gradient", {"x"})


class FlakyStateSource:
    """Stands in for the averager's download (not under test): no usable state for the first ``fails`` asks, then
    ``state``, a real replica's packed state."""

    def __init__(self, state, fails: int) -> None:
        self.state, self.fails, self.asked = state, fails, 0

    def download_state(self, peer: str, timeout: float, max_bytes: int):
        self.asked += 1
        return None if self.asked <= self.fails else self.state


def test_a_replica_behind_the_swarm_keeps_asking_for_the_state_while_a_replica_lives(caplog):
    """The churn soak's restarted stage2-1 got no usable state in its 3 rounds (4 s), then refused its 59-step-old
    checkpoint and exited; now it asks again, with a backoff, while its own state is behind the swarm's."""
    model = ModelConfig(hidden_size=16, intermediate_size=32, n_layers=2, n_heads=2, n_kv_heads=2)
    live = ReplicaState(StageWorker(model, PipelineConfig(n_stages=2), 0), "cafe")
    live.step = 59
    lane = ComputeLane("test-sync")

    async def sibling() -> list[str]:
        return ["sibling"]

    async def behind() -> bool:
        return joining.step < 59

    joining = ReplicaState(StageWorker(model, PipelineConfig(n_stages=2), 0), "cafe")
    joining.resumed_from = "checkpoint"  # a restart from its own old checkpoint
    source = FlakyStateSource(live.current(), fails=STATE_DOWNLOAD_ROUNDS + 1)
    with caplog.at_level(logging.WARNING):
        asyncio.run(joining.sync(sibling, source, lane, behind, patience_s=60.0))
    assert joining.step == 59 and joining.synced_from == "sibling" and source.asked == STATE_DOWNLOAD_ROUNDS + 2
    assert "gave a usable state yet, and this one's (step -1) is behind the swarm's; asking again" in caplog.text

    # a state that will do (not behind), or patience spent: it gives up after its rounds, as before
    for still_needed, patience in ((None, 60.0), (behind, 0.5)):
        stale = ReplicaState(StageWorker(model, PipelineConfig(n_stages=2), 0), "cafe")
        stale.resumed_from = "checkpoint"
        source = FlakyStateSource(live.current(), fails=100)
        asyncio.run(stale.sync(sibling, source, lane, still_needed, patience_s=patience))
        assert stale.step == -1 and stale.synced_from is None and source.asked == STATE_DOWNLOAD_ROUNDS
