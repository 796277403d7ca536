"""`bench detection --suite sweep`: its families and points, the verdict it draws from them, and the command."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sentinel_node.attacks import CATALOGUE, make_attack
from sentinel_node.bench import sweep
from sentinel_node.cli import main


def test_every_family_names_a_catalogue_attack_and_every_point_builds():
    names = [f.name for f in sweep.FAMILIES]
    assert len(names) == len(set(names))
    for family in sweep.FAMILIES:
        assert family.attack in CATALOGUE, family.name
        assert set(family.strengths) == {"quick", "full"} and all(family.strengths.values()), family.name
        for profile in ("quick", "full"):
            for point in sweep.points(profile, [family]):
                make_attack(family.attack, **point.params())  # a bad parameter name fails here
    # the red team's four are in the sweep, each on both directions
    four = sweep.families(["plane_rotation", "token_shift", "cross_mix", "ternary_quantize"])
    assert {(p.family.name, p.target) for p in sweep.points("quick", four)} == {
        (f.name, t) for f in four for t in ("activation", "gradient")
    }


def test_an_unknown_family_is_refused_listing_the_choices():
    with pytest.raises(ValueError, match="unknown family wobble; choose from scale, bias"):
        sweep.families(["wobble"])


def _row(family, strength, target, f1, undefended, defended, honest_banned=0, strikes=0):
    return {
        "family": family,
        "strength": strength,
        "target": target,
        "f1": f1,
        "detected": f1 >= sweep.F1_REQUIRED,
        "damage": {"undefended": undefended, "defended": defended},
        "honest_banned": honest_banned,
        "honest_max_strikes": strikes,
    }


def test_judge_names_the_points_that_break_the_criterion_and_the_largest_undetected_strength():
    rows = [
        _row("drift", 0.002, "gradient", 0.0, 0.3, 0.3),  # undetected and harmless: allowed
        _row("drift", 0.005, "gradient", 0.67, 0.82, 0.19, strikes=2),  # harmful and missed: a failure
        _row("drift", 0.03, "gradient", 1.0, 5.0, 0.7),  # caught, but the defence leaves too much damage
        _row("drift", 0.03, "activation", 1.0, 5.0, 0.1, honest_banned=1),
        _row("bias", -1.0, "activation", 0.5, 0.4, 0.4),
        _row("bias", 0.25, "activation", 1.0, 2.0, 0.0),
    ]
    verdict = sweep.judge(rows)
    assert [(f["family"], f["strength"], f["target"]) for f in verdict["failures"]] == [
        ("drift", 0.005, "gradient"),
        ("drift", 0.03, "gradient"),
    ]
    assert verdict["families"]["drift"]["largest_undetected"]["strength"] == 0.005
    assert verdict["families"]["drift"]["undetected_damage_max"] == 0.82
    assert verdict["families"]["bias"]["largest_undetected"]["strength"] == -1.0  # by magnitude, either sign
    assert verdict["honest_banned"] == 1 and verdict["honest_max_strikes"] == 2


@pytest.mark.slow
def test_bench_detection_sweep_runs_a_short_look_at_one_family(tmp_path):
    out = tmp_path / "bench"
    args = ["bench", "detection", "--suite", "sweep", "--quick", "--family", "token_shift", "--steps", "12"]
    result = CliRunner().invoke(main, [*args, "--workers", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "sweep.json").read_text())
    assert {(r["family"], r["strength"], r["target"]) for r in report["points"]} == {
        ("token_shift", s, t) for s in (1, 2, 8) for t in ("activation", "gradient")
    }
    for row in report["points"]:
        assert set(row["val_loss"]) == {"clean", "undefended", "defended"}
        assert row["honest_banned"] == 0
    assert set(report["verdict"]["families"]) == {"token_shift"}
    assert (out / "sweep_token_shift.png").stat().st_size > 0
    assert "largest strength not detected" in result.output and "token_shift" in result.output


def test_bench_detection_sweep_refuses_a_family_that_would_start_after_the_run(tmp_path):
    args = ["bench", "detection", "--suite", "sweep", "--quick", "--family", "start_blatant", "--steps", "12"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "start_blatant would start at or after the last of 12 steps" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["bench", "detection", "--suite", "sybil", "--steps", "5"])
    assert result.exit_code == 2 and "not of --suite sybil" in result.output
