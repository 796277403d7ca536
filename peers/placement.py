"""Which stage a replica serves: the choice of a node that joins without ``--stage``, and whether a serving replica
should move to another stage (docs/architecture.md section 7; after Petals' block selection).

A pipeline goes as fast as its slowest stage, and a stage as fast as the compute of its replicas together. So a
joining replica takes the stage with the least total throughput (then the fewest replicas), and a replica moves
when taking its throughput to another stage would raise the slowest stage's total by enough (``balance_quality``:
it moves when today's slowest total is below that share of the slowest total after the move; Petals' default is
0.75, i.e. a gain of more than a third), and only if its own stage keeps another live replica.

Totals count the online and joining replicas that are not excluded (a replica that is syncing will serve soon).
A replica's tokens/s on another stage is estimated from its own by the stages' relative cost (their layer
counts), since it can only measure the stage it holds.

Everything here is a pure function of a :class:`~peers.SwarmView` (or of the loads read from one) and a random
generator, so it is tested without a network.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from peers.view import SwarmView

# Stages whose total is within this share of the least are as weak as it: one of them is picked at random, so
# volunteers who join at the same moment, reading the same view, spread instead of piling onto one stage.
JOIN_JITTER = 0.1
BALANCE_QUALITY = 0.75


@dataclass(frozen=True)
class StageLoad:
    """What serves stage ``stage``: its replicas' summed compute throughput (tokens/s) and how many there are."""

    stage: int
    throughput: float
    replicas: int  # online and joining, not excluded
    online: int  # of which online


def stage_loads(view: SwarmView, leave_out: Collection[str] = ()) -> list[StageLoad]:
    """The load of every stage, from the non-excluded replicas that are online or joining, less ``leave_out``."""
    loads = []
    for k in range(view.n_stages):
        serving = [
            a
            for a in view.stages.get(k, {}).values()
            if a.state in ("online", "joining") and not view.is_excluded(a.peer_id) and a.peer_id not in leave_out
        ]
        loads.append(
            StageLoad(
                stage=k,
                throughput=sum(a.throughput for a in serving),
                replicas=len(serving),
                online=sum(a.state == "online" for a in serving),
            )
        )
    return loads


@dataclass(frozen=True)
class StageChoice:
    stage: int
    reason: str


def choose_stage(loads: Sequence[StageLoad], rng: random.Random, jitter: float = JOIN_JITTER) -> StageChoice:
    """The stage a joining replica should serve: the least total throughput, then the fewest replicas; among
    stages within ``jitter`` of the least, at random."""
    if not loads:
        raise ValueError("no stages to choose from")
    least = min(load.throughput for load in loads)
    weak = [load for load in loads if load.throughput <= least * (1 + jitter)]
    fewest = min(load.replicas for load in weak)
    tied = [load for load in weak if load.replicas == fewest]
    chosen = rng.choice(tied)
    if chosen.replicas == 0:
        why = "nobody serves it yet"
    else:
        why = f"the least compute of all stages ({_rate(chosen.throughput)} from {chosen.replicas} replicas)"
    others = ", ".join(
        f"{load.stage}: {_rate(load.throughput)} x{load.replicas}" for load in loads if load.stage != chosen.stage
    )
    return StageChoice(chosen.stage, f"{why}; the others: {others or 'none'}")


def should_yield(view: SwarmView, me: str, stage: int) -> bool:
    """Whether a replica that just chose ``stage`` should choose again: another replica (online or joining) took the
    same stage while some stage has nobody, and that replica's peer id is the smaller (nodes that joined at the same
    moment, from the same view, agree without talking on which of them stays)."""
    loads = stage_loads(view, leave_out={me})
    if not any(load.replicas == 0 for load in loads if load.stage != stage):
        return False
    rivals = [
        a.peer_id
        for a in view.stages.get(stage, {}).values()
        if a.state in ("online", "joining") and a.peer_id != me and not view.is_excluded(a.peer_id)
    ]
    return any(peer < me for peer in rivals)


@dataclass(frozen=True)
class Move:
    """Moving from ``source`` to ``target`` takes the slowest stage's total from ``before`` to ``after``."""

    source: int
    target: int
    before: float
    after: float

    @property
    def reason(self) -> str:
        gain = "covers a stage nobody serves" if self.before == 0 else f"x{self.after / self.before:.2f}"
        return (
            f"moving from stage {self.source} to stage {self.target} takes the slowest stage from "
            f"{_rate(self.before)} to {_rate(self.after)} ({gain})"
        )


def plan_move(
    loads: Sequence[StageLoad],
    source: int,
    own: float,
    balance_quality: float = BALANCE_QUALITY,
    costs: Sequence[float] | None = None,
) -> Move | None:
    """The move a replica of stage ``source`` with compute throughput ``own`` (tokens/s, counted in ``loads``)
    should make, or None: to the stage where the slowest total ends up highest, if today's slowest total is below
    ``balance_quality`` times that, and ``source`` keeps another online replica. ``costs`` are the stages'
    relative costs per token (default: all equal)."""
    if not 0 <= balance_quality <= 1:
        raise ValueError(f"balance_quality must lie in [0, 1], got {balance_quality}")
    here = loads[source]
    if here.online < 2 or own <= 0 or len(loads) < 2:
        return None
    costs = list(costs) if costs is not None else [1.0] * len(loads)
    totals = [load.throughput for load in loads]
    before = min(totals)
    best: Move | None = None
    for load in loads:
        if load.stage == source:
            continue
        after = list(totals)
        after[source] -= own
        after[load.stage] += own * costs[source] / costs[load.stage]
        move = Move(source, load.stage, before, min(after))
        if best is None or move.after > best.after:
            best = move
    if best is None or best.after <= 0 or before >= balance_quality * best.after:
        return None
    return best


def plan_rebalance(
    view: SwarmView,
    peer_id: str,
    balance_quality: float = BALANCE_QUALITY,
    costs: Sequence[float] | None = None,
) -> Move | None:
    """The move ``peer_id`` (an online replica in ``view``) should make now, or None.

    Replicas check at random moments but read much the same view, so two replicas of a doubled stage would both
    move to the stage that lost its last replica (and leave theirs empty). So among the online replicas that
    :func:`plan_move` would send to the same stage, only the one with the smallest peer id moves now; the others
    look again later, when its ``joining`` announcement shows the stage covered."""
    mine = next((a for replicas in view.stages.values() for a in replicas.values() if a.peer_id == peer_id), None)
    if mine is None or mine.state != "online" or view.is_excluded(peer_id):
        return None
    loads = stage_loads(view)
    move = plan_move(loads, mine.stage, mine.throughput, balance_quality, costs)
    if move is None:
        return None
    for k in range(view.n_stages):
        for other in view.live_replicas(k):
            if other.peer_id >= peer_id:
                continue
            theirs = plan_move(loads, k, other.throughput, balance_quality, costs)
            if theirs is not None and theirs.target == move.target:
                return None  # that replica makes this move
    return move


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1000:.1f}k tok/s" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f} tok/s"
