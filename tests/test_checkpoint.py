"""Stage checkpoints: exact round trips, crash safety, and clear refusals of damaged or foreign files."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sentinel_node.pipeline.checkpoint as checkpoint_module
from sentinel_node.config import ModelConfig, PipelineConfig
from sentinel_node.pipeline import StageWorker
from sentinel_node.pipeline.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    CheckpointWriteError,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

MODEL = ModelConfig(hidden_size=32, intermediate_size=64, n_layers=2, n_heads=2, n_kv_heads=2)
PIPE = PipelineConfig(n_stages=2, microbatch_size=2, seq_len=16, warmup_steps=0, lr=3e-3)
HASH = "cafe0123cafe0123"


def worker(stage: int = 1, model: ModelConfig = MODEL, pipe: PipelineConfig = PIPE) -> StageWorker:
    return StageWorker(model, pipe, stage, seed=7)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's input for global step `step`: the same on every run."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, 16, 32, generator=gen), torch.randint(0, 256, (2, 16), generator=gen)


def train(w: StageWorker, steps: range) -> None:
    for step in steps:
        hidden, targets = batch(step)
        w.forward_backward_loss(f"m{step}", hidden, targets)
        w.step(step)


def snapshot(w: StageWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in w.module.state_dict().items()}


def assert_same_state(a: StageWorker, b: StageWorker) -> None:
    for (name, x), y in zip(a.module.state_dict().items(), b.module.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and sa
    for index in sa:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[index][key], sb[index][key]), (index, key)


@pytest.fixture(scope="module")
def trained() -> StageWorker:
    w = worker()
    train(w, range(3))
    return w


def test_round_trip_restores_parameters_optimizer_and_step(trained, tmp_path):
    path = save_checkpoint(trained, tmp_path, 2, HASH)
    assert path == checkpoint_path(tmp_path, 2) and path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # only the node's owner reads its weights
    fresh = worker()
    assert load_checkpoint(fresh, tmp_path, HASH) == 2
    assert_same_state(trained, fresh)
    assert fresh.steps == trained.steps == 3
    assert fresh.optimizer.param_groups[0]["lr"] == trained.optimizer.param_groups[0]["lr"]


def test_training_resumes_as_if_never_interrupted(tmp_path):
    uninterrupted = worker()
    train(uninterrupted, range(2))
    save_checkpoint(uninterrupted, tmp_path, 1, HASH)
    train(uninterrupted, range(2, 4))

    resumed = worker()
    step = load_checkpoint(resumed, tmp_path, HASH)
    train(resumed, range(step + 1, 4))
    assert_same_state(uninterrupted, resumed)  # bitwise: same state, same data, same arithmetic


def test_empty_or_absent_directory_has_no_checkpoint(tmp_path):
    assert load_checkpoint(worker(), tmp_path / "absent", HASH) is None
    assert load_checkpoint(worker(), tmp_path, HASH) is None


def test_keeps_the_latest_and_the_previous(trained, tmp_path):
    for step in (3, 4, 5):
        save_checkpoint(trained, tmp_path, step, HASH)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    save_checkpoint(trained, tmp_path, 9, HASH, keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [9]
    save_checkpoint(trained, tmp_path, 2, HASH)  # the node went back: step 9 would otherwise be loaded next
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]


def test_a_failed_rename_leaves_the_previous_checkpoint(trained, tmp_path, monkeypatch):
    save_checkpoint(trained, tmp_path, 1, HASH)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.os, "replace", crash)
    with pytest.raises(CheckpointWriteError, match="disk full: the checkpoint of step 2 needs about"):
        save_checkpoint(trained, tmp_path, 2, HASH)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_path(tmp_path, 1).name]
    assert load_checkpoint(worker(), tmp_path, HASH) == 1


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(trained, tmp_path):
    """SIGKILL between writing the data and renaming it: no cleanup runs, as in a real crash or power cut."""
    save_checkpoint(trained, tmp_path, 1, HASH)
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        import torch
        torch.set_num_threads(1)
        from sentinel_node.config import ModelConfig, PipelineConfig
        from sentinel_node.pipeline import StageWorker
        from sentinel_node.pipeline import checkpoint
        w = StageWorker(ModelConfig.model_validate({MODEL.model_dump()!r}),
                        PipelineConfig.model_validate({PIPE.model_dump()!r}), 1, seed=7)
        checkpoint.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # dies right after the write
        checkpoint.save_checkpoint(w, Path({str(tmp_path)!r}), 2, {HASH!r})
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # the partial file exists, under a temp name
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    restored = worker()
    assert load_checkpoint(restored, tmp_path, HASH) == 1
    assert_same_state(trained, restored)
    save_checkpoint(trained, tmp_path, 2, HASH)  # the next save sweeps the crashed one's temporary file
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def corrupt_truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def corrupt_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def corrupt_empty(path: Path) -> None:
    path.write_bytes(b"")


def corrupt_missing_keys(path: Path) -> None:
    payload = torch.load(path, weights_only=True)
    del payload["optimizer"], payload["step"]
    torch.save(payload, path)


def corrupt_optimizer(path: Path) -> None:
    payload = torch.load(path, weights_only=True)
    payload["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    torch.save(payload, path)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (corrupt_truncated, "is corrupt or not a sentinel-node checkpoint"),
        (corrupt_garbage, "is corrupt or not a sentinel-node checkpoint"),
        (corrupt_empty, "is corrupt or not a sentinel-node checkpoint"),
        (corrupt_missing_keys, "is incomplete: it lacks step, optimizer"),
        (corrupt_optimizer, "optimizer exp_avg of parameter 0 has shape"),
    ],
)
def test_a_damaged_checkpoint_is_refused_not_skipped(trained, tmp_path, damage, message):
    save_checkpoint(trained, tmp_path, 1, HASH)
    latest = save_checkpoint(trained, tmp_path, 2, HASH)
    damage(latest)
    fresh = worker()
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(fresh, tmp_path, HASH)
    text = str(info.value)
    assert str(latest) in text and "delete" in text and "checkpoint-0000000001.pt" in text  # what to do
    assert all(torch.equal(before[k], v) for k, v in fresh.module.state_dict().items())  # untouched


def test_a_lone_damaged_checkpoint_suggests_starting_over(trained, tmp_path):
    corrupt_garbage(save_checkpoint(trained, tmp_path, 1, HASH))
    with pytest.raises(CheckpointError, match="move .* away to start this stage from scratch"):
        load_checkpoint(worker(), tmp_path, HASH)


def test_checkpoints_of_another_stage_pipeline_or_config_are_refused(trained, tmp_path):
    save_checkpoint(trained, tmp_path, 1, HASH)  # stage 1 of 2
    with pytest.raises(CheckpointError, match="holds stage 1 of 2, but this node serves stage 0 of 2"):
        load_checkpoint(worker(stage=0), tmp_path, HASH)
    three = PIPE.model_copy(update={"n_stages": 3})
    with pytest.raises(CheckpointError, match="holds stage 1 of 2, but this node serves stage 1 of 3"):
        load_checkpoint(worker(stage=1, model=MODEL.model_copy(update={"n_layers": 3}), pipe=three), tmp_path, HASH)
    with pytest.raises(CheckpointError, match=f"written under swarm config {HASH}, this node runs config other"):
        load_checkpoint(worker(), tmp_path, "other")


def test_parameter_shapes_that_differ_are_refused(trained, tmp_path):
    save_checkpoint(trained, tmp_path, 1, HASH)
    wider = MODEL.model_copy(update={"intermediate_size": 96})
    with pytest.raises(CheckpointError, match=r"parameter layers\.0\.mlp\.\w+_proj\.weight has shape"):
        load_checkpoint(worker(model=wider), tmp_path, HASH)


def test_another_optimizer_is_refused(trained, tmp_path):
    save_checkpoint(trained, tmp_path, 1, HASH)
    other = worker()
    other.optimizer_name = "bitsandbytes.AdamW8bit"
    with pytest.raises(CheckpointError, match="holds torch.AdamW state, this node uses bitsandbytes.AdamW8bit"):
        load_checkpoint(other, tmp_path, HASH)


class Payload:
    """Not a tensor, number or string: a weights-only load must refuse to build it."""

    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_a_file_carrying_code_is_never_unpickled(tmp_path, capsys):
    torch.save({"format": checkpoint_module.FORMAT, "trap": Payload()}, checkpoint_path(tmp_path, 4))
    with pytest.raises(CheckpointError, match="is corrupt or not a sentinel-node checkpoint"):
        load_checkpoint(worker(), tmp_path, HASH)
    assert "pickled code ran" not in capsys.readouterr().out


def test_policy_saves_every_n_steps_even_when_steps_are_skipped():
    policy = CheckpointPolicy(every_steps=5)
    assert not policy.due(-1) and policy.due(0)
    policy.saved(0)
    assert not policy.due(4) and policy.due(7)  # step 5 never came (the trainer moved on)
    policy.saved(7)
    assert not policy.due(11) and policy.due(12)
    with pytest.raises(ValueError, match="every_steps=0"):
        CheckpointPolicy(every_steps=0)


def test_invalid_arguments(trained, tmp_path):
    with pytest.raises(ValueError, match="step=-1"):
        save_checkpoint(trained, tmp_path, -1, HASH)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_checkpoint(trained, tmp_path / "file", HASH)


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 64 KiB filesystem (tmpfs), too small for any checkpoint; remount it larger to free space."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode:
        pytest.skip("tmpfs cannot be mounted here")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_said_in_words_counted_and_recovered_from(trained, small_disk, caplog):
    """Issue 16: a state directory on a full disk logged an opaque `enforce fail at inline_container.cc` on every
    step while the node kept serving."""
    from sentinel_node.roles.replica_state import ReplicaState

    directory = small_disk / "state"
    with pytest.raises(CheckpointWriteError, match=r"disk full: the checkpoint of step 2 needs about [\d.]+ MiB in"):
        save_checkpoint(trained, directory, 2, HASH)
    assert list_checkpoints(directory) == []
    state = ReplicaState(trained, HASH, str(directory), checkpoint_every=1)
    with caplog.at_level("INFO"):
        for step in (3, 4, 5):
            state.step = step
            state.save(force=True)
    assert state.failed == 3 and state.saved == 0 and state.problem.startswith("disk full")
    assert str(directory) in state.problem and "MiB free" in state.problem
    assert caplog.text.count("not saved: disk full") == 1  # once, not on every step
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space freed
    state.step = 6
    state.save(force=True)
    state.close()
    assert state.problem is None and state.saved == 1
    assert [step for step, _ in list_checkpoints(directory)] == [6]
