"""``sentinel-node bench verifier``: it runs on tiny shapes, and its JSON carries every figure the table shows."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from sentinel_node.bench.verifier import DIRECTIONS, REST, synthetic_tensor
from sentinel_node.cli import main

ROW_FIELDS = {
    "shape",
    "direction",
    "dtype",
    "mib",
    "check_ms",
    "check_wall_ms",
    "ms_per_mib",
    "mib_per_s",
    "copy_ms",
    "ratio_to_copy",
    "transfer_ms",
    "share_of_1gbit",
    "stages_ms",
    "flagged",
    "checks",
}
STAGES = {"scan", "clip, quantiles", "power iteration", "range, energy", REST}


def run(*args: str) -> str:
    result = CliRunner().invoke(main, ["bench", "verifier", "--shape", "2,16,32", "--shape", "2,32,64", *args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_json_has_every_field(wire_dtype):
    report = json.loads(run("--repeats", "3", "--json", "--wire-dtype", wire_dtype))
    assert report["device"] == "cpu" and report["threads"] == 1 and report["wire_dtype"] == wire_dtype
    assert report["clock"] == "cpu"
    assert report["spectral"] == {"rank": 4, "oversample": 8, "power_iterations": 1}
    assert set(report["goal"]) == {"share_of_1gbit", "linearity"} and set(report["linearity"]) == set(DIRECTIONS)
    assert isinstance(report["meets_goal"], bool) and report["worst_share_of_1gbit"] > 0
    rows = report["rows"]
    assert [(tuple(r["shape"]), r["direction"]) for r in rows] == [
        (shape, direction) for shape in ((2, 16, 32), (2, 32, 64)) for direction in DIRECTIONS
    ]
    element = 4 if wire_dtype == "float32" else 2
    for row in rows:
        assert set(row) == ROW_FIELDS, set(row) ^ ROW_FIELDS
        assert row["dtype"] == wire_dtype and row["checks"] == 3
        assert row["mib"] == pytest.approx(element * 2 * row["shape"][1] * row["shape"][2] / 2**20)
        assert row["check_ms"] > 0 and row["copy_ms"] > 0 and row["check_wall_ms"] > 0
        assert row["ratio_to_copy"] == pytest.approx(row["check_ms"] / row["copy_ms"])
        assert row["mib_per_s"] == pytest.approx(row["mib"] / row["check_ms"] * 1000)
        # 1 Gbit/s moves 10x the bytes of 100 Mbit/s in the same time
        assert row["transfer_ms"]["100mbit"] == pytest.approx(10 * row["transfer_ms"]["1gbit"])
        assert row["transfer_ms"]["1gbit"] == pytest.approx(8 * row["mib"] * 2**20 / 1e9 * 1000)
        assert set(row["stages_ms"]) == STAGES and all(ms >= 0 for ms in row["stages_ms"].values())


def test_table_and_a_device_that_is_not_there(monkeypatch):
    text = run("--repeats", "3")
    assert "CPU ms" in text and "x copy" in text and "% of 1Gb/s" in text and "ms per stage" in text
    assert "2x32x64" in text and "goal:" in text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(main, ["bench", "verifier", "--device", "cuda", "--shape", "2,16,32"])
    assert result.exit_code != 0 and "no CUDA device is visible" in result.output
    result = CliRunner().invoke(main, ["bench", "verifier", "--shape", "2,16"])
    assert result.exit_code != 0 and "batch,tokens,hidden" in result.output


def test_synthetic_tensors_have_the_structure_of_honest_ones():
    generator = torch.Generator().manual_seed(0)
    activation = synthetic_tensor((4, 64, 128), "activation", generator).reshape(-1, 128)
    gradient = synthetic_tensor((4, 64, 128), "gradient", generator).reshape(-1, 128)
    energy = torch.linalg.svdvals(activation).square()
    assert 0.3 < float(energy[:4].sum() / energy.sum()) < 0.95  # a few dominant directions, and noise
    assert activation.mean(0).abs().mean() > 5 * gradient.mean(0).abs().mean() / gradient.abs().mean()
    norms = gradient.norm(dim=1)
    assert (norms > 4 * norms.median()).any()  # outlier tokens: row clipping has work to do
