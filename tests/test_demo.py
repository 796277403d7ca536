"""``sentinel-node demo``: its command line and summary, and the local swarm's process handling.

The demo's whole swarm runs in tests/test_pipeline_swarm.py (through the same :class:`~sentinel_node.demo.Demo`);
here the command is run with the swarm replaced by a canned result, and the local swarm with one real node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel_node import demo as demo_module
from sentinel_node.cli import main
from sentinel_node.demo import DemoResult, DemoSettings, DemoSummary, render_summary
from sentinel_node.supervisor import LocalSwarm, follow_json_lines

SUMMARY = {
    "steps": 40,
    "first_loss": 5.55,
    "last_loss": 3.01,
    "first_val_loss": 5.56,
    "last_val_loss": 2.85,
    "loss_fell": True,
    "attacker": {"name": "stage1-1", "peer_id": "QmAttacker"},
    "excluded": ["stage1-1"],
    "attacker_excluded_by_every_peer": True,
    "honest_excluded": [],
    "honest_peers_with_strikes": {},
    "verifier_checks": 512,
    "microbatches": {
        "sent": 160,
        "succeeded": 155,
        "dropped": 5,
        "failed": 0,
        "retried": 0,
        "in_flight": 0,
        "consistent": True,
    },
    "tokens_per_s": 1500.0,
    "wall_s": 150.0,
}


@pytest.fixture
def canned(monkeypatch) -> list[DemoSettings]:
    seen: list[DemoSettings] = []

    def fake_run_demo(settings: DemoSettings, echo) -> DemoResult:
        seen.append(settings)
        echo("   0   5.550            1500     0       0  -")
        return DemoResult(DemoSummary.model_validate(SUMMARY), [])

    monkeypatch.setattr(demo_module, "run_demo", fake_run_demo)
    return seen


def test_demo_json_prints_one_object_and_nothing_else(canned):
    result = CliRunner().invoke(main, ["demo", "--json", "--steps", "12", "--attack-start", "3"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == SUMMARY
    assert canned[0].steps == 12 and canned[0].attack_start == 3 and canned[0].attack == "random"


def test_demo_live_view_and_summary_table(canned):
    result = CliRunner().invoke(main, ["demo", "--attack", "none"])
    assert result.exit_code == 0, result.output
    assert canned[0].attack is None
    assert result.stdout.splitlines()[0].startswith("   0   5.550")
    assert "validation loss 5.560 -> 2.850 (falling)" in result.stdout
    assert "attacker stage1-1: excluded in every peer's view" in result.stdout
    assert "honest peers excluded: none; honest peers with strikes: none" in result.stdout


def test_summary_says_what_went_wrong():
    bad = {**SUMMARY, "loss_fell": False, "attacker_excluded_by_every_peer": False, "honest_excluded": ["stage0-0"]}
    text = render_summary(DemoSummary.model_validate(bad))
    assert "NOT falling" in text and "stage1-1: NOT excluded" in text and "honest peers excluded: stage0-0" in text


class Finished:
    alive = False


def test_follow_yields_whole_json_lines_only(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2')  # the last line is still being written
    assert list(follow_json_lines(path, Finished())) == [{"step": 0}, {"step": 1}]


@pytest.mark.slow
def test_local_swarm_stops_every_process_it_started(tmp_path: Path):
    with LocalSwarm(tmp_path, demo_module.DEMO_CONFIG_PATH) as swarm:
        node = swarm.start("bootstrap", "bootstrap")
        swarm.wait_ready([node], timeout=60)
        assert node.peer_id and node.maddrs[0].endswith(node.peer_id)
        swarm.stop(grace=15)
        assert swarm.leftovers() == {}
        assert node.process.returncode == 0  # SIGTERM was enough: it shut its DHT down itself
