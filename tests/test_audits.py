"""Recomputation audits without a network: the comparison, the judgement, the reference recomputation, the relay
cache, the stage-level attacks, and the audits of the in-process mesh (which run the code the verifier role runs).

The mesh runs are tiny (a narrow model, a few dozen steps) but real: every stage trains on the embedded corpus,
every audit recomputes a stage's work with the replicas' shared reference parameters.
"""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from sentinel_node.attacks import (
    STAGE_ATTACKS,
    Attacker,
    AttackError,
    StageAttack,
    StageContext,
    arm,
    attack_maker,
    load_attack_file,
    make_attack,
    refuses_steps,
)
from sentinel_node.config import load_config
from sentinel_node.model import load_corpus
from sentinel_node.pipeline import BoundaryVerifier, StageWorker
from sentinel_node.pipeline.audits import AuditJudge, Recomputation, assemble
from sentinel_node.pipeline.recompute import NoReference
from sentinel_node.pipeline.relay_cache import AuditDraw, Crossing, RelayCache
from sentinel_node.roles import audits as role_audits
from sentinel_node.sim import AttackPlan, Mesh
from sentinel_node.transport import HopDeadlineExceeded, HopRefused, HopUnavailable
from sentinel_node.verification import SenderStrikes
from sentinel_node.verification.audit import (
    AuditLedger,
    AuditOutcome,
    AuditTolerance,
    Drift,
    Finding,
    Work,
    compare,
    contribution_error,
    decide,
    digest,
    relative_error,
    wants_another,
)

TOLERANCE = AuditTolerance(exact=1e-5, floor=0.5, factor=3.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tensor(seed: int, shape=(2, 4, 8)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- the comparison ------------------------------------------------------------------------------------------------


def test_errors_measure_a_stages_contribution_so_skipping_its_layers_is_an_error_of_one():
    x, f = tensor(0), 0.1 * tensor(1)
    assert contribution_error(x, x + f, x) == pytest.approx(1.0)  # returned its input
    assert relative_error(x, x + f) < 0.2  # what a plain relative error would have missed
    assert contribution_error(x + f, x + f, x) == 0.0
    assert contribution_error(x + 1.05 * f, x + f, x) == pytest.approx(0.05)
    g = tensor(2)
    assert relative_error(-g, g) == pytest.approx(2.0)  # an inverted gradient
    assert relative_error(torch.full_like(g, float("nan")), g) == float("inf")
    assert relative_error(g[:1], g) == float("inf")
    assert relative_error(None, g) == float("inf") and relative_error(None, None) == 0.0


def test_digest_names_the_exact_bytes_dtype_and_shape():
    t = tensor(3)
    assert digest(t) == digest(t.clone()) and len(digest(t)) == 64
    assert digest(t) != digest(t.reshape(4, 2, 8))
    assert digest(t) != digest(t.double())
    nudged = t.clone()
    nudged.view(-1)[0] += 1e-6
    assert digest(nudged) != digest(t)


def test_compare_tells_the_reference_computation_drift_mismatch_and_a_frozen_replica():
    y, g = tensor(4), tensor(5)
    reference = Work(output=y, grad_input=g)
    assert compare(reference, reference, TOLERANCE, must_have_stepped=False).finding is Finding.SAME
    frozen = compare(reference, reference, TOLERANCE, must_have_stepped=True)
    assert frozen.finding is Finding.FROZEN and frozen.failed
    drifted = Work(output=y * 1.1, grad_input=g)
    assert compare(drifted, reference, TOLERANCE, must_have_stepped=True).finding is Finding.DRIFTED
    inverted = compare(Work(output=y, grad_input=-g), reference, TOLERANCE, must_have_stepped=False)
    assert inverted.finding is Finding.MISMATCH and inverted.direction == "gradient"
    assert inverted.error == pytest.approx(2.0)


def test_the_allowance_is_the_drift_the_auditor_measured_on_its_own_parameters():
    y, g = tensor(4), tensor(5)
    reference, far = Work(output=y, grad_input=g), Work(output=y * 2.5, grad_input=g)  # an error of 1.5
    fast = Drift(steps=2, errors={"activation": 0.6, "gradient": 0.1})  # early training: 0.3 per step
    slow = Drift(steps=2, errors={"activation": 0.02, "gradient": 0.01})
    assert compare(far, reference, TOLERANCE, False, drift=fast, steps=3).finding is Finding.DRIFTED  # < 2.7
    late = compare(far, reference, TOLERANCE, False, drift=slow, steps=3)
    assert late.finding is Finding.MISMATCH and late.allowances["activation"] == TOLERANCE.floor
    blind = compare(far, reference, TOLERANCE, False, drift=Drift(), steps=3)  # the auditor never stepped
    assert blind.finding is Finding.DRIFTED and math.isinf(blind.allowances["activation"])
    assert compare(far, reference, TOLERANCE, False, drift=Drift(), steps=0).failed  # no step since: no drift
    skipped = compare(Work(output=y), Work(output=y + 0.1), TOLERANCE, False, passthrough=Work(output=y))
    assert skipped.finding is Finding.SKIPPED  # its layers added nothing, whatever the allowance


def test_an_input_the_layers_pass_through_unchanged_proves_neither_skipping_nor_freezing():
    """An attacker upstream sent zeros, which its verifier (warming up) let through: the honest replica after it
    returned zeros, as every bias-free block does, and was convicted of skipping its layers (bench detection,
    constant attack, 30 steps: s2r3 banned)."""
    zeros, g, g_out = torch.zeros(2, 4, 8), tensor(6), tensor(7)
    reference = Work(output=zeros, grad_input=g)
    passthrough = Work(output=zeros, grad_input=g_out)
    assert compare(reference, reference, TOLERANCE, False, passthrough=passthrough).finding is Finding.SAME
    # a replica that stepped: zeros forward, its own gradient back
    honest = compare(Work(output=zeros, grad_input=1.05 * g), reference, TOLERANCE, True, passthrough=passthrough)
    assert honest.finding is Finding.DRIFTED, honest
    # on the activation alone (no gradient audited): the same, and an output that is not zeros is still a mismatch
    alone = Work(output=zeros)
    assert compare(alone, alone, TOLERANCE, True, passthrough=Work(output=zeros)).finding is Finding.SAME
    added = compare(Work(output=tensor(8)), alone, TOLERANCE, False, passthrough=Work(output=zeros))
    assert added.finding is Finding.MISMATCH
    # where the gradient does move, a replica that must have stepped and returns the reference gradient is frozen
    frozen = compare(reference, reference, TOLERANCE, True, passthrough=Work(output=zeros, grad_input=g_out))
    assert frozen.finding is Finding.FROZEN and frozen.direction == "gradient"


# --- the judgement --------------------------------------------------------------------------------------------------


class Cmp:
    def __init__(self, failed: bool) -> None:
        self.failed = failed


def agreeing(groups: dict[int, int]):
    return lambda i, j: groups[i] == groups[j]


def test_one_auditor_never_convicts_and_two_that_agree_do():
    assert decide([Cmp(False)], agreeing({0: 0})).outcome is AuditOutcome.PASSED
    assert decide([Cmp(True)], agreeing({0: 0})).outcome is AuditOutcome.UNCONFIRMED
    decision = decide([Cmp(True), Cmp(True)], agreeing({0: 0, 1: 0}))
    assert decision.outcome is AuditOutcome.CONVICTED and decision.contradicted == () and decision.convicting == (0, 1)


def test_a_lying_first_auditor_is_contradicted_by_one_that_bears_the_claim_out():
    decision = decide([Cmp(True), Cmp(False)], agreeing({0: 0, 1: 1}))
    assert decision.outcome is AuditOutcome.CONTRADICTED and decision.contradicted == (0,)


def test_when_two_accusers_disagree_a_third_decides_and_the_odd_one_out_is_contradicted():
    two = [Cmp(True), Cmp(True)]
    assert decide(two, agreeing({0: 0, 1: 1})).outcome is AuditOutcome.DISPUTED
    assert wants_another(two, agreeing({0: 0, 1: 1}))
    convicted = decide([*two, Cmp(True)], agreeing({0: 0, 1: 1, 2: 1}))
    assert convicted.outcome is AuditOutcome.CONVICTED and convicted.contradicted == (0,)
    cleared = decide([*two, Cmp(False)], agreeing({0: 0, 1: 1, 2: 2}))
    assert cleared.outcome is AuditOutcome.CONTRADICTED and cleared.contradicted == (0, 1)
    assert not wants_another([*two, Cmp(True)], agreeing({0: 0, 1: 1, 2: 2}))  # three asked: disputed it stays


def test_repeated_refusals_are_a_strike():
    ledger = AuditLedger(refusal_limit=3)
    assert [ledger.refusal("slow") for _ in range(4)] == [False, False, True, False]
    ledger.refusal("other")
    ledger.record(AuditOutcome.PASSED, "someone", ["other"])  # answering resets the streak
    assert [ledger.refusal("other") for _ in range(3)] == [False, False, True]


# --- what an auditor recomputes --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config():
    return load_config().with_overrides(
        model={"hidden_size": 16, "intermediate_size": 40, "n_layers": 3, "n_heads": 2, "n_kv_heads": 2},
        pipeline={"n_stages": 3, "microbatch_size": 2, "seq_len": 8},
    )


def test_a_recomputation_is_the_training_computation_and_touches_nothing_of_the_replica(config):
    worker = StageWorker(config.model, config.pipeline, 1, seed=0)
    x, g = tensor(6, (2, 8, 16)), tensor(7, (2, 8, 16))
    pending = worker.forward("pending", tensor(8, (2, 8, 16)))  # a microbatch awaiting its backward
    work, version, drift = worker.recompute(0, x, g)
    assert drift.steps == 0  # it has not stepped since the reference
    assert version.round_step == -1 and version.members is None
    assert all(p.grad is None for p in worker.module.parameters())  # nothing accumulated
    output = worker.forward("audited", x)
    grad_input = worker.backward("audited", g)
    assert torch.equal(work.output, output) and torch.equal(work.grad_input, grad_input)  # bitwise, fp32 CPU
    assert worker.backward("pending", torch.ones_like(pending)) is not None  # the pending graph survived


def test_recomputation_uses_the_reference_not_the_replicas_own_parameters(config):
    worker = StageWorker(config.model, config.pipeline, 2, seed=0)  # the last stage
    x, targets = tensor(9, (2, 8, 16)), torch.randint(0, 256, (2, 8))
    before, _, _ = worker.recompute(0, x, targets=targets)
    worker.forward_backward_loss("m", x, targets)
    assert worker.step(0)  # its own parameters moved
    after, _, drift = worker.recompute(1, x, targets=targets)
    assert torch.equal(before.grad_input, after.grad_input)
    assert drift.steps == 1 and drift.errors["gradient"] > 0  # its own parameters moved it this far
    worker.set_reference(round_step=4, applies_from=5, members=["a", "b"])
    moved, version, _ = worker.recompute(5, x, targets=targets)
    assert not torch.equal(moved.grad_input, before.grad_input) and version.includes("a")
    assert not version.includes("c")
    with pytest.raises(NoReference):
        worker.recompute(4 + 2 * config.pipeline.average_every + 1, x, targets=targets)  # too old to compare


def test_a_replica_that_averages_late_keeps_its_reference_for_two_of_its_own_periods(config):
    every = config.pipeline.average_every
    worker = StageWorker(config.model, config.pipeline, 2, seed=0)
    x, targets = tensor(9, (2, 8, 16)), torch.randint(0, 256, (2, 8))
    late = 3 * every  # rounds take longer than the steps between them: every third one is due when one is free
    worker.set_reference(round_step=every - 1, applies_from=every, members=None)
    worker.set_reference(round_step=every - 1 + late, applies_from=every + late, members=None)
    _, version, _ = worker.recompute(every - 1 + 2 * late, x, targets=targets)  # two of its periods: still kept
    assert version.round_step == every - 1 + late
    with pytest.raises(NoReference):
        worker.recompute(every - 1 + 3 * late + 1, x, targets=targets)
    worker.set_reference(round_step=every - 1 + 20 * late, applies_from=every + 20 * late, members=None)
    with pytest.raises(NoReference):  # a replica cut off for many rounds: no more than four periods due
        worker.recompute(every - 1 + 20 * late + 8 * every + 1, x, targets=targets)


def test_stage_zero_recomputes_its_embeddings_too(config):
    worker = StageWorker(config.model, config.pipeline, 0, seed=0)
    tokens = torch.randint(0, 256, (2, 8))
    work, _, _ = worker.recompute(0, tokens)
    assert torch.equal(work.output, worker.forward("t", tokens))
    assert torch.equal(work.embedding, worker.module.embed(tokens).detach())


# --- the relay cache and the case ---------------------------------------------------------------------------------


def crossing(mb: str, boundary: int, sender: str, receiver: str, seed: int) -> Crossing:
    c = Crossing(mb, 3, boundary, sender, tensor(seed, (2, 8, 16)))
    c.receiver, c.gradient, c.settled = receiver, tensor(seed + 1, (2, 8, 16)), True
    return c


def test_the_cache_is_bounded_by_bytes_and_evicts_the_oldest():
    one = crossing("a", 0, "s", "r", 0).nbytes
    cache = RelayCache(max_bytes=int(2.5 * one))
    for name in "abc":
        cache.open(crossing(name, 0, "s", "r", 0))
    assert cache.get("a", 0) is None and cache.get("c", 0) is not None
    assert cache.bytes <= 2.5 * one and cache.evicted == 1
    cache.completed("r", 4)
    assert cache.completed_between("r", 3, 5) and not cache.completed_between("r", 4, 5)


def test_a_middle_stages_work_is_assembled_from_the_crossings_around_it():
    below, above = crossing("m", 0, "s0", "A", 10), crossing("m", 1, "A", "s2", 20)
    case = assemble(1, 3, below, above)
    assert case.audited == "A" and torch.equal(case.inputs, below.activation)
    assert torch.equal(case.claimed.output, above.activation) and torch.equal(case.claimed.grad_input, below.gradient)
    assert torch.equal(case.grad_output, above.gradient)
    assert set(case.digests) == {"input", "output", "grad_output", "grad_input"}
    assert assemble(1, 3, below, crossing("m", 1, "B", "s2", 20)) is None  # not the same replica's work
    above.tainted = True
    assert assemble(1, 3, below, above) is None


def test_a_held_microbatch_is_the_forward_half_alone_and_the_last_stage_has_no_case():
    """The loss gate held the microbatch back: no gradient came, the crossings are closed as held (with the replica
    that took the activation), and a middle stage's case is its output for its input."""
    cache = RelayCache(max_bytes=1 << 20)
    for boundary, (sender, seed) in enumerate((("s0", 10), ("A", 20))):
        cache.open(Crossing("m", 3, boundary, sender, tensor(seed, (2, 8, 16))))
    assert cache.hold("m", 0, "A").held and cache.hold("m", 1, "s2").held
    assert cache.hold("gone", 0, "A") is None
    below, above = cache.get("m", 0), cache.get("m", 1)
    case = assemble(1, 3, below, above)
    assert case.audited == "A" and case.grad_output is None and case.claimed.grad_input is None
    assert torch.equal(case.claimed.output, above.activation) and torch.equal(case.inputs, below.activation)
    assert set(case.digests) == {"input", "output"}
    assert assemble(2, 3, above, None) is None  # the last stage sends no output: nothing of it to check
    assert assemble(1, 3, below, crossing("m", 1, "A", "s2", 20)) is None  # one half held, the other not
    unanswered = Crossing("n", 3, 0, "s0", tensor(1, (2, 8, 16)))
    unanswered.settled = True
    assert assemble(0, 3, None, unanswered) is None  # neither held nor answered: no gradient to compare


def test_a_middle_stage_recomputes_the_forward_half_of_a_held_microbatch(config):
    worker = StageWorker(config.model, config.pipeline, 1, seed=0)
    x = tensor(6, (2, 8, 16))
    work, _, drift = worker.recompute(0, x)  # no output gradient: the microbatch had no backward pass
    assert work.grad_input is None and work.directions() == ("activation",)
    assert torch.equal(work.output, worker.forward("audited", x))
    worker.discard("audited")
    assert drift.steps == 0


def test_the_draw_is_a_share_of_settled_microbatches():
    draw = AuditDraw(0.25, seed=1)
    share = sum(draw() for _ in range(4000)) / 4000
    assert 0.22 < share < 0.28
    assert not any(AuditDraw(0.0, seed=1)() for _ in range(100))


def test_a_replica_on_probation_is_drawn_at_the_probation_rate():
    draw = AuditDraw(0.02, seed=1, probation_rate=0.25)
    newcomer = sum(draw(probation=True) for _ in range(4000)) / 4000
    established = sum(draw() for _ in range(4000)) / 4000
    assert 0.22 < newcomer < 0.28 and established < 0.04
    no_probation = AuditDraw(0.1, seed=2, probation_rate=0.0)  # a lower probation rate never lowers the rate
    assert 0.08 < sum(no_probation(probation=True) for _ in range(4000)) / 4000 < 0.12


def test_a_sender_gathering_peer_evidence_is_a_suspect_before_any_strike_and_honest_peers_are_not():
    """Four replicas' gradients at one boundary, their norms spread as honest ones are (a factor exp(0.3 z) per
    tensor, so that doubling stays inside every fence), one doubled from check 200 on: the peer test's evidence
    against it reaches half its limit long before an alarm, and from then on its work is worth recomputing, while
    it holds no strike; its honest peers never reach it in 400 checks each. `share` 0 turns it off."""
    config = load_config().verification.model_copy(update={"warmup": 40})
    checker = BoundaryVerifier(config, [0], hidden_size=16, expected_shape=(4, 32, 16), seed=1)
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(4, 32, 16, generator=generator)
    became, honest_suspect = None, set()
    for i in range(400):
        for sender in "abcd":
            spread = float(torch.exp(0.3 * torch.randn(1, generator=generator)))
            tensor = (base + 0.7 * torch.randn(4, 32, 16, generator=generator)) * spread
            if sender == "d" and i >= 200:
                tensor = 2 * tensor
            verdict = checker.check(0, "gradient", tensor, sender, tainted=False, step=i)
            if sender != "d" and checker.suspicious(sender, 0, "gradient", 0.5):
                honest_suspect.add(sender)
            if sender == "d" and became is None and checker.suspicious("d", 0, "gradient", 0.5):
                became = (i, verdict.flagged, checker.ledger.suspect("d"))
            assert not checker.suspicious(sender, 0, "gradient", 0.0)
    assert became is not None, "the doubled sender never gathered evidence"
    step, flagged, struck = became
    assert 200 <= step < 215 and not flagged and not struck, became
    assert not honest_suspect, honest_suspect
    assert not checker.suspicious("d", 0, "activation", 0.5), "no evidence on what it did not send"
    assert not checker.suspicious("unheard", 0, "gradient", 0.5)


def test_a_suspect_holding_a_strike_is_drawn_at_the_suspect_rate_until_forgiven():
    strikes = SenderStrikes(3, forgive_after=5)
    strikes.record("flagged", True)
    strikes.record("honest", False)
    assert strikes.suspect("flagged") and not strikes.suspect("honest") and not strikes.suspect("unheard")
    draw = AuditDraw(0.02, seed=3, suspect_rate=0.25)
    suspect = sum(draw(suspect=strikes.suspect("flagged")) for _ in range(4000)) / 4000
    other = sum(draw(suspect=strikes.suspect("honest")) for _ in range(4000)) / 4000
    assert 0.22 < suspect < 0.28 and other < 0.04
    for _ in range(5):
        strikes.record("flagged", False)
    assert not strikes.suspect("flagged"), "a forgiven strike is no suspicion"
    for _ in range(3):
        strikes.record("banned", True)
    assert strikes.is_banned("banned") and not strikes.suspect("banned")  # its work is not routed any more


def test_the_judge_convicts_only_with_two_agreeing_auditors_and_strikes_the_contradicted(config):
    worker = StageWorker(config.model, config.pipeline, 1, seed=0)
    below, above = crossing("m", 0, "s0", "cheat", 30), crossing("m", 1, "cheat", "s2", 40)
    honest, version, _ = worker.recompute(3, below.activation, above.gradient)
    above.activation = honest.output
    below.gradient = -honest.grad_input  # the gradient it sent back, inverted
    case = assemble(1, 3, below, above)
    strikes = SenderStrikes(3, 100)
    judge = AuditJudge(TOLERANCE, strikes, AuditLedger(), lambda *_: False)
    drift = Drift(steps=1, errors={"activation": 0.01, "gradient": 0.01})
    liar = Recomputation("liar", Work(output=honest.output, grad_input=3 * honest.grad_input), version, drift)
    auditors = [Recomputation(name, honest, version, drift) for name in ("h1", "h2")]
    recs = [liar, *auditors]
    result = judge.settle(case, recs, [judge.compare(case, r) for r in recs])
    assert result.outcome is AuditOutcome.CONVICTED and strikes.is_banned("cheat")
    assert result.contradicted == ("liar",) and strikes.peek("liar").strikes == 1
    assert result.evidence["auditors"] == ["h1", "h2"] and result.evidence["error"] > 1


# --- stage-level attacks -------------------------------------------------------------------------------------------


def test_stage_attacks_change_what_a_replica_does_not_how_the_tensor_looks(config):
    name, make = attack_maker("skip")
    skip = arm(make, "both", 1, 3, seed="x")
    x, g = tensor(60, (2, 8, 16)), tensor(61, (2, 8, 16))
    out, attacked = skip["activation"](x * 2, 0, StageContext(inputs=x))
    assert attacked and torch.equal(out, x)
    out, _ = skip["gradient"](g * 2, 0, StageContext(grad_output=g))
    assert torch.equal(out, g)
    replay = arm(attack_maker("replay")[1], "both", 1, 3, seed="x")["activation"]
    first, attacked_first = replay(x, 0)
    second, attacked_second = replay(g, 0)
    assert torch.equal(first, x) and not attacked_first and torch.equal(second, x) and attacked_second


def test_a_stale_replica_never_applies_its_optimizer_step(config):
    worker = StageWorker(config.model, config.pipeline, 2, seed=0)
    attackers = arm(attack_maker("stale")[1], "both", 2, 3, start=1, seed="x")
    worker.applies_step = refuses_steps(attackers)
    x, targets = tensor(62, (2, 8, 16)), torch.randint(0, 256, (2, 8))
    worker.forward_backward_loss("a", x, targets)
    assert worker.step(0)  # before the attack starts
    frozen = [p.detach().clone() for p in worker.module.parameters()]
    worker.forward_backward_loss("b", x, targets)
    assert not worker.step(1) and worker.accumulated == 0
    assert all(torch.equal(p, q) for p, q in zip(worker.module.parameters(), frozen, strict=True))
    assert refuses_steps(arm(attack_maker("scale")[1], "both", 2, 3)) is None


def test_an_attack_file_may_name_a_stage_attack_class(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "from sentinel_node.attacks import StageAttack\n"
        "class Lazy(StageAttack):\n"
        "    def gradient(self, grad_input, step, context):\n"
        "        return grad_input * 0.5\n"
        "class NotOne:\n"
        "    pass\n"
    )
    name, cls = load_attack_file(f"{path}:Lazy")
    assert name == "Lazy" and issubclass(cls, StageAttack)
    attackers = arm(attack_maker(file=f"{path}:Lazy")[1], "both", 1, 3)
    g = tensor(63)
    assert torch.equal(attackers["gradient"](g, 0)[0], g * 0.5)
    with pytest.raises(AttackError, match="StageAttack"):
        load_attack_file(f"{path}:NotOne")
    assert set(STAGE_ATTACKS) == {"stale", "skip", "replay", "lie"}
    assert isinstance(attackers["gradient"], Attacker)


# --- audits in the mesh --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=2**20)


def mesh_config(**verification):
    # statistics that never leave their warm-up, and judge no crossing in it, and no gradient passage: whatever is
    # caught here, audits caught
    return load_config().with_overrides(
        model={"hidden_size": 32, "intermediate_size": 86, "n_layers": 3},
        pipeline={"n_stages": 3},
        verification={
            "warmup": 10**6,
            "warmup_fenced_after": 0,
            "audit_rate": 0.5,
            "passage_floor": 0.0,
            **verification,
        },
        sim={"steps": 24, "attack_start": 10, "replicas": 4, "eval_every": 12, "eval_batches": 1},
    )


def test_the_mesh_convicts_a_gradient_inverter_that_statistics_miss(corpus):
    config = mesh_config()
    plan = AttackPlan("scale", "gradient", attack_maker("scale")[1])
    result = Mesh(config, corpus, plan).run()
    assert result.malicious == ["s1r0"] and set(result.banned_at) == {"s1r0"}
    audits = result.audits
    assert audits["malicious"]["convicted"] == 1 and audits["honest"]["convicted"] == 0
    assert audits["honest_failed_first"] == 0 and audits["honest_audits"] > 20
    conviction = audits["convictions"][0]
    assert conviction["direction"] == "gradient" and conviction["step"] >= 10 and conviction["error"] > 1
    assert len(conviction["auditors"]) == 2 and "s1r0" not in conviction["auditors"]


@pytest.mark.parametrize("loss_evidence", [0.5, 0.0])
def test_higher_losses_make_a_suspect_whose_audit_convicts_it(corpus, loss_evidence):
    # the base draw (0.1%), the peer test's suspicion and the loss gate are off, and the fences stay in warm-up: in
    # 8 attacked steps only its microbatches' losses, ranked against its peers', can get s1r0 audited
    config = mesh_config(audit_rate=0.001, suspect_evidence=0.0, loss_evidence=loss_evidence, loss_gate=0.0)
    rotate = AttackPlan("plane_rotation", "activation", lambda d: make_attack("plane_rotation", degrees=180))
    result = Mesh(config, corpus, rotate).run(steps=18)
    audits = result.audits
    assert result.malicious == ["s1r0"] and audits["honest"]["convicted"] == 0
    assert audits["loss_suspect_draws"]["honest"] <= 2  # a suspicion of honest work costs an audit that passes
    if loss_evidence:
        assert set(result.banned_at) == {"s1r0"} and audits["malicious"]["convicted"] == 1
        assert audits["loss_suspect_draws"]["malicious"] >= 1
    else:
        assert audits["loss_suspect_draws"] == {"honest": 0, "malicious": 0}
        assert not result.banned_at


@pytest.mark.parametrize("gate", [4.0, 0.0])
def test_the_loss_gate_holds_a_corrupters_microbatches_and_their_audit_convicts_it(corpus, gate):
    # The base draw (0.1%), the peer test's suspicion and the loss evidence are off, and the fences stay in warm-up:
    # only the gate, which holds back what ends far above the loss its text predicts, and the audit of every stage
    # of a held microbatch (its forward half alone: no gradient ever came) can stop s1r0, which turns its
    # activations by 180 degrees in 8 planes (+45% on a microbatch's loss, every statistic unmoved).
    # (From step 16: before it this model has learnt so little that the rotation costs it 1-3%, which no gate needs
    # to hold, and the gate, which opens after 16 applied microbatches and 8 read excesses, holds none of it.)
    config = mesh_config(
        audit_rate=0.001, suspect_evidence=0.0, loss_evidence=0.0, loss_gate=gate, loss_gate_warmup=16
    ).with_overrides(sim={"attack_start": 16})
    rotate = AttackPlan("plane_rotation", "activation", lambda d: make_attack("plane_rotation", degrees=180))
    mesh = Mesh(config, corpus, rotate)
    result = mesh.run(steps=20)
    audits = result.audits
    assert result.malicious == ["s1r0"] and audits["honest"]["convicted"] == 0
    if not gate:
        assert mesh.held == 0 and not result.banned_at
        return
    assert set(result.banned_at) == {"s1r0"} and result.banned_at["s1r0"][0] <= 17  # within two steps of its start
    conviction = audits["convictions"][0]
    assert conviction["digests"].keys() == {"input", "output"}  # a held microbatch: the forward half alone
    assert conviction["direction"] == "activation" and conviction["error"] > 1
    assert audits["held_draws"]["malicious"] >= 1
    assert mesh.held <= audits["held_draws"]["honest"] + audits["held_draws"]["malicious"]
    # honest replicas audited on held microbatches (those of the attacker's routes, and any honest microbatch held):
    # a few, and they passed
    assert audits["held_draws"]["honest"] <= 8 and audits["honest"]["passed"] >= audits["held_draws"]["honest"]


@pytest.mark.parametrize("floor", [0.5, 0.0])
def test_the_gradient_passage_has_a_middle_stage_that_sends_gradients_at_the_wrong_tokens_audited(corpus, floor):
    # The base draw (0.1%), the suspicions and the loss gate are off, and the fences stay in warm-up: only the
    # passage test (the input gradient of a middle stage against the one its next verifier passed back to it) can
    # see s1r0 send every gradient shifted by one token, a tensor every statistic finds honest.
    config = mesh_config(
        audit_rate=0.001, suspect_evidence=0.0, loss_evidence=0.0, loss_gate=0.0, passage_floor=floor
    ).with_overrides(sim={"attack_start": 4})
    shift = AttackPlan("token_shift", "gradient", lambda d: make_attack("token_shift", shift=1))
    mesh = Mesh(config, corpus, shift)
    result = mesh.run(steps=12)
    assert result.malicious == ["s1r0"]
    honest_flags = sum(c.flags_honest for c in result.timeline)
    if not floor:
        assert not result.banned_at
        return
    assert set(result.banned_at) == {"s1r0"} and result.banned_at["s1r0"][0] <= 6  # within three steps
    # the passage flags and drops its gradients, a suspicion; the audit of the flagged crossing convicts it
    audits = result.audits
    assert honest_flags == 0 and audits["malicious"]["convicted"] == 1, audits
    draws = audits["passage_draws"]
    assert draws["honest"] == 0 and draws["malicious"] >= 1, draws
    assert audits["convictions"][0]["direction"] == "gradient"


def test_a_lying_auditor_cannot_frame_an_honest_replica(corpus):
    config = mesh_config(audit_rate=1.0)
    # s1r0 trains honestly and lies whenever it audits: it says the layers add the opposite of what they add
    liar = AttackPlan("lie", "both", attack_maker("lie")[1])
    mesh = Mesh(config.with_overrides(sim={"attack_start": 0}), corpus, liar)
    result = mesh.run(steps=12)
    assert result.malicious == ["s1r0"]
    assert set(result.banned_at) <= {"s1r0"}  # only the liar may go
    audits = result.audits
    assert audits["honest"]["convicted"] == 0 and audits["honest_auditors_contradicted"] == 0
    assert audits["honest"]["contradicted"] > 0  # the liar accused honest replicas, and was contradicted
    ledger = mesh.verifiers[0][0].ledger
    assert ledger.peek("s1r0").strikes > 0


# --- what people see ------------------------------------------------------------------------------------------------


def test_swarm_strikes_shows_audits_and_the_evidence_of_a_failed_one():
    from dht import StrikeRecord, ephemeral_identity
    from peers import StrikeLedger, SwarmView
    from sentinel_node.cli.swarm_tables import render_strikes, to_json

    config = load_config()
    verifier, accused, auditor = (ephemeral_identity().peer_id for _ in range(3))
    evidence = {
        "microbatch": "s7:m2:a0",
        "step": 7,
        "stage": 1,
        "finding": "mismatch",
        "direction": "gradient",
        "error": 2.0,
        "confirmed_error": 2.0,
        "auditors": [auditor, verifier],
        "digests": {"input": "a" * 64, "grad_input": "b" * 64},
        "parameters": "0123456789abcdef",
    }
    record = StrikeRecord(
        verifier=verifier,
        accused=accused,
        boundary=0,
        direction="gradient",
        strikes=3,
        checks=1,
        flags=1,
        metrics={},
        banned=True,
        config_hash=config.swarm_hash(),
        version="test",
        time=100.0,
        audits_passed=5,
        audits_failed=1,
        audit=evidence,
    )
    view = SwarmView(config.pipeline.n_stages, ledger=StrikeLedger.from_records([record]), time=110.0)
    text = render_strikes(view, config)
    assert "5/1" in text and "FAILED AUDITS" in text
    assert "s7:m2:a0" in text and auditor in text and "mismatch gradient" in text and "grad_input=bbbbbbbbbbbb" in text
    assert to_json(view, config, "strikes")["strikes"][accused][0]["audit"]["microbatch"] == "s7:m2:a0"


@pytest.mark.parametrize(
    ("error", "counted"),
    [
        (HopUnavailable("failed to dial: all dials failed"), False),
        (HopDeadlineExceeded("no answer within 5.00 s"), False),
        (HopRefused("not on this replica's route"), True),
    ],
    ids=["unreachable", "late", "refused"],
)
def test_an_auditor_that_cannot_be_reached_is_not_counted_as_refusing(monkeypatch, error, counted):
    """A killed replica stays in a verifier's audit draw until its announcement expires: the dials that fail meanwhile
    are no refusal of its own (a swarm test saw it struck for them); a refusal it answers with still counts."""
    refused: list[str] = []

    async def call_peer(*_args, **_kwargs):
        raise error

    monkeypatch.setattr(role_audits, "call_peer", call_peer)
    audits = object.__new__(role_audits.VerifierAudits)
    audits.node = SimpleNamespace(p2p=None, transport=None)
    audits.config = SimpleNamespace(audit_timeout=10.0)
    audits.judge = SimpleNamespace(refused=lambda peer: refused.append(peer) or False)
    case = SimpleNamespace(inputs=torch.zeros(1), grad_output=None, stage=1, targets=None, microbatch="m", step=3)
    found, rest = asyncio.run(audits._recompute(case, ["auditor"], None))
    assert found is None and rest == []
    assert refused == (["auditor"] if counted else [])
