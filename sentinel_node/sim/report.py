"""What a simulator run shows a person: a line per step while it trains, and a summary at the end."""

from __future__ import annotations

from sentinel_node.sim.mesh import SimResult, StepLog


def step_line(log: StepLog) -> str:
    """One line per step, numbered from 0 like the demo's and the network's global steps."""
    val = f"  val {log.val_loss:.3f}" if log.val_loss is not None else ""
    banned = f"  banned {', '.join(log.banned)}" if log.banned else ""
    if log.loss is None:
        loss = f"dropped (verifiers dropped all {log.microbatches} microbatches)"
    else:
        loss = f"loss {log.loss:.3f}" + (f" ({log.dropped}/{log.microbatches} dropped)" if log.dropped else "")
    return f"step {log.step:4d}  {loss}{val}  flags {log.flags:3d}  strikes {log.strikes:2d}{banned}"


def summary(result: SimResult, wall_s: float) -> dict:
    banned = set(result.banned_at)
    return {
        "steps": len(result.train_losses),
        "microbatches": result.microbatches,
        "dropped_microbatches": result.dropped,
        "first_val_loss": round(result.val_curve[0][1], 4),
        "last_val_loss": round(result.final_val_loss, 4),
        "malicious": result.malicious,
        "banned": {
            worker: {"step": s, "microbatches_after_attack_start": m} for worker, (s, m) in result.banned_at.items()
        },
        "malicious_not_banned": sorted(set(result.malicious) - banned),
        "honest_banned": sorted(set(result.honest) & banned),
        "honest_max_strikes": result.honest_max_strikes,
        "flags": result.stats.flags,
        "checks": result.stats.checked(),
        "wall_s": round(wall_s, 1),
    }


def summary_text(s: dict) -> str:
    lines = [
        f"trained {s['steps']} steps ({s['microbatches']} microbatches, {s['dropped_microbatches']} dropped) "
        f"in {s['wall_s']} s",
        f"validation loss {s['first_val_loss']:.3f} -> {s['last_val_loss']:.3f}",
        f"{s['flags']} flags in {s['checks']} checks",
    ]
    for worker in s["malicious"]:
        ban = s["banned"].get(worker)
        lines.append(
            f"attacker {worker}: banned at step {ban['step']}, {ban['microbatches_after_attack_start']} "
            "microbatches after the attack started"
            if ban
            else f"attacker {worker}: NOT banned"
        )
    lines.append(
        f"honest workers banned: {', '.join(s['honest_banned']) or 'none'} "
        f"(highest strike count of an honest worker: {s['honest_max_strikes']})"
    )
    return "\n".join(lines)
