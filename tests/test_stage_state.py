"""A stage replica's state across restarts and joins, as real processes on loopback: a SIGKILLed replica restarted
with its ``--state-dir`` resumes from its checkpoint and the step count goes on; a new replica of a live stage
takes the stage's state from it before serving; a damaged checkpoint stops a node with a clear error."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from sentinel_node.demo import Demo, DemoSettings, SwarmStartError
from sentinel_node.pipeline.checkpoint import list_checkpoints

FIRST_RUN = 7  # global steps 0..6; checkpoints after steps 0, 3 and 6
SECOND_RUN = 3  # steps 7..9
EVERY = 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, forkserver) -> Iterator[Demo]:
    settings = DemoSettings(
        forkserver=forkserver,
        steps=FIRST_RUN,
        attack=None,
        replicas=1,
        verifiers=1,
        workdir=tmp_path_factory.mktemp("state"),
        eval_every=100,
        metrics=False,
        state=True,
        checkpoint_every=EVERY,
    )
    with Demo(settings) as demo:
        demo.start()
        demo.first = demo.train()
        yield demo


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_replica_resumes_from_its_checkpoint_and_the_step_goes_on(swarm):
    name = "stage1-0"
    directory = swarm.state_dir(name)
    # the latest two of 0, 3, 6 (periodic checkpoints are written in the background)
    wait_for(lambda: [step for step, _ in list_checkpoints(directory)] == [3, 6], what="checkpoints 3 and 6")
    peer = swarm.peer(name)
    swarm.swarm.kill(name)  # SIGKILL: no shutdown checkpoint
    restarted = swarm.swarm.restart(name)
    swarm.swarm.wait_ready([restarted], 120)
    assert restarted.peer_id == peer  # same identity
    status = wait_for(restarted.status, what="the restarted replica's status")
    assert status.resumed_from == FIRST_RUN - 1 and status.last_step == FIRST_RUN - 1

    # a new replica of the same stage takes the state from the live one before it serves
    joiner = swarm.swarm.start("stage1-1", "stage", "--stage", "1", "--state-dir", str(swarm.state_dir("stage1-1")))
    swarm.swarm.wait_ready([joiner], 120)
    joined = wait_for(joiner.status, what="the joining replica's status")
    assert joined.synced_from == peer and joined.last_step == FIRST_RUN - 1 and joined.resumed_from is None

    second = swarm.train(steps=SECOND_RUN, name="trainer2")
    steps = [record["step"] for record in swarm.steps[FIRST_RUN:]]
    assert steps == list(range(FIRST_RUN, FIRST_RUN + SECOND_RUN))  # continuing, not restarting
    first_val = dict(swarm.first["val_curve"])
    second_val = dict(second["val_curve"])
    # validated before the second run trains: the model is the trained one, not a fresh stage 1
    assert second_val[FIRST_RUN] < first_val[0] - 0.3, (first_val, second_val)
    assert second_val[FIRST_RUN] < first_val[FIRST_RUN] + 0.1
    last = FIRST_RUN + SECOND_RUN - 1
    for replica in (restarted, joiner):
        wait_for(lambda r=replica: getattr(r.status(), "last_step", None) == last, what=f"{replica.name} at {last}")
    wait_for(lambda: max(step for step, _ in list_checkpoints(directory)) == last, what=f"checkpoint {last}")


def test_a_replica_behind_the_swarm_refuses_to_serve_unless_told(swarm):
    """Issue 16: after a restart, the only replica of stage 0 resumed from an old state and served it as current
    (944 steps of the stage lost, unnoticed). It now refuses, naming both steps, unless --resume-behind."""
    name = "stage0-0"
    swarm.swarm.kill(name, signal.SIGTERM)  # its shutdown checkpoint is at the swarm's step
    swarm.node(name).process.wait(timeout=60)
    checkpoints = list_checkpoints(swarm.state_dir(name))
    (newest, path), (older, _) = checkpoints[-1], checkpoints[-2]
    assert newest == FIRST_RUN + SECOND_RUN - 1 > older
    path.unlink()  # as if the disk had lost the newest checkpoints: the replica would resume from step `older`
    restarted = swarm.swarm.restart(name)
    with pytest.raises(SwarmStartError, match=f"state is at step {older}.*live replicas are at step {newest}") as info:
        swarm.swarm.wait_ready([restarted], 180)
    assert "--resume-behind" in str(info.value)
    assert restarted.process.wait(timeout=30) != 0
    restarted = swarm.swarm.restart(name, "--resume-behind")
    swarm.swarm.wait_ready([restarted], 180)
    status = wait_for(restarted.status, what="the restarted replica's status")
    assert status.resumed_from == older and status.last_step == newest  # its old state, at the swarm's step
    assert "--resume-behind: serving step" in restarted.log_tail(20000)


def test_a_damaged_checkpoint_stops_the_node_with_a_clear_error(swarm):
    name = "stage2-0"
    swarm.swarm.kill(name, signal.SIGTERM)
    swarm.node(name).process.wait(timeout=30)
    checkpoints = list_checkpoints(swarm.state_dir(name))
    newest = checkpoints[-1][1]
    assert newest.name.endswith(f"{FIRST_RUN + SECOND_RUN - 1:010d}.pt")  # the newest
    newest.write_bytes(newest.read_bytes()[:1000])
    restarted = swarm.swarm.restart(name)
    with pytest.raises(SwarmStartError, match="is corrupt or not a sentinel-node checkpoint") as info:
        swarm.swarm.wait_ready([restarted], 60)
    assert f"delete {newest}" in str(info.value)  # and what to do
    assert restarted.process.wait(timeout=10) != 0
