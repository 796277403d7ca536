"""Joining with one address, as real processes on loopback: automatic stage choice, rebalancing, and the swarm's
config read from the DHT.

One swarm for the module, on a 3-stage config with a 3 s rebalance period: a bootstrap started with the config
file, and every other node started with nothing but ``--initial-peers`` (they run the config the bootstrap
publishes). Three stage nodes without ``--stage`` cover the three stages, a fourth joins the weakest, a verifier
serves both boundaries and a trainer trains; while it trains, the only replica of a stage is SIGKILLed and a
replica of the doubled stage moves there, and the trainer's accounting says nothing was lost or counted twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml
from click.testing import CliRunner

from peers.placement import JOIN_JITTER
from sentinel_node.cli import main
from sentinel_node.config import load_config
from sentinel_node.supervisor import CLI, LOOPBACK, LocalSwarm, follow_json_lines

# a loaded 2-core machine takes minutes to start seven nodes (the suite's default is 300 s a test)
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

STEPS = 14
KILL_AT = 4
CONFIG = {
    "model": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 172, "n_layers": 3, "n_heads": 4},
    "pipeline": {"n_stages": 3, "microbatches_per_step": 4, "lr": 0.003, "warmup_steps": 5, "average_every": 5},
    "verification": {"warmup": 24},
    "swarm": {
        "prefix": "placement-test",
        "announce_period": 1.0,
        "announce_ttl": 6.0,
        "request_timeout": 3.0,
        "rebalance_period": 3.0,
        "open_trainers": True,  # placement is under test here, not admission (test_pipeline_swarm.py)
        "open_verifiers": True,
    },
    "data": {"max_bytes": 2**22},
}


def swarm_cli(*args: str):
    return CliRunner().invoke(main, ["swarm", *args, "--timeout", "60"])  # generous: a loaded machine is slow


def stages_of(swarm: LocalSwarm, names) -> dict[str, int | None]:
    found = {}
    for name in names:
        status = swarm.nodes[name].status()
        found[name] = None if status is None or not swarm.nodes[name].alive else status.stage
    return found


def wait_for(predicate, timeout: float, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(poll)


def loads(peer: str) -> dict[int, dict]:
    """Each stage's live replicas and total compute, as `swarm status --json` reports them."""
    result = swarm_cli("status", "--json", "--initial-peers", peer)
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.stdout)
    return {s["stage"]: s for s in report["stage_totals"]}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, forkserver) -> Iterator[LocalSwarm]:
    workdir = tmp_path_factory.mktemp("placement")
    config_path = workdir / "swarm.yaml"
    config_path.write_text(yaml.safe_dump(CONFIG))
    with LocalSwarm(workdir, config_path, forkserver=forkserver) as running:
        bootstrap = running.start("bootstrap", "bootstrap")
        running.wait_ready([bootstrap], 150)
        running.checks = {"empty": swarm_cli("status", "--check", "--initial-peers", bootstrap.maddrs[0]).exit_code}
        placed = [running.start(f"stage{i}", "stage", config=False) for i in range(3)]  # all at once
        running.wait_ready(placed, 300)
        first = ["stage0", "stage1", "stage2"]
        wait_for(lambda: sorted(filter(None.__ne__, stages_of(running, first).values())) == [0, 1, 2], timeout=90)
        running.first_three = stages_of(running, first)
        running.before_fourth = loads(bootstrap.maddrs[0])
        fourth = running.start("stage3", "stage", config=False)
        verifier = running.start("verifier", "verifier", config=False)
        running.wait_ready([fourth, verifier], 300)
        wait_for(lambda: stages_of(running, ["stage3"])["stage3"] is not None, timeout=60)
        running.fourth = stages_of(running, ["stage3"])["stage3"]
        yield running


def test_three_nodes_without_a_stage_cover_every_stage(swarm):
    assert sorted(swarm.first_three.values()) == [0, 1, 2], swarm.first_three
    assert swarm.checks["empty"] == 2  # broken: nobody serves anything yet


def test_a_fourth_joins_the_weakest_stage(swarm):
    totals = {k: s["throughput"] for k, s in swarm.before_fourth.items()}
    assert all(s["live_replicas"] == 1 for s in swarm.before_fourth.values()), swarm.before_fourth
    assert swarm.fourth is not None
    # the least total compute, or one within the jitter that spreads simultaneous joiners
    assert totals[swarm.fourth] <= min(totals.values()) * (1 + JOIN_JITTER) + 1e-6, (swarm.fourth, totals)
    log = swarm.nodes["stage3"].log_tail(20000)
    assert f"serving stage {swarm.fourth}: the least compute of all stages" in log


def test_nodes_with_only_an_address_run_the_swarms_config(swarm):
    expected = load_config(swarm.config_path).swarm_hash()
    for name in ("stage0", "verifier"):
        log = swarm.nodes[name].log_tail(50000)
        assert f"running the config the swarm publishes: placement-test ({expected})" in log, log[-2000:]


def test_a_node_with_another_config_is_refused_with_both_hashes(swarm, tmp_path):
    other = {**CONFIG, "swarm": {**CONFIG["swarm"], "seed": 7}}
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(other))
    result = subprocess.run(
        [*CLI, "join", "--role", "verifier", "--config", str(path), "--host-maddrs", LOOPBACK]
        + ["--initial-peers", swarm.initial_peers[0]],
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    ours, theirs = load_config(path).swarm_hash(), load_config(swarm.config_path).swarm_hash()
    assert result.returncode == 1, result.stderr[-3000:]
    assert ours in result.stderr and theirs in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_a_stage_whose_only_replica_dies_is_covered_by_a_move_and_nothing_is_lost(swarm):
    names = ["stage0", "stage1", "stage2", "stage3"]
    placement = stages_of(swarm, names)
    alone = [name for name, k in placement.items() if list(placement.values()).count(k) == 1]
    assert alone, placement
    victim, uncovered = alone[0], placement[alone[0]]
    metrics = swarm.workdir / "trainer-metrics.jsonl"
    trainer = swarm.start(
        "trainer",
        "trainer",
        "--steps",
        str(STEPS),
        "--eval-every",
        "0",
        "--metrics-out",
        str(metrics),
        "--no-progress",
        "--microbatch-timeout",
        "20",
        config=False,
    )
    swarm.wait_ready([trainer], 300)
    killed_at = None
    summary = None
    for record in follow_json_lines(metrics, trainer):
        if record.get("event") == "step" and record["step"] == KILL_AT and killed_at is None:
            swarm.kill(victim)
            killed_at = time.monotonic()
        if record.get("event") == "summary":
            summary = record
    assert trainer.process.wait(timeout=60) == 0, trainer.log_tail()
    assert summary is not None and killed_at is not None
    after = stages_of(swarm, [n for n in names if n != victim])
    assert sorted(after.values()) == [0, 1, 2], (placement, after)  # the uncovered stage is served again
    movers = [n for n in after if after[n] != placement[n]]
    assert movers and after[movers[0]] == uncovered, (placement, after)
    assert f"moving from stage {placement[movers[0]]} to stage {uncovered}" in swarm.nodes[movers[0]].log_tail(50000)
    accounting = summary["accounting"]
    assert accounting["consistent"] and accounting["failed"] == 0, accounting
    assert accounting["sent"] == STEPS * CONFIG["pipeline"]["microbatches_per_step"], accounting
    assert accounting["succeeded"] + accounting["dropped"] == accounting["sent"]
    # one verifier: the swarm is degraded, not broken
    assert swarm_cli("status", "--check", "--initial-peers", swarm.initial_peers[0]).exit_code == 1


def test_ctrl_c_stops_every_role_cleanly_and_leaves_nothing_behind(swarm):
    running = {name: node for name, node in swarm.nodes.items() if node.alive}
    assert {"bootstrap", "verifier"} <= set(running) and any(n.startswith("stage") for n in running), running
    logged = {name: len(node.log_path.read_bytes()) for name, node in running.items()}
    for node in running.values():
        os.killpg(node.process.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole group, p2pd included
    for name, node in running.items():
        assert node.process.wait(timeout=30) == 0, (name, node.log_tail())
        tail = node.log_path.read_bytes()[logged[name] :].decode(errors="replace")
        assert "SIGINT: shutting down" in tail and "Traceback" not in tail, (name, tail[-3000:])
    swarm.stop()
    assert swarm.leftovers() == {}
