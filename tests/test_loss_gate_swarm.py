"""The loss gate over libp2p, as real processes on loopback.

One swarm for the module: a bootstrap, three stages (one replica of stage 0, three of stage 1, one of stage 2), a
verifier on each boundary and a trainer. From step ATTACK_START one stage 1 replica swaps whole sequences of every
activation it sends (every statistic of the tensor stays honest; only which sequence carries which content is wrong).
The verifiers' statistics never leave their warm-up, the base audit draw is 0.1%, the peer test and the gradient
passage are off and the loss evidence makes no suspects: whatever stops the attacker here is the gate of the last
boundary's verifier, which has the last stage hold back what ends far above the loss its text predicts, and the audit
of a held microbatch's forward half.
"""

from __future__ import annotations

import json
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

STEPS = 72  # the ban comes 1 to 12 steps after the attack starts, later under load (audits find no idle auditor)
# After the steep first descent (loss 5.5 to 3.2 by step 18), where a loss fitted against the training's progress
# scatters most (docs/decisions.md, "The loss gate on the demo's model")
ATTACK_START = 30
# On this 64-wide model a shuffle adds two to three deviations of excess loss, not the six the default gate waits
# for (sized on the full profile): at 6, 41 and 64 shuffled microbatches of two runs went through unheld
LOSS_GATE = 4.0
SHUFFLER = "stage1-0"
HONEST_STAGES = ("stage0-0", "stage1-1", "stage1-2", "stage2-0")
VERIFIERS = ("verifier0", "verifier1")


@dataclass
class GatedSwarm:
    config: Config
    local: LocalSwarm
    records: list[dict]
    views: dict[str, list[str]]
    dht_view: SwarmView
    diagnosis: str  # JSON, for failed assertions

    def peer(self, name: str) -> str:
        return self.local.nodes[name].peer_id

    def status(self, name: str):
        return self.local.nodes[name].status()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, forkserver) -> Iterator[GatedSwarm]:
    workdir = Path(tmp_path_factory.mktemp("gate-swarm"))
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
            "peer_limit": 0.0,
            "passage_floor": 0.0,
            "loss_gate": LOSS_GATE,
        },
        swarm={"trusted_verifiers": verifiers, "ban_quorum": 1, "open_verifiers": False, "open_trainers": True},
    )
    (workdir / "swarm.yaml").write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
    with local:
        local.wait_ready([local.start("bootstrap", "bootstrap")], 120)
        nodes = [local.start("stage0-0", "stage", "--stage", "0"), local.start("stage2-0", "stage", "--stage", "2")]
        for r in range(3):
            args = ["--stage", "1"]
            if f"stage1-{r}" == SHUFFLER:
                args += ["--attack", "sequence_shuffle", "--attack-target", "activation"]
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
        shuffler = local.nodes[SHUFFLER].peer_id
        names = [n for n in (*HONEST_STAGES, *VERIFIERS) if local.nodes[n].alive]
        deadline = time.monotonic() + 120  # every node's view catches up with the published ban (a loaded machine)
        while True:
            views = {name: getattr(local.nodes[name].status(), "excluded", None) or [] for name in names}
            if all(shuffler in view for view in views.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        views["trainer"] = local.nodes["trainer"].status().excluded
        with SwarmReader(local.initial_peers, config, timeout=30) as reader:
            dht_view = reader.refresh()
        yield GatedSwarm(config, local, records, views, dht_view, diagnosis(local))


def diagnosis(local: LocalSwarm) -> str:
    """What a failed assertion should show: how the gate held and the audits went, and whom the attacker served."""
    fields = ("held", "audits", "attacked", "served", "recomputations", "averaging_rounds")
    found = {}
    for name in (*VERIFIERS, SHUFFLER, *HONEST_STAGES):
        status = local.nodes[name].status() if local.nodes[name].alive else None
        found[name] = {f: getattr(status, f) for f in fields if getattr(status, f, None) is not None}
    return json.dumps(found, default=str)


def test_a_shuffler_the_statistics_miss_is_held_audited_and_excluded_everywhere(swarm):
    shuffler = swarm.peer(SHUFFLER)
    assert all(shuffler in view for view in swarm.views.values()), f"{swarm.views} {swarm.diagnosis}"
    records = [r for r in swarm.dht_view.ledger.about(shuffler) if r.banned]
    assert records, "no verifier published a ban on the shuffler"
    evidence = next(r.audit for r in records if r.audit is not None)
    honest = {swarm.peer(n) for n in HONEST_STAGES}
    assert evidence.step >= ATTACK_START and evidence.stage == 1
    assert evidence.finding == "mismatch" and evidence.direction == "activation"
    assert set(evidence.digests) == {"input", "output"}  # a held microbatch: its forward half, no gradient
    assert len(evidence.auditors) == 2 and set(evidence.auditors) <= honest
    last_boundary = swarm.status("verifier1")
    assert last_boundary.held >= 1  # the gate held back the shuffler's microbatches
    assert swarm.status("stage2-0").held >= 1  # the last stage ran no backward pass for them


def test_held_microbatches_are_sent_again_and_no_token_is_lost_to_the_gate(swarm):
    summary = next(r for r in swarm.records if r.get("event") == "summary")
    accounting = summary["accounting"]
    assert accounting["consistent"] and accounting["held"] >= 1, f"{accounting} {swarm.diagnosis}"
    assert accounting["failed"] == 0
    # a held microbatch goes again around every replica of its route: the honest ones of stage 1 carry it
    assert accounting["dropped"] <= 1, accounting
    steps = [r for r in swarm.records if r.get("event") == "step"]
    per_step = swarm.config.pipeline.microbatches_per_step
    assert len(steps) == STEPS and all(r["microbatches"] == per_step for r in steps[-5:])


def test_nobody_honest_is_struck_or_excluded(swarm):
    honest = {swarm.peer(n) for n in HONEST_STAGES}
    for name, view in swarm.views.items():
        assert not honest & set(view), (name, view)
    struck = {r.accused for r in swarm.dht_view.ledger if r.strikes or r.banned} & honest
    assert not struck
