"""A middle stage's input gradient against the output gradient it was given (sentinel_node/verification/passage.py),
on the gradients of a real three-stage model training on real text."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sentinel_node import attacks
from sentinel_node.config import load_config
from sentinel_node.model import build_stage, load_corpus
from sentinel_node.model.corpus import sample_batch
from sentinel_node.verification import BoundaryMonitor, VerdictKind
from sentinel_node.verification.passage import Given, GradientPassage

ROWS = 256  # of the 512 rows (token positions) of a microbatch: what a verifier asks the next one for

HIDDEN = 32
SHAPE = (8, 64, HIDDEN)
PRETRAIN_STEPS = 60
STREAM_STEPS = 160


@dataclass(frozen=True)
class Passages:
    sent: list[torch.Tensor]  # the middle stage's input gradient
    given: list[torch.Tensor]  # the output gradient it was given


@pytest.fixture(scope="module")
def passages() -> Passages:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config().with_overrides(
        model=dict(hidden_size=HIDDEN, intermediate_size=86, n_layers=3), pipeline=dict(n_stages=3)
    )
    corpus = load_corpus(max_bytes=2**20)
    stages = [build_stage(cfg.model, k, 3) for k in range(3)]
    optimizer = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    sent, given = [], []
    for step in range(PRETRAIN_STEPS + STREAM_STEPS):
        optimizer.param_groups[0]["lr"] = 1e-3 * min(1.0, (step + 1) / 20)
        inputs, targets = sample_batch(corpus.train, SHAPE[0], SHAPE[1], rng)
        first = stages[0](inputs)
        middle_in = first.detach().requires_grad_(True)
        middle = stages[1](middle_in)
        last_in = middle.detach().requires_grad_(True)
        stages[2].loss(stages[2](last_in), targets).backward()
        middle.backward(last_in.grad)
        first.backward(middle_in.grad)
        if step >= PRETRAIN_STEPS:
            sent.append(middle_in.grad.detach().clone())
            given.append(last_in.grad.detach().clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return Passages(sent, given)


def monitor() -> BoundaryMonitor:
    base = load_config().verification.monitor_settings("gradient", seed=0, boundary=0)
    return BoundaryMonitor(dataclasses.replace(base, warmup=40, passage_floor=0.8), HIDDEN, expected_shape=SHAPE)


def test_an_honest_middle_stage_passes_the_gradient_it_was_given_on(passages):
    cosines = [
        float(torch.nn.functional.cosine_similarity(s.reshape(1, -1), g.reshape(1, -1)))
        for s, g in zip(passages.sent, passages.given, strict=True)
    ]
    assert min(cosines) > 0.5, min(cosines)  # the residual stream: far from anything an attack below leaves
    rows = torch.Generator().manual_seed(1)
    sampled = [
        1 - GradientPassage(32, 5.5, 0.5).judge(s, Given.sample(g, ROWS, rows)).score
        for s, g in zip(passages.sent, passages.given, strict=True)
    ]
    assert min(sampled) > 0.5, min(sampled)  # over a quarter of the rows as well
    checker = monitor()
    for i, (sent, given) in enumerate(zip(passages.sent, passages.given, strict=True)):
        verdict = checker.check(sent, "honest", given=Given.sample(given, ROWS, rows), step=i)
        assert verdict.kind is not VerdictKind.PASSAGE, (i, verdict.scores)
    assert len(checker.passage.fence.scores) > 100  # it judged, and learnt the honest spread


@pytest.mark.parametrize(
    "attack",
    [
        pytest.param(lambda g: attacks.token_shift(g, 0, {}, shift=1), id="token_shift-1"),
        pytest.param(lambda g: attacks.token_shift(g, 0, {}, shift=8), id="token_shift-8"),
        pytest.param(lambda g: attacks.cross_mix(g, 0, {}, weight=1.0), id="cross_mix-1"),
        pytest.param(lambda g: -g, id="sign-inversion"),
        pytest.param(lambda g: attacks.plane_rotation(g, 0, {"seed": 3}, degrees=180, planes=16), id="rotation"),
    ],
)
def test_a_gradient_moved_off_the_residual_stream_is_dropped_and_its_sender_made_a_suspect(passages, attack):
    """Statistics of the tensor alone cannot see these (each keeps the gradient's norm and every marginal); one
    sender among three honest ones sends them from check 80 on: every one of its gradients is flagged and dropped,
    and it becomes a suspect (its crossings audited) without a strike: a flag of the passage bans no one by itself,
    as an honest replica on disturbed parameters fails it too (only the audit it calls for bans, test_audits). The
    honest senders are never flagged by the passage test."""
    checker = monitor()
    flagged, honest_passage_flags = [], 0
    rows = torch.Generator().manual_seed(2)
    for i, (sent, given) in enumerate(zip(passages.sent, passages.given, strict=True)):
        sender = "abcd"[i % 4]
        attacked = sender == "d" and i >= 80
        verdict = checker.check(
            attack(sent) if attacked else sent, sender, given=Given.sample(given, ROWS, rows), step=i
        )
        if attacked:
            flagged.append(verdict.kind is VerdictKind.PASSAGE and verdict.tensor is None and not verdict.struck)
            assert checker.ledger.suspect("d")
        elif verdict.kind is VerdictKind.PASSAGE:
            honest_passage_flags += 1
    assert len(flagged) == 20 and all(flagged), flagged
    record = checker.ledger.peek("d")
    assert record.strikes == 0 and not record.banned and record.flags == 20 and record.suspicions > 0
    assert honest_passage_flags == 0


def test_a_suspicion_is_forgiven_as_a_strike_is_and_never_bans():
    from sentinel_node.verification.strikes import SenderStrikes

    ledger = SenderStrikes(strike_limit=3, forgive_after=4)
    for _ in range(10):
        record = ledger.record("x", True, weight=2, blatant=True, strike=False)
    assert not record.banned and record.strikes == 0 and record.blatant == 0 and record.suspicions == 3
    assert ledger.suspect("x")
    for _ in range(3 * 4):
        ledger.record("x", False)
    assert not ledger.suspect("x") and ledger.peek("x").suspicions == 0


def test_what_cannot_be_compared_is_not_judged():
    passage = GradientPassage(window=32, k=5.5, floor=0.5)
    g = torch.randn(2, 8, 4)
    assert passage.judge(g, Given.sample(torch.randn(2, 8, 5), 0)) is None  # another width
    assert passage.judge(g, Given.sample(torch.randn(2, 9, 4), 0)) is None  # all rows of another length
    assert passage.judge(g, Given(torch.randn(3, 4), torch.tensor([0, 5, 16]))) is None  # no row 16 in 16
    assert passage.judge(g, Given(torch.randn(3, 4), torch.tensor([0, 5]))) is None  # values for 3 rows, 2 named
    assert passage.judge(g, Given.sample(torch.zeros_like(g), 0)) is None
    assert passage.judge(torch.full_like(g, float("nan")), Given.sample(g, 0)) is None
    assert passage.judge(g, Given.sample(torch.full_like(g, float("inf")), 0)) is None
    first = passage.judge(g, Given.sample(g, 0))
    assert first is not None and abs(first.score) < 1e-9 and not first.over  # no fence yet: nothing is over it
    rows = Given.sample(g, 5, torch.Generator().manual_seed(0))
    assert rows.rows is not None and len(rows.rows) == 5 and abs(passage.judge(g, rows).score) < 1e-9
    assert abs(passage.judge(-g, rows).score - 2) < 1e-9  # the same rows of the sent gradient, inverted
    off = GradientPassage(window=32, k=5.5, floor=0.0)
    assert off.judge(-g, Given.sample(g, 0)) is None  # floor 0: the test is off
