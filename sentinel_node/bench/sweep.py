"""`sentinel-node bench detection --suite sweep`: attack families with a strength, written outside the catalogue.

A defence tuned on its own test set proves little. Each family here has a strength parameter, from too weak to
matter to blatant, and runs on activations and on gradients; per point it reports the bans (F1, microbatches and
steps to ban, honest strikes) and the damage (validation loss undefended and defended over clean). An attack too
weak to be detected must also be too weak to matter: per family the report names the largest strength that went
undetected and the damage it did, and checks the criterion: every point whose undefended damage is at least
`DAMAGE_THRESHOLD` of the clean validation loss is detected with F1 >= `F1_REQUIRED` and its defended loss is
within `DAMAGE_THRESHOLD` of clean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sentinel_node.attacks import make_attack
from sentinel_node.bench.detection import (
    PROFILES,
    TARGETS,
    clean_summary,
    estimate_minutes,
    mesh_summary,
    worker_scores,
)
from sentinel_node.bench.runner import RunSpec, run_all
from sentinel_node.config import Config
from sentinel_node.model import load_corpus
from sentinel_node.sim import AttackPlan, SimResult

DAMAGE_THRESHOLD = 0.5  # percent of the clean validation loss
F1_REQUIRED = 0.95


@dataclass(frozen=True)
class Family:
    """An attack with one parameter swept. `parameter` None: the strength is the step the attack starts at."""

    name: str
    attack: str
    parameter: str | None
    strengths: dict[str, tuple[float, ...]]  # per profile
    about: str
    fixed: dict = field(default_factory=dict)
    watch: int = 0  # steps before its start the attacker needs to watch honest tensors

    def strength_name(self) -> str:
        return self.parameter or "attack start (global step)"


FAMILIES: tuple[Family, ...] = (
    Family(
        "scale",
        "scale",
        "sigma",
        {"quick": (-2, -1, -0.5, -0.25, 0.25, 0.5, 0.75, 1.25, 1.5, 2), "full": (-1, -0.5, 0.25, 0.5, 0.75, 1.5, 2)},
        "the tensor times sigma",
    ),
    Family(
        "bias",
        "bias",
        "offset",
        {"quick": (0.05, 0.1, 0.25, 0.5, 1.0), "full": (0.05, 0.25, 1.0)},
        "plus offset times the tensor's RMS",
    ),
    Family(
        "gaussian_noise",
        "gaussian_noise",
        "fraction",
        {"quick": (0.05, 0.1, 0.25, 0.5, 1.0), "full": (0.1, 0.5, 1.0)},
        "plus noise of fraction of its norm",
    ),
    Family(
        "lowrank_noise",
        "lowrank_noise",
        "fraction",
        {"quick": (0.1, 0.25, 0.5, 1.0), "full": (0.25, 1.0)},
        "plus noise in 2 directions of the hidden space",
        {"rank": 2},
    ),
    Family(
        "sparse_sign_flip",
        "sparse_sign_flip",
        "fraction",
        {"quick": (0.01, 0.05, 0.1, 0.25, 0.5), "full": (0.05, 0.1, 0.5)},
        "a fraction of its elements negated",
    ),
    Family(
        "channel_permutation",
        "channel_permutation",
        "fraction",
        {"quick": (0.05, 0.25, 1.0), "full": (0.05, 1.0)},
        "a fraction of its channels permuted",
    ),
    Family(
        "drift",
        "drift",
        "speed",
        {"quick": (0.002, 0.005, 0.01, 0.03), "full": (0.001, 0.005, 0.03)},
        "a bias growing by speed x RMS per step",
    ),
    Family(
        "replay",
        "replay",
        "noise",
        {"quick": (0.0, 0.01, 0.05, 0.2), "full": (0.0, 0.05)},
        "the previous tensor again, plus noise",
        {"lag": 1},
    ),
    Family(
        "intermittent",
        "intermittent",
        "every",
        {"quick": (2, 5, 10, 20, 50), "full": (5, 20, 50)},
        "one tensor in every corrupted (noise)",
    ),
    Family(
        "start_blatant",
        "random",
        None,
        {"quick": (5, 20, 35, 60), "full": (5, 35, 250)},
        "noise from a step during or after warm-up",
    ),
    Family(
        "start_subtle",
        "scale",
        None,
        {"quick": (5, 20, 35, 60), "full": (5, 35, 250)},
        "half the tensor from a step during or after warm-up",
        {"sigma": 0.5},
    ),
    Family(
        "channel_target",
        "channel_target",
        "channels",
        {"quick": (1, 2, 4, 8), "full": (1, 8)},
        "the largest channels zeroed",
    ),
    Family(
        "row_corruption",
        "row_corruption",
        "fraction",
        {"quick": (0.02, 0.05, 0.1, 0.25), "full": (0.05, 0.25)},
        "the tokens furthest along one direction negated",
    ),
    Family(
        "sequence_shuffle",
        "sequence_shuffle",
        "fraction",
        {"quick": (0.25, 1.0), "full": (0.25, 1.0)},
        "sequences of the microbatch swapped",
    ),
    # four written after the detection was settled, as a red team would (docs/decisions.md "Four attacks from
    # outside"): each keeps the tensor's norm
    Family(
        "plane_rotation",
        "plane_rotation",
        "degrees",
        {"quick": (10, 30, 90, 180), "full": (30, 180)},
        "turned by degrees in 8 planes of two channels",
        {"planes": 8},
    ),
    Family(
        "token_shift",
        "token_shift",
        "shift",
        {"quick": (1, 2, 8), "full": (1, 8)},
        "each token given the state shift positions before",
    ),
    Family(
        "cross_mix",
        "cross_mix",
        "weight",
        {"quick": (0.05, 0.2, 0.5, 1.0), "full": (0.2, 1.0)},
        "weight of another sequence blended in",
    ),
    Family(
        "ternary_quantize",
        "ternary_quantize",
        "threshold",
        {"quick": (0.0, 0.7, 1.5), "full": (0.0, 1.5)},
        "-1/0/+1 times a scale, 0 under threshold x mean",
    ),
    Family(
        "adaptive",
        "adaptive",
        "margin",
        {"quick": (0.25, 0.5, 0.9), "full": (0.5, 0.9)},
        "noise kept under margin x its thresholds",
        watch=25,
    ),
)


@dataclass(frozen=True)
class Point:
    family: Family
    strength: float
    target: str

    def params(self) -> dict:
        values = dict(self.family.fixed)
        if self.family.parameter is not None:
            value = self.strength
            values[self.family.parameter] = int(value) if float(value).is_integer() and value != 0 else value
        return values

    def start(self, config: Config) -> int:
        return int(self.strength) if self.family.parameter is None else config.sim.attack_start

    def label(self) -> str:
        return f"{self.family.name} {self.family.parameter or 'start'}={self.strength:g} on {self.target}s"


def families(names: list[str] | None) -> list[Family]:
    if not names:
        return list(FAMILIES)
    known = {f.name: f for f in FAMILIES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown family {', '.join(unknown)}; choose from {', '.join(known)}")
    return [known[n] for n in names]


def points(profile: str, selected: list[Family]) -> list[Point]:
    return [Point(f, s, t) for f in selected for s in f.strengths[profile] for t in TARGETS]


def _plan(point: Point, config: Config) -> Callable[[], AttackPlan]:
    def make(direction: str):
        params = point.params()
        if point.family.attack == "adaptive":
            params["settings"] = config.verification.monitor_settings(direction, config.swarm.seed)
        return make_attack(point.family.attack, **params)

    make("activation")  # a bad parameter fails here, not in a worker
    return lambda: AttackPlan(point.label(), point.target, make)


def summarize_point(point: Point, defended: SimResult, undefended: SimResult, clean: SimResult) -> dict:
    base = clean.final_val_loss
    scores = worker_scores(defended)
    return {
        "family": point.family.name,
        "strength": point.strength,
        "target": point.target,
        **scores,
        "val_loss": {
            "clean": round(base, 4),
            "undefended": round(undefended.final_val_loss, 4),
            "defended": round(defended.final_val_loss, 4),
        },
        "damage": {
            "undefended": round(100 * (undefended.final_val_loss / base - 1), 3),
            "defended": round(100 * (defended.final_val_loss / base - 1), 3),
        },
        "flags": {
            "honest": sum(c.flags_honest for c in defended.timeline),
            "attacker": sum(c.flags_attacker for c in defended.timeline),
        },
        "detected": scores["f1"] >= F1_REQUIRED,
    }


def judge(rows: list[dict]) -> dict:
    """Per family the largest undetected strength (and its damage), and which points break the criterion."""
    per_family = {}
    for name in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == name]
        undetected = [r for r in mine if not r["detected"]]
        worst = max(undetected, key=lambda r: abs(r["strength"]), default=None)
        per_family[name] = {
            "largest_undetected": None
            if worst is None
            else {"strength": worst["strength"], "target": worst["target"], "damage": worst["damage"]},
            "undetected_damage_max": max((r["damage"]["undefended"] for r in undetected), default=None),
        }
    failures = [
        {k: r[k] for k in ("family", "strength", "target", "f1", "damage")}
        for r in rows
        if r["damage"]["undefended"] >= DAMAGE_THRESHOLD
        and (r["f1"] < F1_REQUIRED or r["damage"]["defended"] > DAMAGE_THRESHOLD)
    ]
    honest_banned = sum(r["honest_banned"] for r in rows)
    return {
        "families": per_family,
        "failures": failures,
        "honest_banned": honest_banned,
        "honest_max_strikes": max((r["honest_max_strikes"] for r in rows), default=0),
    }


def run_sweep(
    config: Config,
    profile: str = "quick",
    family_names: list[str] | None = None,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    bar: bool = False,
    steps: int | None = None,
) -> dict:
    """Runs every point of the chosen families (all by default) on the profile, undefended and defended, and one
    clean run; ``steps`` replaces the profile's run length, the attacks starting halfway (a short look, not the
    profile's figures). A family that would start at or after the last step is refused with a ValueError."""
    config = config.with_overrides(**PROFILES[profile])
    if steps is not None:
        config = config.with_overrides(sim={"steps": steps, "attack_start": steps // 2})
    selected = points(profile, families(family_names))
    late = sorted({p.family.name for p in selected if p.start(config) >= config.sim.steps})
    if late:
        raise ValueError(
            f"{', '.join(late)} would start at or after the last of {config.sim.steps} steps; raise --steps or "
            "leave out those families"
        )
    corpus = load_corpus(config.data.path, config.data.val_fraction, config.data.max_bytes)
    specs = []
    for point in selected:
        start = point.start(config)
        plan = _plan(point, config)
        branch = max(0, start - point.family.watch)
        for verify in (False, True):
            label = f"{point.label()}, {'defended' if verify else 'undefended'}"
            specs.append(RunSpec(label, plan, verify, start, branch))
    if progress is not None:
        minutes = estimate_minutes(profile, config.sim.steps, specs, workers)
        progress(
            f"bench detection --suite sweep, {profile} profile: {len(selected)} points "
            f"({len({p.family.name for p in selected})} families x strengths x activations/gradients), "
            f"{len(specs) + 1} runs of {config.sim.steps} steps; about {minutes:.0f} min on 2 otherwise idle cores "
            "here"
        )
    clean, results, step_cpu = run_all(config, corpus, specs, workers, progress=None if bar else progress, bar=bar)
    rows = [summarize_point(p, results[2 * i + 1], results[2 * i], clean) for i, p in enumerate(selected)]
    return {
        "suite": "sweep",
        "profile": profile,
        "config_hash": config.swarm_hash(),
        "mesh": mesh_summary(config),
        "cpu_s_per_step": None if step_cpu is None else round(step_cpu, 3),
        "clean": clean_summary(clean),
        "points": rows,
        "verdict": judge(rows),
        "criterion": {"damage_percent": DAMAGE_THRESHOLD, "f1": F1_REQUIRED},
    }


def table(report: dict) -> str:
    header = (
        f"{'family':<20} {'strength':>8} {'target':<10} {'F1':>5} {'honest':>6} {'mb→ban':>7} {'st→ban':>6} "
        f"{'h.strk':>6} {'undef%':>7} {'def%':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in report["points"]:
        failing = r["damage"]["undefended"] >= DAMAGE_THRESHOLD and (
            r["f1"] < F1_REQUIRED or r["damage"]["defended"] > DAMAGE_THRESHOLD
        )
        lines.append(
            f"{r['family']:<20} {r['strength']:>8g} {r['target']:<10} {r['f1']:>5.2f} {r['honest_banned']:>6d} "
            f"{_fmt(r['microbatches_to_ban']):>7} {_fmt(r['steps_to_ban']):>6} {r['honest_max_strikes']:>6d} "
            f"{r['damage']['undefended']:>+7.2f} {r['damage']['defended']:>+6.2f}{'  <- criterion' if failing else ''}"
        )
    verdict = report["verdict"]
    lines.append("")
    lines.append("largest strength not detected (F1 < 0.95), and its undefended damage:")
    for name, fam in verdict["families"].items():
        worst = fam["largest_undetected"]
        lines.append(
            f"  {name:<20} "
            + (
                "every point detected"
                if worst is None
                else f"{worst['strength']:g} on {worst['target']}s: {worst['damage']['undefended']:+.2f}% undefended, "
                f"{worst['damage']['defended']:+.2f}% defended"
            )
        )
    c = report["clean"]
    lines.append(
        f"clean run: val loss {c['val_loss']:.3f}, {c['flags']} flags in {c['checks']} checks, "
        f"{c['honest_banned']} honest banned, max honest strikes {c['honest_max_strikes']}"
    )
    lines.append(
        f"honest workers banned over the sweep: {verdict['honest_banned']}; most strikes an honest worker held: "
        f"{verdict['honest_max_strikes']}; points breaking the criterion (undefended damage >= "
        f"{DAMAGE_THRESHOLD}% but F1 < {F1_REQUIRED} or defended damage > {DAMAGE_THRESHOLD}%): "
        f"{len(verdict['failures'])}"
    )
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def plot(report: dict, out: Path) -> list[Path]:
    """One PNG per family: F1 and damage against strength."""
    from sentinel_node.bench.plots import plot_family

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    known = {f.name: f for f in FAMILIES}
    for name in dict.fromkeys(r["family"] for r in report["points"]):
        family = known[name]
        path = out / f"sweep_{name}.png"
        plot_family(
            name, family.about, family.strength_name(), [r for r in report["points"] if r["family"] == name], path
        )
        paths.append(path)
    return paths
