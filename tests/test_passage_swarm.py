"""The gradient passage over libp2p, as real processes on loopback.

One swarm for the module: a bootstrap, three stages (one replica of stage 0, three of stage 1, one of stage 2), a
verifier on each boundary and a trainer. From step ATTACK_START one stage 1 replica sends every input gradient shifted
by one token: a tensor every statistic finds honest (the verifiers' statistics never leave their warm-up here anyway,
and the peer test is off), whose damage the loss never shows (the loss is taken before the backward pass; the loss gate
is off) and which the audits, at a base draw of 0.1%, would take hundreds of steps to draw. What sees it is the
verifier of boundary 0, which asks the verifier of boundary 1 for rows of the gradient it passed back to that replica
and finds the replica's input gradient unrelated to them (the residual stream carries one into the other in an honest
stage): it drops the gradient and has that very crossing audited by the two other stage 1 replicas, whose agreeing
recomputations convict it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from dht import create_identity_file
from peers import SwarmView
from sentinel_node.config import Config, load_config
from sentinel_node.demo import DEMO_CONFIG_PATH
from sentinel_node.supervisor import LocalSwarm, follow_json_lines
from sentinel_node.swarm_reader import SwarmReader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 20
ATTACK_START = 8  # 32 microbatches in: the passage fence judges from its 16th score
SHIFTER = "stage1-1"
HONEST_STAGES = ("stage0-0", "stage1-0", "stage1-2", "stage2-0")
VERIFIERS = ("verifier0", "verifier1")


@dataclass
class PassageSwarm:
    config: Config
    local: LocalSwarm
    records: list[dict]
    views: dict[str, list[str]]
    dht_view: SwarmView
    passages: dict[str, int]  # the verifier of boundary 0's passage rows: judged, missing; audits of flagged ones

    def peer(self, name: str) -> str:
        return self.local.nodes[name].peer_id


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, forkserver) -> Iterator[PassageSwarm]:
    workdir = Path(tmp_path_factory.mktemp("passage-swarm"))
    (workdir / "identities").mkdir(mode=0o700)
    local = LocalSwarm(workdir, workdir / "swarm.yaml", forkserver=forkserver)
    verifiers = [create_identity_file(local.identity(name)).peer_id for name in VERIFIERS]
    config = load_config(DEMO_CONFIG_PATH).with_overrides(
        verification={
            "warmup": 10**6,
            "warmup_fenced_after": 0,
            "audit_rate": 0.001,
            "suspect_evidence": 0.0,
            "loss_evidence": 0.0,
            "loss_gate": 0.0,
            "peer_limit": 0.0,
        },
        swarm={"trusted_verifiers": verifiers, "ban_quorum": 1, "open_verifiers": False, "open_trainers": True},
    )
    (workdir / "swarm.yaml").write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
    with local:
        local.wait_ready([local.start("bootstrap", "bootstrap")], 120)
        nodes = [local.start("stage0-0", "stage", "--stage", "0"), local.start("stage2-0", "stage", "--stage", "2")]
        for r in range(3):
            args = ["--stage", "1"]
            if f"stage1-{r}" == SHIFTER:
                args += ["--attack", "token_shift", "--attack-target", "gradient"]
                args += ["--attack-start", str(ATTACK_START)]
            nodes.append(local.start(f"stage1-{r}", "stage", *args))
        nodes += [local.start(name, "verifier", "--boundaries", str(b)) for b, name in enumerate(VERIFIERS)]
        local.wait_ready(nodes, 180)
        out = workdir / "trainer-metrics.jsonl"
        trainer = local.start(
            "trainer", "trainer", "--steps", str(STEPS), "--eval-every", "0", "--metrics-out", str(out)
        )
        local.wait_ready([trainer], 120)
        records = list(follow_json_lines(out, trainer))
        assert trainer.process.wait(timeout=60) == 0, trainer.log_tail()
        shifter = local.nodes[SHIFTER].peer_id
        names = [n for n in (*HONEST_STAGES, *VERIFIERS) if local.nodes[n].alive]
        deadline = time.monotonic() + 120  # every node's view catches up with the published ban (a loaded machine)
        while True:
            views = {name: getattr(local.nodes[name].status(), "excluded", None) or [] for name in names}
            if all(shifter in view for view in views.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        views["trainer"] = local.nodes["trainer"].status().excluded
        with SwarmReader(local.initial_peers, config, timeout=30) as reader:
            dht_view = reader.refresh()
        audits = local.nodes["verifier0"].status().audits
        passages = {
            "judged": audits.get("passage_rows", 0),
            "missing": audits.get("passage_missing", 0),
            "drawn": audits.get("passage_drawn", 0),
        }
        yield PassageSwarm(config, local, records, views, dht_view, passages)


def test_a_gradient_shifter_fails_its_passage_is_audited_on_it_and_excluded_everywhere(swarm):
    shifter = swarm.peer(SHIFTER)
    assert all(shifter in view for view in swarm.views.values()), swarm.views
    banned = [r for r in swarm.dht_view.ledger.about(shifter) if r.banned]
    assert banned, "no verifier published a ban on the shifter"
    record = banned[0]
    assert record.verifier == swarm.peer("verifier0") and record.boundary == 0 and record.direction == "gradient"
    # a passage flag is a suspicion, not a strike: the audit of a flagged crossing convicted it
    assert record.audit is not None and record.audit.direction == "gradient", record.audit
    assert swarm.passages["drawn"] >= 1, swarm.passages
    # the last check before the ban was its passage: 1 - cos over the fence, and over the floor
    assert record.metrics["passage"] > max(0.8, record.thresholds["passage"]), (record.metrics, record.thresholds)


def test_the_rows_come_from_the_next_verifier_for_nearly_every_gradient(swarm):
    # every training microbatch's gradient at boundary 0 is a middle stage's: each was judged on rows the verifier
    # of boundary 1 sent, but those of the shifter after its ban (refused) and a few lost to a stage's failover
    judged, missing = swarm.passages["judged"], swarm.passages["missing"]
    assert judged >= 2 * STEPS and missing <= judged // 10, swarm.passages


def test_nobody_honest_is_banned_or_excluded_and_training_goes_on(swarm):
    honest = {swarm.peer(n) for n in HONEST_STAGES}
    for name, view in swarm.views.items():
        assert not honest & set(view), (name, view)
    # no strike at all: the shifter's gradients never reached stage 0 (each was dropped), and a passage flag on an
    # honest replica (one computing on parameters an attacker disturbed) would be a suspicion, not a strike
    assert not [r for r in swarm.dht_view.ledger if r.accused in honest and (r.strikes or r.banned)]
    steps = [r for r in swarm.records if r.get("event") == "step"]
    per_step = swarm.config.pipeline.microbatches_per_step
    assert len(steps) == STEPS and all(r["microbatches"] == per_step for r in steps[-3:])
