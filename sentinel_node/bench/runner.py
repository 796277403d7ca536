"""Mesh runs that share their past, run in parallel with a progress bar.

Runs of a benchmark differ from the step their attack starts (or from a little earlier, for an attacker that
watches honest tensors first). So one clean mesh is trained once, copied at every step where some run branches
off, and each run goes on from its copy: the clean, undefended and defended runs are then identical up to the
branch, and a difference in the loss is the attack's (or the defence's), not another draw of the data. A
process pool forked after the prefix inherits the copies.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.utils.logging import get_logger
from tqdm import tqdm

from sentinel_node.config import Config
from sentinel_node.model import Corpus
from sentinel_node.sim import AttackPlan, Mesh, SimResult

logger = get_logger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """One run: `plan()` builds its attack (None: clean), from `attack_start`, branching off the clean mesh at
    `branch` (at most `attack_start`)."""

    label: str  # for people: "scale sigma=0.5 activation defended"
    plan: Callable[[], AttackPlan | None]
    verify: bool
    attack_start: int
    branch: int
    prepare: Callable[[Mesh], None] | None = None  # changes the run's copy of the mesh before it goes on


# inherited by the pool's forked workers (plans are closures: they travel by fork, not by pickle)
_SNAPSHOTS: dict[int, Mesh] = {}
_SPECS: list[RunSpec] = []


def _run(index: int) -> tuple[int, SimResult, float]:
    torch.set_num_threads(1)  # one run per core beats one run on two
    started = time.process_time()
    spec = _SPECS[index]
    mesh = _SNAPSHOTS[spec.branch].fork()
    mesh.arm(spec.plan(), spec.verify, attack_start=spec.attack_start)
    if spec.prepare is not None:
        spec.prepare(mesh)
    result = mesh.run()
    return index, result, (time.process_time() - started) / max(1, mesh.step - spec.branch)


def run_all(
    config: Config,
    corpus: Corpus,
    specs: list[RunSpec],
    workers: int,
    progress: Callable[[str], None] | None = None,
    bar: bool = False,
) -> tuple[SimResult, list[SimResult], float | None]:
    """The clean run, each spec's result in order, and the median CPU seconds a run spent per global step.
    `progress` gets a line per finished run (with the time left); `bar` shows a tqdm bar on stderr instead."""
    torch.set_num_threads(1)
    started = time.monotonic()
    last = max((spec.branch for spec in specs), default=0)
    clean = RunSpec("clean", lambda: None, True, config.sim.attack_start, last)
    everything = [clean, *specs]
    mesh = Mesh(config, corpus, None, verify=True)
    _SNAPSHOTS.clear()
    _SPECS[:] = everything
    for branch in sorted({spec.branch for spec in everything}):
        mesh.advance(branch)  # the shared past, trained once
        _SNAPSHOTS[branch] = mesh.fork()
    del mesh
    results: list[SimResult | None] = [None] * len(everything)
    step_cpu: list[float] = []
    meter = tqdm(total=len(everything), unit="run", disable=not bar, dynamic_ncols=True)
    context = multiprocessing.get_context("fork")  # workers inherit the corpus and the snapshots
    with context.Pool(max(1, min(workers, len(everything)))) as pool:
        for done, (index, result, cpu) in enumerate(pool.imap_unordered(_run, range(len(everything))), 1):
            results[index] = result
            step_cpu.append(cpu)
            _report(meter, progress, everything[index].label, done, len(everything), started)
    meter.close()
    _SNAPSHOTS.clear()
    _SPECS.clear()
    if step_cpu:
        logger.info(f"{statistics.median(step_cpu):.3f} CPU seconds per global step of a run (median)")
    return results[0], results[1:], statistics.median(step_cpu) if step_cpu else None


def _report(meter: tqdm, progress: Callable[[str], None] | None, label: str, done: int, total: int, t0: float):
    meter.set_postfix_str(label, refresh=False)
    meter.update(1)
    if progress is not None:
        elapsed = time.monotonic() - t0
        left = elapsed / done * (total - done)
        progress(f"run {done}/{total} done: {label} ({elapsed / 60:.1f} min so far, about {left / 60:.1f} min left)")
