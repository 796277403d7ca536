"""What ``sentinel-node swarm ...`` shows: the swarm read from the DHT as a client-only peer, as JSON or tables.

Reading never hangs: starting the DHT and every read share one deadline, and an unreachable swarm is reported as
a :class:`~sentinel_node.roles.common.NodeStartError` naming the addresses tried.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone

from dht import Announcement, DHTUnavailable, StrikeRecord, ephemeral_identity
from peers import ExclusionPolicy, SwarmView, SwarmWatcher
from sentinel_node.config import Config
from sentinel_node.roles.common import NodeStartError, record_store, start_dht, stop_dht

SECTIONS = ("status", "peers", "strikes", "bans")


def read_swarm(config: Config, initial_peers: Sequence[str], timeout: float) -> SwarmView:
    """One snapshot of the swarm, read through a client-only DHT peer that is gone when this returns."""
    if not initial_peers:
        raise NodeStartError("no --initial-peers given: pass the multiaddrs a bootstrap node printed")
    deadline = time.monotonic() + timeout
    identity = ephemeral_identity()  # a reader signs nothing; hivemind's signature validator still needs a key
    dht = start_dht(config, identity, initial_peers=initial_peers, client_mode=True, timeout=timeout)
    try:
        store = record_store(dht, config, identity=None, timeout=max(0.5, deadline - time.monotonic()))
        watcher = SwarmWatcher(store, config.pipeline.n_stages, config.swarm.exclusion_policy())
        try:
            return watcher.refresh()
        except DHTUnavailable as e:
            raise NodeStartError(f"joined the swarm but it did not answer in time: {e}") from None
    finally:
        stop_dht(dht)


# --- JSON ---


def _announcement(view: SwarmView, a: Announcement) -> dict:
    return {**a.dict(), "live": view.is_live(a), "excluded": view.is_excluded(a.peer_id)}


def _strike(policy: ExclusionPolicy, record: StrikeRecord) -> dict:
    return {**record.dict(), "vote": policy.counts(record)}


def to_json(view: SwarmView, config: Config, section: str = "status") -> dict:
    """The ``section`` of ``view`` as plain JSON-ready data; ``status`` holds everything."""
    policy = config.swarm.exclusion_policy()
    health = view.health()
    parts = {
        "peers": [_announcement(view, a) for a in view.announcements()],
        "strikes": {peer: [_strike(policy, r) for r in view.ledger.about(peer)] for peer in view.ledger.accused()},
        "bans": {
            peer: {"voters": list(exclusion.voters), "votes": [r.dict() for r in exclusion.votes]}
            for peer, exclusion in sorted(view.excluded.items())
        },
    }
    if section != "status":
        return {section: parts[section]}
    return {
        "swarm": config.swarm.prefix,
        "config_hash": config.swarm_hash(),
        "time": view.time,
        "n_stages": view.n_stages,
        "bootstraps": [_announcement(view, a) for _, a in sorted(view.bootstraps.items())],
        "stages": {
            str(k): [_announcement(view, a) for _, a in sorted(view.stages.get(k, {}).items())]
            for k in range(view.n_stages)
        },
        "verifiers": [_announcement(view, a) for _, a in sorted(view.verifiers.items())],
        "trainers": [_announcement(view, a) for _, a in sorted(view.trainers.items())],
        "strikes": parts["strikes"],
        "bans": parts["bans"],
        "health": {
            "ok": health.ok,
            "stages_without_replica": list(health.stages_without_replica),
            "boundaries_without_verifier": list(health.boundaries_without_verifier),
            "summary": health.summary(),
        },
    }


# --- tables ---


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], empty: str = "(none)") -> str:
    rows = [[str(cell) for cell in row] for row in rows]
    if not rows:
        return empty
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _age(view: SwarmView, then: float) -> str:
    return f"{max(0.0, view.time - then):.0f}s"


def _state(view: SwarmView, a: Announcement) -> str:
    return "EXCLUDED" if view.is_excluded(a.peer_id) else a.state


def render_status(view: SwarmView, config: Config) -> str:
    stamp = datetime.fromtimestamp(view.time, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    stage_rows = []
    for k in range(view.n_stages):
        replicas = [a for _, a in sorted(view.stages.get(k, {}).items())]
        if not replicas:
            stage_rows.append([k, "-", "(no replica)", "", "", "", ""])
        for a in replicas:
            stage_rows.append(
                [
                    k,
                    a.peer_id,
                    _state(view, a),
                    "-" if a.last_step < 0 else a.last_step,
                    f"{a.throughput:.1f}",
                    "yes" if a.relayed else "no",
                    a.version,
                ]
            )
    verifier_rows = [
        [
            " ".join(f"{b}|{b + 1}" for b in a.boundaries),
            a.peer_id,
            _state(view, a),
            f"{a.throughput:.1f}",
            "yes" if a.relayed else "no",
        ]
        for _, a in sorted(view.verifiers.items())
    ]
    trainer_rows = [
        [a.peer_id, _state(view, a), a.global_step, "-" if a.loss is None else f"{a.loss:.4f}"]
        for _, a in sorted(view.trainers.items())
    ]
    bootstrap_rows = [[a.peer_id, a.state, " ".join(a.maddrs)] for _, a in sorted(view.bootstraps.items())]
    return "\n\n".join(
        [
            f"swarm {config.swarm.prefix}  config {config.swarm_hash()}  read {stamp}",
            "BOOTSTRAPS\n" + table(["PEER", "STATE", "MULTIADDRS"], bootstrap_rows),
            "STAGES\n" + table(["STAGE", "PEER", "STATE", "STEP", "THROUGHPUT", "RELAYED", "VERSION"], stage_rows),
            "VERIFIERS\n" + table(["BOUNDARIES", "PEER", "STATE", "THROUGHPUT", "RELAYED"], verifier_rows),
            "TRAINERS\n" + table(["PEER", "STATE", "STEP", "LOSS"], trainer_rows),
            f"excluded peers: {len(view.excluded)}   strike records: {len(view.ledger)}",
            "health: " + view.health().summary(),
        ]
    )


def render_peers(view: SwarmView, config: Config) -> str:
    rows = [
        [
            a.kind,
            a.peer_id,
            _state(view, a),
            f"{a.throughput:.1f}",
            "yes" if a.relayed else "no",
            a.version,
            _age(view, a.time),
            " ".join(a.maddrs),
        ]
        for a in view.announcements()
    ]
    headers = ["ROLE", "PEER", "STATE", "THROUGHPUT", "RELAYED", "VERSION", "SEEN", "MULTIADDRS"]
    return table(headers, rows, empty="no peer has announced itself")


def render_strikes(view: SwarmView, config: Config) -> str:
    policy = config.swarm.exclusion_policy()
    rows = [
        [
            r.accused,
            r.verifier,
            f"{r.boundary}|{r.boundary + 1}",
            r.direction,
            r.strikes,
            f"{r.flags}/{r.checks}",
            "yes" if r.banned else "no",
            "yes" if policy.counts(r) else "no",
            f"{r.audits_passed}/{r.audits_failed}",
            _age(view, r.time),
            " ".join(f"{name}={value:.3g}" for name, value in sorted(r.metrics.items())),
        ]
        for r in view.ledger
    ]
    headers = [
        "ACCUSED",
        "VERIFIER",
        "BOUNDARY",
        "DIRECTION",
        "STRIKES",
        "FLAGS",
        "BANNED",
        "VOTE",
        "AUDITS OK/FAILED",
        "AGE",
        "METRICS",
    ]
    text = table(headers, rows, empty="no strike records about announced peers")
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


def render_bans(view: SwarmView, config: Config) -> str:
    quorum = config.swarm.ban_quorum
    rows = [
        [peer, f"{len(exclusion.votes)}/{quorum}", ", ".join(exclusion.voters)]
        for peer, exclusion in sorted(view.excluded.items())
    ]
    trusted = len(config.swarm.trusted_verifiers)
    voters = (
        f"{quorum} of the {trusted} trusted verifiers" if trusted else f"{quorum} verifiers (open set: any verifier)"
    )
    header = f"a peer is excluded while {voters} hold a live ban on it"
    return header + "\n" + table(["PEER", "VOTES", "VOTERS"], rows, empty="no peer is excluded")


RENDERERS = {"status": render_status, "peers": render_peers, "strikes": render_strikes, "bans": render_bans}
