"""`sentinel-node bench detection`: SENTINEL against every attack of the catalogue, in the mesh simulator.

For each (attack, target) three runs on the same seed and data: clean (no attacker, verification on), attacked
without verification, attacked with SENTINEL; all three share the steps before the attack starts exactly
(:mod:`sentinel_node.bench.runner`). Worker-level precision/recall/F1 count a malicious worker banned by the end as
a true positive and an honest one banned as a false positive. `--suite sweep` (:mod:`sentinel_node.bench.sweep`)
runs attack families with a strength instead.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from hivemind.utils.logging import get_logger

from sentinel_node.attacks import (
    ATTACK_NAMES,
    BASIC_ATTACKS,
    STAGE_ATTACKS,
    AttackError,
    load_attack_file,
    make_attack,
)
from sentinel_node.bench.runner import RunSpec, run_all
from sentinel_node.config import Config
from sentinel_node.model import load_corpus
from sentinel_node.sim import AttackPlan, SimResult
from sentinel_node.sim.run import attack_plan

logger = get_logger(__name__)

TARGETS = ("activation", "gradient")

# quick: the catalogue finishes within 5 minutes on 2 cores; full: the DESIGN measurement's model, a larger mesh.
# Audit rates: high enough that an attacker is audited several times in the attack window (docs/decisions.md,
# "Recomputation audits": expected steps to a ban R / (M * rate * p), R replicas per stage, M microbatches per step)
PROFILES: dict[str, dict[str, dict]] = {
    "quick": {
        "model": {"hidden_size": 64, "intermediate_size": 172},
        "verification": {"audit_rate": 0.2},
        "sim": {"steps": 90, "attack_start": 45, "replicas": 4, "eval_every": 15, "eval_batches": 3},
    },
    "full": {
        "model": {"hidden_size": 128, "intermediate_size": 344},
        "pipeline": {"n_stages": 4},
        "verification": {"audit_rate": 0.05},
        "sim": {"steps": 400, "attack_start": 150, "replicas": 8, "eval_every": 20},
    },
}

# CPU seconds one global step of one run takes here (2 otherwise idle cores, one run per core), measured with
# `bench detection`; the upfront estimate of a benchmark's time is built from them
# (full: 1.5 before issue 12's linear-time statistics; 0.34-0.4 since, measured 2026-12-04: 1,000 honest steps in
# 340 s, and a sweep of 17 runs in 13 min where 1.5 had promised 57)
STEP_SECONDS = {"quick": 0.45, "full": 0.4}


@dataclass(frozen=True)
class Case:
    name: str
    target: str
    attack_file: str | None = None  # PATH.py:NAME for a red team's own attack


def cases(attacks: list[str] | None, attack_file: str | None, targets: list[str] | None = None) -> list[Case]:
    """The runs to make: every catalogue attack on each target (or on ``targets`` only), or the named ones, or the
    attack file's."""
    selected = [case for case in _cases(attacks, attack_file) if not targets or case.target in (*targets, "both")]
    if not selected:
        raise AttackError(f"no run on targets {targets}: stage-level attacks run on both directions at once")
    return selected


def _cases(attacks: list[str] | None, attack_file: str | None) -> list[Case]:
    if attack_file is not None:
        name, loaded = load_attack_file(attack_file)  # fail now, not in a worker
        targets = ("both",) if isinstance(loaded, type) else TARGETS  # a StageAttack class: one run
        selected = [Case(name, t, attack_file) for t in targets]
        return selected + [Case(a, t) for a in attacks or [] for t in TARGETS]
    names = attacks or [*BASIC_ATTACKS, "mixed", "adaptive", *STAGE_ATTACKS]
    for name in names:
        if name not in STAGE_ATTACKS:
            make_attack(name)  # unknown names fail here, with the catalogue listed
    # a stage-level attack changes the replica's whole computation: one run, on what it sends in both directions
    return [Case(name, t) for name in names for t in (("both",) if name in STAGE_ATTACKS else TARGETS)]


def _plan(case: Case, config: Config) -> AttackPlan:
    if case.attack_file is not None:
        return attack_plan(config, None, case.attack_file, case.target)
    return attack_plan(config, case.name, None, case.target)


def _watches_honest(case: Case, config: Config) -> bool:
    """Whether the attack learns from honest tensors before it starts (then its runs branch off at step 0)."""
    return any(getattr(_plan(case, config).make(d), "observes_honest", False) for d in TARGETS)


def estimate_minutes(profile: str, steps: int, specs: list[RunSpec], workers: int) -> float:
    """How long the runs take here: the shared prefix in one process, then the rest spread over the workers."""
    prefix = max((spec.branch for spec in specs), default=0)
    rest = (steps - prefix) + sum(steps - spec.branch for spec in specs)
    return STEP_SECONDS[profile] * (prefix + rest / max(1, min(workers, 2))) / 60


def worker_scores(defended: SimResult) -> dict:
    """Worker-level precision, recall and F1 of the bans, and how long they took."""
    malicious, honest = set(defended.malicious), set(defended.honest)
    banned = set(defended.banned_at)
    tp, fp = len(banned & malicious), len(banned & honest)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / len(malicious) if malicious else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    to_ban = [defended.banned_at[w] for w in banned & malicious]
    return {
        "precision": round(precision, 4),
        "recall": round(recall, 4),
        "f1": round(f1, 4),
        "honest_banned": fp,
        "honest_banned_ids": sorted(banned & honest),
        "malicious": sorted(malicious),
        "bans": {w: {"step": s, "microbatches": m} for w, (s, m) in sorted(defended.banned_at.items())},
        "microbatches_to_ban": statistics.median(m for _, m in to_ban) if to_ban else None,
        "steps_to_ban": statistics.median(s - defended.attack_start + 1 for s, _ in to_ban) if to_ban else None,
        "honest_max_strikes": defended.honest_max_strikes,
    }


def summarize(case: Case, defended: SimResult, undefended: SimResult, clean: SimResult) -> dict:
    flag_precision, flag_recall = defended.stats.precision_recall(case.target)
    return {
        "name": case.name,
        "target": case.target,
        **worker_scores(defended),
        "flag_precision": None if flag_precision is None else round(flag_precision, 4),
        "flag_recall": None if flag_recall is None else round(flag_recall, 4),
        "metric_flag_rates": {
            "attacked": _rounded(defended.stats.metric_rates(case.target, True)),
            "honest": _rounded(defended.stats.metric_rates(case.target, False)),
        },
        "audits": _audits(defended),
        "val_loss": {
            "clean": round(clean.final_val_loss, 4),
            "undefended": round(undefended.final_val_loss, 4),
            "defended": round(defended.final_val_loss, 4),
        },
        "attack_start": defended.attack_start,
        "curves": {
            "clean": clean.val_curve,
            "undefended": undefended.val_curve,
            "defended": defended.val_curve,
        },
        "timeline": [asdict(c) for c in defended.timeline],
    }


def _audits(result: SimResult) -> dict | None:
    """The defended run's audits: counts by outcome for honest and malicious replicas, the honest error
    distribution, and the evidence of each conviction."""
    return result.audits


def _rounded(rates: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in rates.items()}


def clean_summary(clean: SimResult) -> dict:
    return {
        "val_loss": round(clean.final_val_loss, 4),
        "honest_banned": len(clean.banned_at),
        "honest_max_strikes": clean.honest_max_strikes,
        "flags": clean.stats.flags,
        "checks": clean.stats.checked(),
        "audits": _audits(clean),
        "curve": clean.val_curve,
    }


def mesh_summary(config: Config) -> dict:
    return {
        "stages": config.pipeline.n_stages,
        "replicas": config.sim.replicas,
        "steps": config.sim.steps,
        "attack_start": config.sim.attack_start,
        "microbatches_per_step": config.pipeline.microbatches_per_step,
        "audit_rate": config.verification.audit_rate,
        "average_every": config.pipeline.average_every,
    }


def run_detection(
    config: Config,
    profile: str = "quick",
    attacks: list[str] | None = None,
    attack_file: str | None = None,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    bar: bool = False,
    targets: list[str] | None = None,
    steps: int | None = None,
) -> dict:
    """Runs the benchmark and returns {"profile", "config_hash", "mesh", "clean", "attacks": [...]}.

    `progress` gets the plan with its estimated time, then a line per finished run; `bar` shows a progress bar.
    ``steps`` replaces the profile's run length, the attack starting halfway."""
    config = config.with_overrides(**PROFILES[profile])
    if steps is not None:
        config = config.with_overrides(sim={"steps": steps, "attack_start": steps // 2})
    selected = cases(attacks, attack_file, targets)
    corpus = load_corpus(config.data.path, config.data.val_fraction, config.data.max_bytes)
    start = config.sim.attack_start
    specs = []
    for case in selected:
        branch = 0 if _watches_honest(case, config) else start
        plan = _case_plan(case, config)
        for verify in (False, True):
            label = f"{case.name} on {case.target}s, {'defended' if verify else 'undefended'}"
            specs.append(RunSpec(label, plan, verify, start, branch))
    if progress is not None:
        minutes = estimate_minutes(profile, config.sim.steps, specs, workers)
        progress(
            f"bench detection, {profile} profile: {len(specs) + 1} runs of {config.sim.steps} steps "
            f"({len(selected)} attacks x undefended/defended, and a clean run); about {minutes:.0f} min on 2 "
            "otherwise idle cores here"
        )
    clean, results, step_cpu = run_all(config, corpus, specs, workers, progress=None if bar else progress, bar=bar)
    rows = [summarize(case, results[2 * i + 1], results[2 * i], clean) for i, case in enumerate(selected)]
    return {
        "suite": "catalogue",
        "profile": profile,
        "config_hash": config.swarm_hash(),
        "mesh": mesh_summary(config),
        "cpu_s_per_step": None if step_cpu is None else round(step_cpu, 3),
        "clean": clean_summary(clean),
        "attacks": rows,
    }


def _case_plan(case: Case, config: Config) -> Callable[[], AttackPlan]:
    return lambda: _plan(case, config)


def table(report: dict) -> str:
    """A readable table of a report."""
    header = (
        f"{'attack':<16} {'target':<10} {'prec':>5} {'recall':>6} {'F1':>5} {'honest':>6} {'mb→ban':>7} "
        f"{'st→ban':>6} {'flagP':>6} {'flagR':>6} {'clean':>6} {'undef':>6} {'def':>6} {'audits':>7} {'conv':>5}"
    )
    lines = [header, "-" * len(header)]
    for row in report["attacks"]:
        v = row["val_loss"]
        lines.append(
            f"{row['name']:<16} {row['target']:<10} {row['precision']:>5.2f} {row['recall']:>6.2f} {row['f1']:>5.2f} "
            f"{row['honest_banned']:>6d} {_fmt(row['microbatches_to_ban']):>7} {_fmt(row['steps_to_ban']):>6} "
            f"{_fmt(row['flag_precision']):>6} {_fmt(row['flag_recall']):>6} "
            f"{v['clean']:>6.3f} {v['undefended']:>6.3f} {v['defended']:>6.3f}"
            f"{_audit_cells(row.get('audits'))}"
        )
    c = report["clean"]
    lines.append(
        f"clean run: val loss {c['val_loss']:.3f}, {c['flags']} flags in {c['checks']} checks, "
        f"{c['honest_banned']} honest banned, max honest strikes {c['honest_max_strikes']}"
    )
    lines += audit_lines(report)
    return "\n".join(lines)


def _audit_cells(audits: dict | None) -> str:
    if not audits:
        return f" {'-':>7} {'-':>5}"
    return f" {audits['run']:>7d} {audits['malicious']['convicted']:>5d}"


def audit_lines(report: dict) -> list[str]:
    """Recomputation audits over every defended run and the clean one: honest audits and how many failed, and
    the distribution of the honest relative error against the tolerance."""
    runs = [row["audits"] for row in report["attacks"] if row.get("audits")]
    if report["clean"].get("audits"):
        runs.append(report["clean"]["audits"])
    if not runs:
        return []
    honest = sum(a["honest_audits"] for a in runs)
    failed = sum(a["honest_failed_first"] for a in runs)
    convicted = sum(a["honest"]["convicted"] for a in runs)
    lines = [
        f"audits (rate {report['mesh']['audit_rate']}): {honest} of honest replicas, {failed} failed a first "
        f"comparison, {convicted} convicted; {sum(a['run'] for a in runs)} in all"
    ]
    for direction in ("activation", "gradient"):
        maxima = [a["honest_error"][direction]["max"] for a in runs if direction in a["honest_error"]]
        p99 = [a["honest_error"][direction]["p99"] for a in runs if direction in a["honest_error"]]
        if maxima:
            lines.append(
                f"  honest {direction} error after drifting: worst run p99 {max(p99):.3f}, max {max(maxima):.3f}"
            )
    return lines


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def plot(report: dict, out: Path) -> list[Path]:
    """One PNG per (attack, target): validation loss of the clean, undefended and defended runs, their difference to
    clean, and the defended run's flags and strikes per step (honest senders and attackers apart), with the attack
    start and each ban marked."""
    from sentinel_node.bench.plots import plot_run

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for row in report["attacks"]:
        path = out / f"val_loss_{row['name']}_{row['target']}.png"
        plot_run(row, f"{row['name']} on {row['target']}s ({report['profile']} profile)", path)
        paths.append(path)
    return paths


def known_attacks() -> list[str]:
    return list(ATTACK_NAMES)
