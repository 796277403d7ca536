"""The routing choice: for each stage a replica and for each boundary a verifier (docs/architecture.md section 5).

Candidates are live (online, not excluded), not suspended by the liveness blacklist and not in the caller's
``avoid`` set; direct peers are preferred over relayed ones, and among those the pick is weighted by announced
throughput, so faster peers get proportionally more microbatches. Weights are sanitized (a record read through
another path, or built in memory, may hold anything): a weight that is not a finite positive number counts as
zero. A caller may also keep pairs of peers apart (``apart``: a verifier that refused a stage replica is not put
next to it again for a while).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

from dht.records import Announcement, StageAnnouncement, VerifierAnnouncement
from peers.liveness import LivenessBlacklist
from peers.view import SwarmView

A = TypeVar("A", bound=Announcement)

# A peer announcing zero throughput (just joined, not measured yet) still gets this share of the fastest weight.
MIN_WEIGHT_SHARE = 0.01
# Each hop of a route names this many other candidates, for the peer calling it to retry on.
MAX_ALTERNATES = 2
# Routes drawn at random before giving up on keeping every ``apart`` pair apart.
APART_TRIES = 16

Apart = Callable[[str, str], bool]  # (peer, neighbour) -> True when the two must not be adjacent on a route


def never_apart(_a: str, _b: str) -> bool:
    return False


class NoRouteError(RuntimeError):
    """Some stage or boundary has no usable peer; the message names it and why."""


@dataclass(frozen=True)
class Route:
    """``stages[k]`` serves stage k; ``verifiers[b]`` checks boundary b (between stage b and b + 1)."""

    stages: tuple[StageAnnouncement, ...]
    verifiers: tuple[VerifierAnnouncement, ...]

    @property
    def peers(self) -> tuple[str, ...]:
        """Peer ids in call order: stage 0, verifier 0|1, stage 1, ..."""
        order = []
        for k, stage in enumerate(self.stages):
            order.append(stage.peer_id)
            if k < len(self.verifiers):
                order.append(self.verifiers[k].peer_id)
        return tuple(order)


def pick(
    candidates: Sequence[A],
    rng: random.Random,
    blacklist: LivenessBlacklist | None = None,
    avoid: Collection[str] = (),
) -> A | None:
    """One usable candidate (direct before relayed, weighted by throughput), or None if none is usable."""
    usable = [c for c in candidates if c.peer_id not in avoid and (blacklist is None or c.peer_id not in blacklist)]
    direct = [c for c in usable if not c.relayed]
    pool = direct or usable
    if not pool:
        return None
    rates = [_rate(c) for c in pool]
    fastest = max(rates)
    if fastest <= 0:
        return rng.choice(pool)
    weights = [max(rate, fastest * MIN_WEIGHT_SHARE) for rate in rates]
    return rng.choices(pool, weights=weights, k=1)[0]


def _rate(candidate: Announcement) -> float:
    rate = getattr(candidate, "throughput", 0.0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
        return 0.0
    return min(float(rate), 1e12)


def pick_replica(
    view: SwarmView,
    stage: int,
    rng: random.Random,
    blacklist: LivenessBlacklist | None = None,
    avoid: Collection[str] = (),
) -> StageAnnouncement:
    """A replica of ``stage`` (e.g. to retry a hop on another candidate); NoRouteError if none is usable."""
    chosen = pick(view.live_replicas(stage), rng, blacklist, avoid)
    if chosen is None:
        raise NoRouteError(f"no usable replica of stage {stage}: {_why(view.stages.get(stage, {}).values(), view)}")
    return chosen


def pick_verifier(
    view: SwarmView,
    boundary: int,
    rng: random.Random,
    blacklist: LivenessBlacklist | None = None,
    avoid: Collection[str] = (),
) -> VerifierAnnouncement:
    """A verifier of ``boundary``; NoRouteError if none is usable."""
    chosen = pick(view.live_verifiers(boundary), rng, blacklist, avoid)
    if chosen is None:
        serving = [v for v in view.verifiers.values() if boundary in v.boundaries]
        raise NoRouteError(f"no usable verifier on boundary {boundary}|{boundary + 1}: {_why(serving, view)}")
    return chosen


def choose_route(
    view: SwarmView,
    rng: random.Random | None = None,
    blacklist: LivenessBlacklist | None = None,
    avoid: Collection[str] = (),
    apart: Apart = never_apart,
) -> Route:
    """A full route through every stage and boundary of ``view``; NoRouteError naming the first gap. Adjacent
    peers of the route are kept ``apart`` when some route allows it (else the pairs are ignored: a route that may
    be refused again beats none)."""
    rng = rng or random.Random()
    stages = tuple(pick_replica(view, k, rng, blacklist, avoid) for k in range(view.n_stages))
    verifiers = tuple(pick_verifier(view, b, rng, blacklist, avoid) for b in range(view.n_stages - 1))
    if apart is never_apart:
        return Route(stages, verifiers)
    for _ in range(APART_TRIES):
        route = _route_apart(view, rng, blacklist, avoid, apart)
        if route is not None:
            return route
    return Route(stages, verifiers)


def _route_apart(
    view: SwarmView, rng: random.Random, blacklist: LivenessBlacklist | None, avoid: Collection[str], apart: Apart
) -> Route | None:
    """One random route, hop by hop, each hop chosen among the candidates not kept apart from the hop before it
    (and, for a verifier, from the replica after it); None when some hop has none."""
    stages: list[StageAnnouncement] = []
    verifiers: list[VerifierAnnouncement] = []
    for k in range(view.n_stages):
        previous = verifiers[-1].peer_id if verifiers else None
        replicas = [a for a in view.live_replicas(k) if previous is None or not apart(previous, a.peer_id)]
        stage = pick(replicas, rng, blacklist, avoid)
        if stage is None:
            return None
        stages.append(stage)
        if k < view.n_stages - 1:
            candidates = [v for v in view.live_verifiers(k) if not apart(stage.peer_id, v.peer_id)]
            verifier = pick(candidates, rng, blacklist, avoid)
            if verifier is None:
                return None
            verifiers.append(verifier)
    return Route(tuple(stages), tuple(verifiers))


def _why(announced: Collection[Announcement], view: SwarmView) -> str:
    if not announced:
        return "none announced"
    states = {}
    for a in announced:
        reason = "excluded" if view.is_excluded(a.peer_id) else a.state
        states[reason] = states.get(reason, 0) + 1
    return (
        f"{len(announced)} announced (" + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + "), none usable"
    )


@dataclass(frozen=True)
class RouteHop:
    """One hop of a route as the callers along it see it: the chosen peer and the alternates to retry on.
    ``boundary`` is None for a stage replica and b for the verifier of boundary b."""

    peer_id: str
    boundary: int | None
    alternates: tuple[str, ...]


def expand(
    route: Route,
    view: SwarmView,
    rng: random.Random,
    blacklist: LivenessBlacklist | None = None,
    avoid: Collection[str] = (),
    max_alternates: int = MAX_ALTERNATES,
) -> list[RouteHop]:
    """The route in call order (stage 0, verifier 0|1, stage 1, ...), each hop with up to ``max_alternates``
    other live candidates for the same place that are neither avoided nor suspended, picked at random."""

    def alternates(candidates: Sequence[Announcement], chosen: str) -> tuple[str, ...]:
        fresh = [
            c.peer_id
            for c in candidates
            if c.peer_id != chosen and c.peer_id not in avoid and (blacklist is None or c.peer_id not in blacklist)
        ]
        return tuple(rng.sample(fresh, min(max_alternates, len(fresh))))

    hops = []
    for k, stage in enumerate(route.stages):
        hops.append(RouteHop(stage.peer_id, None, alternates(view.live_replicas(k), stage.peer_id)))
        if k < len(route.verifiers):
            verifier = route.verifiers[k].peer_id
            hops.append(RouteHop(verifier, k, alternates(view.live_verifiers(k), verifier)))
    return hops


def order_candidates(
    chosen: str,
    alternates: Sequence[str],
    view: SwarmView,
    blacklist: LivenessBlacklist,
    skip: Callable[[str], bool] = lambda _: False,
) -> list[str]:
    """The peers that may serve a hop: the chosen one, then its alternates; never excluded or skipped peers, and
    peers that just failed only after the others."""
    peers = [p for p in dict.fromkeys([chosen, *alternates]) if not view.is_excluded(p) and not skip(p)]
    return [p for p in peers if p not in blacklist] + [p for p in peers if p in blacklist]
