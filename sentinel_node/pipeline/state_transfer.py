"""A stage replica's state on the wire: a captured state (see :func:`checkpoint.capture_state`) as small metadata
plus a flat list of tensors, the form hivemind's averager state sharing carries, and back.

The metadata holds only numbers, strings and lists (msgpack), the tensors are plain tensors, so a state from a
peer is data, never code. :func:`unpack_state` checks the structure; :func:`checkpoint.restore_state` then checks
that it fits the replica, so a malformed or foreign state is a clear :class:`CheckpointError`, never a crash.
"""

from __future__ import annotations

from typing import Any

import torch

from sentinel_node.pipeline.checkpoint import CheckpointError

_SCALARS = (int, float, bool, str, type(None))
_HEADER = ("format", "version", "step", "stage", "n_stages", "config_hash", "optimizer_name", "optimizer_steps")


def pack_state(payload: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(metadata, tensors) for a captured state: the model's tensors in ``metadata["model"]`` order, then the
    optimizer's, each optimizer entry naming its parameter, key and either a tensor index or a scalar value."""
    # copies: the replica goes on training while they are sent
    tensors = [tensor.detach().to("cpu", copy=True) for tensor in payload["model"].values()]
    entries = []
    for index, values in payload["optimizer"]["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                entries.append([int(index), key, "tensor", len(tensors)])
                tensors.append(value.detach().to("cpu", copy=True))
            else:
                entries.append([int(index), key, "value", value])
    metadata = {key: payload[key] for key in _HEADER}
    metadata["model"] = list(payload["model"])
    metadata["optimizer_state"] = entries
    return metadata, tensors


def unpack_state(metadata: Any, tensors: list[Any], origin: str, param_groups: list[dict]) -> dict[str, Any]:
    """The captured state that :func:`pack_state` packed, with ``param_groups`` (this replica's own optimizer
    settings: a peer sends moments, never hyperparameters); CheckpointError (naming ``origin``) for anything else."""
    if not isinstance(metadata, dict) or not all(key in metadata for key in (*_HEADER, "model", "optimizer_state")):
        raise CheckpointError(f"{origin} sent no sentinel-node stage state (its metadata lacks required fields)")
    if not all(isinstance(tensor, torch.Tensor) for tensor in tensors):
        raise CheckpointError(f"{origin} sent something other than tensors")
    names, entries = metadata["model"], metadata["optimizer_state"]
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names) or len(names) > len(tensors):
        raise CheckpointError(f"{origin} sent a malformed parameter list")
    if not isinstance(entries, list):
        raise CheckpointError(f"{origin} sent a malformed optimizer state")
    state: dict[int, dict[str, Any]] = {}
    used = set(range(len(names)))
    for entry in entries:
        if not (isinstance(entry, list | tuple) and len(entry) == 4):
            raise CheckpointError(f"{origin} sent a malformed optimizer state entry {entry!r:.80}")
        index, key, kind, value = entry
        if not isinstance(index, int) or not isinstance(key, str):
            raise CheckpointError(f"{origin} sent a malformed optimizer state entry {entry!r:.80}")
        if kind == "tensor" and isinstance(value, int) and len(names) <= value < len(tensors) and value not in used:
            used.add(value)
            value = tensors[value]
        elif kind != "value" or not isinstance(value, _SCALARS):
            raise CheckpointError(f"{origin} sent a malformed optimizer state entry {entry!r:.80}")
        state.setdefault(index, {})[key] = value
    if len(used) != len(tensors):
        raise CheckpointError(f"{origin} sent {len(tensors) - len(used)} tensors its metadata does not name")
    payload = {key: metadata[key] for key in _HEADER}
    payload["model"] = dict(zip(names, tensors, strict=False))
    payload["optimizer"] = {"state": state, "param_groups": param_groups}
    return payload
