"""The verified pipeline over libp2p, as real processes on loopback.

One swarm for the whole module (it takes half a minute to start on two cores): the demo's swarm (bootstrap,
3 stages x 2 replicas of which one replica of stage 1 attacks from step ATTACK_START, 2 trusted verifiers, a
trainer). While it trains, a stage 2 replica is SIGKILLed and later a verifier. The steps before the attack
starts are an honest swarm. After training, the tests call the nodes themselves as a peer of their own: a
"stage" that skips the verifier, an excluded peer, and every kind of malformed tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from click.testing import CliRunner
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse
from hivemind.proto.runtime_pb2 import Tensor as WireTensor
from hivemind.utils import get_dht_time
from prometheus_client.parser import text_string_to_metric_families
from status_page import browser_page, get_json, status_server

from dht import Identity, StageAnnouncement, VerifierAnnouncement, create_identity_file, load_identity_file
from sentinel_node.cli import main
from sentinel_node.demo import Demo, DemoSettings
from sentinel_node.roles.common import record_store, start_dht, stop_dht
from sentinel_node.roles.metrics import METRICS
from sentinel_node.roles.wire import STAGE_FORWARD, VERIFIER_RELAY, PipelineRequest, Shapes, transport_settings
from sentinel_node.transport import (
    Hop,
    HopBanned,
    HopError,
    HopMalformed,
    HopRefused,
    MicrobatchReply,
    Reply,
    call_peer,
)
from sentinel_node.transport.errors import decode_error
from sentinel_node.transport.messages import pack_envelope, unpack_envelope

STEPS = 30
ATTACK_START = 12
KILL_STAGE_AT = 6  # stage2-1, SIGKILL
KILL_VERIFIER_AT = 22  # verifier1, SIGKILL (after both verifiers banned the attacker)
SCRAPE_AT = (3, 16)  # Prometheus scrapes of live nodes while they train (and one more after training)
SCRAPED = ("bootstrap", "stage1-0", "verifier0", "trainer")
CHECK_AT = 2  # `swarm status --check` of the healthy swarm, before anything is killed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Iterator[Demo]:
    settings = DemoSettings(
        steps=STEPS,
        attack="random",
        attack_start=ATTACK_START,
        workdir=tmp_path_factory.mktemp("swarm"),
        eval_every=6,
    )
    with Demo(settings) as running, contextlib.ExitStack() as page:
        running.start()
        running.scrapes = {}
        # the status page follows the whole run, so it has seen the training curve and the ban
        running.page_url = page.enter_context(status_server(running.swarm.initial_peers, "--refresh", "2"))

        def chaos(record: dict) -> None:
            if record["step"] == CHECK_AT:  # every stage has two replicas, every boundary two verifiers
                check = CliRunner().invoke(
                    main,
                    ["swarm", "status", "--check", "--timeout", "60", "--initial-peers", *running.swarm.initial_peers],
                )
                running.healthy_check = (check.exit_code, check.output[-2000:])
            if record["step"] in SCRAPE_AT:
                running.scrapes[record["step"]] = {name: scrape(running.node(name)) for name in SCRAPED}
            if record["step"] == KILL_STAGE_AT:
                running.swarm.kill("stage2-1")
            elif record["step"] == KILL_VERIFIER_AT:
                running.scrapes["verifier1"] = scrape(running.node("verifier1"))  # its last words
                running.swarm.kill("verifier1")

        running.train(on_step=chaos)
        running.scrapes["after"] = {name: scrape(running.node(name)) for name in SCRAPED if name != "trainer"}
        running.result = running.summary()
        yield running


def scrape(node) -> dict[tuple, float]:
    """A node's metrics as {(name, label values in their declared order...): value}, read the way Prometheus
    reads them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, *(sample.labels[label] for label in METRICS[family.name].labels)): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(metrics: dict[tuple, float], name: str) -> float:
    return sum(value for key, value in metrics.items() if key[0] == name)


def test_metrics_of_live_nodes_move_while_they_train(demo):
    early, late, after = (demo.scrapes[key] for key in (*SCRAPE_AT, "after"))
    for name in SCRAPED:
        role = demo.node(name).role
        assert late[name][("sentinel_node_info", role, demo.peer(name))] == 1, late[name]
        assert late[name][("sentinel_dht_peers",)] >= 1
    verifier, trainer, stage = (late[n] for n in ("verifier0", "trainer", "stage1-0"))
    # checks per boundary and direction, counted as they happen
    for boundary in ("0", "1"):
        for direction in ("activation", "gradient"):
            key = ("sentinel_checks_total", boundary, direction)
            assert verifier[key] > early["verifier0"][key] > 0, (key, early["verifier0"], verifier)
    # every microbatch of the steps done so far has settled, and the counts say how (the trainer, a process of its
    # own, may already have settled some of the next step's when the test reads its step record)
    mb, per_step = "sentinel_microbatches_total", demo.config.pipeline.microbatches_per_step
    assert total(trainer, mb) >= per_step * (SCRAPE_AT[1] + 1) > total(early["trainer"], mb)
    assert trainer[(mb, "succeeded")] > early["trainer"][(mb, "succeeded")]
    served = ("sentinel_microbatches_total", "served")
    assert stage[served] > early["stage1-0"][served]
    assert trainer[("sentinel_global_step",)] >= SCRAPE_AT[1] > early["trainer"][("sentinel_global_step",)]
    assert stage[("sentinel_global_step",)] >= SCRAPE_AT[1] - 1
    assert trainer[("sentinel_tokens_per_second",)] > 0 and 0 < trainer[("sentinel_loss", "train")] < 10
    # 6 replicas, less the attacker once excluded and stage2-1 once its announcement expired
    assert 4 <= trainer[("sentinel_swarm_peers", "stage")] <= 6 and trainer[("sentinel_swarm_peers", "verifier")] == 2
    # the attack (from step ATTACK_START) is flagged, struck and ends in a ban and a swarm-wide exclusion; by
    # whichever verifier the attacker's tensors happened to cross (one ban excludes it, and then the other sees none)
    verifiers = (after["verifier0"], demo.scrapes["verifier1"])
    assert total(early["verifier0"], "sentinel_flags_total") == 0
    assert sum(total(v, "sentinel_flags_total") for v in verifiers) > 0
    assert sum(total(v, "sentinel_strikes_issued_total") for v in verifiers) >= 1
    assert max(v[("sentinel_peers_banned",)] for v in verifiers) >= 1
    assert after["verifier0"][("sentinel_peers_excluded",)] == 1
    assert after["stage1-0"][("sentinel_peers_excluded",)] == 1


def test_honest_phase_trains_and_nobody_is_struck(demo):
    before_attack = [s for s in demo.steps if s["step"] < ATTACK_START]
    assert len(before_attack) == ATTACK_START
    assert all(s["strikes"] == 0 and s["flags"] == 0 and not s["excluded"] for s in before_attack)
    val_curve = dict(demo.trainer_summary["val_curve"])
    assert val_curve[6] < val_curve[0] - 0.3, val_curve  # measured before the attack starts
    assert all(s["loss"] is not None for s in before_attack)


def test_attacker_is_excluded_swarm_wide_and_training_goes_on(demo):
    summary = demo.result
    assert summary.attacker_excluded_by_every_peer, demo.views()
    assert summary.excluded == [demo.attacker_name()]
    assert summary.honest_excluded == []
    assert summary.honest_peers_with_strikes == {}
    assert summary.steps == STEPS
    assert summary.loss_fell and summary.last_val_loss < summary.first_val_loss - 0.5
    after_exclusion = [s for s in demo.steps if demo.attacker in s["excluded"]]
    # warm-up ends about when the attack starts; each verifier then needs 3 flags: within a few steps
    assert after_exclusion and after_exclusion[0]["step"] < ATTACK_START + 10
    assert all(s["loss"] is not None and s["microbatches"] >= 3 for s in after_exclusion[1:])


def test_killed_stage_and_verifier_lose_no_microbatch(demo):
    accounting = demo.trainer_summary["accounting"]
    assert accounting["consistent"], accounting
    assert accounting["sent"] == STEPS * demo.config.pipeline.microbatches_per_step
    assert accounting["failed"] == 0
    assert accounting["succeeded"] + accounting["dropped"] == accounting["sent"]
    assert not demo.node("stage2-1").alive and not demo.node("verifier1").alive
    after_kills = [s for s in demo.steps if s["step"] > KILL_VERIFIER_AT]
    assert after_kills and all(s["microbatches"] >= 3 for s in after_kills)


class Peer:
    """A peer of the test's own, in the swarm's DHT, that announces what the test says and calls handlers."""

    def __init__(self, demo: Demo, identity: Identity) -> None:
        self.demo, self.identity, self.config = demo, identity, demo.config
        self.dht = start_dht(self.config, identity, initial_peers=demo.swarm.initial_peers, check_identity=False)
        self.store = record_store(self.dht, self.config, identity)
        self.loop = asyncio.new_event_loop()
        self.p2p = self.loop.run_until_complete(self.dht.replicate_p2p())
        self.shapes = Shapes.of(self.config)
        self.settings = transport_settings(self.config)

    def close(self) -> None:
        self.loop.run_until_complete(self.p2p.shutdown())
        self.loop.close()
        stop_dht(self.dht)

    def announce(self, kind: type, **fields) -> None:
        record = kind(
            peer_id=self.identity.peer_id,
            maddrs=[str(m) for m in self.dht.get_visible_maddrs()],
            state="online",
            relayed=False,
            throughput=0.0,
            config_hash=self.config.swarm_hash(),
            version="test",
            time=get_dht_time(),
            **fields,
        )
        self.store.put(record, ttl=60.0)

    def meta(self, route: list[Hop]) -> PipelineRequest:
        return PipelineRequest(
            deadline=time.time() + 15,
            microbatch_id=f"test.{time.monotonic_ns()}",
            step=STEPS,
            kind="forward",
            route=route,
        )

    def call(self, peer: str, handler: str, tensors: list[torch.Tensor], route: list[Hop]) -> Reply | HopError:
        coroutine = call_peer(self.p2p, peer, handler, tensors, self.meta(route), settings=self.settings)
        try:
            return self.loop.run_until_complete(coroutine)
        except HopError as e:
            return e

    def raw(self, peer: str, handler: str, request: ExpertRequest) -> HopError:
        from hivemind.p2p import PeerID

        response = self.loop.run_until_complete(
            self.p2p.call_protobuf_handler(PeerID.from_base58(peer), handler, request, ExpertResponse)
        )
        error = unpack_envelope(response.metadata).error
        assert error is not None
        return decode_error(error, peer)

    def tokens(self) -> torch.Tensor:
        return torch.randint(0, self.shapes.vocab, (self.shapes.batch, self.shapes.seq_len))

    def activation(self) -> torch.Tensor:
        return torch.randn(self.shapes.activation)


def until_not_refused(attempt, timeout: float = 10.0):
    """The result of ``attempt()`` once the node's view holds our new announcement (a refusal until then)."""
    deadline = time.monotonic() + timeout
    while True:
        result = attempt()
        if not isinstance(result, HopRefused) or isinstance(result, HopBanned) or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stranger(demo, tmp_path_factory) -> Iterator[Peer]:
    peer = Peer(demo, create_identity_file(tmp_path_factory.mktemp("stranger") / "id.key"))
    yield peer
    peer.close()


def test_stage_refuses_activations_straight_from_a_stage(demo, stranger):
    stranger.announce(StageAnnouncement, stage=0)
    time.sleep(2 * demo.config.swarm.announce_period)  # every node has read the announcement by now
    route = [Hop(peer_id=demo.peer("verifier0"), boundary=1), Hop(peer_id=demo.peer("stage2-0"))]
    error = stranger.call(demo.peer("stage1-0"), STAGE_FORWARD, [stranger.activation(), stranger.tokens()], route)
    assert isinstance(error, HopRefused) and not isinstance(error, HopBanned), error
    assert "accepts activations only from a verifier announced for boundary 0|1" in error.detail
    assert demo.node("stage1-0").alive


def test_malformed_tensors_get_a_clear_error_a_strike_and_the_verifier_keeps_serving(demo, stranger):
    verifier = demo.peer("verifier0")
    route = [Hop(peer_id=demo.peer("stage1-0"))]
    nan = stranger.activation()
    nan[0, 0, 0] = float("nan")
    cases = [
        ([nan, stranger.tokens()], "non-finite values"),
        ([torch.randn(8, 64, 32), stranger.tokens()], "shape (8, 64, 32)"),
        ([stranger.activation().half(), stranger.tokens()], "dtype torch.float16"),
    ]
    stranger.announce(StageAnnouncement, stage=0)
    # bytes that never become a tensor: refused by the transport, before the verification core (no strike)
    declared_huge = WireTensor(buffer=b"", size=[8, 64, 999999], dtype="float32")
    request = ExpertRequest(metadata=pack_envelope(stranger.meta(route), 1), tensors=[declared_huge])
    error = until_not_refused(lambda: stranger.raw(verifier, VERIFIER_RELAY, request))
    assert isinstance(error, HopMalformed) and "over the 64 MiB limit" in error.detail, error
    error = stranger.raw(verifier, VERIFIER_RELAY, ExpertRequest(metadata=b"\x93garbage"))
    assert isinstance(error, HopMalformed) and "metadata is not msgpack" in error.detail, error
    wrong_bytes = WireTensor(buffer=b"\x00garbage", size=[8, 64, 64], dtype="float32")
    error = stranger.raw(
        verifier, VERIFIER_RELAY, ExpertRequest(metadata=pack_envelope(stranger.meta(route), 1), tensors=[wrong_bytes])
    )
    assert isinstance(error, HopMalformed) and "does not match shape" in error.detail, error

    for tensors, message in cases:
        error = until_not_refused(lambda t=tensors: stranger.call(verifier, VERIFIER_RELAY, t, route))
        assert isinstance(error, HopMalformed), error
        assert message in error.detail and "a strike was recorded" in error.detail, error.detail

    # three malformed activations were three strikes: this verifier banned the sender and says so
    error = stranger.call(verifier, VERIFIER_RELAY, [stranger.activation(), stranger.tokens()], route)
    assert isinstance(error, HopBanned), error
    records = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (verifier in records and records[verifier].banned):
        records = stranger.store.strikes(stranger.identity.peer_id)
        time.sleep(0.5)
    assert records[verifier].strikes == 3 and records[verifier].banned

    # still serving, and counting what it refused
    assert demo.node("verifier0").alive
    deadline = time.monotonic() + 5
    while demo.node("verifier0").status().malformed < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert demo.node("verifier0").status().malformed == 3


def test_stage_checks_tensors_from_a_verifier_and_keeps_serving(demo, tmp_path_factory):
    peer = Peer(demo, create_identity_file(tmp_path_factory.mktemp("fake-verifier") / "id.key"))
    try:
        peer.announce(VerifierAnnouncement, boundaries=[0])
        stage = demo.peer("stage1-0")
        route = [Hop(peer_id=demo.peer("verifier0"), boundary=1), Hop(peer_id=demo.peer("stage2-0"))]
        nan = peer.activation()
        nan[1, 2, 3] = float("inf")
        error = until_not_refused(lambda: peer.call(stage, STAGE_FORWARD, [nan, peer.tokens()], route))
        assert isinstance(error, HopMalformed) and "NaN or infinite" in error.detail, error
        error = peer.call(stage, STAGE_FORWARD, [torch.randn(8, 64, 32), peer.tokens()], route)
        assert isinstance(error, HopMalformed) and "expected (8, 64, 64)" in error.detail, error
        bad_tokens = peer.tokens() + 1000
        error = peer.call(stage, STAGE_FORWARD, [peer.activation(), bad_tokens], route)
        assert isinstance(error, HopMalformed) and "token ids must lie in [0, 256)" in error.detail, error

        # and it still serves a well-formed microbatch end to end, through verifier0 and stage 2 and back; noise
        # in gives an output unlike any the verifier learned, so it may well be flagged and dropped there
        reply = peer.call(stage, STAGE_FORWARD, [peer.activation() * 0.5, peer.tokens()], route)
        assert isinstance(reply, Reply), reply
        assert isinstance(reply.metadata, MicrobatchReply)
        loss, taint = reply.metadata.loss, reply.metadata.taint
        assert (loss is not None and math.isfinite(loss)) or taint == [1], reply.metadata
    finally:
        peer.close()


def test_an_excluded_peer_is_refused_everywhere(demo):
    attacker = demo.attacker_name()
    demo.swarm.kill(attacker)  # its peer id is about to be used by the test
    peer = Peer(demo, load_identity_file(demo.swarm.identity(attacker)))
    try:
        peer.announce(StageAnnouncement, stage=0)
        route = [Hop(peer_id=demo.peer("stage1-0"))]
        error = peer.call(demo.peer("verifier0"), VERIFIER_RELAY, [peer.activation(), peer.tokens()], route)
        assert isinstance(error, HopBanned), error
        route = [Hop(peer_id=demo.peer("verifier0"), boundary=1), Hop(peer_id=demo.peer("stage2-0"))]
        error = peer.call(demo.peer("stage1-0"), STAGE_FORWARD, [peer.activation(), peer.tokens()], route)
        assert isinstance(error, HopBanned) and "is excluded from the swarm" in error.detail, error
    finally:
        peer.close()


def test_status_check_of_a_healthy_swarm_exits_zero(demo):
    code, output = demo.healthy_check
    assert code == 0, output
    assert "health: healthy" in output


def test_status_page_shows_every_stage_and_the_banned_attacker(demo, tmp_path):
    url, attacker = demo.page_url, demo.attacker
    deadline = time.monotonic() + 60
    while attacker not in get_json(url + "api/bans")["bans"] and time.monotonic() < deadline:
        time.sleep(1)
    bans = get_json(url + "api/bans")["bans"]
    assert attacker in bans and "strikes on" in bans[attacker]["reason"], bans
    history = get_json(url + "api/history")["points"]
    assert len([p for p in history if p["loss"] is not None]) >= 5, history
    metrics = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
    assert "sentinel_swarm_excluded_peers 1.0" in metrics and 'sentinel_stage_live_replicas{stage="0"}' in metrics
    with browser_page(tmp_path / "profile") as page:
        page.goto(url)
        page.wait_for_selector("body[data-loaded=yes]", timeout=60_000)
        for k in range(demo.config.pipeline.n_stages):
            assert page.locator(f'[data-stage="{k}"]').count() == 1, k
        for b in range(demo.config.pipeline.n_stages - 1):
            assert page.locator(f'[data-boundary="{b}"] li[data-peer]').count() >= 1, b
        banned = page.locator(f'#bans tr[data-peer="{attacker}"]')
        assert banned.count() == 1 and "strikes on" in banned.inner_text()
        assert page.locator(f'#map li.excluded[data-peer="{attacker}"]').count() == 1
        assert page.locator("#loss-chart polyline").count() >= 1  # the training curve was drawn
        shot = tmp_path / "status-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("SENTINEL_SCREENSHOT"):  # how docs/status-page.png was made
            shutil.copy(shot, os.environ["SENTINEL_SCREENSHOT"])


def test_every_process_is_gone_after_stop(demo):
    started = {name: node.process.pid for name, node in demo.swarm.nodes.items()}
    assert len(started) == 10  # bootstrap, 6 stages, 2 verifiers, trainer
    demo.swarm.stop()
    assert demo.swarm.leftovers() == {}
    assert all(node.process.returncode is not None for node in demo.swarm.nodes.values())
    clean = [name for name, node in demo.swarm.nodes.items() if node.process.returncode == 0]
    assert {"bootstrap", "stage0-0", "verifier0"} <= set(clean), {
        n: x.process.returncode for n, x in demo.swarm.nodes.items()
    }
