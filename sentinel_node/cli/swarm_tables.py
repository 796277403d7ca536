"""What ``sentinel-node swarm ...`` and ``swarm serve`` show of a swarm read from the DHT: JSON, or tables.

Tables fit a terminal: peers are named by a short id (``QmeA15..X9rN``; ``--wide`` for whole ones) and by the
name a node announces, every figure carries its unit, and each stage and boundary has a health verdict
(:mod:`peers.health`).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone

from dht import Announcement, StageAnnouncement, StrikeRecord
from peers import Exclusion, ExclusionPolicy, SwarmView, Verdict
from sentinel_node.config import Config

SECTIONS = ("status", "peers", "strikes", "bans")


# --- units and names ---


def short_id(peer: str, wide: bool = False) -> str:
    """``QmeA15..X9rN``: enough of a peer id to tell peers apart in one swarm (``wide``: all of it)."""
    return peer if wide or len(peer) <= 14 else f"{peer[:6]}..{peer[-4:]}"


def _si(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}" if abs(value) >= 10 or value == 0 else f"{value:.1f}"


def tokens_per_s(value: float) -> str:
    return f"{_si(value)} tok/s"


def checks_per_s(value: float) -> str:
    return f"{_si(value)} checks/s"


def throughput(a: Announcement) -> str:
    """An announcement's throughput in its role's unit."""
    if a.kind == "verifier":
        return checks_per_s(a.throughput)
    if a.kind == "bootstrap":
        return "-"
    return tokens_per_s(a.throughput)


def _when(then: float) -> str:
    return datetime.fromtimestamp(then, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(view: SwarmView, then: float) -> str:
    seconds = max(0.0, view.time - then)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _in(view: SwarmView, then: float) -> str:
    seconds = then - view.time
    if seconds <= 0:
        return "expired"
    if seconds < 7200:
        return f"in {seconds / 60:.0f}m"
    return f"in {seconds / 3600:.1f}h"


class Names:
    """How a peer is shown: its announced name and short id, or its whole id with ``wide``."""

    def __init__(self, view: SwarmView, wide: bool = False) -> None:
        self.wide = wide
        self.names = {a.peer_id: a.name for a in view.announcements() if a.name}

    def __call__(self, peer: str) -> str:
        name = self.names.get(peer)
        return f"{name} ({short_id(peer, self.wide)})" if name else short_id(peer, self.wide)


def stage_of(view: SwarmView, peer: str) -> int | None:
    """The stage ``peer`` announced itself on (live or not), or None."""
    for k in range(view.n_stages):
        if peer in view.stages.get(k, {}):
            return k
    return None


# --- the verdicts ---


def ban_reason(record: StrikeRecord) -> str:
    """Why a verifier banned a peer, from its last strike record: the metrics over their thresholds."""
    over = [
        f"{name} {score:.3g} > {record.thresholds[name]:.3g}"
        for name, score in sorted(record.metrics.items())
        if name in record.thresholds and score > record.thresholds[name]
    ]
    what = ", ".join(over) if over else "malformed or drifting tensors" if record.strikes else "no strike"
    return f"{record.strikes} strikes on {record.direction}s: {what}"


def _state(view: SwarmView, a: Announcement) -> str:
    return "EXCLUDED" if view.is_excluded(a.peer_id) else a.state


def _stage_total(replicas: Sequence[StageAnnouncement], field: str) -> float:
    return sum(getattr(a, field) for a in replicas)


# --- JSON ---


def plain(value: object) -> object:
    """``value`` as strict JSON can hold it: bytes (a certificate's signature) in base64, a number that is not finite
    as None (strict parsers refuse NaN and Infinity, which Python's json writes by default)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _announcement(view: SwarmView, a: Announcement) -> dict:
    found = {**a.dict(), "live": view.is_live(a), "excluded": view.is_excluded(a.peer_id)}
    found["short_id"] = short_id(a.peer_id)
    return found


def _strike(policy: ExclusionPolicy, view: SwarmView, record: StrikeRecord) -> dict:
    return {**record.dict(), "vote": policy.counts(record, view.open_voters)}


def _ban(view: SwarmView, config: Config, exclusion: Exclusion) -> dict:
    latest = max(exclusion.votes, key=lambda r: r.time)
    return {
        "peer": exclusion.peer,
        "short_id": short_id(exclusion.peer),
        "name": Names(view).names.get(exclusion.peer),
        "stage": stage_of(view, exclusion.peer),
        "reason": ban_reason(latest),
        "boundary": latest.boundary,
        "direction": latest.direction,
        "since": min(r.time for r in exclusion.votes),
        "expires": max(r.time for r in exclusion.votes) + config.swarm.strike_ttl,
        "votes": len(exclusion.votes),
        "quorum": config.swarm.ban_quorum,
        "voters": list(exclusion.voters),
        "records": [r.dict() for r in exclusion.votes],
    }


def health_json(view: SwarmView) -> dict:
    health = view.health()
    return {
        "verdict": health.verdict.value,
        "ok": health.ok,
        "summary": health.summary(),
        "stages": [
            {"stage": k, "verdict": health.stage(k).value, "live_replicas": n} for k, n in enumerate(health.replicas)
        ],
        "boundaries": [
            {"boundary": b, "verdict": health.boundary(b).value, "live_verifiers": n}
            for b, n in enumerate(health.verifiers)
        ],
        "stages_without_replica": list(health.stages_without_replica),
        "boundaries_without_verifier": list(health.boundaries_without_verifier),
    }


def to_json(view: SwarmView, config: Config, section: str = "status") -> dict:
    """The ``section`` of ``view`` as plain JSON-ready data; ``status`` holds everything."""
    policy = config.swarm.exclusion_policy()
    parts = {
        "peers": [{**_announcement(view, a), "stage": stage_of(view, a.peer_id)} for a in view.announcements()],
        "strikes": {
            peer: [_strike(policy, view, r) for r in view.ledger.about(peer)] for peer in view.ledger.accused()
        },
        "bans": {peer: _ban(view, config, exclusion) for peer, exclusion in sorted(view.excluded.items())},
    }
    if section != "status":
        return plain({section: parts[section]})
    stages = []
    for k in range(view.n_stages):
        live = view.live_replicas(k)
        stages.append(
            {
                "stage": k,
                "replicas": [_announcement(view, a) for _, a in sorted(view.stages.get(k, {}).items())],
                "live_replicas": len(live),
                "throughput": _stage_total(live, "throughput"),
                "network": _stage_total(live, "network"),
                "step": max((a.last_step for a in live), default=-1),
            }
        )
    boundaries = [
        {
            "boundary": b,
            "verifiers": [a.peer_id for a in view.live_verifiers(b)],
            "throughput": sum(a.throughput for a in view.live_verifiers(b)),
        }
        for b in range(view.n_stages - 1)
    ]
    return plain(
        {
            "swarm": config.swarm.prefix,
            "config_hash": config.swarm_hash(),
            "time": view.time,
            "n_stages": view.n_stages,
            "units": {"stage": "tokens/s", "verifier": "checks/s", "trainer": "tokens/s"},
            "bootstraps": [_announcement(view, a) for _, a in sorted(view.bootstraps.items())],
            "stages": {str(s["stage"]): s["replicas"] for s in stages},
            "stage_totals": stages,
            "boundaries": boundaries,
            "verifiers": [_announcement(view, a) for _, a in sorted(view.verifiers.items())],
            "trainers": [_announcement(view, a) for _, a in sorted(view.trainers.items())],
            "strikes": parts["strikes"],
            "bans": parts["bans"],
            "health": health_json(view),
            "checkpoint_problems": {
                a.peer_id: a.checkpoint_problem for a in view.announcements() if getattr(a, "checkpoint_problem", None)
            },
        }
    )


# --- tables ---


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], empty: str = "(none)") -> str:
    rows = [[str(cell) for cell in row] for row in rows]
    if not rows:
        return empty
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _verdict(verdict: Verdict) -> str:
    return verdict.value if verdict is Verdict.HEALTHY else verdict.value.upper()


def render_status(view: SwarmView, config: Config, wide: bool = False) -> str:
    name = Names(view, wide)
    health = view.health()
    stage_rows, replica_rows = [], []
    for k in range(view.n_stages):
        live = view.live_replicas(k)
        step = max((a.last_step for a in live), default=-1)
        stage_rows.append(
            [
                k,
                _verdict(health.stage(k)),
                f"{len(live)} live",
                tokens_per_s(_stage_total(live, "throughput")),
                tokens_per_s(_stage_total(live, "network")),
                "-" if step < 0 else step,
            ]
        )
        for _, a in sorted(view.stages.get(k, {}).items()):
            replica_rows.append(
                [
                    k,
                    name(a.peer_id),
                    _state(view, a),
                    tokens_per_s(a.throughput),
                    tokens_per_s(a.network),
                    "-" if a.last_step < 0 else a.last_step,
                    "yes" if a.relayed else "no",
                    "FAILING" if a.checkpoint_problem else "ok",
                ]
            )
    problems = [
        f"  {name(a.peer_id)}: {a.checkpoint_problem}"
        for a in view.announcements()
        if getattr(a, "checkpoint_problem", None)
    ]
    boundary_rows = []
    for b in range(view.n_stages - 1):
        live = view.live_verifiers(b)
        boundary_rows.append(
            [
                f"{b}|{b + 1}",
                _verdict(health.boundary(b)),
                ", ".join(name(v.peer_id) for v in live) or "(none)",
                checks_per_s(sum(v.throughput for v in live)),
            ]
        )
    trainer_rows = [
        [
            name(a.peer_id),
            _state(view, a),
            a.global_step,
            "-" if a.loss is None else f"{a.loss:.4f}",
            "-" if a.val_loss is None else f"{a.val_loss:.4f}",
            tokens_per_s(a.throughput),
        ]
        for _, a in sorted(view.trainers.items())
    ]
    bootstrap_rows = [[name(a.peer_id), a.state, " ".join(a.maddrs)] for _, a in sorted(view.bootstraps.items())]
    return "\n\n".join(
        [
            f"swarm {config.swarm.prefix}  config {config.swarm_hash()}  read {_when(view.time)}",
            f"health: {health.summary()}",
            "STAGES\n"
            + table(["STAGE", "HEALTH", "REPLICAS", "COMPUTE", "SERVED", "STEP"], stage_rows)
            + "\n\n"
            + table(
                ["STAGE", "REPLICA", "STATE", "COMPUTE", "SERVED", "STEP", "RELAYED", "CHECKPOINTS"], replica_rows
            ),
            "BOUNDARIES\n" + table(["BOUNDARY", "HEALTH", "VERIFIERS", "CHECKING"], boundary_rows),
            "TRAINERS\n" + table(["TRAINER", "STATE", "STEP", "LOSS", "VAL LOSS", "TRAINED"], trainer_rows),
            "BOOTSTRAPS\n" + table(["BOOTSTRAP", "STATE", "MULTIADDRS"], bootstrap_rows),
            f"excluded peers: {len(view.excluded)}   strike records: {len(view.ledger)}"
            + ("   (swarm bans, swarm strikes for details)" if view.excluded or len(view.ledger) else ""),
            *(["checkpoints that cannot be written:\n" + "\n".join(problems)] if problems else []),
        ]
    )


def render_peers(view: SwarmView, config: Config, wide: bool = False) -> str:
    rows = []
    for a in view.announcements():
        stage = stage_of(view, a.peer_id)
        addresses = list(a.maddrs[:1])
        if wide or len(a.maddrs) == 1:
            addresses = list(a.maddrs)
        elif len(a.maddrs) > 1:
            addresses.append(f"(+{len(a.maddrs) - 1})")
        rows.append(
            [
                a.kind,
                "-" if stage is None else stage,
                a.name or "-",
                short_id(a.peer_id, wide),
                _state(view, a),
                throughput(a),
                "yes" if a.relayed else "no",
                _ago(view, a.time),
                a.version,
                " ".join(addresses),
            ]
        )
    headers = ["ROLE", "STAGE", "NAME", "PEER", "STATE", "THROUGHPUT", "RELAYED", "SEEN", "VERSION", "ADDRESS"]
    return table(headers, rows, empty="no peer has announced itself")


def _scores(record: StrikeRecord) -> str:
    return " ".join(
        f"{metric}={score:.3g}" + (f"/{record.thresholds[metric]:.3g}" if metric in record.thresholds else "")
        for metric, score in sorted(record.metrics.items())
    )


def render_strikes(view: SwarmView, config: Config, wide: bool = False) -> str:
    policy, name = config.swarm.exclusion_policy(), Names(view, wide)
    rows = [
        [
            name(r.accused),
            name(r.verifier),
            f"{r.boundary}|{r.boundary + 1}",
            r.direction,
            r.strikes,
            f"{r.flags}/{r.checks}",
            "yes" if r.banned else "no",
            "yes" if policy.counts(r, view.open_voters) else "no",
            f"{r.audits_passed}/{r.audits_failed}",
            _ago(view, r.time),
            _scores(r),
        ]
        for r in view.ledger
    ]
    headers = ["ACCUSED", "VERIFIER", "BOUNDARY", "DIRECTION", "STRIKES", "FLAGS", "BANNED", "VOTE"]
    headers += ["AUDITS OK/FAILED", "AGE", "LAST METRICS (score/threshold)"]
    text = table(headers, rows, empty="no strike records about announced peers")
    if rows:
        v = config.verification
        quiet = f" or {v.forgive_steps} steps without a flag" if v.forgive_steps else ""
        text += f"\nstrike limit {v.strike_limit}; one strike forgiven per {v.forgive_after} clean checks{quiet}"
    evidence = [audit_evidence(r) for r in view.ledger if r.audit is not None]
    if evidence:
        text += "\n\nFAILED AUDITS (signed by the verifier that ran them)\n" + "\n".join(evidence)
    return text


def audit_evidence(record: StrikeRecord) -> str:
    """One failed recomputation audit, as the accused peer's strike record carries it."""
    a = record.audit
    confirmed = "" if a.confirmed_error is None else f", confirmed {a.confirmed_error:.3g}"
    digests = " ".join(f"{name}={value[:12]}" for name, value in sorted(a.digests.items()))
    return (
        f"{record.accused} stage {a.stage} microbatch {a.microbatch} (step {a.step}): {a.finding} {a.direction}, "
        f"error {a.error:.3g}{confirmed}; auditors {', '.join(a.auditors)}; verifier {record.verifier}; "
        f"parameters {a.parameters}; {digests}"
    )


def render_bans(view: SwarmView, config: Config, wide: bool = False) -> str:
    quorum, name = config.swarm.ban_quorum, Names(view, wide)
    rows = []
    for _, exclusion in sorted(view.excluded.items()):
        ban = _ban(view, config, exclusion)
        rows.append(
            [
                name(exclusion.peer),
                "-" if ban["stage"] is None else ban["stage"],
                ban["reason"],
                f"{ban['boundary']}|{ban['boundary'] + 1}",
                ban["direction"],
                _ago(view, ban["since"]),
                _in(view, ban["expires"]),
                f"{ban['votes']}/{quorum}",
                ", ".join(name(v) for v in exclusion.voters),
            ]
        )
    swarm = config.swarm
    admitted = []
    if swarm.trusted_verifiers:
        admitted.append(f"the {len(swarm.trusted_verifiers)} trusted verifiers")
    if swarm.organiser:
        admitted.append("verifiers the organiser certified")
    if swarm.open_verifiers:
        admitted.append(
            f"(open set) any verifier this reader has seen announced for {swarm.min_voter_age:.0f}s and not "
            "excluded, which a one-shot read never has"
        )
    voters = f"{quorum} of: " + "; ".join(admitted)
    header = f"a peer is excluded while {voters} hold a live ban on it"
    headers = ["PEER", "STAGE", "REASON", "BOUNDARY", "DIRECTION", "BANNED", "EXPIRES", "VOTES", "VOTERS"]
    return header + "\n" + table(headers, rows, empty="no peer is excluded")


RENDERERS = {"status": render_status, "peers": render_peers, "strikes": render_strikes, "bans": render_bans}
