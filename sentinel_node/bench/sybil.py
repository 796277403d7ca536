"""`sentinel-node bench detection --suite sybil`: attackers that come back under a fresh identity each time they are
banned, with and without probation (issue 14).

A ban costs an attacker one identity, and identities are free. So what matters is how long each new identity lasts
and how much it gets to do: per attack, each run counts the identities the attacker went through, the microbatches
routed to each before its ban and the global steps it lasted, the honest workers banned, and the validation loss
against the clean run. Probation (:mod:`sentinel_node.verification.strikes`: a blatant flag bans at once, nothing is
forgiven, and audits draw the newcomer at ``probation_audit_rate``) should shorten every life after the first.

The audit rate is the swarm's own (the config's, 0.02 by default) rather than the profile's raised one, since
probation's audits are measured against the rate a swarm runs at.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from sentinel_node.attacks import make_attack
from sentinel_node.bench.detection import PROFILES, clean_summary, estimate_minutes, mesh_summary
from sentinel_node.bench.runner import RunSpec, run_all
from sentinel_node.config import Config
from sentinel_node.model import load_corpus
from sentinel_node.sim import AttackPlan, Mesh, SimResult


@dataclass(frozen=True)
class SybilCase:
    name: str
    attack: str
    target: str
    params: tuple[tuple[str, float], ...] = ()
    about: str = ""

    def plan(self) -> AttackPlan:
        params = dict(self.params)
        return AttackPlan(self.name, self.target, lambda _direction: make_attack(self.attack, **params))


CASES: tuple[SybilCase, ...] = (
    SybilCase("random", "random", "activation", about="blatant: every tensor replaced by noise"),
    SybilCase("scale 0.5", "scale", "activation", (("sigma", 0.5),), "moderate: activations halved"),
    SybilCase("intermittent 10", "intermittent", "activation", (("every", 10),), "one tensor in 10 blatant"),
    SybilCase("scale -1", "scale", "gradient", (("sigma", -1.0),), "gradients inverted: audits alone see it"),
)


def _prepare(probation: int, probation_rate: float) -> Callable[[Mesh], None]:
    def prepare(mesh: Mesh) -> None:
        mesh.rejoin = True
        for verifiers in mesh.verifiers:
            for verifier in verifiers:
                verifier.ledger.probation = probation
        if mesh.audits is not None:
            for station in mesh.audits.stations:
                station.draw.probation_rate = probation_rate

    return prepare


def lives_summary(result: SimResult) -> dict:
    """The attacker's identities: how many were banned, and the microbatches and steps each banned one lasted."""
    banned = [life for life in result.lives if life.banned_step is not None]
    later = [life for life in banned if life.identity != life.replica]  # identities taken after a ban
    microbatches = [life.microbatches for life in later]
    steps = [life.steps for life in later]
    return {
        "identities": len(result.lives),
        "banned": len(banned),
        "rejoined_banned": len(later),
        "microbatches_per_life": round(statistics.mean(microbatches), 2) if microbatches else None,
        "median_microbatches_per_life": statistics.median(microbatches) if microbatches else None,
        "steps_per_life": round(statistics.mean(steps), 2) if steps else None,
        "first_life_microbatches": next((x.microbatches for x in result.lives if x.identity == x.replica), None),
        "attacker_microbatches": sum(life.microbatches for life in result.lives),
    }


def run_sybil(
    config: Config,
    profile: str = "quick",
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    bar: bool = False,
) -> dict:
    """Each case with probation and without, every attacker re-joining at once after each ban; and a clean run."""
    probation, probation_rate = config.verification.probation, config.verification.probation_audit_rate
    audit_rate = config.verification.audit_rate
    config = config.with_overrides(**PROFILES[profile]).with_overrides(verification={"audit_rate": audit_rate})
    if probation <= 0:
        raise ValueError("the config's verification.probation is 0: there is no probation to compare")
    corpus = load_corpus(config.data.path, config.data.val_fraction, config.data.max_bytes)
    start = config.sim.attack_start
    specs = []
    for case in CASES:
        for on in (False, True):
            prepare = _prepare(probation, probation_rate) if on else _prepare(0, 0.0)
            label = f"{case.name} on {case.target}s, {'with' if on else 'without'} probation"
            specs.append(RunSpec(label, case.plan, True, start, start, prepare))
    if progress is not None:
        minutes = estimate_minutes(profile, config.sim.steps, specs, workers)
        progress(
            f"bench detection --suite sybil, {profile} profile: {len(specs) + 1} runs of {config.sim.steps} steps "
            f"({len(CASES)} attacks x without/with probation, and a clean run); about {minutes:.0f} min here"
        )
    clean, results, _ = run_all(config, corpus, specs, workers, progress=None if bar else progress, bar=bar)
    rows = []
    for i, case in enumerate(CASES):
        without, with_ = results[2 * i], results[2 * i + 1]
        rows.append(
            {
                "name": case.name,
                "target": case.target,
                "about": case.about,
                "without": _run_summary(without, clean),
                "with": _run_summary(with_, clean),
            }
        )
    return {
        "suite": "sybil",
        "profile": profile,
        "config_hash": config.swarm_hash(),
        "mesh": mesh_summary(config),
        "probation": {"clean_checks": probation, "audit_rate": probation_rate, "base_audit_rate": audit_rate},
        "clean": clean_summary(clean),
        "attacks": rows,
    }


def _run_summary(result: SimResult, clean: SimResult) -> dict:
    honest = set(result.honest)
    return {
        **lives_summary(result),
        "honest_banned": len(honest & set(result.banned_at)),
        "honest_max_strikes": result.honest_max_strikes,
        "val_loss": round(result.final_val_loss, 4),
        "damage_pct": round(100 * (result.final_val_loss / clean.final_val_loss - 1), 2),
    }


def table(report: dict) -> str:
    p = report["probation"]
    header = (
        f"{'attack':<16} {'target':<10} {'probation':<9} {'ids':>4} {'banned':>6} {'mb/life':>8} {'st/life':>8} "
        f"{'1st mb':>6} {'attack mb':>9} {'honest':>6} {'damage%':>8}"
    )
    lines = [
        f"probation: {p['clean_checks']} clean checks, audit rate {p['audit_rate']} (else {p['base_audit_rate']})",
        header,
        "-" * len(header),
    ]
    for row in report["attacks"]:
        for key in ("without", "with"):
            r = row[key]
            lines.append(
                f"{row['name']:<16} {row['target']:<10} {key:<9} {r['identities']:>4} {r['banned']:>6} "
                f"{_fmt(r['microbatches_per_life']):>8} {_fmt(r['steps_per_life']):>8} "
                f"{_fmt(r['first_life_microbatches']):>6} {r['attacker_microbatches']:>9} {r['honest_banned']:>6} "
                f"{r['damage_pct']:>8.2f}"
            )
    c = report["clean"]
    lines.append(f"clean run: val loss {c['val_loss']:.3f}, {c['honest_banned']} honest banned")
    return "\n".join(lines)


def plot(report: dict, out) -> list:
    return []


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)
