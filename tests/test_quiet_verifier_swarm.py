"""A verifier that stops checking, noticed by the trainer, as real processes on loopback (issue 14, item 4).

The demo's swarm in an open verifier set (a ban takes two verifiers): verifier0 relays without checking, verifier1
checks; a stage 1 replica sends random activations from ATTACK_START. verifier1 bans it, which alone does not
exclude it, and refuses it from then on, so the attacker's microbatches all go through verifier0, unflagged. The
trainer's agreement test (peers.agreement) must name verifier0, and only it, while the run goes on.
"""

from __future__ import annotations

import pytest

from sentinel_node.demo import Demo, DemoSettings
from sentinel_node.roles.status import TrainerStatus

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

STEPS, ATTACK_START = 30, 14


@pytest.mark.xfail(
    reason="not yet shown on the network: of three runs at load 20-40, one noticed the silent verifier (p=5e-5) and "
    "let it go 6 s later, two never did; the simulator and unit tests do (issue 14, closing note of 2026-12-01)",
    strict=False,
)
def test_the_trainer_notices_a_verifier_that_relays_without_checking(tmp_path, forkserver):
    settings = DemoSettings(
        forkserver=forkserver,
        steps=STEPS,
        attack="random",
        attack_target="activation",
        attack_start=ATTACK_START,
        workdir=tmp_path,
        trusted_verifiers=False,
        silent_verifiers=1,
        metrics=False,
        start_timeout=400.0,
    )
    with Demo(settings) as demo:
        demo.start()
        silent, honest = demo.peer("verifier0"), demo.peer("verifier1")
        demo.train()
        status = demo.node("trainer").status()
        log = demo.node("trainer").log_tail(200_000)
    assert isinstance(status, TrainerStatus)
    assert status.quiet_verifiers == [silent], (status.quiet_verifiers, silent, honest)
    assert f"verifier {silent} of boundary 1" in log and "may have stopped checking" in log
    assert "still routed through" in log  # an open set: reported, not acted on
    assert f"verifier {honest} of boundary" not in log
    assert status.accounting.consistent
