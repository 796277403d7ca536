"""The attack catalogue (docs/architecture.md section 4): what each attack does to activation- and gradient-shaped
tensors, the Attacker's start step and probability, and how a red team's own attack file is loaded or refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sentinel_node.attacks import (
    BASIC_ATTACKS,
    CATALOGUE,
    FAMILIES,
    Attacker,
    AttackError,
    load_attack_file,
    make_attack,
)
from sentinel_node.config import load_config

SHAPE = (8, 64, 32)
KINDS = ("activation", "gradient")


class HonestSource:
    """A stationary stream of structured boundary tensors: a few dominant directions, per-channel offsets and noise.

    Activations are O(1) with channel means away from zero; gradients are O(1e-4), centred, with a few heavy tokens.
    """

    def __init__(self, kind: str, seed: int = 0):
        self.kind = kind
        self.generator = torch.Generator().manual_seed(seed)
        self.basis = torch.randn(4, SHAPE[-1], generator=self.generator)
        self.offset = torch.randn(SHAPE[-1], generator=self.generator)

    def __call__(self) -> torch.Tensor:
        coefficients = torch.randn(*SHAPE[:-1], 4, generator=self.generator)
        noise = torch.randn(SHAPE, generator=self.generator)
        if self.kind == "activation":
            return coefficients @ self.basis + self.offset + 0.3 * noise
        heavy = 1 + 9 * (torch.rand(*SHAPE[:-1], 1, generator=self.generator) < 0.02)
        return 1e-4 * heavy * (coefficients @ self.basis + 0.3 * noise)


def honest(kind: str, seed: int = 0) -> torch.Tensor:
    return HonestSource(kind, seed)()


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / (a.norm() * b.norm()))


def relative_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.norm() / b.norm())


# --- the basic attacks ---------------------------------------------------------------------------------------------


def test_the_catalogue_holds_the_designed_attacks():
    assert set(CATALOGUE) == {*BASIC_ATTACKS, "mixed", "adaptive", *FAMILIES}
    assert not set(FAMILIES) & {*BASIC_ATTACKS, "mixed", "adaptive"}  # families written outside the catalogue
    assert set(BASIC_ATTACKS) == {"constant", "random", "scale", "sign_flip", "delay", "bias", "invisible_noise"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [0.0, 2.5])
def test_constant_sends_the_value_everywhere(kind, value):
    x = honest(kind)
    out = make_attack("constant", value=value)(x, 0, {}) if value else CATALOGUE["constant"](x, 0, {})
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.all(out == value)


@pytest.mark.parametrize("kind", KINDS)
def test_random_is_noise_with_the_honest_mean_and_std(kind):
    x = honest(kind)
    out = CATALOGUE["random"](x, 0, {"seed": 1})
    assert out.shape == x.shape
    assert abs(float(out.mean() - x.mean())) < 0.05 * float(x.std())
    assert float(out.std()) == pytest.approx(float(x.std()), rel=0.05)
    assert abs(correlation(out, x)) < 0.05


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sigma", [-1.0, 3.0])
def test_scale_multiplies_exactly_by_sigma(kind, sigma):
    x = honest(kind)
    attack = CATALOGUE["scale"] if sigma == -1.0 else make_attack("scale", sigma=sigma)
    assert torch.equal(attack(x, 0, {}), x * sigma)


@pytest.mark.parametrize("kind", KINDS)
def test_sign_flip_keeps_magnitudes_and_flips_about_half_the_signs(kind):
    x = honest(kind)
    out = CATALOGUE["sign_flip"](x, 0, {"seed": 2})
    assert torch.equal(out.abs(), x.abs())
    flipped = float((torch.sign(out) != torch.sign(x)).float().mean())
    assert 0.47 < flipped < 0.53


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offset", [1.0, -0.5])
def test_bias_adds_offset_times_rms(kind, offset):
    x = honest(kind)
    attack = CATALOGUE["bias"] if offset == 1.0 else make_attack("bias", offset=offset)
    rms = x.square().mean().sqrt()
    assert torch.allclose(attack(x, 0, {}), x + offset * rms, rtol=1e-6, atol=1e-6 * float(rms))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fraction", [0.99, 0.5])
def test_invisible_noise_keeps_the_norm_and_leaves_sqrt_1_minus_fraction_of_the_signal(kind, fraction):
    x = honest(kind)
    attack = CATALOGUE["invisible_noise"] if fraction == 0.99 else make_attack("invisible_noise", fraction=fraction)
    out = attack(x, 0, {"seed": 3})
    assert relative_norm(out, x) == pytest.approx(1.0, abs=0.03)
    assert correlation(out, x) == pytest.approx((1 - fraction) ** 0.5, abs=0.03)


@pytest.mark.parametrize("name", ["random", "sign_flip", "invisible_noise"])
def test_random_attacks_are_reproducible_from_the_seed_in_their_state(name):
    x = honest("activation")
    attack = CATALOGUE[name]
    assert torch.equal(attack(x, 0, {"seed": 5}), attack(x, 0, {"seed": 5}))
    assert not torch.equal(attack(x, 0, {"seed": 5}), attack(x, 0, {"seed": 6}))


# --- delay ---------------------------------------------------------------------------------------------------------


def tagged(kind: str, step: int, call: int) -> torch.Tensor:
    """An honest tensor whose origin (step, call within the step) can be read back from the tensor itself."""
    return honest(kind, seed=1000 * step + call)


@pytest.mark.parametrize("kind", KINDS)
def test_delay_sends_the_tensor_from_steps_before(kind):
    delay, state, steps = make_attack("delay", steps=5), {}, 5
    for step in range(20):
        for call in range(3):  # several microbatches per global step
            x = tagged(kind, step, call)
            out = delay(x, step, state)
            if step == 0:
                assert out is x  # nothing older yet: not attacked
            else:
                assert torch.equal(out, tagged(kind, max(0, step - steps), 0))
        assert len(state["history"]) <= steps + 1  # one tensor per step, never more than `steps` back


def test_delay_with_gaps_sends_the_newest_tensor_at_least_steps_old():
    delay, state = make_attack("delay", steps=5), {}
    for step in range(0, 13, 3):  # seen at steps 0, 3, 6, 9, 12
        delay(tagged("gradient", step, 0), step, state)
    assert torch.equal(delay(tagged("gradient", 13, 0), 13, state), tagged("gradient", 6, 0))


def test_delay_default_is_100_steps():
    state = {}
    for step in range(150):
        out = CATALOGUE["delay"](tagged("activation", step, 0), step, state)
    assert torch.equal(out, tagged("activation", 49, 0))
    assert len(state["history"]) <= 101


# --- mixed ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_cycles_through_the_basic_attacks_every_few_steps(kind):
    every = 3
    mixed, state = make_attack("mixed", every=every), {"seed": 4}
    used_per_block = []
    for block in range(len(BASIC_ATTACKS)):
        before = {key for key in state if key.startswith("state_")}
        for step in range(block * every, (block + 1) * every):
            x = honest(kind, seed=step)
            out = mixed(x, step, state)
            name = state["order"][block]
            if name == "constant":
                assert not out.any()
            elif name == "scale":
                assert torch.equal(out, -x)
            elif name == "bias":
                assert torch.allclose(out, x + x.square().mean().sqrt())
        used_per_block.append({key for key in state if key.startswith("state_")} - before)
    assert sorted(state["order"]) == sorted(BASIC_ATTACKS)
    assert all(len(new) == 1 for new in used_per_block)  # one attack per block, a new one each time
    assert {key.removeprefix("state_") for new in used_per_block for key in new} == set(BASIC_ATTACKS)


def test_mixed_order_depends_on_the_attackers_seed():
    orders = set()
    for seed in range(6):
        state = {"seed": seed}
        CATALOGUE["mixed"](honest("activation"), 0, state)
        orders.add(tuple(state["order"]))
    assert len(orders) > 1


# --- adaptive ------------------------------------------------------------------------------------------------------


def test_adaptive_without_settings_is_a_clear_error():
    with pytest.raises(AttackError, match="verification settings"):
        CATALOGUE["adaptive"](honest("activation"), 0, {})


@pytest.mark.parametrize("kind", KINDS)
def test_adaptive_learns_then_sends_a_changed_tensor_of_the_same_norm(kind):
    settings = load_config().verification.monitor_settings(kind, seed=0)
    learning = 20
    attack, state, source = (
        make_attack("adaptive", settings=settings, warmup=learning),
        {"seed": 1},
        HonestSource(kind),
    )
    for step in range(learning):
        x = source()
        assert attack(x, step, state) is x
    changed = []
    for step in range(learning, learning + 8):
        x = source()
        out = attack(x, step, state)
        assert out.shape == x.shape and out.dtype == x.dtype
        if out is not x:
            changed.append((x, out))
    assert len(changed) >= 4
    for x, out in changed:
        assert not torch.equal(out, x)
        assert relative_norm(out, x) == pytest.approx(1.0, abs=0.02)
        assert correlation(out, x) < 0.995


def test_adaptive_learns_no_longer_than_the_swarm_warmup():
    settings = dataclasses.replace(load_config().verification.monitor_settings("activation", seed=0), warmup=5)
    attack, state, source = make_attack("adaptive", settings=settings, warmup=20), {}, HonestSource("activation")
    for step in range(5):
        attack(source(), step, state)
    assert not state["monitor"].warming_up


# --- four attacks from outside (the red-team pass; docs/decisions.md "Four attacks from outside") ----------------


@pytest.mark.parametrize("kind", KINDS)
def test_plane_rotation_turns_a_few_channel_pairs_and_keeps_every_norm(kind):
    x = honest(kind)
    state = {"seed": 4}
    out = make_attack("plane_rotation", degrees=90, planes=8)(x, 0, state)
    changed = (out != x).flatten(0, -2).any(0)
    assert int(changed.sum()) == 16  # two channels per plane
    assert relative_norm(out, x) == pytest.approx(1.0, rel=1e-4)
    pairs = state["planes"][0]
    for a, b in pairs.tolist():  # a quarter turn: (a, b) -> (-b, a), each plane's energy kept
        assert torch.allclose(out[..., a], -x[..., b], atol=1e-6 * float(x.abs().max()))
        assert torch.allclose(out[..., b], x[..., a], atol=1e-6 * float(x.abs().max()))
    # the planes are the attacker's own and fixed: the same channels on the next tensor
    nxt = honest(kind, seed=9)
    assert torch.equal(((make_attack("plane_rotation")(nxt, 1, state)) != nxt).flatten(0, -2).any(0), changed)


def test_plane_rotation_of_half_a_turn_negates_its_channels_and_of_none_changes_nothing():
    x = honest("activation")
    state = {"seed": 1}
    half = make_attack("plane_rotation", degrees=180)(x, 0, state)
    channels = state["planes"][0].flatten()
    assert torch.allclose(half[..., channels], -x[..., channels], atol=1e-5)
    assert torch.allclose(make_attack("plane_rotation", degrees=0)(x, 0, {}), x)
    narrow = torch.randn(4, 3, 1)
    assert make_attack("plane_rotation")(narrow, 0, {}) is narrow  # no plane fits in one channel


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shift", [1, 5])
def test_token_shift_hands_each_position_the_state_of_one_before(kind, shift):
    x = honest(kind)
    out = make_attack("token_shift", shift=shift)(x, 0, {})
    assert torch.equal(out[:, shift:], x[:, :-shift])
    assert torch.equal(out[:, :shift], x[:, -shift:])  # cyclic within the sequence
    assert not torch.equal(out, x)


def test_token_shift_leaves_what_it_cannot_shift():
    x = honest("activation")
    assert make_attack("token_shift", shift=SHAPE[1])(x, 0, {}) is x  # a whole turn
    flat = torch.randn(6, 5)
    assert make_attack("token_shift")(flat, 0, {}) is flat  # no sequence axis


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("weight", [0.2, 0.5])
def test_cross_mix_blends_the_next_sequence_in_at_the_tensors_norm(kind, weight):
    x = honest(kind)
    out = make_attack("cross_mix", weight=weight)(x, 0, {})
    assert relative_norm(out, x) == pytest.approx(1.0, rel=1e-4)
    mixed = (1 - weight) * x + weight * x.roll(1, dims=0)
    assert torch.allclose(out, mixed * (x.norm() / mixed.norm()), rtol=1e-5, atol=1e-7 * float(x.abs().max()))
    assert 0.2 < correlation(out, x) < 0.999


def test_cross_mix_at_full_weight_is_the_next_sequence_and_one_sequence_is_left_alone():
    x = honest("activation")
    assert torch.allclose(make_attack("cross_mix", weight=1.0)(x, 0, {}), x.roll(1, dims=0), atol=1e-5)
    single = x[:1]
    assert make_attack("cross_mix")(single, 0, {}) is single


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threshold", [0.0, 0.7, 1.5])
def test_ternary_quantize_sends_three_values_at_the_tensors_norm(kind, threshold):
    x = honest(kind)
    out = make_attack("ternary_quantize", threshold=threshold)(x, 0, {})
    assert relative_norm(out, x) == pytest.approx(1.0, rel=1e-4)
    assert out.abs().unique().numel() == (1 if threshold == 0 else 2)  # {c} or {0, c}
    kept = out != 0
    assert torch.equal(torch.sign(out[kept]), torch.sign(x[kept]))
    small = x.abs() < threshold * x.abs().mean()
    assert torch.equal(~kept, small)


def test_ternary_quantize_drops_more_the_higher_its_threshold():
    x = honest("gradient")
    zeros = [float((make_attack("ternary_quantize", threshold=t)(x, 0, {}) == 0).float().mean()) for t in (0.5, 1, 2)]
    assert zeros == sorted(zeros) and zeros[0] > 0.1 and zeros[-1] > 0.7


# --- make_attack ---------------------------------------------------------------------------------------------------


def test_make_attack_rejects_an_unknown_name_listing_the_choices():
    with pytest.raises(AttackError) as error:
        make_attack("nonsense")
    message = str(error.value)
    assert "'nonsense'" in message
    assert all(name in message for name in CATALOGUE)


def test_make_attack_rejects_an_unknown_parameter_listing_the_accepted_ones():
    with pytest.raises(AttackError) as error:
        make_attack("scale", sigma=2.0, gamma=1.0)
    message = str(error.value)
    assert "gamma" in message and "sigma" in message and "'scale'" in message


def test_make_attack_keeps_whether_an_attack_observes_honest_tensors():
    assert make_attack("delay", steps=3).observes_honest
    assert not getattr(make_attack("scale", sigma=2.0), "observes_honest", False)


# --- Attacker ------------------------------------------------------------------------------------------------------


def test_attacker_waits_for_its_start_step():
    attacker = Attacker(CATALOGUE["constant"], start=5)
    for step in range(10):
        x = honest("activation", seed=step)
        out, attacked = attacker(x, step)
        if step < 5:
            assert out is x and not attacked
        else:
            assert attacked and not out.any()


def attack_pattern(seed: int, probability: float, steps: int = 2000) -> list[bool]:
    attacker = Attacker(CATALOGUE["scale"], probability=probability, seed=seed)
    x = honest("gradient")
    return [attacker(x, step)[1] for step in range(steps)]


def test_attacker_attacks_with_its_probability_reproducibly():
    pattern = attack_pattern(seed=1, probability=0.3)
    assert 0.26 < sum(pattern) / len(pattern) < 0.34
    assert attack_pattern(seed=1, probability=0.3) == pattern
    assert attack_pattern(seed=2, probability=0.3) != pattern
    assert all(attack_pattern(seed=1, probability=1.0))


def test_attacker_reports_unchanged_tensors_as_not_attacked():
    x = honest("activation")
    assert Attacker(lambda tensor, step, state: tensor)(x, 0) == (x, False)
    out, attacked = Attacker(CATALOGUE["delay"])(x, 0)  # nothing to replay yet
    assert out is x and not attacked


def test_attacker_with_a_delay_replays_what_it_saw_before_its_start():
    attacker = Attacker(make_attack("delay", steps=4), start=10)
    for step in range(10):
        out, attacked = attacker(tagged("activation", step, 0), step)
        assert not attacked
    out, attacked = attacker(tagged("activation", 10, 0), 10)
    assert attacked and torch.equal(out, tagged("activation", 6, 0))


def test_attacker_refuses_an_attack_that_returns_no_tensor():
    attacker = Attacker(lambda tensor, step, state: tensor.numpy())
    with pytest.raises(AttackError, match="returned ndarray"):
        attacker(honest("activation"), 0)


# --- load_attack_file ----------------------------------------------------------------------------------------------


def attack_file(tmp_path, source: str, name: str = "red.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_load_attack_file_loads_a_function(tmp_path):
    path = attack_file(tmp_path, "def double(tensor, step, state, factor=2.0):\n    return tensor * factor\n")
    name, fn = load_attack_file(f"{path}:double")
    x = honest("gradient")
    assert name == "double"
    assert torch.equal(fn(x, 0, {}), x * 2.0)
    out, attacked = Attacker(fn)(x, 0)
    assert attacked and torch.equal(out, x * 2.0)


def test_load_attack_file_missing_file(tmp_path):
    with pytest.raises(AttackError, match="no file .*missing.py"):
        load_attack_file(f"{tmp_path / 'missing.py'}:attack")


def test_load_attack_file_missing_name(tmp_path):
    path = attack_file(tmp_path, "def other(tensor, step, state):\n    return tensor\n")
    with pytest.raises(AttackError, match="defines no 'attack'"):
        load_attack_file(f"{path}:attack")


def test_load_attack_file_not_callable(tmp_path):
    path = attack_file(tmp_path, "attack = 3\n")
    with pytest.raises(AttackError, match="is not a function"):
        load_attack_file(f"{path}:attack")


def test_load_attack_file_wrong_signature(tmp_path):
    path = attack_file(tmp_path, "def attack(tensor, step):\n    return tensor\n")
    with pytest.raises(AttackError, match=r"must take \(tensor, step, state\), it takes \(tensor, step\)"):
        load_attack_file(f"{path}:attack")


def test_load_attack_file_that_raises_on_import(tmp_path):
    path = attack_file(tmp_path, "raise RuntimeError('boom')\n")
    with pytest.raises(AttackError, match="importing .* failed: RuntimeError: boom"):
        load_attack_file(f"{path}:attack")


def test_load_attack_file_with_a_syntax_error(tmp_path):
    path = attack_file(tmp_path, "def attack(tensor, step, state)\n    return tensor\n")
    with pytest.raises(AttackError, match="SyntaxError"):
        load_attack_file(f"{path}:attack")


@pytest.mark.parametrize("spec", ["attack.py", "attack.py:", ":attack"])
def test_load_attack_file_spec_must_be_path_colon_name(spec):
    with pytest.raises(AttackError, match=r"must look like PATH\.py:NAME"):
        load_attack_file(spec)
