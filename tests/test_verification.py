"""SENTINEL's verification core (docs/architecture.md section 3) on real boundary tensors of a tiny model training on
real text.

The honest streams are the activations and the gradients crossing the boundary of a two-stage tiny Llama that
trains with AdamW on the embedded corpus; the attacks are those of the catalogue. Nothing under test is mocked.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sentinel_node import attacks
from sentinel_node.config import load_config
from sentinel_node.model import build_stage, load_corpus
from sentinel_node.model.corpus import sample_batch
from sentinel_node.verification import (
    METRICS,
    AdaptiveThreshold,
    BoundaryMonitor,
    EmaBaseline,
    LossEvidence,
    MonitorSettings,
    PeerEvidence,
    PeerReference,
    Profile,
    Profiler,
    RecentSenders,
    ReplaySketcher,
    ReplayStore,
    SenderStrikes,
    SharedShift,
    VerdictKind,
    median_profile,
)

HIDDEN = 32
SHAPE = (8, 64, HIDDEN)
WARMUP = 40
PRETRAIN_STEPS = 60  # past the first steep steps of the loss, where every statistic of a boundary moves fast
STREAM_STEPS = 200


@dataclass(frozen=True)
class HonestStreams:
    activations: list[torch.Tensor]
    gradients: list[torch.Tensor]
    losses: list[float]
    # the loss the same microbatch would have ended with had its activation been attacked (nothing trained on it)
    attacked_losses: dict[str, list[float]]

    def of(self, direction: str) -> list[torch.Tensor]:
        return self.activations if direction == "activation" else self.gradients


# an activation attack whose damage this small model feels (+45% on the microbatch's loss), and one it hardly does
# (+1.6%: a shift by a token costs a model this early little)
LOSS_ATTACKS = {
    "plane_rotation": lambda x: attacks.plane_rotation(x, 0, {"seed": 1}, degrees=180),
    "token_shift": lambda x: attacks.token_shift(x, 0, {}, shift=1),
}


def _train_step(stages, optimizer, corpus, rng) -> tuple[torch.Tensor, torch.Tensor, float, dict[str, float]]:
    """One AdamW step of the two-stage model; returns the boundary activation, its gradient, the loss and the losses
    of the same microbatch through `LOSS_ATTACKS` (the step itself is honest)."""
    first, last = stages
    inputs, targets = sample_batch(corpus.train, SHAPE[0], SHAPE[1], rng)
    hidden = first(inputs)
    received = hidden.detach().requires_grad_(True)
    with torch.no_grad():
        attacked = {name: float(last.loss(last(fn(received)), targets)) for name, fn in LOSS_ATTACKS.items()}
    loss = last.loss(last(received), targets)
    loss.backward()
    hidden.backward(received.grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return hidden.detach().clone(), received.grad.detach().clone(), float(loss.detach()), attacked


@pytest.fixture(scope="module")
def streams() -> HonestStreams:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config().with_overrides(
        model=dict(hidden_size=HIDDEN, intermediate_size=86, n_layers=2), pipeline=dict(n_stages=2)
    )
    corpus = load_corpus(max_bytes=2**20)
    stages = (build_stage(cfg.model, 0, 2), build_stage(cfg.model, 1, 2))
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    rng = np.random.default_rng(0)
    for step in range(PRETRAIN_STEPS):
        optimizer.param_groups[0]["lr"] = 1e-3 * min(1.0, (step + 1) / 20)
        _train_step(stages, optimizer, corpus, rng)
    optimizer.param_groups[0]["lr"] = 2e-4
    recorded = [_train_step(stages, optimizer, corpus, rng) for _ in range(STREAM_STEPS)]
    activations, gradients, losses, attacked = (list(column) for column in zip(*recorded, strict=True))
    return HonestStreams(activations, gradients, losses, {name: [a[name] for a in attacked] for name in LOSS_ATTACKS})


def settings(direction: str = "activation", **overrides) -> MonitorSettings:
    base = load_config().verification.monitor_settings(direction, seed=0)
    return dataclasses.replace(base, **{"warmup": WARMUP, **overrides})


def warmed_monitor(streams: HonestStreams, direction: str = "activation", **overrides) -> BoundaryMonitor:
    """A monitor that has accepted the first WARMUP honest tensors of the stream (and is out of warm-up)."""
    monitor = BoundaryMonitor(settings(direction, **overrides), HIDDEN, expected_shape=SHAPE)
    for tensor in streams.of(direction)[:WARMUP]:
        assert not monitor.check(tensor, "honest").flagged
    assert not monitor.warming_up
    return monitor


def snapshot(monitor: BoundaryMonitor) -> tuple:
    """Everything a check may learn from: the EMA profile, its update count and the metrics' score windows."""
    reference = tuple(field.clone() for field in monitor.baseline.reference.fields())
    windows = {name: list(threshold.scores) for name, threshold in monitor.thresholds.items()}
    return reference, monitor.baseline.updates, monitor.accepted, windows


def same_snapshot(before: tuple, after: tuple) -> bool:
    reference_before, *rest_before = before
    reference_after, *rest_after = after
    same_reference = all(torch.equal(a, b) for a, b in zip(reference_before, reference_after, strict=True))
    return same_reference and rest_before == rest_after


# --- profile -------------------------------------------------------------------------------------------------------


def make_profiler(seed: int = 0) -> Profiler:
    s = settings()
    return Profiler(
        HIDDEN,
        s.n_projections,
        s.n_quantiles,
        s.spectral_rank,
        seed,
        s.row_clip,
        oversample=s.spectral_oversample,
        power_iterations=s.spectral_power_iterations,
    )


def profiles_close(a: Profile, b: Profile, atol: float = 1e-5) -> bool:
    return all(torch.allclose(x, y, atol=atol, rtol=1e-4) for x, y in zip(a.fields(), b.fields(), strict=True))


def test_profiler_is_deterministic_for_a_seed(streams):
    tensor = streams.activations[0]
    first, second = make_profiler(seed=7)(tensor), make_profiler(seed=7)(tensor)
    assert all(torch.equal(a, b) for a, b in zip(first.fields(), second.fields(), strict=True))
    other = make_profiler(seed=8)(tensor)
    assert not torch.allclose(first.quantiles, other.quantiles)


@pytest.mark.parametrize("direction", ["activation", "gradient"])
def test_profile_does_not_depend_on_token_order(streams, direction):
    tensor = streams.of(direction)[5]
    rows = tensor.reshape(-1, HIDDEN)
    permuted = rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1))].reshape(SHAPE)
    assert not torch.equal(permuted, tensor)
    profiler = make_profiler()
    assert profiles_close(profiler(tensor), profiler(permuted))


def test_profile_is_scale_free_but_for_its_log_rms(streams):
    tensor = streams.activations[3]
    profiler = make_profiler()
    plain, scaled = profiler(tensor), profiler(tensor * 8.0)
    for a, b in zip(plain.fields()[:-1], scaled.fields()[:-1], strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)
    assert float(scaled.log_rms - plain.log_rms) == pytest.approx(math.log(8.0), abs=1e-4)


# --- metrics -------------------------------------------------------------------------------------------------------


def honest_reference(stream: list[torch.Tensor], beta: float) -> Profile:
    baseline, profiler = EmaBaseline(beta), make_profiler()
    for tensor in stream[:WARMUP]:
        baseline.update(profiler(tensor))
    return baseline.reference


def honest_and_attacked_score(
    streams: HonestStreams, direction: str, metric: str, attack: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[float, float]:
    """The largest score of ten fresh honest tensors against the EMA of the earlier ones, and the attacked score."""
    stream = streams.of(direction)
    reference = honest_reference(stream, settings(direction).beta)
    profiler, fn = make_profiler(), METRICS[metric]
    fresh = stream[WARMUP : WARMUP + 10]
    honest = max(fn(profiler(tensor), reference) for tensor in fresh)
    return honest, fn(profiler(attack(fresh[0])), reference)


ATTACK_FOR_METRIC = [
    ("norm", "activation", "zeros", lambda x: attacks.constant(x, 0, {})),
    ("norm", "gradient", "zeros", lambda x: attacks.constant(x, 0, {})),
    ("norm", "activation", "rescaled x10", lambda x: attacks.scale(x, 0, {}, sigma=10.0)),
    ("norm", "gradient", "rescaled x0.1", lambda x: attacks.scale(x, 0, {}, sigma=0.1)),
    ("scale", "activation", "noise of one scale", lambda x: attacks.random_noise(x, 0, {"seed": 1})),
    ("scale", "gradient", "zeros", lambda x: attacks.constant(x, 0, {})),
    ("sign_flip", "activation", "sign inversion", lambda x: attacks.scale(x, 0, {}, sigma=-1.0)),
    ("spectral", "activation", "random signs", lambda x: attacks.sign_flip(x, 0, {"seed": 1})),
    ("spectral", "gradient", "random signs", lambda x: attacks.sign_flip(x, 0, {"seed": 1})),
    ("l1", "activation", "bias", lambda x: attacks.bias(x, 0, {})),
    ("l1", "gradient", "bias", lambda x: attacks.bias(x, 0, {})),
    ("l2", "activation", "bias", lambda x: attacks.bias(x, 0, {})),
    ("l2", "gradient", "bias", lambda x: attacks.bias(x, 0, {})),
    ("wasserstein", "activation", "bias", lambda x: attacks.bias(x, 0, {})),
    ("wasserstein", "gradient", "bias", lambda x: attacks.bias(x, 0, {})),
    ("opposed", "activation", "5% of tokens negated", lambda x: attacks.row_corruption(x, 0, {}, fraction=0.05)),
]


@pytest.mark.parametrize(
    "metric, direction, attack",
    [(m, d, fn) for m, d, _, fn in ATTACK_FOR_METRIC],
    ids=[f"{m}-{d}-{name}" for m, d, name, _ in ATTACK_FOR_METRIC],
)
def test_metric_reacts_to_its_attack(streams, metric, direction, attack):
    honest, attacked = honest_and_attacked_score(streams, direction, metric, attack)
    assert attacked > 2.5 * honest, f"{metric}: attacked {attacked:.4f} vs honest up to {honest:.4f}"


@pytest.mark.parametrize("direction", ["activation", "gradient"])
def test_the_spectral_fence_keeps_the_honest_spread_while_most_tensors_concentrate_more(streams, direction):
    """A phase where honest tensors concentrate more than the reference (a fast phase of training): their spectral
    scores are negative, and the fence over them is set by their spread, not by its floor; clamped at zero, these
    scores made the window all zeros, the fence fell to its floor (0.05), and a dip of 7% was flagged (a stage of
    one replica was banned on such flags on the network)."""
    s = settings(direction)
    stream = streams.of(direction)
    reference = honest_reference(stream, s.beta)
    share, rng = float(reference.spectral_share), random.Random(7)
    fence = AdaptiveThreshold(s.window, s.fence_k, s.floors["spectral"], s.fence_spaces["spectral"])
    spectral = METRICS["spectral"]
    for _ in range(s.window):
        rise = dataclasses.replace(reference, spectral_share=torch.tensor(share * (1 + rng.gauss(0.1, 0.05))))
        fence.accept(spectral(rise, reference))
    dip = dataclasses.replace(reference, spectral_share=torch.tensor(share * 0.93))
    flattened = make_profiler()(attacks.sign_flip(stream[WARMUP], 0, {"seed": 1}))
    assert spectral(dip, reference) == pytest.approx(0.07)
    assert spectral(dip, reference) < fence.threshold() < spectral(flattened, reference)
    assert fence.threshold() > 2 * s.floors["spectral"]


def test_metrics_are_zero_against_their_own_profile(streams):
    profile = make_profiler()(streams.activations[0])
    assert all(fn(profile, profile) == pytest.approx(0.0, abs=1e-6) for fn in METRICS.values())


# --- the monitor: warm-up, flags, the baseline -----------------------------------------------------------------------


def test_honest_streams_are_not_flagged(streams):
    for direction in ("activation", "gradient"):
        monitor = warmed_monitor(streams, direction)
        verdicts = [monitor.check(tensor, "honest") for tensor in streams.of(direction)[WARMUP:]]
        assert sum(v.flagged for v in verdicts) <= 2, [v.reason for v in verdicts if v.flagged]
        assert not monitor.ledger.is_banned("honest")


def test_nothing_is_flagged_during_warmup_but_malformed_tensors(streams):
    monitor = BoundaryMonitor(settings(), HIDDEN, expected_shape=SHAPE)
    honest = streams.activations[:10]
    garbage = [attacks.constant(x, 0, {}) for x in honest] + [attacks.bias(x, 0, {}, offset=5.0) for x in honest]
    # each garbage tensor carries its microbatch's tokens: not a replay of the honest one (the replay test would
    # flag a near-copy of other tokens even in warm-up, as it needs no baseline)
    for i, tensor in enumerate(honest + garbage):
        verdict = monitor.check(tensor, "sender", content=i % len(honest))
        assert not verdict.flagged and verdict.warming_up
        assert verdict.tensor is tensor
    assert monitor.accepted == len(honest) + len(garbage) < WARMUP
    assert monitor.ledger.senders["sender"].strikes == 0


def test_attacks_are_flagged_after_warmup(streams):
    monitor = warmed_monitor(streams)
    honest = streams.activations[WARMUP]
    for attack in ("constant", "random", "scale", "sign_flip", "bias", "invisible_noise"):
        # all made of the same microbatch, so of the same tokens: not replays of each other
        verdict = monitor.check(attacks.CATALOGUE[attack](honest, 0, {"seed": 3}), f"attacker-{attack}", content=0)
        assert verdict.flagged, f"{attack}: scores {verdict.scores} thresholds {verdict.thresholds}"
        assert verdict.kind is VerdictKind.METRIC and verdict.reason.startswith("metric:")
        assert verdict.over and set(verdict.over) <= set(METRICS)


def test_negated_tokens_are_flagged_on_activations_by_the_rows_against_their_mean(streams):
    """Negating the 5% of tokens furthest along a secret direction leaves every per-channel statistic near honest;
    the rows' shared direction gives it away (the `opposed` share: about 0 honest, most of 0.05 here). Gradients
    have no such direction, and are not judged by it."""
    monitor = warmed_monitor(streams)
    profiler = make_profiler()
    honest = [float(profiler(t).opposed) for t in streams.activations[WARMUP : WARMUP + 20]]
    assert max(honest) < 0.01, honest
    state: dict = {}
    for i, tensor in enumerate(streams.activations[WARMUP : WARMUP + 6]):
        corrupted = attacks.row_corruption(tensor, i, state, fraction=0.05)
        # a negated row's cosine is minus its honest one: most, not all, were well aligned before
        assert 0.6 * 0.05 <= float(profiler(corrupted).opposed) <= 0.05 + 1 / 512
        verdict = monitor.check(corrupted, "attacker", content=i)
        assert verdict.flagged and "opposed" in verdict.over, (verdict.scores, verdict.thresholds)
    assert monitor.ledger.senders["attacker"].strikes >= 3
    assert "opposed" not in warmed_monitor(streams, "gradient").thresholds
    # nor the first stage's output, whose honest rows point many ways (demo model: up to 9% below -1/2)
    config = load_config().verification
    assert [("opposed" in config.monitor_settings("activation", 0, boundary).metrics) for boundary in (0, 1, 2)] == [
        False,
        True,
        True,
    ]
    assert "opposed" not in config.monitor_settings("gradient", 0, 1).metrics


def test_blatantly_flagged_tensors_never_move_the_baseline(streams):
    monitor = warmed_monitor(streams)
    before = snapshot(monitor)
    for i, tensor in enumerate(streams.activations[WARMUP : WARMUP + 5]):
        verdict = monitor.check(attacks.constant(tensor, i, {}), "attacker", content=i)
        assert verdict.flagged and verdict.blatant
    assert same_snapshot(before, snapshot(monitor))
    assert not monitor.check(streams.activations[WARMUP + 5], "honest").flagged
    assert not same_snapshot(before, snapshot(monitor))  # the control: an accepted tensor does move it


def test_a_lone_senders_moderate_flags_move_the_ema_but_never_teach_the_fences(streams):
    monitor = warmed_monitor(streams)
    reference, updates, accepted, windows = snapshot(monitor)
    flagged = 0
    for i, tensor in enumerate(streams.activations[WARMUP : WARMUP + 5]):
        verdict = monitor.check(attacks.bias(tensor, i, {}, offset=0.5), "honest", step=WARMUP + i)
        flagged += verdict.flagged and not verdict.blatant
    assert flagged >= 1
    _, updates_after, accepted_after, windows_after = snapshot(monitor)
    assert updates_after == updates + 5  # the EMA followed every one (accepted or moderately flagged)
    assert accepted_after == accepted + 5 - flagged  # the fences learned from the accepted ones only
    assert sum(map(len, windows_after.values())) == sum(map(len, windows.values())) + (5 - flagged) * len(windows)


def test_a_lone_senders_honest_shift_is_followed_and_not_banned_and_a_lasting_attack_is(streams):
    """A lone sender (no peers, so the EMA is the reference) whose tensors all shift at once, as when the only replica
    of a stage takes an averaging round: flags in the step of the shift give one strike, then the EMA follows and
    the flags stop. The control: an attacker whose every tensor stays away from the reference is banned."""
    per_step = 4
    tensors = streams.activations[WARMUP:]
    shifted = warmed_monitor(streams)
    verdicts = [
        shifted.check(attacks.scale(t, 0, {}, sigma=1.6), "honest", step=i // per_step) for i, t in enumerate(tensors)
    ]
    first = next(i for i, v in enumerate(verdicts) if v.flagged)
    assert sum(v.flagged for v in verdicts[first + 2 * per_step :]) == 0, [v.reason for v in verdicts if v.flagged]
    assert not shifted.ledger.is_banned("honest") and shifted.ledger.senders["honest"].strikes <= 2
    attacked = warmed_monitor(streams)
    for i, t in enumerate(tensors):
        attacked.check(attacks.scale(t, 0, {}, sigma=-1.0) if i % 2 else attacks.bias(t, i, {}, 1.5), "a", step=i)
    assert attacked.ledger.is_banned("a")


def _paired_monitor(streams: HonestStreams) -> BoundaryMonitor:
    """A monitor warmed on two senders taking turns: a stage of two replicas, so the EMA is the reference."""
    monitor = BoundaryMonitor(settings(), HIDDEN, expected_shape=SHAPE)
    for i, tensor in enumerate(streams.activations[:WARMUP]):
        assert not monitor.check(tensor, "ab"[i % 2], content=i).flagged
    assert monitor.reference() is monitor.baseline.reference
    return monitor


@pytest.mark.parametrize("both_shift", [False, True], ids=["attacker beside an honest replica", "both shift"])
def test_beside_an_honest_replica_a_moderate_crossing_walks_no_ema(streams, both_shift):
    """Of a pair, the sender that crosses while the other stays inside moved alone: its flags leave the EMA where it
    is, so an attacker whose tensors are all moderately off stays flagged and is banned (one strike a step), while
    its honest peer is never struck. The control: both replicas shift at once, as when their parameters move, and
    the EMA follows as for a lone sender, banning neither."""
    per_step, monitor = 4, _paired_monitor(streams)
    verdicts: dict[str, list] = {"a": [], "b": []}
    start, walked = float(monitor.baseline.reference.log_rms), 0.0
    for i, tensor in enumerate(streams.activations[WARMUP:]):
        sender = "ab"[i % 2]
        shifted = attacks.scale(tensor, 0, {}, sigma=1.6) if both_shift or sender == "b" else tensor
        verdicts[sender].append(monitor.check(shifted, sender, content=WARMUP + i, step=i // per_step))
        if not monitor.ledger.is_banned("b"):
            walked = max(walked, abs(float(monitor.baseline.reference.log_rms) - start))
    moderate = [v for v in verdicts["b"] if v.flagged and not v.blatant]
    if both_shift:
        assert not monitor.ledger.is_banned("a") and not monitor.ledger.is_banned("b")
        assert sum(v.flagged for v in verdicts["a"] + verdicts["b"]) <= 2 * per_step
        return
    assert monitor.ledger.is_banned("b"), [v.reason for v in verdicts["b"][:12]]
    assert moderate and all(v.flagged for v in verdicts["b"][: len(moderate)]), "every tensor until the ban flagged"
    assert monitor.ledger.peek("a").strikes == 0 and not any(v.flagged for v in verdicts["a"])
    banned_at = next(i for i, v in enumerate(verdicts["b"]) if v.banned)
    assert banned_at <= 3 * per_step  # three steps of the pair's two tensors a step, with room
    assert walked < 0.1 * math.log(1.6), f"the EMA's magnitude moved {walked:.3f} toward the attacker's"


MALFORMED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "nan": lambda x: x.index_put((torch.tensor([0]), torch.tensor([3]), torch.tensor([5])), torch.tensor(math.nan)),
    "inf": lambda x: x.index_put((torch.tensor([2]), torch.tensor([0]), torch.tensor([1])), torch.tensor(math.inf)),
    "-inf": lambda x: torch.full_like(x, -math.inf),
    "wrong hidden size": lambda x: x[..., : HIDDEN // 2],
    "wrong token count": lambda x: x[:, :32],
    "float64": lambda x: x.double(),
    "float16": lambda x: x.half(),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_tensors_are_flagged_even_during_warmup(streams, kind):
    monitor = BoundaryMonitor(settings(replacement="ema"), HIDDEN, expected_shape=SHAPE)
    assert not monitor.check(streams.activations[0], "sender").flagged
    assert monitor.warming_up
    verdict = monitor.check(MALFORMED[kind](streams.activations[1]), "sender")
    assert verdict.flagged and verdict.reason
    assert verdict.sender.strikes == 1
    assert tuple(verdict.tensor.shape) == SHAPE and verdict.tensor.dtype == torch.float32
    assert torch.isfinite(verdict.tensor).all()
    assert monitor.accepted == 1 and monitor.baseline.updates == 1


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_tainted_malformed_tensors_are_replaced_without_a_strike(streams, kind):
    monitor = warmed_monitor(streams, replacement="ema")
    before = snapshot(monitor)
    verdict = monitor.check(MALFORMED[kind](streams.activations[WARMUP]), "downstream", tainted=True)
    assert not verdict.flagged and verdict.skipped
    assert tuple(verdict.tensor.shape) == SHAPE and torch.isfinite(verdict.tensor).all()
    assert "downstream" not in monitor.ledger.senders
    assert same_snapshot(before, snapshot(monitor))


def test_a_tainted_check_is_skipped_without_strike_or_learning(streams):
    monitor = warmed_monitor(streams)
    before = snapshot(monitor)
    for tensor in streams.activations[WARMUP : WARMUP + 3]:
        for sent in (tensor, attacks.constant(tensor, 0, {}), attacks.bias(tensor, 0, {})):
            verdict = monitor.check(sent, "downstream", tainted=True)
            assert not verdict.flagged and verdict.skipped and verdict.tensor is sent
    assert "downstream" not in monitor.ledger.senders
    assert same_snapshot(before, snapshot(monitor))


# --- replacement ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["activation", "gradient"])
def test_ema_replacement_looks_like_the_honest_traffic(streams, direction):
    monitor = warmed_monitor(streams, direction, replacement="ema")
    honest = torch.stack(streams.of(direction)[:WARMUP])
    verdict = monitor.check(torch.zeros(SHAPE), "attacker")
    assert verdict.flagged
    replacement = verdict.tensor
    assert tuple(replacement.shape) == SHAPE and replacement.dtype == torch.float32
    assert torch.isfinite(replacement).all()
    # scale-free: its profile sits on the baseline
    reference = monitor.baseline.reference
    profile = monitor.profiler(replacement)
    assert torch.allclose(profile.mean, reference.mean, atol=0.15)
    # and in the traffic's own units: the magnitude and the channel means of honest tensors
    honest_rms = float(honest.square().mean().sqrt())
    assert float(replacement.square().mean().sqrt()) == pytest.approx(honest_rms, rel=0.5)
    honest_means, replaced_means = honest.mean(dim=(0, 1, 2)), replacement.mean(dim=(0, 1))
    assert float((replaced_means - honest_means).abs().max()) < 0.25 * honest_rms


def test_zero_and_drop_replacements(streams):
    zero = warmed_monitor(streams, replacement="zero").check(torch.zeros(SHAPE), "attacker")
    assert zero.flagged and tuple(zero.tensor.shape) == SHAPE and not zero.tensor.any()
    drop = warmed_monitor(streams, replacement="drop").check(attacks.bias(streams.activations[WARMUP], 0, {}), "a")
    assert drop.flagged and drop.tensor is None and drop.tainted


def test_replacement_without_expected_shape_takes_the_inputs_with_the_hidden_size(streams):
    monitor = BoundaryMonitor(settings(replacement="zero"), HIDDEN)
    verdict = monitor.check(torch.ones(4, 16, HIDDEN // 2), "sender")
    assert verdict.flagged and tuple(verdict.tensor.shape) == (4, 16, HIDDEN)


def test_an_unknown_replacement_policy_is_rejected():
    with pytest.raises(ValueError, match="replacement must be one of"):
        BoundaryMonitor(settings(replacement="median"), HIDDEN)


# --- strikes, forgiveness, bans ------------------------------------------------------------------------------------


@pytest.mark.parametrize("strike_limit", [3, 5])
def test_a_persistent_attacker_is_banned_at_exactly_the_strike_limit(streams, strike_limit):
    monitor = warmed_monitor(streams, strike_limit=strike_limit, blatant_severity=1e9)  # every flag one strike
    banned_after = []
    for i, tensor in enumerate(streams.activations[WARMUP : WARMUP + strike_limit + 2]):
        verdict = monitor.check(attacks.constant(tensor, i, {}), "attacker")
        assert verdict.flagged
        assert verdict.sender.strikes == min(i + 1, strike_limit)
        banned_after.append(verdict.banned)
    assert banned_after.index(True) == strike_limit - 1
    assert all(banned_after[strike_limit - 1 :])
    assert monitor.ledger.banned() == ["attacker"]


def test_blatant_flags_weigh_two_strikes(streams):
    monitor = warmed_monitor(streams)
    seen = []  # the sender's record is live: read its strikes right after each check
    for tensor in streams.activations[WARMUP : WARMUP + 2]:
        verdict = monitor.check(attacks.constant(tensor, 0, {}), "attacker")
        assert verdict.blatant and verdict.severity >= monitor.settings.blatant_severity
        seen.append((verdict.sender.strikes, verdict.banned))
    assert seen == [(2, False), (4, True)]


def glitching_sender(streams: HonestStreams, every: int, **overrides) -> BoundaryMonitor:
    """An honest sender whose every `every`-th tensor after warm-up carries one NaN."""
    monitor = warmed_monitor(streams, **overrides)
    for i, tensor in enumerate(streams.activations[WARMUP:], start=1):
        sent = MALFORMED["nan"](tensor) if i % every == 0 else tensor
        monitor.check(sent, "honest")
    return monitor


def test_an_honest_sender_with_a_rare_glitch_is_forgiven(streams):
    strike_limit, every = 3, 50
    checks_after_warmup = len(streams.activations) - WARMUP
    assert checks_after_warmup // every >= strike_limit  # enough glitches to ban, without forgiveness
    forgiving = glitching_sender(streams, every, strike_limit=strike_limit, forgive_after=every - 10)
    record = forgiving.ledger.senders["honest"]
    assert record.flags >= strike_limit and not record.banned and record.strikes <= 1
    # the control: the same glitches without forgiveness ban
    unforgiving = glitching_sender(streams, every, strike_limit=strike_limit, forgive_after=10**6)
    assert unforgiving.ledger.is_banned("honest")


def test_statistical_flags_of_one_step_give_one_strike_and_blatant_ones_each_their_own():
    ledger = SenderStrikes(strike_limit=3, forgive_after=100)
    for _ in range(4):
        ledger.record("shifted", True, step=7)
    record = ledger.senders["shifted"]
    assert (record.flags, record.strikes, record.banned) == (4, 1, False)
    ledger.record("shifted", True, step=8)
    ledger.record("shifted", True, step=9)
    assert ledger.is_banned("shifted")  # three steps of flags
    for _ in range(2):
        ledger.record("blatant", True, weight=2, blatant=True, step=7)
    assert ledger.is_banned("blatant")
    for _ in range(3):
        ledger.record("unstepped", True)  # a caller that knows no step: every flag is its own evidence
    assert ledger.is_banned("unstepped")


def test_a_lone_senders_isolated_flags_are_suspicions_and_repeated_ones_strike():
    """A lone sender is judged against the EMA of its own past, which lags its honest training: a flag that does not
    repeat within the step or the next is a suspicion (audited), never a strike; one that repeats strikes."""
    ledger = SenderStrikes(strike_limit=3, forgive_after=100)
    for step in range(40):  # one check a step, an isolated flag every few steps: the demo's honest lone replica
        ledger.record("lone", step in {1, 12, 14, 30}, step=step, now=step)
    record = ledger.senders["lone"]
    assert (record.flags, record.strikes, record.banned) == (4, 0, False)
    assert record.suspicions >= 1 and ledger.suspect("lone")  # its work is audited more often meanwhile
    for step in range(40, 43):  # the control: a sender off the reference on every check, one check a step
        ledger.record("off", True, step=step, now=step)
    assert not ledger.is_banned("off") and ledger.senders["off"].strikes == 2
    ledger.record("off", True, step=43, now=43)
    assert ledger.is_banned("off")


def test_a_sender_with_peers_is_struck_for_repeated_crossings_and_an_isolated_one_is_a_suspicion():
    """Two honest stage-2 replicas of the full profile's sweep (`start_blatant`, 8 replicas a stage), banned at the
    head of 2026-12-07 on moderate flags of a training event: one crossed a fence twice in one step and once 39
    steps later; the other crossed one, raised a coherence alarm two checks later, and crossed one again at the next
    check. A crossing of a sender with peers strikes now only when it repeats a flag of the sender's last four
    checks; an attacker whose tensors keep crossing is banned one flag later than before."""
    ledger = SenderStrikes(strike_limit=3, forgive_after=100, forgive_steps=50, repeat_within=4)
    checks = [(step, False) for step in range(60, 83)] + [(83, True), (83, True)]
    checks += [(step, False) for step in range(84, 122)] + [(122, True)]
    for step, flagged in checks:
        ledger.record("twice-in-a-step", flagged, now=step, repeated_only=True)
    record = ledger.senders["twice-in-a-step"]
    assert (record.flags, record.strikes, record.banned) == (3, 1, False) and record.suspicions >= 1
    for step in (136, 136, 137, 138, 139):
        ledger.record("in-an-event", False, now=step)
    ledger.record("in-an-event", True, now=141, repeated_only=True)  # a fence crossed: a suspicion
    ledger.record("in-an-event", False, now=143)
    ledger.record("in-an-event", True, now=143)  # a sequential test's alarm strikes as before
    ledger.record("in-an-event", True, now=144, repeated_only=True)  # repeats it: a strike
    assert (ledger.senders["in-an-event"].strikes, ledger.is_banned("in-an-event")) == (2, False)
    old = SenderStrikes(strike_limit=3, forgive_after=100, forgive_steps=50)  # every crossing a strike: both banned
    for step, flagged in checks:
        old.record("twice-in-a-step", flagged, now=step, repeated_only=True)
    assert old.is_banned("twice-in-a-step")
    for step in range(10):
        ledger.record("keeps-crossing", False, now=step)
    banned_at = [ledger.record("keeps-crossing", True, now=10 + i, repeated_only=True).banned for i in range(4)]
    assert banned_at == [False, False, False, True]
    banned_at = [
        ledger.record("every-other-check", i % 2 == 0, now=20 + i, repeated_only=True).banned for i in range(7)
    ]
    assert banned_at[-1] and not any(banned_at[:-1])  # its 4th crossing, 2 checks apart each
    ledger.record("blatant", True, weight=2, blatant=True, repeated_only=True)
    assert ledger.senders["blatant"].strikes == 2  # a blatant crossing strikes at once, isolated or not
    for i in range(30):  # one crossing in six checks: suspicions only, left to the sequential tests and the audits
        ledger.record("sparse", i % 6 == 0, repeated_only=True)
    assert ledger.senders["sparse"].strikes == 0 and ledger.suspect("sparse")


def test_ledger_forgives_one_strike_after_f_clean_checks():
    ledger = SenderStrikes(strike_limit=3, forgive_after=10)
    ledger.record("peer", True)
    ledger.record("peer", True)
    for _ in range(9):
        assert ledger.record("peer", False).strikes == 2
    assert ledger.record("peer", False).strikes == 1
    for _ in range(9):
        assert ledger.record("peer", False).strikes == 1
    assert ledger.record("peer", False).strikes == 0
    assert ledger.record("peer", False).strikes == 0  # never below zero
    record = ledger.senders["peer"]
    assert (record.checks, record.flags, record.banned) == (23, 2, False)


def test_a_sender_checked_rarely_is_forgiven_by_steps_and_one_flagged_often_is_not():
    """With eight replicas of a stage a replica is checked at a boundary about once in two steps: 100 clean checks
    took it 200 steps, and an honest replica holding two strikes from just-over crossings at steps 88 and 144 was
    banned by a third at 298 (the full profile's `token_shift` sweep). Fifty steps without a flag forgive a strike
    now; a sender flagged within every fifty steps keeps its strikes."""
    ledger = SenderStrikes(strike_limit=3, forgive_after=100, forgive_steps=50)
    flags = {88, 144, 298}
    for step in range(0, 300, 2):  # one check every other step
        ledger.record("rare", step in flags, now=step)
    record = ledger.senders["rare"]
    assert not record.banned and record.strikes == 1 and record.flags == 3
    for step in range(300, 400, 2):
        ledger.record("rare", False, now=step)
    assert ledger.senders["rare"].strikes == 0
    unforgiving = SenderStrikes(strike_limit=3, forgive_after=100)  # checks alone forgive: the ban of before
    for step in range(0, 400, 2):
        unforgiving.record("rare", step in flags, now=step)
    assert unforgiving.is_banned("rare")
    for step in range(0, 200, 2):  # a flag every 40 steps: never 50 steps quiet, 3 strikes by step 80
        ledger.record("often", step % 40 == 0, now=step)
    assert ledger.is_banned("often")
    ledger.record("no-clock", True)
    for _ in range(99):  # a caller that knows no step forgives by checks alone
        ledger.record("no-clock", False)
    assert ledger.senders["no-clock"].strikes == 1


def test_ledger_a_flag_restarts_the_clean_streak():
    ledger = SenderStrikes(strike_limit=3, forgive_after=10)
    ledger.record("peer", True)
    for _ in range(9):
        ledger.record("peer", False)
    assert ledger.record("peer", True).strikes == 2
    for _ in range(9):
        ledger.record("peer", False)
    assert ledger.senders["peer"].strikes == 2
    assert ledger.record("peer", False).strikes == 1


def test_ledger_bans_at_the_limit_and_a_ban_is_final():
    ledger = SenderStrikes(strike_limit=3, forgive_after=2)
    assert [ledger.record("bad", True).banned for _ in range(3)] == [False, False, True]
    for _ in range(10):
        ledger.record("bad", False)
    assert ledger.is_banned("bad") and ledger.senders["bad"].strikes == 3
    assert ledger.record("bad", True).strikes == 3  # strikes stop counting once banned
    assert not ledger.is_banned("never-seen")
    assert ledger.banned() == ["bad"]


def test_ledger_keeps_senders_apart():
    ledger = SenderStrikes(strike_limit=2, forgive_after=5)
    ledger.record("a", True)
    ledger.record("b", False)
    ledger.record("a", True)
    assert ledger.is_banned("a") and not ledger.is_banned("b")
    assert ledger.senders["b"].strikes == 0


# --- adaptive thresholds -------------------------------------------------------------------------------------------


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Q1, median, Q3 with linear interpolation between order statistics (numpy's default rule)."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


@pytest.mark.parametrize("space", ["relative_log", "linear"])
def test_threshold_is_infinite_before_four_scores(space):
    threshold = AdaptiveThreshold(window=16, k=3.0, floor=0.01, space=space)
    for score in (0.1, 0.2, 0.3):
        assert threshold.threshold() == math.inf
        assert threshold.severity(100.0) == 0.0
        threshold.accept(score)
    assert threshold.threshold() == math.inf
    threshold.accept(0.4)
    assert math.isfinite(threshold.threshold())


def test_linear_threshold_is_the_tukey_fence_of_known_data():
    threshold = AdaptiveThreshold(window=16, k=1.5, floor=0.0, space="linear")
    for score in range(1, 10):  # 1..9: Q1 = 3, Q3 = 7
        threshold.accept(float(score))
    assert threshold.threshold() == pytest.approx(7 + 1.5 * (7 - 3))


def test_relative_log_threshold_is_the_tukey_fence_in_log_space():
    rng = random.Random(4)
    scores = [rng.lognormvariate(-2.0, 0.5) for _ in range(51)]
    threshold = AdaptiveThreshold(window=64, k=3.0, floor=1e-6, space="relative_log")
    for score in scores:
        threshold.accept(score)
    median = statistics.median(scores)
    q1, _, q3 = quartiles([math.log1p(s / median) for s in scores])
    assert threshold.threshold() == pytest.approx(median * math.expm1(q3 + 3.0 * (q3 - q1)), rel=1e-9)
    assert threshold.threshold() > max(scores)


def test_threshold_keeps_only_the_last_window_of_scores():
    threshold = AdaptiveThreshold(window=9, k=1.5, floor=0.0, space="linear")
    for score in [100.0] * 9 + [float(s) for s in range(1, 10)]:
        threshold.accept(score)
    assert threshold.threshold() == pytest.approx(13.0)


@pytest.mark.parametrize("space", ["relative_log", "linear"])
def test_threshold_respects_its_floor(space):
    flat = AdaptiveThreshold(window=32, k=3.0, floor=0.05, space=space)
    for _ in range(20):
        flat.accept(0.0)
    assert flat.threshold() == pytest.approx(0.05)
    tight = AdaptiveThreshold(window=32, k=3.0, floor=0.05, space=space)
    for i in range(20):
        tight.accept(0.001 + 1e-5 * i)
    assert tight.threshold() == pytest.approx(0.05)
    wide = AdaptiveThreshold(window=32, k=3.0, floor=0.05, space=space)
    for i in range(20):
        wide.accept(0.1 * (i + 1))
    assert wide.threshold() > 0.05 * 10


@pytest.mark.parametrize("space", ["relative_log", "linear"])
def test_severity_is_zero_at_the_median_and_one_at_the_threshold(space):
    rng = random.Random(5)
    scores = [rng.uniform(0.05, 0.3) for _ in range(41)]
    threshold = AdaptiveThreshold(window=64, k=3.0, floor=0.01, space=space)
    for score in scores:
        threshold.accept(score)
    assert threshold.severity(statistics.median(scores)) == pytest.approx(0.0, abs=1e-9)
    assert threshold.severity(threshold.threshold()) == pytest.approx(1.0, abs=1e-9)
    assert threshold.severity(min(scores)) < 0 < threshold.severity(max(scores)) < 1


def test_an_unknown_fence_space_is_rejected():
    with pytest.raises(ValueError, match="fence space"):
        AdaptiveThreshold(window=8, k=3.0, floor=0.0, space="log")


# --- the reference: the senders' median ----------------------------------------------------------------------------

SENDERS = ("a", "b", "c", "d")


def test_the_peer_reference_is_the_median_with_an_equal_share_per_sender(streams):
    profiler = make_profiler()
    reference = PeerReference(pool=8, horizon=100, max_senders=16)
    profiles = [profiler(t) for t in streams.activations[:12]]
    for i, profile in enumerate(profiles):
        reference.observe(SENDERS[i % 4], profile)
    # four senders, a pool of eight: the last two profiles of each
    expected = median_profile(profiles[4:])
    assert all(torch.equal(a, b) for a, b in zip(reference.reference().fields(), expected.fields(), strict=True))
    # fewer than three live senders: no majority, no reference
    lonely = PeerReference(pool=8, horizon=100, max_senders=16)
    for i, profile in enumerate(profiles):
        lonely.observe("ab"[i % 2], profile)
    assert lonely.reference() is None


def test_a_minority_cannot_walk_the_peer_reference(streams):
    """One sender in four drifts a little further each check (a bias growing to 2 RMS): the EMA of everything
    accepted follows it, the senders' median does not."""
    profiler, stream = make_profiler(), streams.activations
    honest = PeerReference(pool=12, horizon=100, max_senders=16)
    walked = PeerReference(pool=12, horizon=100, max_senders=16)
    ema = EmaBaseline(0.9)
    for i, tensor in enumerate(stream[:160]):
        sender = SENDERS[i % 4]
        sent = attacks.bias(tensor, 0, {}, offset=2.0 * i / 160) if sender == "d" else tensor
        honest.observe(sender, profiler(tensor))
        walked.observe(sender, profiler(sent))
        ema.update(profiler(sent))
    truth = honest.reference()
    moved = METRICS["l1"](walked.reference(), truth)
    dragged = METRICS["l1"](ema.reference, truth)
    assert dragged > 0.2 and moved < dragged / 4, (moved, dragged)


def test_a_shift_of_every_sender_is_followed_and_strikes_no_one(streams):
    """Every sender moves at once (a bias of 0.5 RMS: honest stages retrained by an attack upstream look like
    this): the median moves with them, so after the first flags nobody is struck again, and nobody is banned."""
    monitor = BoundaryMonitor(settings("activation"), HIDDEN, expected_shape=SHAPE)
    stream = streams.activations
    for i, tensor in enumerate(stream[:WARMUP]):
        monitor.check(tensor, SENDERS[i % 4])
    verdicts = [
        monitor.check(attacks.bias(t, 0, {}, offset=0.5), SENDERS[i % 4]) for i, t in enumerate(stream[WARMUP:])
    ]
    late = verdicts[len(SENDERS) * 8 :]
    assert len(late) > 100
    assert sum(v.flagged for v in late) <= 2, [v.reason for v in late if v.flagged]
    assert not monitor.ledger.banned()


def test_fences_crossed_in_turn_by_every_sender_strike_no_one(streams):
    """The spread of the whole boundary growing faster than the fences follow (measured late in the quick profile:
    every replica of a stage crossed the spectral fence in turn, and one was banned): here every sender's tensors
    get a random scale, exp(0.6 z), from the end of warm-up. Without the exemption this stream bans all four
    senders; most senders crossing the same fence lately is a shift, not evidence, and no one gets a second
    strike."""
    monitor = BoundaryMonitor(settings("activation"), HIDDEN, expected_shape=SHAPE)
    stream = streams.activations
    for i, tensor in enumerate(stream[:WARMUP]):
        monitor.check(tensor, SENDERS[i % 4])
    rng = torch.Generator().manual_seed(7)
    verdicts = []
    for i, tensor in enumerate(stream[WARMUP:]):
        factor = float(torch.exp(0.6 * torch.randn((), generator=rng)))
        verdicts.append(monitor.check(tensor * factor, SENDERS[i % 4]))
    assert sum(bool(v.over) for v in verdicts) >= 5, "the spread should cross the fences of several senders"
    assert sum(v.shared for v in verdicts) >= 3
    assert max(monitor.ledger.peek(s).strikes for s in SENDERS) <= 1
    assert not monitor.ledger.banned(), [v.reason for v in verdicts if v.flagged]


def test_a_shared_crossing_needs_a_quarter_of_the_other_senders():
    shift = SharedShift(window=32)
    senders = [f"h{i}" for i in range(8)]
    for sender in senders:
        assert not shift.observe(sender, ())
    assert not shift.observe("h0", ("l2",)), "the first crossing is nobody else's"
    assert not shift.observe("h1", ("norm",)), "h0 crossed another fence"
    assert not shift.observe("h1", ("l2",)), "one of h1's seven peers crossed l2: under a quarter"
    assert shift.observe("h2", ("l2", "norm")), "two of h2's seven peers (h0, h1) crossed l2"


def test_only_a_senders_first_crossings_in_the_window_are_excused():
    shift = SharedShift(window=64, repeats=3)
    for sender in ("a", "b", "c", "d"):
        shift.observe(sender, ("l1",) if sender == "b" else ())
    excused = [shift.observe("a", ("l1",)) for _ in range(6)]
    assert excused == [True, True, True, False, False, False], "b crossed once; a's later crossings are its own"


def test_a_banned_senders_crossings_excuse_nobody():
    def with_attacker(forget: bool) -> bool:
        shift = SharedShift(window=16)
        shift.observe("h2", ())
        shift.observe("a", ("l1",))
        if forget:
            shift.forget("a")
        return shift.observe("h1", ("l1",))

    assert with_attacker(forget=False), "one of two peers crossed"
    assert not with_attacker(forget=True)


def test_colluders_excuse_each_other_a_few_times_per_window_at_most():
    """Two colluders among five senders, over a fence on every check: each is excused for its first crossings in
    the window only, so most of their crossings are struck; honest senders that never cross are never excused."""
    shift = SharedShift(window=64, repeats=3)
    for sender in ("x", "y", "h1", "h2", "h3"):
        shift.observe(sender, ())
    excused = {sender: 0 for sender in ("x", "y", "h1", "h2", "h3")}
    for _ in range(20):
        for sender in excused:
            excused[sender] += shift.observe(sender, ("l1",) if sender in "xy" else ())
    assert excused["x"] <= 3 and excused["y"] <= 3 and not excused["h1"] + excused["h2"] + excused["h3"]
    assert not SharedShift(window=8).observe("alone", ("l1",)), "no peers: no exemption"
    pair = SharedShift(window=8)
    pair.observe("honest", ("l1",))
    assert not pair.observe("attacker", ("l1",)), "one peer: which of two moved? no exemption"


# --- evidence against peers ----------------------------------------------------------------------------------------


def peer_stream(streams, direction: str, attack=None, attacker: str = "d", **overrides) -> list:
    """The honest stream dealt round-robin to four senders (replicas of one stage); `attacker` sends `attack` of its
    share from the end of warm-up on. Returns [(sender, verdict)]."""
    monitor = BoundaryMonitor(settings(direction, **overrides), HIDDEN, expected_shape=SHAPE)
    found = []
    for i, tensor in enumerate(streams.of(direction)):
        sender = SENDERS[i % 4]
        if attack is not None and sender == attacker and i >= WARMUP:
            tensor = attack(tensor, i)
        found.append((sender, monitor.check(tensor, sender)))
    return found


@pytest.mark.parametrize("direction", ["activation", "gradient"])
def test_honest_peers_raise_no_peer_alarm_over_a_long_stream(streams, direction):
    verdicts = peer_stream(streams, direction)
    assert not [v.reason for _, v in verdicts if v.kind is VerdictKind.PEER]
    assert sum(v.flagged for _, v in verdicts) <= 2


MODERATE = [
    ("activation", "half the tensor", lambda x, i: attacks.scale(x, i, {}, sigma=0.5)),
    (
        "activation",
        "a tenth of the signs flipped",
        lambda x, i: attacks.sparse_sign_flip(x, i, {"seed": i}, fraction=0.1),
    ),
    ("gradient", "half the gradient", lambda x, i: attacks.scale(x, i, {}, sigma=0.5)),
    (
        "gradient",
        "noise of half its norm",
        lambda x, i: attacks.gaussian_noise(x, i, {"seed": i}, fraction=0.5),
    ),
]


@pytest.mark.parametrize("direction, attack", [(d, a) for d, _, a in MODERATE], ids=[n for _, n, _ in MODERATE])
def test_a_sender_consistently_unlike_its_peers_is_flagged_by_its_evidence(streams, direction, attack):
    # the fences opened wide (k = 60) and the drift test off (a tenth of the signs flipped shrinks the mean row, which
    # it sees first): the evidence accumulated against the peers alone flags the attacker
    verdicts = peer_stream(streams, direction, attack, fence_k=60.0, drift_limit=0.0)
    attacker = [v for sender, v in verdicts[WARMUP:] if sender == "d"]
    assert sum(v.kind is VerdictKind.PEER for v in attacker) >= 2, [v.reason for v in attacker if v.flagged]
    assert not any(v.flagged for sender, v in verdicts if sender != "d")


@pytest.mark.parametrize("direction, attack", [(d, a) for d, _, a in MODERATE], ids=[n for _, n, _ in MODERATE])
def test_a_moderate_attacker_among_honest_peers_is_banned_and_they_are_not(streams, direction, attack):
    verdicts = peer_stream(streams, direction, attack)
    banned = {sender for sender, v in verdicts if v.banned}
    assert banned == {"d"}, [(s, v.reason) for s, v in verdicts if v.flagged]


def test_peer_evidence_needs_two_other_senders():
    evidence = PeerEvidence(("m",), pool=64, kappa=0.5, limit=3.0, max_senders=8)
    # one peer: a sender always far above it is no evidence (which of two is the odd one?)
    assert not any(
        evidence.observe(sender, {"m": 10.0 if sender == "x" else 1.0}) for _ in range(50) for sender in "xy"
    )
    evidence = PeerEvidence(("m",), pool=64, kappa=0.5, limit=3.0, max_senders=8)
    alarms = [
        evidence.observe(sender, {"m": 10.0 if sender == "x" else 1.0 + 0.01 * i})
        for i in range(50)
        for sender in "xyz"
    ]
    raised = [a for a in alarms if a is not None]
    assert raised and all(a.metric == "m" for a in raised)


# --- replays -------------------------------------------------------------------------------------------------------


def test_replay_sketches_are_small_and_the_same_for_every_verifier(streams):
    tensor = streams.activations[3]
    first, second = ReplaySketcher(HIDDEN, 16, seed=7)(tensor), ReplaySketcher(HIDDEN, 16, seed=7)(tensor)
    assert torch.equal(first, second) and first.dtype == torch.float16
    assert first.numel() * first.element_size() == SHAPE[0] * 16 * 2  # 256 bytes for 8 sequences
    assert not torch.equal(first, ReplaySketcher(HIDDEN, 16, seed=8)(tensor))


@pytest.mark.parametrize("direction", ["activation", "gradient"])
def test_honest_tensors_are_never_near_copies(streams, direction):
    verdicts = peer_stream(streams, direction)
    assert not [v.reason for _, v in verdicts if v.kind is VerdictKind.REPLAY]


REPLAYS = [
    ("exact", lambda old, i: old.clone()),
    ("with 5% noise", lambda old, i: attacks.gaussian_noise(old, i, {"seed": i}, fraction=0.05)),
    ("sequences shuffled", lambda old, i: attacks.sequence_shuffle(old, i, {"seed": i}, fraction=1.0)),
]


@pytest.mark.parametrize("direction", ["activation", "gradient"])
@pytest.mark.parametrize("copy", [fn for _, fn in REPLAYS], ids=[name for name, _ in REPLAYS])
def test_a_near_copy_of_another_microbatch_is_a_replay_and_blatant(streams, direction, copy):
    monitor = warmed_monitor(streams, direction)
    stream = streams.of(direction)
    for i, tensor in enumerate(stream[WARMUP : WARMUP + 8]):
        monitor.check(tensor, SENDERS[i % 3], content=i)
    verdict = monitor.check(copy(stream[WARMUP + 2], 2), "free-rider", content=100)
    assert verdict.kind is VerdictKind.REPLAY and verdict.blatant and verdict.sender.strikes == 2
    assert verdict.replay.sender == SENDERS[2] and verdict.replay.age == 6
    # the same tokens again (a retried microbatch, duplicate computation) are not a replay
    retried = monitor.check(stream[WARMUP + 3].clone(), "another replica", content=3)
    assert retried.kind is not VerdictKind.REPLAY


def test_tensors_whose_rows_all_point_one_way_are_not_near_copies_of_each_other():
    """Early in training every row of a model can point nearly one way (measured in `bench overhead`'s model: one
    direction held 30/32 of the sketch's energy): per-sequence sketches then agreed for any two tensors, and honest
    replicas were banned as replays. The dominant direction is no sequence's own and is taken off the sketch; a copy
    is still a near-copy."""
    generator = torch.Generator().manual_seed(3)
    direction = torch.randn(HIDDEN, generator=generator)

    def collapsed() -> torch.Tensor:  # each sequence's rows: one size of one direction, a little noise
        sizes = torch.randn(SHAPE[0], 1, 1, generator=generator) + 0.2 * torch.randn(
            *SHAPE[:2], 1, generator=generator
        )
        return sizes * direction + 0.01 * torch.randn(SHAPE, generator=generator)

    sketcher, store = ReplaySketcher(HIDDEN, 32, seed=0), ReplayStore(256, 0.95)
    tensors = [collapsed() for _ in range(40)]
    for i, tensor in enumerate(tensors):
        assert store.match(sketcher(tensor), content=i) is None, i
        store.add(sketcher(tensor), "honest", content=i)
    copy = tensors[5][torch.randperm(SHAPE[0], generator=generator)]  # its sequences shuffled
    match = store.match(sketcher(copy), content=100)
    assert match is not None and match.age == 35


# --- weighted strikes, bounded memory -------------------------------------------------------------------------------


def test_a_blatant_flag_weighs_two_strikes_and_a_near_miss_one():
    ledger = SenderStrikes(strike_limit=3, forgive_after=10)
    assert ledger.record("glitch", True).strikes == 1
    assert ledger.record("cheat", True, weight=2, blatant=True).strikes == 2
    assert ledger.record("cheat", True, weight=2, blatant=True).banned  # two blatant flags: banned


def test_sparse_blatant_cheating_is_banned_however_sparse_while_an_honest_glitch_is_forgiven():
    ledger = SenderStrikes(strike_limit=3, forgive_after=10, blatant_limit=3, blatant_forgive_after=1000)
    for _ in range(3):  # one blatant tensor in 200: its strikes are forgiven in between, its marks are not
        ledger.record("sparse", True, weight=2, blatant=True)
        assert not ledger.is_banned("sparse") or ledger.senders["sparse"].blatant == 3
        for _ in range(199):
            ledger.record("sparse", False)
    assert ledger.is_banned("sparse") and ledger.senders["sparse"].blatant == 3
    for _ in range(3):  # an honest glitch now and then, just over a fence
        ledger.record("honest", True)
        for _ in range(199):
            ledger.record("honest", False)
    assert not ledger.is_banned("honest") and ledger.senders["honest"].strikes == 0


def test_state_per_sender_is_bounded_and_bans_are_kept_apart():
    ledger = SenderStrikes(strike_limit=1, forgive_after=10, max_senders=8)
    ledger.record("banned-early", True)
    for i in range(100):
        ledger.record(f"sybil-{i}", False)
    assert len(ledger.senders) == 9 and ledger.is_banned("banned-early")
    senders = RecentSenders(3, dict)
    for name in "abcd":
        senders.get(name)
    senders.get("b")  # heard from again: the oldest is now c
    senders.get("e")
    assert [name for name, _ in senders.items()] == ["d", "b", "e"]


def test_a_monitor_fed_by_many_identities_keeps_bounded_state(streams):
    monitor = BoundaryMonitor(settings(max_senders=8), HIDDEN, expected_shape=SHAPE)
    for i, tensor in enumerate(streams.activations[:60]):
        monitor.check(tensor, f"identity-{i}")
    assert len(monitor.peer_reference.senders) <= 8 and len(monitor.peers.sums) <= 8
    assert len(monitor.ledger.senders) <= 8


# --- the randomized spectral share and the linear-time profile -------------------------------------------------------


def exact_share(tensor: torch.Tensor, rank: int, row_clip: float) -> float:
    """The share of the clipped rows' energy in their top singular values, from a float64 SVD of all of them."""
    rows = tensor.reshape(-1, tensor.shape[-1]).double()
    norms = rows.norm(dim=1, keepdim=True)
    rows = rows * (row_clip * norms.median() / norms).clamp(max=1.0)
    energy = torch.linalg.svdvals(rows).square()
    return float(energy[:rank].sum() / energy.sum())


@pytest.mark.parametrize("direction", ["activation", "gradient"])
def test_randomized_spectral_share_matches_the_exact_one(streams, direction):
    s = settings(direction)
    profiler = make_profiler()
    errors = [
        float(profiler(tensor).spectral_share) - exact_share(tensor, s.spectral_rank, s.row_clip)
        for tensor in streams.of(direction)[::10]
    ]
    # the range finder only ever misses energy; with one power iteration it misses little
    assert all(-0.02 < error < 1e-5 for error in errors), errors


def test_two_monitors_with_one_seed_compute_the_same_profile_whatever_the_global_rng(streams):
    tensor = streams.gradients[7]
    torch.manual_seed(1)
    first = BoundaryMonitor(settings("gradient"), HIDDEN, expected_shape=SHAPE)
    torch.manual_seed(2)
    torch.randn(100)
    second = BoundaryMonitor(settings("gradient"), HIDDEN, expected_shape=SHAPE)
    a, b = first.profiler(tensor), second.profiler(tensor)
    assert all(torch.equal(x, y) for x, y in zip(a.fields(), b.fields(), strict=True))
    other = BoundaryMonitor(settings("gradient", seed=1), HIDDEN, expected_shape=SHAPE).profiler(tensor)
    assert float(other.spectral_share) != float(a.spectral_share)


def test_the_profile_reads_like_its_definition(streams):
    """Clipped rows corrected on their own, moments from one scan: the statistics of the clipped, scale-free rows."""
    s = settings("gradient")
    tensor = streams.gradients[11].clone()
    tensor[0, :3] *= 20  # three tokens of surprising text
    rows = tensor.reshape(-1, HIDDEN).double()
    norms = rows.norm(dim=1, keepdim=True)
    assert (norms > s.row_clip * norms.median()).sum() >= 3
    rows = rows * (s.row_clip * norms.median() / norms).clamp(max=1.0)
    rows = rows / rows.square().mean().sqrt()
    profile = make_profiler()(tensor)
    assert torch.allclose(profile.mean.double(), rows.mean(0), atol=1e-5)
    assert torch.allclose(profile.absmean.double(), rows.abs().mean(0), atol=1e-5)
    assert torch.allclose(profile.rms.double(), rows.square().mean(0).sqrt(), atol=1e-5)
    projected = rows @ make_profiler().directions.double()
    levels = torch.linspace(0.02, 0.98, s.n_quantiles, dtype=torch.float64)
    assert torch.allclose(profile.quantiles.double(), torch.quantile(projected, levels, dim=0).T, atol=1e-4)


def test_a_profile_needs_no_hidden_by_hidden_matrix(streams, monkeypatch):
    """Every matrix product of a profile has the rows on one side and at most a few dozen columns on the other."""
    shapes = []
    real_mm, real_matmul = torch.mm, torch.Tensor.__matmul__

    def mm(a, b, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b, **kwargs)

    def matmul(a, b):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real_matmul(a, b)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
    make_profiler()(streams.activations[0])
    assert shapes
    s = settings()
    narrow = max(s.n_projections, s.spectral_rank + s.spectral_oversample + 1)
    assert all(min(min(a), min(b)) <= narrow for a, b in shapes), shapes


def test_non_finite_values_are_found_however_large_the_finite_ones(streams):
    monitor = warmed_monitor(streams)
    huge = streams.activations[WARMUP].clone()
    huge[0, 0, :4] = 1e30  # finite, but its row's sum of squares overflows: the exact check decides
    assert monitor.profiler.scan(huge).finite
    for bad in (float("nan"), float("inf")):
        tensor = streams.activations[WARMUP].clone()
        tensor[3, 5, 7] = bad
        verdict = monitor.check(tensor, "honest")
        assert verdict.kind is VerdictKind.MALFORMED and verdict.problem == "non-finite values"


# --- wire dtypes -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_monitor_checks_its_wire_dtype_and_replaces_in_it(streams, dtype):
    monitor = BoundaryMonitor(settings(replacement="ema"), HIDDEN, expected_shape=SHAPE, dtype=dtype)
    for tensor in streams.activations[:WARMUP]:
        assert not monitor.check(tensor.to(dtype), "honest").flagged
    honest = monitor.check(streams.activations[WARMUP].to(dtype), "honest")
    assert not honest.flagged and honest.tensor.dtype == dtype
    wrong = monitor.check(streams.activations[WARMUP], "honest")  # float32 where the wire says 16-bit
    assert wrong.kind is VerdictKind.MALFORMED and f"instead of {dtype}" in wrong.problem
    attacked = monitor.check(torch.zeros(SHAPE, dtype=dtype), "cheat")
    assert attacked.flagged and attacked.tensor.dtype == dtype and tuple(attacked.tensor.shape) == SHAPE


def test_statistics_of_a_16_bit_tensor_are_those_of_its_float32_values(streams):
    tensor = streams.gradients[3].to(torch.bfloat16)
    profiler = make_profiler()
    assert profiles_close(profiler(tensor), profiler(tensor.float()), atol=1e-4)


# --- probation of new identities (issue 14) ------------------------------------------------------------------------


def _established(probation: int = 20, **overrides) -> SenderStrikes:
    """A ledger past its own start: two founders have sent `probation` clean checks between them."""
    ledger = SenderStrikes(strike_limit=3, forgive_after=10, probation=probation, **overrides)
    for i in range(probation):
        ledger.record(f"founder-{i % 2}", False)
    return ledger


def test_a_newcomers_first_blatant_flag_bans_while_a_founders_does_not():
    ledger = _established()
    assert not ledger.on_probation("founder-0") and ledger.on_probation("sybil")
    assert ledger.record("sybil", True, weight=2, blatant=True).banned
    assert not ledger.record("founder-0", True, weight=2, blatant=True).banned  # two strikes, as before
    # without probation the same newcomer needs a second blatant flag
    plain = _established(probation=0)
    assert not plain.record("sybil", True, weight=2, blatant=True).banned
    assert plain.record("sybil", True, weight=2, blatant=True).banned


def test_probation_forgives_nothing_until_enough_clean_checks_then_ends():
    ledger = _established(probation=20)
    ledger.record("newcomer", True)  # a near miss: one strike, not a ban
    for _ in range(19):
        assert ledger.record("newcomer", False).strikes == 1  # no forgiveness while on probation
    assert ledger.on_probation("newcomer")  # 19 clean checks of 20
    ledger.record("newcomer", False)
    assert not ledger.on_probation("newcomer")
    for _ in range(10):
        record = ledger.record("newcomer", False)
    assert record.strikes == 0  # forgiven once in good standing
    assert not ledger.record("newcomer", True, weight=2, blatant=True).banned  # and judged as anyone else


def test_a_young_ledger_puts_nobody_on_probation():
    ledger = SenderStrikes(strike_limit=3, forgive_after=10, probation=50)
    assert not ledger.on_probation("anyone")  # a verifier that just started: everyone is new to it alone
    for i in range(49):
        ledger.record(f"peer-{i % 4}", False)
    assert ledger.senders["peer-3"].founder
    assert not ledger.record("peer-3", True, weight=2, blatant=True).banned


def test_an_honest_newcomer_passes_probation_and_a_rejoining_attacker_is_banned_at_its_first_tensor(streams):
    monitor = warmed_monitor(streams, probation=30)
    tensors = streams.activations[WARMUP:]
    assert monitor.ledger.on_probation("newcomer")
    for tensor in tensors:  # an honest identity joining the running boundary
        verdict = monitor.check(tensor, "newcomer")
        assert not verdict.flagged, verdict
    assert not monitor.ledger.on_probation("newcomer") and not monitor.ledger.is_banned("newcomer")
    # the founder turns attacker: banned at its second blatant tensor; back under a fresh identity, at its first
    noise = attacks.make_attack("random")
    for identity, limit in (("honest", 2), ("honest-again", 1)):
        for n in range(1, limit + 1):
            assert not monitor.ledger.is_banned(identity)
            verdict = monitor.check(noise(tensors[n], 0, {"seed": n}), identity)
            assert verdict.flagged and verdict.blatant
        assert monitor.ledger.is_banned(identity), identity


@pytest.mark.parametrize("blatant_after", [32, 0], ids=["fenced", "unfenced"])
def test_a_blatant_attack_starting_in_warm_up_is_flagged_there_where_peers_are_the_reference(streams, blatant_after):
    # the sweep's start_blatant: noise from a step inside warm-up was learned by the baseline and the fences, and
    # the ban came only after warm-up, 1-2% of validation loss later. The peer test is off here (it can catch such
    # noise too, once its pool has filled): the fences alone, with warmup_fenced_after 0 as the control
    warmup, start = STREAM_STEPS - 10, 60
    overrides = dict(warmup=warmup, warmup_fenced_after=blatant_after, peer_limit=0.0)
    monitor = BoundaryMonitor(settings("activation", **overrides), HIDDEN, expected_shape=SHAPE)
    found = []
    for i, tensor in enumerate(streams.activations):
        sender = SENDERS[i % 4]
        if sender == "d" and i >= start:
            tensor = attacks.random_noise(tensor, i, {"seed": i})
        found.append((i, sender, monitor.check(tensor, sender)))
    attacked = [v for i, s, v in found if s == "d" and i >= start][:30]
    assert all(v.warming_up for v in attacked)
    assert not [(i, s, v.reason) for i, s, v in found if s != "d" and v.flagged]
    if blatant_after:
        assert attacked[0].flagged and attacked[0].blatant, (attacked[0].scores, attacked[0].thresholds)
        assert attacked[1].banned  # two blatant flags weigh four strikes
    else:
        assert not any(v.flagged for v in attacked)


def test_a_lone_sender_is_judged_by_no_fence_in_warm_up():
    monitor_settings = settings(warmup=1000)
    assert monitor_settings.warmup_fenced_after > 0
    monitor = BoundaryMonitor(monitor_settings, HIDDEN, expected_shape=SHAPE)
    generator = torch.Generator().manual_seed(0)
    honest = [torch.randn(SHAPE, generator=generator) for _ in range(60)]
    # a lone sender's EMA is still forming: even noise a hundred times larger is not flagged before warm-up ends
    verdicts = [monitor.check(t * (100.0 if i >= 50 else 1.0), "alone", content=i) for i, t in enumerate(honest)]
    assert not any(v.flagged for v in verdicts)


@pytest.mark.parametrize("fenced_after", [32, 0], ids=["fenced", "unfenced"])
def test_a_moderate_attack_starting_in_warm_up_is_flagged_there_where_peers_are_the_reference(streams, fenced_after):
    # the sweep's start_blatant at a deep boundary early in training: its noise sat 1-2 times over the fences, not
    # the 4 times of a blatant crossing, and was accepted through warm-up until audits banned the sender (+1.4-2.1%
    # of validation loss). With a majority as the reference, a fence that holds `warmup_fenced_after` scores
    # judges in warm-up too. The peer test is off, so that the fences alone are measured
    warmup, start = STREAM_STEPS - 10, 60
    overrides = dict(warmup=warmup, warmup_fenced_after=fenced_after, peer_limit=0.0)
    monitor = BoundaryMonitor(settings("activation", **overrides), HIDDEN, expected_shape=SHAPE)
    halve = attacks.make_attack("scale", sigma=0.5)
    found = []
    for i, tensor in enumerate(streams.activations):
        sender = SENDERS[i % 4]
        if sender == "d" and i >= start:
            tensor = halve(tensor, i, {})
        found.append((i, sender, monitor.check(tensor, sender), monitor.ledger.is_banned(sender)))
    attacked = [(v, banned) for i, s, v, banned in found if s == "d" and i >= start][:30]
    assert all(v.warming_up for v, _ in attacked)
    assert not [(i, s, v.reason) for i, s, v, _ in found if s != "d" and v.flagged]
    if fenced_after:
        first = attacked[0][0]
        assert first.flagged and not first.blatant and 1 < first.severity < 4, (first.scores, first.thresholds)
        # its first crossing is a suspicion (isolated), each one after it repeats and strikes: banned at its fourth
        assert [banned for _, banned in attacked[:4]] == [False, False, False, True]
    else:
        assert not any(v.flagged for v, _ in attacked)


def test_a_crossing_of_the_opposed_rows_alone_weighs_one_strike_however_far(streams):
    """Honest `opposed` shares are zeros with rare content-driven spikes the fence cannot learn (an honest replica's
    share at a deep boundary, five times over the fence, with a second spike two steps later, banned it in the
    sweep): so a crossing of it alone is never blatant, and costs one strike, whatever its severity."""
    monitor = warmed_monitor(streams)
    tensor = attacks.row_corruption(streams.activations[WARMUP], 0, {}, fraction=0.1)
    verdict = monitor.check(tensor, "spiky", content=0)
    assert verdict.flagged and verdict.over == ("opposed",), (verdict.over, verdict.scores, verdict.thresholds)
    assert verdict.severity >= monitor.settings.blatant_severity  # far over its fence...
    assert not verdict.blatant and monitor.ledger.senders["spiky"].strikes == 1  # ...and one strike


# --- evidence of higher losses (losses.py) --------------------------------------------------------------------------


def loss_evidence(**overrides) -> LossEvidence:
    # ranking raw losses, as a verifier does without the gate's prediction (the loss evidence's kappa of before it,
    # 1: its own default, 0.25, is set for excesses, whose text is taken off; tests/test_loss_gate.py)
    c = load_config().verification
    values = {
        "pool": c.peer_pool,
        "kappa": 1.0,
        "limit": c.peer_limit,
        "share": c.loss_evidence,
        "max_senders": c.max_senders,
    }
    return LossEvidence(**{**values, **overrides})


def loss_stream(streams: HonestStreams, seed: int, attacked: str | None = None, replicas: str = "abcd"):
    """The stream's microbatches, in training order, each through a replica drawn at random (as routes are);
    replica ``d``'s end with the loss through `attacked`. Yields (replica, evidence after its loss)."""
    rng = random.Random(seed)
    evidence = loss_evidence()
    for i, honest_loss in enumerate(streams.losses):
        replica = rng.choice(replicas)
        loss = streams.attacked_losses[attacked][i] if attacked and replica == "d" else honest_loss
        evidence.observe(replica, loss)
        yield replica, evidence


def test_honest_replicas_are_rarely_suspected_for_their_losses(streams):
    suspected, checks = 0, 0
    for seed in range(10):
        for replica, evidence in loss_stream(streams, seed):
            checks += 1
            suspected += evidence.suspicious(replica)
    # a suspicion costs an audit that passes; the rate is that of extra audits of honest work
    assert suspected / checks < 0.02, (suspected, checks)


def test_a_replica_whose_microbatches_end_worse_is_a_suspect_within_a_few_of_them(streams):
    attack = "plane_rotation"
    # the real damage: the loss of the same microbatch through the attacked activation
    rise = statistics.median(a / h for a, h in zip(streams.attacked_losses[attack], streams.losses, strict=True))
    assert rise > 1.2, rise
    for seed in range(5):
        mine = 0
        for replica, evidence in loss_stream(streams, seed, attacked=attack):
            mine += replica == "d"
            if evidence.suspicious("d"):
                break
        assert evidence.suspicious("d") and mine <= 15, (seed, mine)
        assert not any(evidence.suspicious(r) for r in "abc")


def test_loss_evidence_ignores_what_is_not_a_loss_and_can_be_turned_off():
    evidence = loss_evidence()
    for bad in (None, float("nan"), float("inf"), 0.0, -1.0):
        evidence.observe("x", bad)
    assert evidence.evidence("x") == 0.0 and not evidence.suspicious("x")
    off = loss_evidence(share=0.0)
    for i in range(100):
        off.observe("abcd"[i % 4], 100.0 if i % 4 == 3 else 1.0 + 0.01 * i)
    assert not off.enabled and not off.suspicious("d")
