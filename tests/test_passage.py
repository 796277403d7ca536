"""A middle stage's input gradient against the output gradient it was given (sentinel_node/verification/passage.py),
on the gradients of a real three-stage model training on real text."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sentinel_node import attacks
from sentinel_node.config import load_config
from sentinel_node.model import build_stage, load_corpus
from sentinel_node.model.corpus import sample_batch
from sentinel_node.verification import BoundaryMonitor, VerdictKind
from sentinel_node.verification.coherence import CoherenceEvidence, mean_row, row_coherence
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


# --- the coherence of a middle stage's own contribution (sentinel_node/verification/coherence.py) ---


def coherence_monitor() -> BoundaryMonitor:
    base = load_config().verification.monitor_settings("gradient", seed=0, boundary=0)
    assert base.coherence_limit > 0  # on by default
    return BoundaryMonitor(dataclasses.replace(base, warmup=40, passage_floor=0.8), HIDDEN, expected_shape=SHAPE)


def test_rows_without_a_shared_direction_have_a_coherence_near_one_and_an_offset_adds_its_square_times_the_rows():
    rows = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    assert 0.6 < row_coherence(rows) < 1.6
    # an offset of 0.25 RMS on every element: n * 0.25^2 = 16 more, whatever the rows
    assert 14 < row_coherence(rows + 0.25) < 20
    offset = mean_row(rows + 0.25)  # and its direction is the offset's
    assert float(offset @ torch.ones(64, dtype=torch.float64)) / float(offset.norm()) / 8 > 0.95
    assert row_coherence(torch.ones(4, 3)) is None  # every row alike: no spread to compare with
    assert row_coherence(torch.randn(1, 8)) is None


def test_an_honest_stream_raises_no_coherence_alarm(passages):
    """Four honest senders over the whole stream (160 gradients of a real model in training): the test learns the
    boundary's spread and never alarms, nor holds more than half its limit against anyone."""
    checker = coherence_monitor()
    rows = torch.Generator().manual_seed(3)
    for i, (sent, given) in enumerate(zip(passages.sent, passages.given, strict=True)):
        verdict = checker.check(sent, "abcd"[i % 4], given=Given.sample(given, ROWS, rows), step=i)
        assert verdict.kind is not VerdictKind.COHERENCE, (i, verdict.reason)
    assert all(len(checker.coherence.senders.peek(s).scores) == 32 for s in "abcd")  # it judged all along
    assert max(checker.coherence.evidence(s) for s in "abcd") < checker.settings.coherence_limit / 2


@pytest.mark.parametrize(
    "attack",
    [
        pytest.param(lambda g, step: attacks.bias(g, step, {}, offset=0.1), id="bias-0.1"),
        pytest.param(lambda g, step: attacks.drift(g, step, {"first_step": 80}, speed=0.01), id="drift-0.01"),
    ],
)
def test_an_offset_on_every_token_is_flagged_and_its_sender_banned_by_the_coherence_of_its_contribution(
    passages, attack
):
    """One sender of four adds the same offset to every token's gradient from check 80 on: too small for a fence
    (0.1 of the RMS; a drift from nothing) but repeated in every row. Its coherence evidence crosses, it is flagged
    and struck until banned; no honest sender is flagged by the coherence test."""
    checker = coherence_monitor()
    rows = torch.Generator().manual_seed(4)
    kinds, honest = [], []
    for i, (sent, given) in enumerate(zip(passages.sent, passages.given, strict=True)):
        sender = "abcd"[i % 4]
        attacked = sender == "d" and i >= 80
        verdict = checker.check(
            attack(sent, i) if attacked else sent, sender, given=Given.sample(given, ROWS, rows), step=i
        )
        (kinds if attacked else honest).append(verdict.kind)
    assert VerdictKind.COHERENCE not in honest
    assert kinds.count(VerdictKind.COHERENCE) >= 2, kinds
    assert checker.ledger.peek("d").banned, kinds


WIDTH = 16
_BASIS = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def honest_offsets(seed: int, n: int) -> list[torch.Tensor]:
    """Offsets as honest contributions give them: a few directions of the hidden space, their signs changing from
    microbatch to microbatch, and a little of every other direction."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, generator=g, dtype=torch.float64) @ _BASIS
        + 0.1 * torch.randn(WIDTH, generator=g, dtype=torch.float64)
        for _ in range(n)
    ]


def outside(norm: float) -> torch.Tensor:
    """A fixed direction the honest offsets leave out (orthogonal to their three), of norm `norm`."""
    q, _ = torch.linalg.qr(torch.cat([_BASIS.T, torch.eye(WIDTH, dtype=torch.float64)[:, :1]], 1))
    return q[:, 3] * norm


def test_the_coherence_test_judges_the_offsets_direction_needs_peers_counts_each_sender_alike_and_forgets_the_banned():
    evidence = CoherenceEvidence(kappa=1.0, limit=4.0, max_senders=8, min_checks=8)
    typical = statistics.median(float(u.norm()) for u in honest_offsets(9, 64))
    attack = outside(typical)  # no larger than an honest offset: only its direction gives it away
    for u in honest_offsets(1, 16):
        evidence.accept("a", u)
    assert all(evidence.observe("a", attack) is None for _ in range(10))  # no peers: nobody to differ from
    for u in honest_offsets(2, 16):
        evidence.accept("b", u)
    assert evidence.observe("a", attack) is None  # one peer is not a majority
    # a colluder's many checks along the attack count as one sender among the peers: the centre, the scale and the
    # whitening stay honest
    for u in honest_offsets(3, 200):
        evidence.accept("x", attack + 0.01 * u)
    for seed, name in ((4, "c"), (5, "d")):
        for u in honest_offsets(seed, 16):
            evidence.accept(name, u)
    alarms = [evidence.observe("a", attack) for _ in range(4)]
    assert alarms[:2] == [None, None] and alarms[2] is not None  # the cap: one check adds at most 3 - kappa
    honest_median = math.exp(evidence.senders.peek("c").spread[0])  # an honest offset's size, in its peers' spread
    assert alarms[2].size > 10 * honest_median, (alarms[2].size, honest_median)
    assert evidence.evidence("a") <= evidence.limit
    assert all(evidence.observe("b", u) is None for u in honest_offsets(6, 50))  # honest offsets: no alarm
    assert evidence.evidence("b") < evidence.limit / 2
    evidence.forget("a")
    assert evidence.evidence("a") == 0.0
    assert evidence.observe("b", None) is None and evidence.observe("b", torch.ones(WIDTH + 1)) is None
    for name in "efghijkl":  # bounded: at most max_senders senders' state
        evidence.observe(name, honest_offsets(7, 1)[0])
    assert len(evidence.senders) <= 8
    for _ in range(10):  # offsets whose squares overflow are judged (the cap bounds them) and break nothing
        evidence.observe("z", torch.full((WIDTH,), 1e200, dtype=torch.float64))
        evidence.accept("z", torch.full((WIDTH,), 1e200, dtype=torch.float64))
    assert evidence.senders.peek("z").inverse is None and evidence.evidence("z") <= evidence.limit


def test_wide_offsets_are_judged_in_a_secret_sketch():
    """Wider than the sketch, offsets are projected by a matrix the verifier draws itself: from its generator (the
    simulator's, reproducible), else from the OS, so that no stage can know its null space."""
    wide = torch.randn(64, dtype=torch.float64)

    def projected(generator: torch.Generator | None) -> torch.Tensor:
        evidence = CoherenceEvidence(kappa=1.0, limit=4.0, max_senders=4, sketch=8, generator=generator)
        evidence.accept("a", wide)
        return evidence.projection

    assert projected(torch.Generator().manual_seed(1)).shape == (8, 64)
    assert torch.equal(projected(torch.Generator().manual_seed(1)), projected(torch.Generator().manual_seed(1)))
    assert not torch.equal(projected(None), projected(None))
    narrow = CoherenceEvidence(kappa=1.0, limit=4.0, max_senders=4, sketch=8)
    narrow.accept("a", torch.ones(8, dtype=torch.float64))
    assert narrow.projection is None  # as wide as the sketch: judged as it is


@pytest.mark.parametrize("change", ["direction", "growth"])
def test_a_change_every_sender_shares_is_evidence_against_no_one(change):
    """The boundary moving, every sender at once (as when an attack upstream retrains every replica): a new direction
    in every offset (each peer's spread learns it from one accepted check), or every offset six times larger (which
    it learns slowly, so every sender accumulates until the median sender's evidence is taken off each check).
    Neither is evidence against anyone; one sender alone changing so is alarmed."""
    shift = outside(statistics.median(float(u.norm()) for u in honest_offsets(9, 64)))

    def changed(u: torch.Tensor) -> torch.Tensor:
        return u + shift if change == "direction" else 6 * u

    def run(changing: str) -> list[str]:
        evidence = CoherenceEvidence(kappa=1.0, limit=4.0, max_senders=8, min_checks=8)
        for i in range(16):  # in turns, as a boundary hears its senders: each learns its peers' judgement too
            for seed, name in enumerate("abcd"):
                evidence.accept(name, honest_offsets(1000 * i + seed, 1)[0])
        alarmed = []
        for i in range(12):
            for seed, name in enumerate("abcd"):
                u = honest_offsets(100 * i + seed, 1)[0]
                u = changed(u) if name in changing else u
                if evidence.observe(name, u) is not None:
                    alarmed.append(name)
                else:
                    evidence.accept(name, u)
        return alarmed

    assert run("abcd") == []
    assert "d" in run("d") and set(run("d")) == {"d"}
