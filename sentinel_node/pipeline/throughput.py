"""How fast a stage replica computes: forward and backward of random microbatches on its own device, timed once
and cached per host, swarm config, stage, device and torch build (like Petals' throughput cache), so a replica
that restarts announces its figure at once instead of measuring again.

The figure is tokens per second of compute: on the CPU, per CPU second of the thread that computes (so other
processes on a shared machine do not make it look slow); on a GPU, per second of wall time with the device
synchronised.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.utils.logging import get_logger

from sentinel_node.pipeline.stage_worker import StageWorker

logger = get_logger(__name__)

CACHE_NAME = "throughput.json"


@dataclass(frozen=True)
class Measured:
    tokens_per_s: float
    cached: bool  # read from the cache rather than measured now


def cache_key(worker: StageWorker, config_hash: str) -> str:
    return "|".join(
        [
            platform.node(),
            config_hash,
            f"stage{worker.stage}",
            str(worker.device),
            worker.precision.name,
            f"torch{torch.__version__}",
            f"threads{torch.get_num_threads()}",
        ]
    )


def benchmark(worker: StageWorker, batch: int, seq_len: int, vocab: int, hidden: int, rounds: int = 3) -> float:
    """Tokens per second of forward and backward on random microbatches; the first (warm-up) is not counted.
    Leaves no gradient behind."""
    shape = (batch, seq_len)
    device = worker.device
    if worker.is_first:
        inputs = torch.randint(0, vocab, shape, device=device)
    else:
        inputs = torch.randn(*shape, hidden, device=device)
    module, timed = worker.module, 0.0
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    for index in range(rounds + 1):
        if cuda:
            torch.cuda.synchronize(device)
        started = clock()
        output = module(inputs)
        output.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize(device)
        if index:
            timed += clock() - started
    module.zero_grad(set_to_none=True)
    return rounds * batch * seq_len / max(timed, 1e-6)


def measure(
    worker: StageWorker,
    config_hash: str,
    shape: tuple[int, int, int, int],
    cache_dir: str | os.PathLike | None = None,
) -> Measured:
    """The replica's tokens/s (``shape``: batch, seq_len, vocab, hidden), from ``cache_dir/throughput.json`` when
    it holds this host's figure for the same config, stage, device and torch, else measured (and cached)."""
    key = cache_key(worker, config_hash)
    path = Path(cache_dir) / CACHE_NAME if cache_dir is not None else None
    cache = _read(path) if path is not None else {}
    entry = cache.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("tokens_per_s"), float) and entry["tokens_per_s"] > 0:
        return Measured(entry["tokens_per_s"], cached=True)
    batch, seq_len, vocab, hidden = shape
    tokens_per_s = benchmark(worker, batch, seq_len, vocab, hidden)
    if path is not None:
        cache[key] = {"tokens_per_s": tokens_per_s, "measured": time.time()}
        _write(path, cache)
    return Measured(tokens_per_s, cached=False)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning(f"ignoring the throughput cache {path} ({e}); measuring again")
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(cache, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError as e:
        logger.warning(f"cannot write the throughput cache {path}: {e}")
