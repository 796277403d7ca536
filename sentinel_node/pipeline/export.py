"""``sentinel-node export``: the stages' latest states assembled into one Hugging Face checkpoint.

States come from the stages' checkpoint folders (``--state-dir`` of each replica; see
:mod:`sentinel_node.pipeline.checkpoint`) or from live replicas (:mod:`sentinel_node.roles.state_download`). Every
stage must be there and all from the same global step: a checkpoint mixing steps is a model no one trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.utils import get_logger

from sentinel_node.config import Config
from sentinel_node.model.weights import WeightsError, export_checkpoint
from sentinel_node.pipeline.checkpoint import FORMAT, list_checkpoints

logger = get_logger(__name__)


@dataclass(frozen=True)
class StageState:
    stage: int
    step: int
    model: Mapping[str, torch.Tensor]
    origin: str


def check_payload(payload: object, config: Config, origin: str) -> StageState:
    """The stage, step and parameters of a captured stage state (a checkpoint or a downloaded one)."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise WeightsError(f"{origin} is not a sentinel-node stage state")
    if payload.get("config_hash") != config.swarm_hash():
        raise WeightsError(
            f"{origin} was written under swarm config {payload.get('config_hash')}, --config is "
            f"{config.swarm_hash()}; pass the config the swarm trained with"
        )
    if payload.get("n_stages") != config.pipeline.n_stages:
        raise WeightsError(
            f"{origin} holds a stage of {payload.get('n_stages')}, the config has {config.pipeline.n_stages}"
        )
    stage, step, model = payload.get("stage"), payload.get("step"), payload.get("model")
    if not isinstance(stage, int) or not isinstance(step, int) or not isinstance(model, dict):
        raise WeightsError(f"{origin} is corrupt (stage, step or parameters missing)")
    return StageState(stage, step, model, origin)


def states_from_dirs(config: Config, directories: Iterable[str | Path]) -> dict[int, StageState]:
    """The newest checkpoint of each folder; where several folders hold one stage, the newest of them."""
    found: dict[int, StageState] = {}
    for directory in directories:
        checkpoints = list_checkpoints(directory)
        if not checkpoints:
            raise WeightsError(f"--from {directory} holds no stage checkpoint (checkpoint-*.pt)")
        path = checkpoints[-1][1]
        try:
            # mmap: the optimizer state in the file is never read into memory
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise WeightsError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from None
        state = check_payload(payload, config, f"checkpoint {path}")
        if state.stage not in found or state.step > found[state.stage].step:
            found[state.stage] = state
    return found


def assemble(config: Config, states: Mapping[int, StageState], out: str | Path) -> Path:
    """Checks that every stage is there at one step, then writes the checkpoint (with the tokenizer)."""
    n = config.pipeline.n_stages
    missing = [k for k in range(n) if k not in states]
    if missing:
        raise WeightsError(
            f"no state of stage(s) {', '.join(map(str, missing))}: every one of the {n} stages is needed (give each "
            "stage's --state-dir, or wait until a replica of each serves)"
        )
    steps = {k: states[k].step for k in range(n)}
    if len(set(steps.values())) > 1:
        listed = ", ".join(f"stage {k} at step {s} ({states[k].origin})" for k, s in steps.items())
        raise WeightsError(
            f"the stages are at different global steps ({listed}); export when every stage has saved the same "
            "step (stop the trainer and let the stages checkpoint on shutdown), or give older folders"
        )
    tokenizer = None
    if config.data.tokenizer != "bytes":
        from sentinel_node.data import DataError, load_tokenizer

        try:
            tokenizer = load_tokenizer(config.data.tokenizer, config.model.vocab_size)
        except DataError as e:
            raise WeightsError(f"the tokenizer cannot be saved with the model: {e}") from None
    path = export_checkpoint(config, {k: s.model for k, s in states.items()}, out, tokenizer)
    logger.info(f"exported global step {steps[0]} of {n} stages to {path}")
    return path
