"""Crash-safe checkpoints of one stage replica: its parameters, its optimizer state and the global step.

Layout: one directory per node, holding ``checkpoint-<step>.pt`` files (the step zero-padded so names sort by
step). Each file is complete or absent: it is written under a temporary name in the same directory, flushed and
fsynced, renamed onto its final name with ``os.replace`` (atomic on POSIX) and the directory is fsynced, so a
crash or a power cut at any moment leaves the previous checkpoints intact and never a partial file under a
checkpoint's name. Older checkpoints are deleted only once the new one is durable; by default the latest and the
one before it are kept, so a checkpoint that turns out unreadable (a disk fault) can be deleted by hand to resume
from the previous one.

Files are read with ``torch.load(weights_only=True)``: they hold only tensors, numbers, strings and containers
of those, so loading a file from disk can never run code. They are created readable by their owner only.

One process writes a directory at a time (a node's own); two nodes sharing a directory would prune each other's
files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hivemind.utils.logging import get_logger

if TYPE_CHECKING:
    from sentinel_node.pipeline.stage_worker import StageWorker

logger = get_logger(__name__)

FORMAT = "sentinel-node/stage-checkpoint"
VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
_TMP_PREFIX = ".checkpoint-"
_TMP_SUFFIX = ".tmp"
_REQUIRED = {
    "format": str,
    "version": int,
    "step": int,
    "stage": int,
    "n_stages": int,
    "config_hash": str,
    "optimizer_name": str,
    "optimizer_steps": int,
    "model": dict,
    "optimizer": dict,
}


class CheckpointError(ValueError):
    """A checkpoint cannot be used: the message names the file, what is wrong and what to do."""


@dataclass
class CheckpointPolicy:
    """When to save: every `every_steps` global steps since the last save (steps may be skipped, so not modulo)."""

    every_steps: int
    last_saved: int | None = None

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ValueError(f"every_steps={self.every_steps} must be at least 1")

    def due(self, step: int) -> bool:
        """True when a checkpoint should be written after global step `step` has been applied."""
        if step < 0:
            return False
        return self.last_saved is None or step - self.last_saved >= self.every_steps

    def saved(self, step: int) -> None:
        self.last_saved = step


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"checkpoint-{step:010d}.pt"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `directory`, oldest first; temporary files are ignored."""
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} is not a directory; pass a directory path")
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def capture_state(worker: StageWorker, step: int, config_hash: str) -> dict[str, Any]:
    """The worker's state after global step ``step``, as a checkpoint holds it (tensors are the live ones: copy or
    serialize them before the worker steps again)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "stage": worker.stage,
        "n_stages": worker.n_stages,
        "config_hash": config_hash,
        "optimizer_name": worker.optimizer_name,
        "optimizer_steps": worker.steps,
        "model": dict(worker.module.state_dict()),
        "optimizer": worker.optimizer.state_dict(),
    }


def restore_state(
    worker: StageWorker, payload: Any, origin: str, config_hash: str, fix: str, any_optimizer: bool = False
) -> int:
    """Loads a captured state into ``worker`` and returns its step; :class:`CheckpointError` (naming ``origin``,
    e.g. "checkpoint PATH", and suggesting ``fix`` where the state is damaged) leaves the worker untouched.

    ``any_optimizer``: a state kept by another optimizer (a GPU replica's 8-bit AdamW, for a CPU replica) loads its
    parameters and leaves the optimizer fresh, instead of being refused.
    """
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{origin} is not a sentinel-node stage checkpoint; {fix}")
    with_optimizer = payload.get("optimizer_name") == worker.optimizer_name or not any_optimizer
    _check(payload, origin, worker, config_hash, fix, with_optimizer)
    if with_optimizer:
        try:
            # first: it validates before it changes anything, and _check has already vetted the parameters
            worker.optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"{origin}: optimizer state does not load ({e}); {fix}") from None
    else:
        logger.warning(
            f"{origin} holds {payload['optimizer_name']} state, this node uses {worker.optimizer_name}: "
            "loading its parameters only (the optimizer's moments start afresh)"
        )
    worker.module.load_state_dict(payload["model"])
    worker.optimizer.zero_grad(set_to_none=True)
    worker._pending.clear()
    worker.accumulated = 0
    worker.steps = payload["optimizer_steps"]
    return payload["step"]


def save_checkpoint(worker: StageWorker, directory: str | Path, step: int, config_hash: str, keep: int = 2) -> Path:
    """Writes the worker's state after global step `step` atomically; returns the checkpoint's path.

    Call it between global steps (after ``worker.step``): gradients accumulated since the last step and graphs
    awaiting backward are not saved. Keeps the `keep` newest checkpoints (the latest and the previous by default)
    and removes temporary files a crashed save left behind.
    """
    return write_checkpoint(snapshot_state(worker, step, config_hash), directory, keep)


def snapshot_state(worker: StageWorker, step: int, config_hash: str) -> dict[str, Any]:
    """A captured state whose tensors are copies on the CPU: :func:`write_checkpoint` may write it in another
    thread while the worker trains on. Call it between global steps, as :func:`save_checkpoint`."""
    if step < 0:
        raise ValueError(f"step={step}: a checkpoint records an applied global step (0 or more)")
    if worker.accumulated or worker._pending:
        logger.info(
            f"checkpoint at step {step} leaves out {worker.accumulated} accumulated and "
            f"{len(worker._pending)} pending microbatches (they belong to a step not yet applied)"
        )
    payload = capture_state(worker, step, config_hash)
    payload["model"] = {name: _copy(value) for name, value in payload["model"].items()}
    optimizer = payload["optimizer"]
    optimizer["state"] = {
        index: {key: _copy(value) for key, value in values.items()} for index, values in optimizer["state"].items()
    }
    return payload


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written; the message says why in words (disk full, the path, the bytes needed)."""


def payload_bytes(payload: dict[str, Any]) -> int:
    """About what a checkpoint of ``payload`` takes on disk: its tensors' bytes (the rest is small)."""
    total = 0
    for value in payload["model"].values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    for values in payload["optimizer"].get("state", {}).values():
        for value in values.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total + (1 << 16)


def write_checkpoint(payload: dict[str, Any], directory: str | Path, keep: int = 2) -> Path:
    """Writes a snapshot (:func:`snapshot_state`) atomically, prunes to the `keep` newest; returns its path.

    CheckpointWriteError saying why when it cannot: a disk without room for it is found before writing (torch
    says only "enforce fail at inline_container.cc" when it runs out of room mid-way)."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1")
    step = payload["step"]
    directory = Path(directory)
    needed = payload_bytes(payload)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_stale_temporaries(directory)
    except OSError as e:
        raise CheckpointWriteError(f"cannot write checkpoints into {directory}: {e.strerror or e}") from None
    free = _free_bytes(directory)
    if free is not None and free < needed:
        raise CheckpointWriteError(_disk_full(directory, step, needed, free))
    final = checkpoint_path(directory, step)
    try:
        # mkstemp creates the file 0600: the owner alone may read or replace a node's weights
        fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=directory)
    except OSError as e:
        raise CheckpointWriteError(f"cannot create a checkpoint in {directory}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        if isinstance(e, Exception):
            free = _free_bytes(directory)
            if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or (free is not None and free < needed):
                raise CheckpointWriteError(_disk_full(directory, step, needed, free or 0)) from None
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointWriteError(f"checkpoint {final} could not be written: {reason}") from None
        raise
    _fsync_directory(directory)
    _prune(directory, final, step, keep)
    logger.debug(f"stage {payload['stage']}: saved checkpoint {final}")
    return final


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _disk_full(directory: Path, step: int, needed: int, free: int) -> str:
    return (
        f"disk full: the checkpoint of step {step} needs about {needed / 2**20:.1f} MiB in {directory}, which has "
        f"{free / 2**20:.1f} MiB free; free some space or point --state-dir elsewhere"
    )


def _copy(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def load_checkpoint(worker: StageWorker, directory: str | Path, config_hash: str) -> int | None:
    """Restores the newest checkpoint in `directory` into `worker`; returns its global step, None when there is none.

    A checkpoint that is unreadable or belongs to another stage, pipeline, config or optimizer raises
    :class:`CheckpointError` and leaves the worker untouched; it is never skipped for an older one or a fresh start,
    since either would silently throw training away. Gradients and microbatches awaiting backward are discarded.
    """
    checkpoints = list_checkpoints(directory)
    if not checkpoints:
        return None
    step, path = checkpoints[-1]
    previous = checkpoints[-2][1] if len(checkpoints) > 1 else None
    fix = (
        f"delete {path} to resume from the previous checkpoint {previous.name}"
        if previous is not None
        else f"move {path} away to start this stage from scratch"
    )
    payload = _read(path, fix)
    if isinstance(payload, dict) and isinstance(payload.get("step"), int) and payload["step"] != step:
        raise CheckpointError(f"checkpoint {path} records step {payload['step']}, not the step in its name; {fix}")
    restore_state(worker, payload, f"checkpoint {path}", config_hash, fix)
    logger.info(f"stage {worker.stage}: resumed from checkpoint {path} (global step {step})")
    return step


def _read(path: Path, fix: str) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {e.strerror or e}; check its permissions") from None
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError... for a damaged file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a sentinel-node checkpoint ({reason}); {fix}"
        ) from None
    return payload


def _check(
    payload: dict[str, Any], origin: str, worker: StageWorker, config_hash: str, fix: str, with_optimizer: bool
) -> None:
    """Everything that would make the checkpoint wrong for this worker, before any of it is changed."""
    missing = [key for key in _REQUIRED if key not in payload]
    if missing:
        raise CheckpointError(f"{origin} is incomplete: it lacks {', '.join(missing)}; {fix}")
    wrong = [
        f"{key} ({type(payload[key]).__name__})" for key, kind in _REQUIRED.items() if not _is(payload[key], kind)
    ]
    if wrong:
        raise CheckpointError(f"{origin} is corrupt: wrong type of {', '.join(wrong)}; {fix}")
    if payload["version"] != VERSION:
        raise CheckpointError(
            f"{origin} has format version {payload['version']}, this node reads version {VERSION}; "
            "use the sentinel-node release that wrote it, or move it away to start from scratch"
        )
    elsewhere = "give each stage its own checkpoint directory, or move the file away to start from scratch"
    if payload["n_stages"] != worker.n_stages or payload["stage"] != worker.stage:
        raise CheckpointError(
            f"{origin} holds stage {payload['stage']} of {payload['n_stages']}, but this node serves stage "
            f"{worker.stage} of {worker.n_stages}; {elsewhere}"
        )
    if payload["config_hash"] != config_hash:
        raise CheckpointError(
            f"{origin} was written under swarm config {payload['config_hash']}, this node runs config "
            f"{config_hash}; rejoin with the config that wrote it, or move the file away to start from scratch"
        )
    if with_optimizer and payload["optimizer_name"] != worker.optimizer_name:
        raise CheckpointError(
            f"{origin} holds {payload['optimizer_name']} state, this node uses {worker.optimizer_name} "
            f"(on {worker.device}); resume on a device with the same optimizer, or move the file away to start from "
            "scratch"
        )
    _check_tensors(payload["model"], worker.module.state_dict(), origin, fix)
    if with_optimizer:
        _check_optimizer(payload["optimizer"], worker.optimizer, origin, fix)


def _check_tensors(saved: dict, current: dict, origin: str, fix: str) -> None:
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:5])}"] if missing else []) + (
            [f"unexpected {', '.join(extra[:5])}"] if extra else []
        )
        raise CheckpointError(
            f"{origin} does not fit this stage's parameters ({'; '.join(parts)}): it was written for "
            "another model; move it away to start from scratch"
        )
    for name, tensor in current.items():
        value = saved[name]
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{origin} is corrupt: {name} is not a tensor; {fix}")
        if value.shape != tensor.shape:
            raise CheckpointError(
                f"{origin}: parameter {name} has shape {tuple(value.shape)}, this stage's has "
                f"{tuple(tensor.shape)} (a different model config); move it away to start from scratch"
            )
        if value.is_floating_point() != tensor.is_floating_point():
            raise CheckpointError(f"{origin} is corrupt: {name} has dtype {value.dtype}; {fix}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{origin} is corrupt: {name} holds NaN or infinite values; {fix}")


def _check_optimizer(saved: dict, optimizer: torch.optim.Optimizer, origin: str, fix: str) -> None:
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{origin} is corrupt: its optimizer state lacks param_groups or state; {fix}")
    sizes = [len(g.get("params", ())) for g in groups]
    expected = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != expected:
        raise CheckpointError(
            f"{origin}: optimizer groups hold {sizes} parameters, this stage's hold {expected}; "
            "move it away to start from scratch"
        )
    saved_ids = [i for g in groups for i in g["params"]]
    params = dict(zip(saved_ids, (p for g in optimizer.param_groups for p in g["params"]), strict=True))
    for index, values in state.items():
        if index not in params or not isinstance(values, dict):
            raise CheckpointError(f"{origin} is corrupt: optimizer state for unknown parameter {index}; {fix}")
        # torch AdamW's moments have their parameter's shape (bitsandbytes' quantized states need not)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            value = values.get(key)
            if isinstance(value, torch.Tensor) and value.shape != params[index].shape:
                raise CheckpointError(
                    f"{origin}: optimizer {key} of parameter {index} has shape {tuple(value.shape)}, "
                    f"expected {tuple(params[index].shape)}; {fix}"
                )


def _prune(directory: Path, final: Path, step: int, keep: int) -> None:
    """Keeps `final` and the keep - 1 newest older checkpoints.

    Checkpoints of later steps describe a state this node has left (it went back to an earlier step); left in
    place, they would be the ones loaded next time.
    """
    others = [(s, p) for s, p in list_checkpoints(directory) if p != final]
    older = [p for s, p in others if s < step]
    stale = older[: max(0, len(older) - (keep - 1))]
    for s, p in others:
        if s > step:
            logger.warning(f"removing checkpoint {p.name}: this node has gone back to step {step}")
            stale.append(p)
    for p in stale:
        with contextlib.suppress(OSError):
            p.unlink()


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _remove_stale_temporaries(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.name.endswith(_TMP_SUFFIX):
            with contextlib.suppress(OSError):
                entry.unlink()


def _fsync_directory(directory: Path) -> None:
    """Makes the rename durable: without it a power cut may forget the new name even though the data is on disk."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as e:  # not every platform opens directories; the rename itself has happened
        logger.debug(f"cannot open {directory} to fsync it: {e}")
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (network mounts) refuse fsync on a directory
        logger.debug(f"fsync of {directory} failed: {e}")
    finally:
        os.close(fd)
