"""One simulator run as the `simulate` command makes it: pick the attack, train, summarize."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sentinel_node.attacks import attack_maker
from sentinel_node.config import Config
from sentinel_node.model import load_corpus
from sentinel_node.sim.mesh import AttackPlan, Mesh
from sentinel_node.sim.report import step_line, summary, summary_text


def attack_plan(config: Config, attack: str | None, attack_file: str | None, target: str) -> AttackPlan | None:
    """The plan for a catalogue attack or a red team's file; None for an honest run."""
    if attack is None and attack_file is None:
        return None
    seed = config.swarm.seed
    name, make = attack_maker(attack, attack_file, lambda d: config.verification.monitor_settings(d, seed))
    return AttackPlan(name, target, make)


def simulate(
    config: Config,
    attack: str | None = None,
    attack_file: str | None = None,
    target: str = "activation",
    verify: bool = True,
    on_line: Callable[[str], None] | None = None,
) -> dict:
    """Trains the mesh; `on_line` receives a line per step. Returns the summary (with its text under "text")."""
    plan = attack_plan(config, attack, attack_file, target)
    if plan is not None and config.sim.attack_start >= config.sim.steps:
        raise ValueError(
            f"the attack would start at step {config.sim.attack_start} but the run ends after {config.sim.steps} "
            f"steps (0..{config.sim.steps - 1}): nothing would be attacked; lower --attack-start or raise --steps"
        )
    corpus = load_corpus(config.data.path, config.data.val_fraction, config.data.max_bytes)
    torch.set_num_threads(1)  # tensors this small gain nothing from a second thread, and lose much on a busy machine
    started = time.monotonic()
    mesh = Mesh(config, corpus, plan, verify=verify)
    if on_line is not None:
        malicious = [w.id for w in mesh.all_workers if w.malicious]
        on_line(
            f"mesh: {config.pipeline.n_stages} stages x {config.sim.replicas} replicas, "
            f"attack {plan.name + ' on ' + plan.target + 's' if plan else 'none'}"
            f"{' from step ' + str(config.sim.attack_start) if plan else ''}, "
            f"malicious {', '.join(malicious) or 'none'}, verification {'on' if verify else 'off'}"
        )
    result = mesh.run(on_step=(lambda log: on_line(step_line(log))) if on_line is not None else None)
    report = summary(result, time.monotonic() - started)
    return {**report, "text": summary_text(report)}
