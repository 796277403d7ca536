"""``sentinel-node bench overhead``: its figures from step records and status files, and its table.

The bench's swarm is the demo's (tested in tests/test_pipeline_swarm.py); a run takes minutes, so here the
arithmetic and the trainer's mode schedule are checked on their own.
"""

from __future__ import annotations

import pytest

from sentinel_node.bench.overhead import (
    MODES,
    OverheadSettings,
    _audit_report,
    _cpu_accounting,
    _report,
    _tokens_per_s,
    table,
)
from sentinel_node.config import load_config
from sentinel_node.roles.route_modes import RoutingMode, RoutingSchedule
from sentinel_node.roles.status import StageStatus, VerifierStatus
from sentinel_node.roles.trainer import TrainerOptions


def step(tokens_per_s: float, step_s: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "step_s": step_s}


def stage_status(**fields) -> StageStatus:
    """A stage's status file as the bench reads it, with every counter not given at zero."""
    base = dict(
        peer_id="QmStage", time=0.0, stage=0, attacker=False, last_step=0, resumed_from=None, synced_from=None,
        checkpoints=0, reachability=None, averaging_rounds=0, averaged_with=[], throughput=0.0,
        forward_cpu_ms=None, compute_cpu_s=0.0, served=0, evaluated=0, dropped=0, failed=0, attacked=0, steps=0,
    )  # fmt: skip
    return StageStatus(**{**base, **fields})


def verifier_status(**fields) -> VerifierStatus:
    base = dict(
        peer_id="QmVerifier", time=0.0, boundaries=[0, 1], verify=True, ledger={}, banned=[], published=0,
        reachability=None, checks={}, flags={}, skipped=0, malformed=0, relayed=0, check_cpu_s=0.0,
        cpu_ms_per_check=None,
    )  # fmt: skip
    return VerifierStatus(**{**base, **fields})


def test_tokens_per_s_weighs_steps_by_their_time():
    assert _tokens_per_s([step(1000, 1.0), step(3000, 3.0)]) == pytest.approx(10000 / 4)
    assert _tokens_per_s([]) == 0.0


def test_cpu_accounting_prices_checks_against_compute():
    config = load_config("configs/demo.yaml")  # 3 stages: 2 boundaries, 4 checks per microbatch
    stages = {f"s{i}": stage_status(served=10, compute_cpu_s=0.5) for i in range(3)}
    cpu = _cpu_accounting(config, verifier_status(cpu_ms_per_check=5.0), stages)
    assert cpu["stage_compute_ms_per_microbatch"] == pytest.approx(150.0)  # 50 ms per stage visit, 3 stages
    assert cpu["checks_ms_per_microbatch"] == pytest.approx(20.0)
    assert cpu["verified_over_relay"] == pytest.approx(150 / 170)
    assert cpu["verified_over_duplicate"] == pytest.approx(300 / 170)
    assert _cpu_accounting(config, verifier_status(), stages) is None


def test_report_and_table():
    config = load_config("configs/demo.yaml")
    steps = {
        "verified": [step(900, 1.0)],
        "audited": [step(882, 1.0)],
        "relay": [step(1000, 1.0)],
        "duplicate": [step(450, 2.0)],
    }
    stages = {"s0": stage_status(served=4, compute_cpu_s=0.4, forward_cpu_ms=20.0)}
    checking = verifier_status(cpu_ms_per_check=4.0, checks={"activation": 8, "gradient": 8})
    report = _report(config, OverheadSettings(), steps, 0.01, checking, stages, wall_s=100.0)
    assert report["ratios"] == {"verified_over_relay": pytest.approx(0.9), "verified_over_duplicate": 2.0}
    assert report["meets_targets"] and report["check_over_forward"] == pytest.approx(0.2)
    stages["s0"] = stage_status(served=4, compute_cpu_s=0.4, recomputations={"served": 2}, recompute_cpu_s=0.2)
    report["audits"] = _audit_report(config, report, verifier_status(audits={"passed": 2}), stages)
    audits = report["audits"]
    assert audits["audited_over_verified"] == pytest.approx(0.98) and audits["target"] == pytest.approx(0.97)
    assert audits["meets_target"] and audits["by_cpu"]["recompute_ms_per_audit"] == pytest.approx(100.0)
    # 0.02 audits per stage visit, 3 stages: 6 ms per microbatch against 300 ms of compute and 16 ms of checks
    assert audits["by_cpu"]["audited_over_verified"] == pytest.approx(316 / 322)
    text = table(report)
    assert "verified / relay        0.90" in text and "verified / duplicate    2.00" in text
    assert "targets met" in text and "by CPU time" in text and "audited / verified      0.98" in text


def test_trainer_cycles_the_bench_modes_step_by_step():
    modes = (
        RoutingMode(("checking",)),
        RoutingMode(("auditing",)),
        RoutingMode(("relay",)),
        RoutingMode(("relay",), copies=2),
    )
    options = TrainerOptions(routing=RoutingSchedule(modes))
    assert [options.routing.at(s) for s in range(5)] == [*modes, modes[0]]
    assert [options.routing.index(s) for s in range(5)] == [0, 1, 2, 3, 0]
    assert len(MODES) == len(modes)
    assert TrainerOptions().routing.at(7) == RoutingMode()  # the production default: any verifier, one copy


def test_a_routing_mode_bars_every_verifier_it_does_not_name():
    from peers import SwarmView

    view = SwarmView(n_stages=2, verifiers={"a": None, "b": None, "c": None})
    assert RoutingMode(("a",)).barred(view) == {"b", "c"}
    assert RoutingMode().barred(view) == set()
    with pytest.raises(ValueError):
        RoutingMode(copies=0)
