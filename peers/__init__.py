"""The peer society: who is who, routing choice, strikes and exclusion."""

from peers.ledger import StrikeLedger
from peers.liveness import BackoffParams, LivenessBlacklist
from peers.policy import Exclusion, ExclusionParams, ExclusionPolicy, verifier_peer_id
from peers.routing import NoRouteError, Route, choose_route, pick, pick_replica, pick_verifier
from peers.view import Health, SwarmView, SwarmWatcher

__all__ = [
    "BackoffParams",
    "Exclusion",
    "ExclusionParams",
    "ExclusionPolicy",
    "Health",
    "LivenessBlacklist",
    "NoRouteError",
    "Route",
    "StrikeLedger",
    "SwarmView",
    "SwarmWatcher",
    "choose_route",
    "pick",
    "pick_replica",
    "pick_verifier",
    "verifier_peer_id",
]
