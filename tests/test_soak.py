"""The churn soak (``bench soak``, issue 14 item 5): its fault schedule, its accounting across trainer restarts and
its verdicts, as pure functions; and, marked long, a short real soak of the demo swarm."""

from __future__ import annotations

import os
import time

import pytest

from sentinel_node.bench.soak import (
    FD_SLACK_TREE,
    Fault,
    FaultKind,
    FaultRecord,
    Microbatches,
    Roster,
    SoakSettings,
    TrainerLife,
    evaluate,
    life_of,
    merge_accounting,
    pick,
    plan_faults,
    repeated_steps,
    split_lives,
)
from sentinel_node.roles.status import AccountingStatus, TrainerStatus

ROSTER = Roster(
    replicas={0: ("stage0-0", "stage0-1"), 1: ("stage1-0", "stage1-1"), 2: ("stage2-0", "stage2-1")},
    attacker="stage1-1",
    verifiers=("verifier0", "verifier1"),
    trainer="trainer",
)


def test_targets_leave_every_stage_an_honest_replica_and_never_fault_the_attacker():
    # stage1-0 is the middle stage's only honest replica: faulting it would stall the whole pipeline
    assert ROSTER.eligible() == ["stage0-0", "stage0-1", "stage2-0", "stage2-1", "verifier0", "verifier1", "trainer"]
    honest = Roster(ROSTER.replicas, None, ROSTER.verifiers, "trainer")
    assert "stage1-0" in honest.eligible() and "stage1-1" in honest.eligible()
    assert Roster({0: ("a",), 1: ("b",)}, None, ("v",), None).eligible() == []  # single replicas, one verifier


def test_a_node_down_protects_its_last_sibling_and_is_not_faulted_twice():
    down = {"stage0-1", "verifier0", "trainer"}
    # stage0-0 is stage 0's last honest replica up, verifier1 the last verifier up
    assert ROSTER.eligible(down) == ["stage2-0", "stage2-1"]
    assert ROSTER.eligible(down | {"stage2-0"}) == []


def test_the_plan_is_one_fault_per_interval_drawn_from_the_seed():
    settings = SoakSettings(minutes=30, interval_s=60, seed=3, down_s=(3.0, 15.0))
    plan = plan_faults(settings)
    assert [f.at_s for f in plan] == [60.0 * k for k in range(1, 30)]  # none at the start, none at the very end
    assert all(3.0 <= f.down_s <= 15.0 and 0 <= f.draw < 1 for f in plan)
    assert {f.kind for f in plan} == {FaultKind.KILL, FaultKind.STOP}
    targets = ROSTER.eligible()
    assert len({pick(f, targets) for f in plan}) >= 5  # 29 draws over 7 targets reach most of them
    assert plan_faults(settings) == plan  # the same seed, the same faults
    other = plan_faults(SoakSettings(minutes=30, interval_s=60, seed=4))
    assert [(f.kind, f.draw) for f in other] != [(f.kind, f.draw) for f in plan]


def test_pick_spreads_draws_over_whoever_is_eligible():
    fault = plan_faults(SoakSettings(minutes=2, interval_s=60))[0]
    assert pick(fault, []) is None  # skipped
    assert pick(fault, ["only"]) == "only"
    low, high = (Fault(60.0, FaultKind.KILL, 5.0, draw) for draw in (0.0, 0.999999))
    assert pick(low, ["a", "b", "c"]) == "a" and pick(high, ["a", "b", "c"]) == "c"


def test_kill_share_decides_the_kinds():
    kills = plan_faults(SoakSettings(minutes=10, interval_s=30, kill_share=1.0))
    stops = plan_faults(SoakSettings(minutes=10, interval_s=30, kill_share=0.0))
    assert {f.kind for f in kills} == {FaultKind.KILL} and {f.kind for f in stops} == {FaultKind.STOP}


def test_settings_refuse_a_downtime_as_long_as_the_interval():
    with pytest.raises(ValueError, match="shorter than the interval"):
        SoakSettings(interval_s=10, down_s=(3.0, 10.0))
    with pytest.raises(ValueError, match="low <= high"):
        SoakSettings(down_s=(5.0, 3.0))


def step(n: int, sent: int, settled: int, excluded=()) -> dict:
    accounting = {"sent": sent, "succeeded": settled, "dropped": 0, "failed": 0, "retried": 1, "in_flight": 0}
    return {"event": "step", "step": n, "excluded": list(excluded), "accounting": accounting, "loss": 5.0}


def test_accounting_over_a_killed_and_a_stopped_trainer():
    first = [{"event": "validation", "step": 0, "val_loss": 5.5}, step(0, 4, 4), step(1, 8, 8)]
    second = [step(2, 4, 4), step(3, 8, 8)]
    summary = {"event": "summary", "accounting": {**step(0, 12, 8)["accounting"], "failed": 4}}
    records = first + second + [summary]
    lives = split_lives(records, [len(first)])
    assert lives == [first, second + [summary]]
    killed_status = TrainerStatus(
        peer_id="t",
        time=0.0,
        step=2,
        val_curve=[],
        accounting=AccountingStatus(
            sent=11, succeeded=8, dropped=0, failed=0, retried=1, in_flight=3, consistent=False
        ),
    )
    killed = life_of(lives[0], killed=True, last_status=killed_status)
    stopped = life_of(lives[1], killed=False, last_status=None)
    assert (killed.first_step, killed.last_step, killed.sent, killed.in_flight) == (0, 1, 11, 3)
    assert (stopped.first_step, stopped.last_step, stopped.failed, stopped.abandoned_at_stop) == (2, 3, 4, 4)
    total = merge_accounting([killed, stopped])
    assert total.sent == 23 and total.succeeded == 16 and total.failed == 4
    assert total.lost_with_killed_trainers == 3 and total.unsettled_in_live_trainers == 0
    assert repeated_steps(records) == []
    assert repeated_steps(records + [step(3, 0, 0)]) == [3]


def life(killed: bool, sent: int, settled: int, in_flight: int = 0) -> TrainerLife:
    return TrainerLife(0, 9, sent, settled, 0, 0, 0, in_flight, killed)


def verdicts(**changes) -> dict[str, bool]:
    lives = changes.pop("lives", [life(True, 44, 41, 3), life(False, 80, 80)])
    arguments = {
        "loss": {"first_val_loss": 5.5, "last_val_loss": 3.0},
        "honest_excluded": {},
        "attacker": {"first_excluded_step": 20, "excluded_at_end_by_every_peer": True},
        "microbatches": merge_accounting(lives),
        "lives": lives,
        "microbatches_per_step": 4,
        "repeated": [],
        "unexpected_exits": [],
        "faults": [FaultRecord(60.0, 60.0, "stage0-0", "kill", 5.0, back_after_s=30.0)],  # restarted
        "leaks": {
            "leftovers": {},
            "fds": {"bootstrap": {"start": 40, "end": 44}},
            "driver_fds": {"start": 30, "end": 30},
        },
    }
    arguments.update(changes)
    return {check.name: check.ok for check in evaluate(**arguments)}


def test_a_clean_soak_passes_every_check():
    assert all(verdicts().values()), verdicts()


@pytest.mark.parametrize(
    ("changes", "failing"),
    [
        ({"loss": {"first_val_loss": 5.5, "last_val_loss": 5.6}}, "loss fell"),
        ({"loss": {"first_val_loss": 5.5, "last_val_loss": None}}, "loss fell"),
        ({"honest_excluded": {"stage0-1": "in verifier0's view at 300s"}}, "no honest exclusion"),
        ({"attacker": {"first_excluded_step": None}}, "attacker excluded"),
        ({"attacker": {"first_excluded_step": 20, "excluded_at_end_by_every_peer": False}}, "attacker excluded"),
        ({"lives": [life(False, 80, 79)]}, "accounting consistent"),  # a microbatch lost by a live trainer
        ({"lives": [life(True, 80, 70, 10)]}, "accounting consistent"),  # more than a step lost with a kill
        ({"repeated": [41]}, "no step trained twice"),
        ({"unexpected_exits": [{"name": "verifier1", "code": 1}]}, "no unexpected exit"),
        ({"faults": [FaultRecord(60.0, 60.0, "stage0-0", "kill", 5.0, error="not ready")]}, "every restart served"),
        (
            {"faults": [FaultRecord(60.0, 60.0, "stage0-0", "kill", 5.0, back_after_s=9.0, orphans=[4242])]},
            "no process leaked",
        ),
        (
            {"leaks": {"leftovers": {"4242": "p2pd"}, "fds": {}, "driver_fds": {"start": 30, "end": 30}}},
            "no process leaked",
        ),
        (
            {
                "leaks": {
                    "leftovers": {},
                    "fds": {"bootstrap": {"start": 40, "end": 41 + FD_SLACK_TREE}},
                    "driver_fds": {"start": 30, "end": 30},
                }
            },
            "no file descriptor leaked",
        ),
        (
            {"leaks": {"leftovers": {}, "fds": {}, "driver_fds": {"start": 30, "end": 42}}},
            "no file descriptor leaked",
        ),
    ],
)
def test_each_broken_invariant_fails_its_check_alone(changes, failing):
    found = verdicts(**changes)
    assert not found[failing], found
    assert all(ok for name, ok in found.items() if name != failing), found


def test_microbatches_report_counts_nothing_twice():
    merged = merge_accounting([life(True, 10, 6, 4), life(True, 10, 8, 2), life(False, 5, 5)])
    assert merged == Microbatches(
        sent=25,
        succeeded=19,
        dropped=0,
        failed=0,
        retried=0,
        lost_with_killed_trainers=6,
        abandoned_at_stop=0,
        unsettled_in_live_trainers=0,
    )


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(1800)
@pytest.mark.xfail(
    reason="a restarted node can go minutes without seeing a ban (its strike reads time out on a loaded machine): "
    "found by this test, not fixed (docs/reliability.md, churn soak)",
    strict=False,
)
def test_a_short_soak_keeps_every_invariant(tmp_path):
    """A minute and a half of the real swarm, a fault every 30 s: seed 1 SIGKILLs two nodes (verifier1 first; the
    second among those up when it comes) and restarts both. About 4 minutes on 2 idle cores with the swarm's start;
    16 at a load average of 38, where it found that a restarted replica's DHT reads may fail for over a minute."""
    from sentinel_node.bench.soak import Soak

    report = Soak(SoakSettings(minutes=1.5, interval_s=30, seed=1, workdir=tmp_path / "swarm")).run()
    assert [f.kind for f in report.faults] == ["kill", "kill"] and report.faults[0].target == "verifier1"
    assert report.restarts == 2
    failed = [check for check in report.checks if not check.ok]
    assert not failed, failed
    assert report.steps["trained"] > 10 and report.microbatches.succeeded > 0


ESCAPER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_node_takes_the_processes_that_left_its_group_along(tmp_path):
    """torch_shm_manager (started by hivemind's file_system sharing strategy) calls setsid: the soak saw it outlive
    SIGKILLed nodes, which a SIGKILL of the node's process group does not reach. A node whose child does the same."""
    import sys

    from sentinel_node.processes import alive
    from sentinel_node.supervisor import LocalSwarm

    swarm = LocalSwarm(tmp_path, tmp_path / "swarm.yaml")
    (tmp_path / "logs").mkdir()
    with swarm:
        node = swarm._launch("escaper", "stage", [sys.executable, "-c", ESCAPER], tmp_path / "escaper.json")
        escaped = int(node.lines.get(timeout=60))
        assert alive(escaped) and os.getpgid(escaped) != node.process.pid  # it left the node's group
        swarm.kill("escaper")
        deadline = time.monotonic() + 10
        while alive(escaped) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(escaped)
        assert swarm.leftovers() == {}


def test_the_command_refuses_an_interval_shorter_than_a_downtime_before_starting_anything(tmp_path):
    from click.testing import CliRunner

    from sentinel_node.cli import main

    result = CliRunner().invoke(main, ["bench", "soak", "--interval", "10", "--workdir", str(tmp_path / "swarm")])
    assert result.exit_code == 1
    assert "must be shorter than the interval" in result.output
    assert not (tmp_path / "swarm").exists()  # no swarm was started
