"""A sender's mean activation row against its peers' (sentinel_node/verification/drift.py), on the activations of a
real three-stage model training on real text: five replicas of the middle stage, one of which may attack."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sentinel_node import attacks
from sentinel_node.config import load_config
from sentinel_node.model import build_stage, load_corpus
from sentinel_node.model.corpus import sample_batch
from sentinel_node.verification import BoundaryMonitor, VerdictKind
from sentinel_node.verification.drift import PeerMeans

HIDDEN = 32
SHAPE = (8, 64, HIDDEN)
PRETRAIN_STEPS = 60
STREAM_STEPS = 240
ATTACK_FROM = 80
SENDERS = "abcde"  # "e" attacks


@pytest.fixture(scope="module")
def activations() -> list[torch.Tensor]:
    """The middle stage's output over STREAM_STEPS steps of training (one microbatch each)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config().with_overrides(
        model=dict(hidden_size=HIDDEN, intermediate_size=86, n_layers=3), pipeline=dict(n_stages=3)
    )
    corpus = load_corpus(max_bytes=2**20)
    stages = [build_stage(cfg.model, k, 3) for k in range(3)]
    optimizer = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    sent = []
    for step in range(PRETRAIN_STEPS + STREAM_STEPS):
        optimizer.param_groups[0]["lr"] = 1e-3 * min(1.0, (step + 1) / 20)
        inputs, targets = sample_batch(corpus.train, SHAPE[0], SHAPE[1], rng)
        middle = stages[1](stages[0](inputs))
        stages[2].loss(stages[2](middle), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= PRETRAIN_STEPS:
            sent.append(middle.detach().clone())
    return sent


def monitor() -> BoundaryMonitor:
    base = load_config().verification.monitor_settings("activation", seed=0, boundary=1)
    assert base.drift_limit > 0  # on by default, for activations
    return BoundaryMonitor(dataclasses.replace(base, warmup=40, private_seed=1), HIDDEN, expected_shape=SHAPE)


def stream(activations, attack=None, attackers=("e",)) -> tuple[BoundaryMonitor, list, list]:
    """Checks the stream round-robin from SENDERS, `attackers` applying `attack` from ATTACK_FROM on; the monitor,
    and the verdicts of attacked and of honest checks."""
    checker, state, attacked, honest = monitor(), {}, [], []
    for i, tensor in enumerate(activations):
        sender = SENDERS[i % len(SENDERS)]
        hit = attack is not None and sender in attackers and i >= ATTACK_FROM
        verdict = checker.check(attack(tensor, i, state) if hit else tensor, sender, step=i)
        (attacked if hit else honest).append(verdict)
    return checker, attacked, honest


def test_an_honest_stream_raises_no_drift_alarm(activations):
    """Five honest replicas over the whole stream: the test judges them all along and holds less than half its
    limit against anyone."""
    checker, _, honest = stream(activations)
    assert not [v.reason for v in honest if v.kind is VerdictKind.DRIFT]
    assert all(len(checker.drift.senders.peek(s).scores) >= 16 for s in SENDERS)  # it judged
    assert max(checker.drift.evidence(s) for s in SENDERS) < checker.settings.drift_limit / 2
    assert load_config().verification.monitor_settings("gradient", 0).drift_limit == 0  # gradients: coherence.py


def test_a_rotation_that_keeps_every_norm_and_spread_is_flagged_and_its_sender_banned(activations):
    """A replica turns its activations by 30 degrees in 8 planes of two channels: every norm and every channel's
    spread stay, so no fence crosses, but the mean row departs from its peers' the same way on every tensor."""
    checker, attacked, honest = stream(
        activations, lambda t, i, state: attacks.plane_rotation(t, i, state, degrees=30.0)
    )
    assert not [v.reason for v in honest if v.flagged]
    kinds = [v.kind for v in attacked]
    assert VerdictKind.METRIC not in kinds  # inside every fence
    assert kinds.count(VerdictKind.DRIFT) >= 2, kinds
    assert checker.ledger.peek("e").banned
    drift = next(v for v in attacked if v.kind is VerdictKind.DRIFT)
    assert drift.reason.startswith("drift:") and drift.coherence.evidence > checker.settings.drift_limit


def test_a_change_every_replica_makes_is_evidence_against_no_one(activations):
    """Every replica turns its activations alike from ATTACK_FROM on (the boundary moving, as after an attack upstream
    that reaches every replica): the peers' median moves with them, and nobody is flagged by the drift test."""
    checker, moved, _ = stream(
        activations, lambda t, i, state: attacks.plane_rotation(t, i, state, degrees=30.0), attackers=SENDERS
    )
    assert len(moved) == STREAM_STEPS - ATTACK_FROM
    assert not [v.reason for v in moved if v.kind is VerdictKind.DRIFT]


def test_peer_means_judge_against_the_others_median_forget_the_banned_and_stay_bounded():
    means = PeerMeans(pool=8, min_others=4)
    row = torch.zeros(3)
    for sender in "abcaaa":
        means.accept(sender, row)
    assert means.deviation("d", row) is None  # six rows, but of three others: too few to judge against
    means.accept("x", torch.full((3,), 100.0))  # one far sender cannot move the median
    means.accept("d", row)
    assert means.deviation("d", torch.ones(3)).tolist() == [1.0, 1.0, 1.0]
    assert means.deviation("x", torch.ones(3)) is not None
    assert means.deviation("d", torch.ones(4)) is None  # another width is not judged
    means.forget("x")
    assert all(who != "x" for who, _ in means.recent)
    for i in range(50):
        means.accept(f"s{i}", row)
    assert len(means.recent) == 8
