"""A replica's state on the wire: exact round trips through hivemind's msgpack and tensor serialization, and clear
refusals (never a crash, never a half-loaded worker) of anything malformed or foreign a peer may send."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.utils.serializer import MSGPackSerializer
from test_checkpoint import HASH, assert_same_state, snapshot, train, worker

from sentinel_node.pipeline.checkpoint import CheckpointError, capture_state, restore_state
from sentinel_node.pipeline.state_transfer import pack_state, unpack_state


def over_the_wire(metadata, tensors):
    """What the averager's download hands over: msgpack metadata and protobuf-serialized tensors."""
    wire = MSGPackSerializer.dumps(metadata)
    return MSGPackSerializer.loads(wire), [deserialize_torch_tensor(serialize_torch_tensor(t)) for t in tensors]


def groups(w):
    return w.optimizer.state_dict()["param_groups"]


@pytest.fixture
def sender():
    w = worker()
    train(w, range(3))
    return w


def test_state_survives_the_wire_exactly_and_training_goes_on_identically(sender):
    metadata, tensors = over_the_wire(*pack_state(capture_state(sender, 2, HASH)))
    joiner = worker()
    step = restore_state(joiner, unpack_state(metadata, tensors, "peer X", groups(joiner)), "peer X", HASH, "fix")
    assert step == 2 and joiner.steps == sender.steps
    assert_same_state(sender, joiner)
    train(sender, range(3, 5))
    train(joiner, range(3, 5))
    assert_same_state(sender, joiner)


def test_packed_tensors_are_copies(sender):
    _, tensors = pack_state(capture_state(sender, 2, HASH))
    before = tensors[0].clone()
    train(sender, range(3, 4))
    assert torch.equal(tensors[0], before)
    assert not torch.equal(next(iter(sender.module.state_dict().values())), before)


def test_a_peers_hyperparameters_are_ignored(sender):
    metadata, tensors = pack_state(capture_state(sender, 2, HASH))
    joiner = worker()
    mine = groups(joiner)
    payload = unpack_state(metadata, tensors, "peer X", mine)
    assert payload["optimizer"]["param_groups"] is mine


def mutate(metadata: dict, tensors: list, how: str):
    if how == "not a dict":
        return ["state"], tensors
    if how == "lacks step":
        return {k: v for k, v in metadata.items() if k != "step"}, tensors
    if how == "names a tensor twice":
        entries = [list(e) for e in metadata["optimizer_state"]]
        tensor_entries = [e for e in entries if e[2] == "tensor"]
        tensor_entries[1][3] = tensor_entries[0][3]
        return {**metadata, "optimizer_state": entries}, tensors
    if how == "index out of range":
        entries = [list(e) for e in metadata["optimizer_state"]]
        next(e for e in entries if e[2] == "tensor")[3] = len(tensors) + 5
        return {**metadata, "optimizer_state": entries}, tensors
    if how == "an extra tensor":
        return metadata, [*tensors, torch.zeros(3)]
    if how == "a non-tensor":
        return metadata, [*tensors[:-1], "weights"]
    if how == "an object value":
        entries = [list(e) for e in metadata["optimizer_state"]]
        entries.append([0, "evil", "value", {"a": 1}])
        return {**metadata, "optimizer_state": entries}, tensors
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how, message",
    [
        ("not a dict", "sent no sentinel-node stage state"),
        ("lacks step", "sent no sentinel-node stage state"),
        ("names a tensor twice", "malformed optimizer state entry"),
        ("index out of range", "malformed optimizer state entry"),
        ("an extra tensor", "tensors its metadata does not name"),
        ("a non-tensor", "something other than tensors"),
        ("an object value", "malformed optimizer state entry"),
    ],
)
def test_malformed_states_are_refused_by_name(sender, how, message):
    metadata, tensors = mutate(*pack_state(capture_state(sender, 2, HASH)), how)
    joiner = worker()
    with pytest.raises(CheckpointError, match=f"peer Q.*{message}|{message}") as info:
        unpack_state(metadata, tensors, "peer Q", groups(joiner))
    assert "peer Q" in str(info.value)


@pytest.mark.parametrize("damage", ["shape", "nan", "stage", "config"])
def test_foreign_or_poisoned_states_leave_the_worker_untouched(sender, damage):
    payload = capture_state(sender, 2, HASH)
    metadata, tensors = pack_state(payload)
    if damage == "shape":
        tensors[0] = torch.zeros(3, 3)
    elif damage == "nan":
        tensors[0] = torch.full_like(tensors[0], float("nan"))
    elif damage == "stage":
        metadata["stage"] = 0
    elif damage == "config":
        metadata["config_hash"] = "another"
    joiner = worker()
    before = snapshot(joiner)
    payload = unpack_state(metadata, tensors, "peer Q", groups(joiner))
    with pytest.raises(CheckpointError, match="peer Q"):
        restore_state(joiner, payload, "peer Q", HASH, "try another replica", any_optimizer=True)
    after = snapshot(joiner)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert joiner.steps == 0


def test_another_optimizers_state_loads_parameters_only(sender):
    payload = capture_state(sender, 2, HASH)
    payload["optimizer_name"] = "bitsandbytes.AdamW8bit"
    payload["optimizer"] = {"state": {0: {"state1": torch.zeros(4, dtype=torch.uint8)}}, "param_groups": []}
    joiner = worker()
    with pytest.raises(CheckpointError, match="holds bitsandbytes.AdamW8bit state"):
        restore_state(joiner, payload, "peer Q", HASH, "fix")
    assert restore_state(joiner, payload, "peer Q", HASH, "fix", any_optimizer=True) == 2
    for x, y in zip(sender.module.state_dict().values(), joiner.module.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert joiner.optimizer.state_dict()["state"] == {}


def test_replica_state_saves_when_due_resumes_and_refuses_a_damaged_directory(tmp_path):
    from sentinel_node.pipeline.checkpoint import list_checkpoints
    from sentinel_node.roles.common import NodeError
    from sentinel_node.roles.replica_state import ReplicaState

    w = worker()
    state = ReplicaState(w, HASH, str(tmp_path), checkpoint_every=3)
    assert state.resume() is None and state.step == -1
    for step in range(5):
        train(w, range(step, step + 1))
        with state.lock:
            state.step = step
        state.save(force=False)
        state.flush()  # periodic checkpoints are written in the background
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0, 3] and state.saved == 2
    state.save()  # shutdown: the last step, due or not
    state.save()  # once
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4] and state.saved == 3

    again = ReplicaState(worker(), HASH, str(tmp_path), checkpoint_every=3)
    assert again.resume() == 4 and again.step == 4 and again.resumed_from == 4
    assert_same_state(w, again.worker)
    metadata, tensors = again.current()
    assert metadata["step"] == 4 and len(tensors) > len(metadata["model"])

    newest = list_checkpoints(tmp_path)[-1][1]
    newest.write_bytes(b"not a checkpoint")
    with pytest.raises(NodeError, match="is corrupt or not a sentinel-node checkpoint"):
        ReplicaState(worker(), HASH, str(tmp_path)).resume()
    state.close()


def test_a_periodic_checkpoint_is_written_in_the_background_from_a_copy(tmp_path, monkeypatch):
    import threading

    import sentinel_node.roles.replica_state as replica_state
    from sentinel_node.pipeline.checkpoint import list_checkpoints, load_checkpoint
    from sentinel_node.roles.replica_state import ReplicaState

    release, writing = threading.Event(), threading.Event()
    real_write = replica_state.write_checkpoint

    def slow_write(payload, directory, keep=2):
        writing.set()
        release.wait(10)
        return real_write(payload, directory, keep)

    monkeypatch.setattr(replica_state, "write_checkpoint", slow_write)
    w = worker()
    train(w, range(1))
    state = ReplicaState(w, HASH, str(tmp_path), checkpoint_every=1)
    state.step = 0
    state.save(force=False)  # returns while the write waits
    assert writing.wait(10) and list_checkpoints(tmp_path) == []
    saved = snapshot(w)
    train(w, range(1, 2))  # the replica trains on meanwhile
    state.step = 1
    state.save(force=False)  # the last one is still being written: skipped
    release.set()
    state.flush()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0] and state.saved == 1
    restored = worker()
    assert load_checkpoint(restored, tmp_path, HASH) == 0
    assert all(torch.equal(saved[k], v) for k, v in restored.module.state_dict().items())  # step 0's copy
    state.save()  # shutdown: step 1, now
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0, 1] and state.saved == 2
    state.close()


class _Averager:
    """What ReplicaState asks an averager for: a peer's packed state (None: the peer gave none)."""

    def __init__(self, states: dict) -> None:
        self.states = states

    def download_state(self, peer: str, timeout: float, max_bytes: int):
        return self.states.get(peer)


def test_a_replica_that_missed_steps_takes_the_state_of_a_replica_past_them(sender):
    """Issue 14, item 2: a replica cut off from the swarm for some steps takes a live replica's newer state when it
    is back; a state not past the step it stopped at, or none at all, is not taken."""
    import asyncio

    from sentinel_node.roles.compute import ComputeLane
    from sentinel_node.roles.replica_state import ReplicaState

    behind = worker()
    train(behind, range(1))
    state = ReplicaState(behind, HASH)
    state.step = 6  # it applied the step call that came after the gap, on parameters of step 0
    lane = ComputeLane("test")
    try:
        old = _Averager({"old": over_the_wire(*pack_state(capture_state(sender, 0, HASH)))})
        assert not asyncio.run(state.resync(["silent", "old"], old, lane, newer_than=0))
        assert state.resyncs == 0 and state.synced_from is None
        live = _Averager({"live": over_the_wire(*pack_state(capture_state(sender, 5, HASH)))})
        # newer than step 0, though not newer than its own step 6: taken
        assert asyncio.run(state.resync(["silent", "live"], live, lane, newer_than=0))
        assert state.resyncs == 1 and state.synced_from == "live" and state.step == 5
        assert_same_state(sender, behind)
    finally:
        lane.close()
