"""`sentinel-node bench detection --suite honest`: a long run without an attacker, to measure the false alarms.

Every flag of this run is a false one. The report counts them by kind (a fence, the peer test, a replay), gives the
peer test's false-alarm rate per 1,000 checks of a sender, the most strikes any worker held, and who was banned
(nobody, or the verification is wrong).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sentinel_node.bench.detection import PROFILES, STEP_SECONDS, mesh_summary
from sentinel_node.config import Config
from sentinel_node.model import load_corpus
from sentinel_node.sim import Mesh


def run_honest(
    config: Config, profile: str = "full", steps: int = 1000, progress: Callable[[str], None] | None = None
) -> dict:
    config = config.with_overrides(**PROFILES[profile]).with_overrides(sim={"steps": steps})
    if progress is not None:
        progress(
            f"bench detection --suite honest, {profile} profile: one clean run of {steps} steps; about "
            f"{STEP_SECONDS[profile] * steps / 60:.0f} min on an otherwise idle core here"
        )
    corpus = load_corpus(config.data.path, config.data.val_fraction, config.data.max_bytes)
    torch.set_num_threads(1)
    started = time.monotonic()
    mesh = Mesh(config, corpus, None, verify=True)
    every = max(1, steps // 20)

    def on_step(log) -> None:
        if progress is not None and (log.step + 1) % every == 0:
            elapsed = time.monotonic() - started
            left = elapsed / (log.step + 1) * (steps - log.step - 1)
            progress(f"step {log.step + 1}/{steps}: {log.flags} flags so far ({left / 60:.0f} min left)")

    result = mesh.run(on_step=on_step)
    stats = result.stats
    checks = stats.checked()
    by_kind = {}
    for (_, _, name), n in stats.metric_hits.items():
        by_kind[name] = by_kind.get(name, 0) + n
    peer = by_kind.get("peer", 0)
    return {
        "suite": "honest",
        "profile": profile,
        "config_hash": config.swarm_hash(),
        "mesh": mesh_summary(config),
        "steps": steps,
        "checks": checks,
        "flags": stats.flags,
        "flags_by_metric_or_kind": dict(sorted(by_kind.items())),
        "peer_alarms": peer,
        "peer_alarms_per_1000_checks": round(1000 * peer / checks, 3) if checks else None,
        "coherence_alarms": by_kind.get("coherence", 0),
        "drift_alarms": by_kind.get("drift", 0),
        "flags_per_1000_checks": round(1000 * stats.flags / checks, 3) if checks else None,
        "honest_max_strikes": result.honest_max_strikes,
        "banned": sorted(result.banned_at),
        "val_curve": result.val_curve,
        "wall_s": round(time.monotonic() - started, 1),
    }


def table(report: dict) -> str:
    return "\n".join(
        [
            f"clean run of {report['steps']} steps ({report['profile']} profile, {report['mesh']['stages']} stages x "
            f"{report['mesh']['replicas']} replicas): {report['flags']} flags in {report['checks']} checks "
            f"({report['flags_per_1000_checks']} per 1,000)",
            f"  by metric or kind: {report['flags_by_metric_or_kind'] or 'none'}",
            f"  peer test: {report['peer_alarms']} false alarms ({report['peer_alarms_per_1000_checks']} per 1,000 "
            "checks)",
            f"  coherence test: {report.get('coherence_alarms', 0)} false alarms; drift test: "
            f"{report.get('drift_alarms', 0)}",
            f"  most strikes an honest worker held: {report['honest_max_strikes']}; banned: "
            f"{', '.join(report['banned']) or 'nobody'}",
            f"  validation loss {report['val_curve'][0][1]:.3f} -> {report['val_curve'][-1][1]:.3f}; "
            f"{report['wall_s']:.0f} s",
        ]
    )


def plot(report: dict, out) -> list:
    """No figure: the report is a handful of counts."""
    return []
