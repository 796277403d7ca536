"""Measures one statistic issue 9 has not built yet: the share of a boundary activation's rows (tokens) that point
against the boundary's mean direction (negative cosine with the channel mean of earlier honest tensors), in an
honest simulator run of the default tiny model, activations and gradients, and what `row_corruption` does to it at
the sweep's strengths.

    .venv/bin/python scripts/row_cosines.py

    .venv/bin/python scripts/row_cosines.py --own [--config sentinel_node/configs/demo.yaml] [--steps 60]

With `--own`, against each tensor's own channel mean (what a verifier can take without a reference), from the
first step on, by phase of training. Figures in docs/decisions.md ("Rows against the boundary's mean direction").
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from sentinel_node.attacks import make_attack
from sentinel_node.config import load_config
from sentinel_node.model import load_corpus
from sentinel_node.sim import Mesh
from sentinel_node.verification import BoundaryMonitor

STEPS, SKIP, REFERENCE = 60, 20, 20  # run length; steps left out (warm-up); tensors averaged into the reference
FRACTIONS = (0.02, 0.05, 0.1, 0.25)  # the quick sweep's row_corruption strengths


def row_cosines(tensor: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    rows = tensor.reshape(-1, tensor.shape[-1]).float()
    return torch.nn.functional.cosine_similarity(rows, direction[None, :], dim=1)


def own(captured: list[tuple[int, tuple[int, str], torch.Tensor]], steps: int, config) -> None:
    """The profile's `opposed` share (rows against the mean of the tensor's clipped rows), as verifiers take it."""
    s = config.verification.monitor_settings("activation", config.swarm.seed)
    profiler = BoundaryMonitor(s, config.model.hidden_size).profiler  # the verifier's own

    def opposed_share(tensor: torch.Tensor) -> float:
        return float(profiler(tensor).opposed)

    def against_ema(tensors: list[torch.Tensor]) -> list[float]:
        """Against the mean row of an EMA of the earlier tensors' mean rows (what a verifier's baseline holds)."""
        shares, ema = [], None
        for tensor in tensors:
            rows = tensor.reshape(-1, tensor.shape[-1]).float()
            mean = rows.mean(0) / rows.square().mean().sqrt()
            reference = mean if ema is None else ema
            shares.append(float(((rows @ reference) < 0).float().mean()))
            ema = mean if ema is None else s.beta * ema + (1 - s.beta) * mean
        return shares

    phases = [(0, 5), (5, 20), (20, steps)]
    for place in sorted({p for _, p, _ in captured}):
        steps_of = [step for step, p, _ in captured if p == place]
        ema = dict(enumerate(against_ema([t for _, p, t in captured if p == place])))
        line = f"boundary {place[0]} {place[1]}s, against the EMA's mean:"
        for low, high in phases:
            shares = np.array([ema[i] for i, step in enumerate(steps_of) if low <= step < high])
            if len(shares):
                line += f" steps {low}-{high - 1}: {shares.mean():.4f} +- {shares.std():.4f} (max {shares.max():.4f});"
        print(line)
        line = f"boundary {place[0]} {place[1]}s, own mean:"
        for low, high in phases:
            shares = np.array([opposed_share(t) for step, p, t in captured if p == place and low <= step < high])
            if len(shares):
                line += f" steps {low}-{high - 1}: {shares.mean():.4f} +- {shares.std():.4f} (max {shares.max():.4f});"
        late = [t for step, p, t in captured if p == place and step >= 20]
        for fraction in FRACTIONS:
            attack, state = make_attack("row_corruption", fraction=fraction), {}
            line += f" row_corruption {fraction}: {np.mean([opposed_share(attack(t, 0, state)) for t in late]):.4f};"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--own", action="store_true", help="against each tensor's own mean, from step 0")
    parser.add_argument("--config", default=None)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config(args.config).with_overrides(sim=dict(steps=args.steps, eval_every=args.steps + 1))
    captured: list[tuple[int, tuple[int, str], torch.Tensor]] = []  # (step, (boundary, direction), tensor)
    check = Mesh._check

    def capture(self, boundary, direction, tensor, sender, attacked, *args, **kwargs):
        if not attacked:
            captured.append((args[1], (boundary, direction), tensor.detach().clone()))
        return check(self, boundary, direction, tensor, sender, attacked, *args, **kwargs)

    Mesh._check = capture
    Mesh(config, load_corpus(max_bytes=2**20)).run()
    if args.own:
        own(captured, args.steps, config)
        return
    for place in sorted({p for _, p, _ in captured}):
        tensors = [t for step, p, t in captured if p == place and step >= SKIP]
        mean = torch.stack([t.reshape(-1, t.shape[-1]).float().mean(0) for t in tensors[:REFERENCE]]).mean(0)
        honest = np.array([(row_cosines(t, mean) < 0).float().mean().item() for t in tensors[REFERENCE:]])
        line = f"boundary {place[0]} {place[1]}s: honest share {honest.mean():.4f} +- {honest.std():.4f}"
        line += f" (max {honest.max():.4f})"
        for fraction in FRACTIONS:
            attack, state = make_attack("row_corruption", fraction=fraction), {}
            shares = [(row_cosines(attack(t, 0, state), mean) < 0).float().mean().item() for t in tensors[REFERENCE:]]
            line += f"; row_corruption {fraction}: {np.mean(shares):.4f}"
        print(line)


if __name__ == "__main__":
    main()
