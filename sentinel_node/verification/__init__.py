"""SENTINEL: stagewise integrity verification for pipeline-parallel training (arXiv 2603.03592).

Pure torch, no networking. A verifier standing on a stage boundary keeps one :class:`BoundaryMonitor` per
direction (activations forward, gradients backward)::

    monitor = BoundaryMonitor(settings, hidden_size=128, expected_shape=(8, 64, 128), ledger=shared_ledger)
    verdict = monitor.check(tensor, sender="peer-id", tainted=False)
    verdict = monitor.check(tensor, sender="peer-id", content=hash_of_targets)
    verdict = monitor.check(gradient, sender="peer-id", given=Given.sample(passed_back, 128))  # a middle stage's
    verdict.kind                      # VerdictKind: accepted, malformed, metric, peer, replay, passage, coherence,
                                      # drift, skipped
    verdict.struck, verdict.over      # whether the sender got a strike; the metrics over their thresholds
    verdict.blatant                   # the flag weighed two strikes (far over a threshold, or a copy)
    verdict.reason                    # for people: "non-finite values", "metric:l2,wasserstein", "peer:norm ..."
    verdict.scores, verdict.thresholds  # per-metric distance to the EMA baseline, and the adaptive threshold
    verdict.tensor                    # what to pass on: the input, or a replacement (None: drop the microbatch)
    verdict.tainted                   # checks further along the route must skip this microbatch
    verdict.sender.strikes, verdict.banned

The steps, in the paper's order: :mod:`profile` (reduce a tensor to token-independent statistics),
:mod:`reference` (the senders' median, which a minority cannot walk), :mod:`baseline` (EMA of accepted profiles,
the clean replacement, and the reference of a boundary with fewer than three senders), :mod:`metrics` (distances),
:mod:`thresholds` (Tukey fence over a window of accepted scores), :mod:`peers` (evidence accumulated per sender
against its peers), :mod:`replay` (sketches that find near-copies), :mod:`passage` (a middle stage's input gradient
against the output gradient it was given, which the residual stream carries into it), :mod:`losses` (higher
losses than its peers' make a replica a suspect for audits), :mod:`coherence` (a middle stage's gradient
contribution sharing one direction over its tokens, check after check), :mod:`drift` (a sender's mean activation
row departing from its peers' the same way, check after check), :mod:`shift` (a fence crossed by several senders is
the boundary moving), :mod:`strikes` (violation counter with forgiveness, weighted by the evidence),
:mod:`senders` (per-sender state with a bound), :mod:`monitor` (all of it for one boundary and direction).
"""

from sentinel_node.verification.baseline import EmaBaseline
from sentinel_node.verification.losses import LossEvidence
from sentinel_node.verification.metrics import METRICS
from sentinel_node.verification.monitor import REPLACEMENTS, BoundaryMonitor, MonitorSettings, Verdict, VerdictKind
from sentinel_node.verification.passage import Given, GradientPassage, PassageScore
from sentinel_node.verification.peers import PeerAlarm, PeerEvidence
from sentinel_node.verification.profile import Profile, Profiler
from sentinel_node.verification.reference import PeerReference, median_profile
from sentinel_node.verification.replay import ReplayMatch, ReplaySketcher, ReplayStore, content_of
from sentinel_node.verification.senders import RecentSenders
from sentinel_node.verification.shift import SharedShift
from sentinel_node.verification.strikes import SenderRecord, SenderStrikes
from sentinel_node.verification.thresholds import AdaptiveThreshold

__all__ = [
    "METRICS",
    "REPLACEMENTS",
    "AdaptiveThreshold",
    "BoundaryMonitor",
    "EmaBaseline",
    "Given",
    "GradientPassage",
    "LossEvidence",
    "MonitorSettings",
    "PassageScore",
    "PeerAlarm",
    "PeerEvidence",
    "PeerReference",
    "Profile",
    "Profiler",
    "RecentSenders",
    "ReplayMatch",
    "ReplaySketcher",
    "ReplayStore",
    "SenderRecord",
    "SenderStrikes",
    "SharedShift",
    "Verdict",
    "VerdictKind",
    "content_of",
    "median_profile",
]
