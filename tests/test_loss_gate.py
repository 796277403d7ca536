"""The loss gate (sentinel_node/verification/excess.py) on the losses of a real model training on real text.

A two-stage tiny Llama trains on the embedded corpus; for every microbatch of the stream we keep its targets, its
honest loss, and the loss the same microbatch ends with when its boundary activation is attacked (nothing trains on
the attacked pass). The gate sees what the verifier of the last boundary sees: the targets and the loss.
"""

from __future__ import annotations

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
from sentinel_node.verification import LossEvidence, content_of
from sentinel_node.verification.excess import BigramText, ExcessLoss, GateSettings, LossGate

SHAPE = (8, 64)
PRETRAIN_STEPS = 60
STREAM_STEPS = 400

ATTACKS = {
    "plane_rotation": lambda x: attacks.plane_rotation(x, 0, {"seed": 1}, degrees=180),
    "cross_mix": lambda x: attacks.cross_mix(x, 0, {}, weight=1.0),
}


@dataclass(frozen=True)
class Stream:
    targets: list[torch.Tensor]
    losses: list[float]
    attacked: dict[str, list[float]]


@pytest.fixture(scope="module")
def stream() -> Stream:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config().with_overrides(
        model=dict(hidden_size=32, intermediate_size=86, n_layers=2), pipeline=dict(n_stages=2)
    )
    corpus = load_corpus(max_bytes=2**20)
    first, last = build_stage(cfg.model, 0, 2), build_stage(cfg.model, 1, 2)
    optimizer = torch.optim.AdamW([*first.parameters(), *last.parameters()], lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    targets, losses, attacked = [], [], {name: [] for name in ATTACKS}
    for step in range(PRETRAIN_STEPS + STREAM_STEPS):
        optimizer.param_groups[0]["lr"] = 1e-3 * min(1.0, (step + 1) / 20)
        inputs, target = sample_batch(corpus.train, *SHAPE, rng)
        hidden = first(inputs)
        received = hidden.detach().requires_grad_(True)
        loss = last.loss(last(received), target)
        if step >= PRETRAIN_STEPS:
            with torch.no_grad():
                for name, attack in ATTACKS.items():
                    attacked[name].append(float(last.loss(last(attack(received)), target)))
            targets.append(target)
            losses.append(float(loss.detach()))
        loss.backward()
        hidden.backward(received.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return Stream(targets, losses, attacked)


def run_gate(stream: Stream, loss_of, gate: LossGate | None = None, attempts: int = 4) -> tuple[LossGate, list]:
    """Every microbatch of the stream through the gate as the verifier of the last boundary keeps it, with up to
    ``attempts`` attempts each; ``loss_of(index, attempt)`` is the loss an attempt ends with. Returns the gate and,
    per microbatch, the list of its attempts' outcomes (True: held)."""
    gate = gate or LossGate(256)
    outcomes = []
    for i, targets in enumerate(stream.targets):
        content, held = content_of(targets), []
        for attempt in range(attempts):
            gated = gate.before(content, targets)
            loss = loss_of(i, attempt)
            holds = gate.holds(gated, loss)
            gate.after(gated, loss, holds)
            held.append(holds)
            if not holds:
                break
        outcomes.append(held)
    return gate, outcomes


def test_the_text_predicts_most_of_how_an_honest_microbatchs_loss_varies(stream):
    """The gate can only be tight where the text explains the loss: after the fit, what is left of the log loss
    varies far less than the log loss itself."""
    excess = ExcessLoss(256)
    residuals = []
    for targets, loss in zip(stream.targets, stream.losses, strict=True):
        expectation = excess.expect(targets)
        value = excess.excess(expectation, loss)
        if value is not None:
            residuals.append(value)
        excess.settled(expectation, loss, applied=True)
    # the spread of the log loss over windows as long as the fit's, its trend taken off as the fit's third term does
    logs = np.log(stream.losses)

    def detrended_spread(window: np.ndarray) -> float:
        index = np.arange(len(window))
        return float(np.std(window - np.polyval(np.polyfit(index, window, 1), index)))

    spread = statistics.median(detrended_spread(logs[s : s + 128]) for s in range(0, len(logs) - 128, 32))
    assert len(residuals) > 300
    assert np.std(residuals[-200:]) < 0.7 * spread, (np.std(residuals[-200:]), spread)


def test_honest_microbatches_are_rarely_held(stream):
    gate, outcomes = run_gate(stream, lambda i, attempt: stream.losses[i])
    held = sum(any(o) for o in outcomes)
    assert held / len(outcomes) < 0.02, held
    assert all(len(o) <= 3 for o in outcomes)  # held twice at most: the third attempt agreeing is applied
    assert gate.excess.applied == len(outcomes)  # nothing is lost


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_microbatch_its_route_damaged_is_held_and_applied_on_an_honest_route(stream, attack):
    """A third of the microbatches go first through a corrupting replica; a held microbatch is sent again on an honest
    route (the trainer avoids every replica of the held one). Once the gate has learnt the text, most damaged
    attempts are held (at the default of 6 deviations, 94% of the rotated ones and 84% of the blended ones on this
    small model, whose excess spreads more than the full profile's; 100% and 98% at 4), the honest attempt after
    one is applied, and honest first attempts are not held."""
    rng = np.random.default_rng(1)
    first_bad = rng.random(len(stream.losses)) < 1 / 3

    def loss_of(i: int, attempt: int) -> float:
        return stream.attacked[attack][i] if attempt == 0 and first_bad[i] else stream.losses[i]

    rise = statistics.median(a / h for a, h in zip(stream.attacked[attack], stream.losses, strict=True))
    assert rise > 1.2, rise  # the damage the attack does to this model
    _, outcomes = run_gate(stream, loss_of)
    warm = range(100, len(outcomes))  # the gate opens once it has fitted the text (64 applied) and read its spread
    bad = [i for i in warm if first_bad[i]]
    good = [i for i in warm if not first_bad[i]]
    caught = sum(outcomes[i][0] for i in bad)
    assert caught / len(bad) > 0.8, (caught, len(bad))
    assert all(outcomes[i][-1] is False for i in bad)  # the honest second attempt was applied
    assert sum(outcomes[i][0] for i in good) / len(good) < 0.03


def test_a_damaged_minority_does_not_open_the_gate(stream):
    """The gate's ceiling reads the low quantiles of recent excesses: with 45% of attempts damaged (held, yet in its
    window), the share of them caught late in the stream is what it was early."""
    rng = np.random.default_rng(2)
    bad = rng.random(len(stream.losses)) < 0.45
    attack = stream.attacked["plane_rotation"]
    _, outcomes = run_gate(stream, lambda i, attempt: attack[i] if attempt == 0 and bad[i] else stream.losses[i])
    late = [outcomes[i][0] for i in range(250, len(outcomes)) if bad[i]]
    assert sum(late) / len(late) > 0.95


def test_when_every_loss_rises_together_a_microbatch_is_held_twice_at_most_and_the_gate_follows(stream):
    """A shift of the whole swarm (every route, every text) is no attack: a microbatch held on two routes and no
    better on the third is applied, and the gate's window then follows the new level."""
    jump = 200

    def loss_of(i: int, attempt: int) -> float:
        return stream.losses[i] * (1.4 if i >= jump else 1.0)

    gate, outcomes = run_gate(stream, loss_of)
    assert all(len(o) <= 3 for o in outcomes)
    assert gate.excess.applied == len(outcomes)  # every microbatch was applied in the end
    assert sum(any(o) for o in outcomes[jump : jump + 10]) >= 8  # at first the rise is held
    assert sum(any(o) for o in outcomes[-100:]) <= 3  # later it is the level


def suspected_share(stream: Stream, seed: int, worse: float = 1.0, expected: bool = True, kappa: float | None = None):
    """The stream's microbatches through four replicas on random routes, replica ``d``'s losses times ``worse``;
    the loss evidence (the config's, or ``kappa``) ranks excesses over the gate's prediction (``expected``) or raw
    losses. Returns the share of honest checks whose replica was then a suspect, and ``d``'s microbatches until it
    was one (None: never)."""
    c = load_config().verification
    evidence = LossEvidence(c.peer_pool, c.loss_kappa if kappa is None else kappa, c.peer_limit, c.loss_evidence, 64)
    excess = ExcessLoss(256)
    rng = np.random.default_rng(seed)
    suspected, honest, mine, found = 0, 0, 0, None
    for targets, loss in zip(stream.targets, stream.losses, strict=True):
        expectation = excess.expect(targets)
        predicted = excess.predicted(expectation)
        replica = "abcd"[rng.integers(4)]
        reported = loss * (worse if replica == "d" else 1.0)
        evidence.observe(replica, reported, math.exp(predicted) if expected and predicted is not None else None)
        excess.settled(expectation, reported, applied=True)
        if replica == "d" and worse != 1.0:
            mine += 1
            if found is None and evidence.suspicious("d"):
                found = mine
        else:
            honest += 1
            suspected += evidence.suspicious(replica)
    return suspected / honest, found


def test_excess_losses_make_a_replica_one_sd_worse_a_suspect_sooner_than_raw_losses(stream):
    """A replica whose microbatches end 3% worse (a shift of about one deviation of the excess, what blending a
    fifth of another sequence in costs the full profile): ranked by excess with the loss evidence's settings it is
    a suspect within 40 of its microbatches; raw losses, whose text varies far more, show it later or never (with
    the kappa of before, 1). The price of so sensitive a test: honest replicas are suspects for some of their
    checks (13-19% here, where every microbatch comes from one model; on the full profile's mesh 31 extra audits of
    honest work in 100 steps, docs/decisions.md), which costs audits that pass, never a strike."""
    for seed in range(4):
        share, found = suspected_share(stream, seed)
        assert share < 0.25, (seed, share)
        _, found = suspected_share(stream, seed, worse=1.03)
        assert found is not None and found <= 40, (seed, found)
        _, raw = suspected_share(stream, seed, worse=1.03, expected=False, kappa=1.0)
        assert raw is None or raw > found, (seed, raw, found)


def test_the_gate_holds_what_is_not_a_loss_and_survives_bad_input():
    gate = LossGate(256, GateSettings(warmup=8))
    rng = np.random.default_rng(3)
    for _ in range(64):
        targets = torch.from_numpy(rng.integers(0, 256, size=(4, 16)))
        gated = gate.before(content_of(targets), targets)
        gate.after(gated, 2.0 + 0.01 * rng.standard_normal(), held=False)
    targets = torch.from_numpy(rng.integers(0, 256, size=(4, 16)))
    gated = gate.before(content_of(targets), targets)
    assert gated.ceiling is not None and math.isfinite(gated.ceiling)
    for bad in (float("nan"), float("inf")):
        assert gate.holds(gated, bad)
    gate.after(gated, None, held=False)  # no loss came back: nothing learnt
    gate.after(gated, float("nan"), held=True)
    assert gate.excess.applied == 64
    # tokens outside the vocabulary (a malformed microbatch) are scored, not an IndexError
    wild = torch.tensor([[-5, 300, 7, 1_000_000]])
    assert math.isfinite(BigramText(256).cross_entropy(wild[:, :-1], wild[:, 1:]))
    off = LossGate(256, GateSettings(k=0.0, warmup=8))
    for _ in range(64):
        gated = off.before(content_of(targets), targets)
        off.after(gated, 2.0, held=False)
    assert off.before(1, targets).ceiling is None  # k = 0: the gate is off


def test_a_large_vocabulary_is_hashed_into_a_bounded_table():
    text = BigramText(128_000)
    assert text.buckets == 1 << 20 and text.pairs.nbytes == 4 << 20
    tokens = torch.randint(0, 128_000, (2, 33))
    before = text.cross_entropy(tokens[:, :-1], tokens[:, 1:])
    text.learn(tokens[:, :-1], tokens[:, 1:])
    assert text.cross_entropy(tokens[:, :-1], tokens[:, 1:]) < before  # seen text is easier
