"""A real-model run end to end, with real processes and p2pd daemons on loopback: a tokenizer trained by
`tokenizer train`, documents streamed from .jsonl and .parquet files, a swarm of 2 stages and a verifier trained
by a trainer whose loss falls; a second trainer continues the data stream exactly where the swarm's step says;
the live stages and their checkpoints export to the same Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from transformers import LlamaForCausalLM

from sentinel_node.cli import main
from sentinel_node.config import load_config
from sentinel_node.data import load_training_data
from sentinel_node.demo import Demo, DemoSettings
from sentinel_node.roles.trainer import data_digest
from sentinel_node.supervisor import follow_json_lines
from tests.realdata import VOCAB, make_dataset, train_tokenizer

pytestmark = pytest.mark.slow


def _run_trainer(demo: Demo, name: str, steps: int, state_dir: Path) -> list[dict]:
    metrics = demo.workdir / f"{name}.jsonl"
    node = demo.swarm.start(
        name,
        "trainer",
        *("--certificate", str(demo.certify(name))),  # the demo's swarm is closed: its organiser admits trainers
        *("--steps", str(steps), "--eval-every", "4", "--eval-batches", "2", "--metrics-out", str(metrics)),
        *("--state-dir", str(state_dir), "--no-progress"),
    )
    demo.swarm.wait_ready([node], 150)
    records = list(follow_json_lines(metrics, node))
    assert node.process.wait(timeout=60) == 0, node.log_tail()
    return records


def test_a_streamed_real_data_swarm_trains_resumes_and_exports(tmp_path, forkserver):
    tokenizer = train_tokenizer(tmp_path / "tokenizer")
    dataset = make_dataset(tmp_path / "docs")
    base = load_config(Path(__file__).resolve().parent.parent / "sentinel_node" / "configs" / "demo.yaml")
    config = base.with_overrides(
        model={"vocab_size": VOCAB, "n_layers": 2},
        pipeline={"n_stages": 2, "microbatch_size": 4, "seq_len": 48, "microbatches_per_step": 4, "lr": 0.003},
        data={"tokenizer": str(tokenizer), "path": str(dataset), "shuffle_buffer": 64, "val_sequences": 16},
    )
    config_path = tmp_path / "swarm.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
    settings = DemoSettings(
        forkserver=forkserver,
        attack=None,
        replicas=1,
        verifiers=1,
        config_path=config_path,
        workdir=tmp_path / "swarm",
        state=True,
        checkpoint_every=100,
        metrics=False,
    )
    trainer_state = tmp_path / "trainer-state"
    with Demo(settings) as demo:
        demo.start()
        first = _run_trainer(demo, "trainer", 12, trainer_state)
        second = _run_trainer(demo, "trainer2", 6, trainer_state)
        swarm_config = load_config(demo.workdir / "swarm.yaml")
        live = CliRunner().invoke(
            main,
            [
                "export",
                "--config",
                str(demo.workdir / "swarm.yaml"),
                "--initial-peers",
                demo.swarm.initial_peers[0],
                "--out",
                str(tmp_path / "from-peers"),
            ],
        )
        assert live.exit_code == 0, live.output
        demo.swarm.stop()  # stages checkpoint on shutdown
        assert demo.swarm.leftovers() == {}

    # the loss falls
    steps = [r for r in first if r.get("event") == "step"]
    summary = next(r for r in first if r.get("event") == "summary")
    assert [s["step"] for s in steps] == list(range(12))
    assert summary["val_curve"][-1][1] < summary["val_curve"][0][1] - 0.3, summary["val_curve"]
    assert summary["accounting"]["succeeded"] == 48
    print(f"validation curve {summary['val_curve']}, training loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")

    # each step trained on the sequences the stream puts at that step, and the second trainer went on from the
    # swarm's step (12), not from the start
    resumed = [r for r in second if r.get("event") == "step"]
    assert [s["step"] for s in resumed] == list(range(12, 18))
    reference = load_training_data(swarm_config, seed=swarm_config.swarm.seed)
    for record in steps + resumed:
        assert record["data_digest"] == data_digest(reference.step_batches(record["step"])), record["step"]

    # the live replicas and the checkpoints they wrote on shutdown export to the same model
    from_dirs = CliRunner().invoke(
        main,
        [
            "export",
            "--config",
            str(tmp_path / "swarm" / "swarm.yaml"),
            "--out",
            str(tmp_path / "from-dirs"),
            "--from",
            str(tmp_path / "swarm" / "state" / "stage0-0"),
            "--from",
            str(tmp_path / "swarm" / "state" / "stage1-0"),
        ],
    )
    assert from_dirs.exit_code == 0, from_dirs.output
    tokens = reference.validation_batches(1)[0][0]
    a = LlamaForCausalLM.from_pretrained(str(tmp_path / "from-peers")).eval()
    b = LlamaForCausalLM.from_pretrained(str(tmp_path / "from-dirs")).eval()
    with torch.no_grad():
        torch.testing.assert_close(a(tokens).logits, b(tokens).logits, atol=1e-5, rtol=0)
        loss = torch.nn.functional.cross_entropy(
            a(tokens).logits.reshape(-1, VOCAB), reference.validation_batches(1)[0][1].reshape(-1)
        )
    assert abs(float(loss) - summary["val_curve"][-1][1]) < 1.0  # the exported model is the trained one
    assert (tmp_path / "from-peers" / "tokenizer.json").exists()
