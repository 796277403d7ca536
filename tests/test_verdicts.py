"""Verdicts are typed: what a check decided is its kind, never a string to be parsed (issue 15's bug).

A drift flag during a boundary-wide shift gives no strike; its display reason says so, and that must not turn it
into a malformed tensor for the verifier role or drop it from the simulator's drift count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sentinel_node import attacks
from sentinel_node.config import load_config
from sentinel_node.model import build_stage, load_corpus
from sentinel_node.model.corpus import sample_batch
from sentinel_node.sim.stats import DetectionStats
from sentinel_node.verification import BoundaryMonitor

HIDDEN = 32
SHAPE = (8, 64, HIDDEN)


@pytest.fixture(scope="module")
def activations() -> list[torch.Tensor]:
    """Boundary activations of a tiny two-stage model training on the embedded corpus."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config().with_overrides(
        model=dict(hidden_size=HIDDEN, intermediate_size=86, n_layers=2), pipeline=dict(n_stages=2)
    )
    corpus = load_corpus(max_bytes=2**20)
    first, last = build_stage(cfg.model, 0, 2), build_stage(cfg.model, 1, 2)
    optimizer = torch.optim.AdamW([*first.parameters(), *last.parameters()], lr=1e-3)
    rng = np.random.default_rng(0)
    found = []
    for _ in range(80):
        inputs, targets = sample_batch(corpus.train, SHAPE[0], SHAPE[1], rng)
        hidden = first(inputs)
        received = hidden.detach().requires_grad_(True)
        loss = last.loss(last(received), targets)
        loss.backward()
        hidden.backward(received.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        found.append(hidden.detach().clone())
    return found


def drift_under_a_shift(activations):
    """Checks two senders that both drift (a moderate bias, far inside the fences) until a drift flag comes while
    the whole boundary has moved; returns (that verdict, every verdict in order)."""
    import dataclasses

    base = load_config().verification.monitor_settings("activation", seed=0)
    settings = dataclasses.replace(base, warmup=30, fence_k=50.0, drift_window=4, drift_limit=0.02, shift_window=64)
    monitor = BoundaryMonitor(settings, HIDDEN, expected_shape=SHAPE)
    for i, tensor in enumerate(activations[:30]):
        assert not monitor.check(tensor, "ab"[i % 2]).flagged
    verdicts = []
    for i, tensor in enumerate(activations[30:]):
        verdict = monitor.check(attacks.bias(tensor, 0, {}, offset=0.5), "ab"[i % 2])
        verdicts.append(verdict)
        if verdict.flagged and not verdict.struck:
            return verdict, verdicts
    raise AssertionError(f"no unstruck drift flag in {len(verdicts)} checks")


def test_a_drift_flag_during_a_boundary_wide_shift_is_drift_without_a_strike(activations):
    verdict, verdicts = drift_under_a_shift(activations)
    from sentinel_node.verification import VerdictKind

    assert verdict.kind is VerdictKind.DRIFT and not verdict.malformed
    assert "no strike" in verdict.reason  # the display text still tells a person why
    struck = [v for v in verdicts if v.flagged and v.struck]
    assert struck and all(v.kind is VerdictKind.DRIFT for v in struck)


def test_the_simulator_counts_every_drift_flag_as_drift(activations):
    _, verdicts = drift_under_a_shift(activations)
    stats = DetectionStats()
    for verdict in verdicts:
        stats.record("activation", True, verdict)
    flagged = sum(v.flagged for v in verdicts)
    assert flagged >= 3
    assert stats.metric_hits["activation", True, "drift"] == flagged
