"""The peer society: who is who, routing choice, strikes and exclusion."""

from peers.health import Health, Verdict
from peers.ledger import StrikeLedger
from peers.liveness import BackoffParams, LivenessBlacklist, PairBlacklist
from peers.policy import DEFAULT_MIN_VOTER_AGE, Exclusion, ExclusionParams, ExclusionPolicy, verifier_peer_id
from peers.routing import (
    MAX_ALTERNATES,
    Apart,
    NoRouteError,
    Route,
    RouteHop,
    choose_route,
    expand,
    never_apart,
    order_candidates,
    pick,
    pick_replica,
    pick_verifier,
)
from peers.step_clock import StepClock
from peers.view import SwarmView, SwarmWatcher

__all__ = [
    "DEFAULT_MIN_VOTER_AGE",
    "MAX_ALTERNATES",
    "Apart",
    "PairBlacklist",
    "never_apart",
    "BackoffParams",
    "Exclusion",
    "ExclusionParams",
    "ExclusionPolicy",
    "Health",
    "LivenessBlacklist",
    "NoRouteError",
    "Route",
    "RouteHop",
    "StepClock",
    "StrikeLedger",
    "SwarmView",
    "SwarmWatcher",
    "Verdict",
    "choose_route",
    "expand",
    "order_candidates",
    "pick",
    "pick_replica",
    "pick_verifier",
    "verifier_peer_id",
]
