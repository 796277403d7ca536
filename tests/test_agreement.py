"""The trainer's test for verifiers that stop checking (peers.agreement), on counts whose answer is known."""

from __future__ import annotations

import math
import random

import pytest

from peers.agreement import VerifierAgreement, binomial_cdf


def test_the_binomial_tail_matches_a_direct_sum():
    for n, p in ((10, 0.3), (200, 0.02), (400, 0.5)):
        for k in (0, 1, 3, n // 2):
            direct = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(min(k, n) + 1))
            assert binomial_cdf(k, n, p) == pytest.approx(direct, rel=1e-9, abs=1e-300)
    assert binomial_cdf(0, 100, 0.0) == 1.0 and binomial_cdf(5, 5, 0.9) == 1.0


def feed(agreement: VerifierAgreement, microbatches: int, flag_rates: dict[str, float], seed: int = 0) -> None:
    """Microbatches over one boundary, each relayed by a verifier drawn at random, flagged at its rate."""
    rng = random.Random(seed)
    names = sorted(flag_rates)
    for _ in range(microbatches):
        verifier = rng.choice(names)
        agreement.settled({1: verifier}, [1] if rng.random() < flag_rates[verifier] else [])


def test_a_verifier_that_flags_nothing_while_the_others_flag_is_quiet_once_they_have_flagged_enough():
    agreement = VerifierAgreement()
    noticed = None
    rng = random.Random(1)
    for i in range(400):
        verifier = "silent" if i % 2 else "honest"
        flagged = verifier == "honest" and rng.random() < 0.1  # an attacker's tensors among honest ones
        agreement.settled({1: verifier}, [1] if flagged else [])
        if noticed is None and agreement.quiet():
            noticed = i
    quiet = agreement.quiet()
    assert [q.verifier for q in quiet] == ["silent"] and quiet[0].boundary == 1 and quiet[0].flags == 0
    assert noticed is not None and quiet[0].p < agreement.alpha
    # about ln(1 / alpha) flags by the others are needed when both relay as many tensors
    flags_then = 1 + noticed // 2 * 0.1
    assert math.log(1 / agreement.alpha) / 2 < flags_then < 3 * math.log(1 / agreement.alpha)


def test_verifiers_that_check_alike_are_never_quiet():
    for seed in range(20):
        agreement = VerifierAgreement()
        feed(agreement, 2000, {"a": 0.05, "b": 0.05, "c": 0.05}, seed)
        assert agreement.quiet() == [], seed


def test_a_microbatch_tainted_elsewhere_counts_for_no_verifier_and_the_window_forgets():
    agreement = VerifierAgreement(window=100)
    for i in range(100):
        agreement.settled({0: "x", 1: "y" if i % 2 else "z"}, [0])  # tainted at 0: boundary 1 judged nothing
    assert agreement.quiet() == []
    feed(agreement, 100, {"y": 0.0, "z": 0.3})
    assert [q.verifier for q in agreement.quiet()] == ["y"]
    feed(agreement, 100, {"y": 0.3, "z": 0.3}, seed=2)  # it checks again: the old relays leave the window
    assert agreement.quiet() == []
    with pytest.raises(ValueError, match="window"):
        VerifierAgreement(window=1)


def test_a_silent_verifier_is_noticed_on_the_senders_an_honest_verifier_banned_and_refuses():
    """The open set's case: the honest verifier flags an attacker twice, bans it (below the quorum: not excluded)
    and refuses it from then on, so the attacker's microbatches all go through the silent verifier. The pooled
    test has only two flags to go on; the per-sender one notices the silent verifier within a dozen relays."""
    agreement = VerifierAgreement()
    rng = random.Random(3)
    for _ in range(200):  # honest traffic over both verifiers, the attacker's among it before it turns
        agreement.settled({1: rng.choice("hs")}, [], {1: (rng.choice(["stage1-0", "attacker"]), "stage2-0")})
    for _ in range(2):
        agreement.settled({1: "h"}, [1], {1: ("attacker", "stage2-0")})
    assert agreement.quiet() == []
    relays = 0
    while not agreement.quiet():
        agreement.settled({1: "s"}, [], {1: ("attacker", "stage2-0")})
        relays += 1
        assert relays < 20
    (quiet,) = agreement.quiet()
    assert quiet.verifier == "s" and quiet.sender == "attacker" and quiet.flags == 0
