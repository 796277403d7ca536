"""The simulate and bench commands: they run, and they reject bad input naming what was wrong."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from sentinel_node.cli import main

SMALL = {
    "model": {"hidden_size": 32, "intermediate_size": 86},
    "verification": {"warmup": 60},
    "sim": {"steps": 40, "attack_start": 24, "eval_every": 10, "eval_batches": 2},
    "data": {"max_bytes": 2**20},
}


def _config(tmp_path, data: dict) -> str:
    path = tmp_path / "swarm.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_help_lists_the_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("simulate", "bench", "join", "swarm", "demo"):
        assert command in result.output


def test_mistyped_config_key_names_the_field(tmp_path):
    path = _config(tmp_path, {"model": {"hiden_size": 64}})
    result = CliRunner().invoke(main, ["simulate", "--config", path])
    assert result.exit_code == 2
    assert "model.hiden_size" in result.output and "unknown key" in result.output


def test_wrongly_typed_config_value_names_the_field(tmp_path):
    path = _config(tmp_path, {"verification": {"warmup": "soon"}})
    result = CliRunner().invoke(main, ["simulate", "--config", path])
    assert result.exit_code == 2
    assert "verification.warmup" in result.output


def test_open_verifier_set_with_quorum_one_is_rejected(tmp_path):
    path = _config(tmp_path, {"swarm": {"ban_quorum": 1, "open_verifiers": True}})
    result = CliRunner().invoke(main, ["simulate", "--config", path])
    assert result.exit_code == 2
    assert "ban_quorum" in result.output and "at least 2" in result.output


@pytest.mark.parametrize(
    "swarm, message",
    [
        ({"trusted_verifiers": ["11111111111111111111111"], "ban_quorum": 1}, "trusted_verifiers entry 0"),
        ({"trusted_verifiers": ["QmNotAPeerIdAtAllButBase58Letters"], "ban_quorum": 1}, "neither a peer id"),
        ({"trainers": ["ssh-rsa AAAAB3Nza"], "open_verifiers": True}, "trainers entry 0"),
        ({"organiser": "ssh-rsa AAAA-not-a-key", "open_verifiers": True}, "organiser"),
    ],
)
def test_malformed_trust_entries_are_rejected_when_the_config_loads(tmp_path, swarm, message):
    """Issue 16: a trusted_verifiers entry that is not a peer id passed config loading and then killed join."""
    path = _config(tmp_path, {"swarm": swarm})
    result = CliRunner().invoke(main, ["join", "--role", "trainer", "--config", path])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_missing_config_file_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["simulate", "--config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read config" in result.output


def test_unknown_attack_lists_the_catalogue():
    result = CliRunner().invoke(main, ["simulate", "--attack", "teleport"])
    assert result.exit_code == 2
    assert "constant" in result.output and "sign_flip" in result.output


def test_attack_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def two(tensor, step):\n    return tensor\n")
    cases = {
        f"{tmp_path / 'missing.py'}:f": "no file",
        f"{bad}:absent": "defines no 'absent'",
        f"{bad}:two": "must take (tensor, step, state)",
        str(bad): "PATH.py:NAME",
    }
    for spec, message in cases.items():
        result = CliRunner().invoke(main, ["simulate", "--attack-file", spec])
        assert result.exit_code == 1, spec
        assert message in result.output, (spec, result.output)


@pytest.mark.slow
def test_simulate_bans_the_attacker_and_no_honest_worker(tmp_path):
    path = _config(tmp_path, SMALL)
    result = CliRunner().invoke(main, ["simulate", "--config", path, "--attack", "constant", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["malicious"] and not summary["malicious_not_banned"]
    assert summary["honest_banned"] == []
    assert summary["last_val_loss"] < summary["first_val_loss"]


@pytest.mark.slow
def test_simulate_with_an_attack_file_runs_the_red_teams_function(tmp_path):
    attack = tmp_path / "mine.py"
    attack.write_text(
        "def wipe(tensor, step, state):\n    state['calls'] = state.get('calls', 0) + 1\n    return tensor * 0\n"
    )
    path = _config(tmp_path, SMALL)
    result = CliRunner().invoke(main, ["simulate", "--config", path, "--attack-file", f"{attack}:wipe", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["malicious"] and not summary["malicious_not_banned"]
    assert summary["honest_banned"] == []


@pytest.mark.slow
@pytest.mark.timeout(600)  # 23 s alone; `make test` runs it niced beside the network half, which can starve it
def test_bench_detection_reports_one_attack_as_json_and_plots(tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(
        main,
        ["bench", "detection", "--quick", "--attack", "constant", "--target", "activation", "--steps", "30"]
        + ["--json", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["profile"] == "quick" and report["mesh"]["steps"] == 30 and report["mesh"]["attack_start"] == 15
    rows = {(row["name"], row["target"]): row for row in report["attacks"]}
    assert set(rows) == {("constant", "activation")}  # the gradient run is the same code on the other direction
    for row in rows.values():
        assert row["recall"] == 1.0  # every attacker banned
        assert set(row["val_loss"]) == {"clean", "undefended", "defended"}
        assert (out / f"val_loss_constant_{row['target']}.png").stat().st_size > 0
    assert json.loads((out / "detection.json").read_text())["attacks"][0]["curves"]["clean"]
    # an honest replica of stage 2 used to be banned at step 89, on spectral flags its whole stage raised in turn
    assert not {key: row["honest_banned_ids"] for key, row in rows.items() if row["honest_banned"]}
    assert all(row["f1"] == 1.0 for row in rows.values())


def test_bench_detection_honest_suite_reports_its_counts(tmp_path):
    # this suite's report has no attacks: its table and file are its own (it used to crash looking for its plots)
    out = tmp_path / "bench"
    args = ["bench", "detection", "--suite", "honest", "--quick", "--steps", "3", "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["steps"] == 3 and report["banned"] == [] and "peer_alarms" in report
    assert json.loads((out / "honest.json").read_text())["steps"] == 3
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "clean run of 3 steps" in result.output and "honest.json in" in result.output
