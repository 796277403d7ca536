"""A long clean swarm on loopback: stages of a single replica, an open verifier set, no attacker.

With one replica per stage there is no peer to compare a stage with, and a stage's honest drift over training is
all a verifier sees: the verification must follow it without flagging it. A clean swarm of this shape once saw a
verifier ban two honest stages on `spectral` flags at steps 46-50 (an EMA baseline that stopped learning once its
tensors were flagged). Every node is a real process; the trainer trains the demo's model on the embedded corpus.
"""

from __future__ import annotations

import pytest

from sentinel_node.demo import Demo, DemoSettings

STEPS = 90

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_a_long_clean_swarm_of_single_replicas_bans_no_honest_stage(tmp_path, forkserver):
    settings = DemoSettings(
        forkserver=forkserver,
        steps=STEPS,
        attack=None,
        replicas=1,
        trusted_verifiers=False,
        workdir=tmp_path,
        eval_every=30,
        metrics=False,
    )
    with Demo(settings) as demo:
        demo.start()
        demo.train()
        summary = demo.summary()
        statuses = {name: demo.node(name).status() for name in demo.verifier_names()}
    assert summary.steps == STEPS
    assert summary.loss_fell, summary
    assert summary.excluded == [] and summary.honest_excluded == [], summary
    for name, status in statuses.items():
        assert status is not None, name
        assert status.banned == [], (name, status.ledger)
        assert status.checks["activation"] > 0 and status.checks["gradient"] > 0, (name, status.checks)
    # what the verifiers held against honest stages at the end: strikes, if any, stayed below a ban
    strikes = [record.strikes for status in statuses.values() for record in status.ledger.values()]
    assert max(strikes, default=0) < demo.config.verification.strike_limit, statuses
