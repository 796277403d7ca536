"""Verdicts are typed: what a check decided is its kind, never a string to be parsed (issue 15's bug).

A flag of the peer test and a replay say why in their display reason; that must not turn them into a malformed
tensor for the verifier role, and the simulator counts each under its own kind.
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


def flags_of_each_kind(activations) -> list:
    """Four senders of one boundary: "d" sends half its tensors (inside the fences, unlike its peers) from the
    20th check on, and at the 60th a copy of the 50th tensor. Returns every verdict in order."""
    import dataclasses

    base = load_config().verification.monitor_settings("activation", seed=0)
    monitor = BoundaryMonitor(dataclasses.replace(base, warmup=30), HIDDEN, expected_shape=SHAPE)
    verdicts = []
    for i, tensor in enumerate(activations):
        sender = "abcd"[i % 4]
        if i == 60:
            sent, sender = activations[50].clone(), "c"
        elif sender == "d" and i >= 20:
            sent = attacks.scale(tensor, i, {}, sigma=0.5)
        else:
            sent = tensor
        verdicts.append(monitor.check(sent, sender, content=i))
    return verdicts


def test_peer_and_replay_flags_are_their_own_kinds_and_never_malformed(activations):
    from sentinel_node.verification import VerdictKind

    verdicts = flags_of_each_kind(activations)
    peer = [v for v in verdicts if v.kind is VerdictKind.PEER]
    assert peer and all(v.struck and not v.malformed and v.over and v.peer is not None for v in peer)
    assert all(v.reason.startswith("peer:") for v in peer)
    replay = verdicts[60]
    assert replay.kind is VerdictKind.REPLAY and replay.blatant and not replay.malformed
    assert replay.replay.age == 10 and replay.reason.startswith("replay")


def test_the_simulator_counts_every_flag_under_its_kind(activations):
    from sentinel_node.verification import VerdictKind

    verdicts = flags_of_each_kind(activations)
    stats = DetectionStats()
    for verdict in verdicts:
        stats.record("activation", True, verdict)
    assert stats.metric_hits["activation", True, "peer"] == sum(v.kind is VerdictKind.PEER for v in verdicts) > 0
    assert stats.metric_hits["activation", True, "replay"] == 1
