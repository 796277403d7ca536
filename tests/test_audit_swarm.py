"""Recomputation audits over libp2p, as real processes on loopback.

One swarm for the module: a bootstrap, one stage 0 replica, four stage 1 replicas (the last stage) of which one
inverts the gradients it sends from step ATTACK_START (what no statistic sees) and one trains honestly but lies
whenever it audits another replica, two trusted verifiers and a trainer. The verifiers' statistics never leave
their warm-up, so whatever is banned here, audits banned.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dht import create_identity_file
from peers import SwarmView
from sentinel_node.cli.swarm_tables import render_strikes
from sentinel_node.config import Config, load_config
from sentinel_node.demo import DEMO_CONFIG_PATH
from sentinel_node.roles.status import StageStatus, VerifierStatus
from sentinel_node.supervisor import LocalSwarm, follow_json_lines
from sentinel_node.swarm_reader import SwarmReader

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]  # nine processes starting on two cores

STEPS = 24
ATTACK_START = 6
INVERTER, LIAR = "stage1-0", "stage1-1"
HONEST_STAGES = ("stage0-0", "stage1-2", "stage1-3")
VERIFIERS = ("verifier0", "verifier1")


@dataclass
class AuditedSwarm:
    config: Config
    local: LocalSwarm
    views: dict[str, list[str]] = field(default_factory=dict)
    dht_view: SwarmView | None = None
    metrics: dict[str, dict[tuple, float]] = field(default_factory=dict)

    def peer(self, name: str) -> str:
        return self.local.nodes[name].peer_id

    def status(self, name: str):
        return self.local.nodes[name].status()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, forkserver) -> Iterator[AuditedSwarm]:
    workdir = Path(tmp_path_factory.mktemp("audit-swarm"))
    (workdir / "identities").mkdir(mode=0o700)
    local = LocalSwarm(workdir, workdir / "swarm.yaml", forkserver=forkserver)
    verifiers = [create_identity_file(local.identity(name)).peer_id for name in VERIFIERS]
    config = load_config(DEMO_CONFIG_PATH).with_overrides(
        pipeline={"n_stages": 2},
        verification={"warmup": 10**6, "warmup_fenced_after": 0, "audit_rate": 0.5},
        swarm={"trusted_verifiers": verifiers, "ban_quorum": 1, "open_verifiers": False, "open_trainers": True},
    )
    (workdir / "swarm.yaml").write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
    with local:
        local.wait_ready([local.start("bootstrap", "bootstrap")], 120)
        nodes = [local.start("stage0-0", "stage", "--stage", "0")]
        attack = {INVERTER: ["scale", "gradient", ATTACK_START], LIAR: ["lie", "both", 0]}
        for r in range(4):
            name = f"stage1-{r}"
            args = ["--stage", "1"]
            if name in attack:
                kind, target, start = attack[name]
                args += ["--attack", kind, "--attack-target", target, "--attack-start", str(start)]
            nodes.append(local.start(name, "stage", *args))
        nodes += [local.start(name, "verifier", metrics=True) for name in VERIFIERS]
        local.wait_ready(nodes, 180)
        out = workdir / "trainer-metrics.jsonl"
        trainer = local.start(
            "trainer", "trainer", "--steps", str(STEPS), "--eval-every", "0", "--metrics-out", str(out)
        )
        local.wait_ready([trainer], 120)
        records = list(follow_json_lines(out, trainer))
        assert trainer.process.wait(timeout=60) == 0, trainer.log_tail()
        assert any(r.get("event") == "summary" for r in records)
        running = AuditedSwarm(config, local)
        inverter = running.peer(INVERTER)
        names = [n for n in (*HONEST_STAGES, LIAR, *VERIFIERS) if local.nodes[n].alive]
        deadline = time.monotonic() + 180  # every node's view catches up with the published bans (a loaded machine)
        while True:
            running.views = {name: getattr(running.status(name), "excluded", None) or [] for name in names}
            if all(inverter in view for view in running.views.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        running.views["trainer"] = running.status("trainer").excluded
        with SwarmReader(local.initial_peers, config, timeout=30) as reader:
            running.dht_view = reader.refresh()
        running.metrics = {name: scrape(local.nodes[name].metrics_port) for name in VERIFIERS}
        yield running


def scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, *sample.labels.values()): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_gradient_inverter_is_convicted_by_audits_and_excluded_in_every_view(swarm):
    inverter = swarm.peer(INVERTER)
    assert all(inverter in view for view in swarm.views.values()), swarm.views
    records = [r for r in swarm.dht_view.ledger.about(inverter) if r.banned]
    assert records, "no verifier published a ban on the inverter"
    evidence = next(r.audit for r in records if r.audit is not None)
    honest = {swarm.peer(n) for n in HONEST_STAGES}
    assert evidence.finding == "mismatch" and evidence.direction == "gradient" and evidence.step >= ATTACK_START
    assert len(evidence.auditors) == 2 and set(evidence.auditors) <= honest  # two honest replicas agreed
    assert evidence.error > 1 and evidence.confirmed_error > 1  # an inverted gradient is 2 away from the truth
    assert set(evidence.digests) == {"input", "grad_input"} and evidence.stage == 1
    assert all(r.flags == r.audits_failed for r in records)  # the statistics never judged: audits did
    text = render_strikes(swarm.dht_view, swarm.config)
    assert "FAILED AUDITS" in text and evidence.microbatch in text
    convicted = sum(m.get(("sentinel_audits_total", "convicted"), 0) for m in swarm.metrics.values())
    passed = sum(m.get(("sentinel_audits_total", "passed"), 0) for m in swarm.metrics.values())
    assert convicted >= 1 and passed >= 1


def test_a_lying_auditor_gets_no_honest_replica_banned(swarm):
    honest = {swarm.peer(n) for n in HONEST_STAGES}
    for name, view in swarm.views.items():
        assert not honest & set(view), (name, view)
    for peer in honest:
        assert not any(r.banned for r in swarm.dht_view.ledger.about(peer))
    statuses = [swarm.status(name) for name in VERIFIERS]
    assert all(isinstance(s, VerifierStatus) for s in statuses)
    # the liar did accuse honest replicas, and other replicas bore their claims out against it
    assert sum(s.audits.get("contradicted", 0) for s in statuses) >= 1
    liar = swarm.peer(LIAR)
    assert any(liar in s.ledger and s.ledger[liar].strikes + int(s.ledger[liar].banned) for s in statuses)
    served = [swarm.status(n).recomputations.get("served", 0) for n in ("stage1-2", "stage1-3")]
    assert all(isinstance(swarm.status(n), StageStatus) for n in ("stage1-2", "stage1-3")) and sum(served) >= 2
