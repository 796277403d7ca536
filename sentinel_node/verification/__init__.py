"""SENTINEL: stagewise integrity verification for pipeline-parallel training (arXiv 2603.03592).

Pure torch, no networking. A verifier standing on a stage boundary keeps one :class:`BoundaryMonitor` per
direction (activations forward, gradients backward)::

    monitor = BoundaryMonitor(settings, hidden_size=128, expected_shape=(8, 64, 128), ledger=shared_ledger)
    verdict = monitor.check(tensor, sender="peer-id", tainted=False)
    verdict.kind                      # VerdictKind: accepted, malformed, metric, drift or skipped
    verdict.struck, verdict.over      # whether the sender got a strike; the metrics over their thresholds
    verdict.reason                    # for people: "non-finite values", "metric:l2,wasserstein", "drift"
    verdict.scores, verdict.thresholds  # per-metric distance to the EMA baseline, and the adaptive threshold
    verdict.tensor                    # what to pass on: the input, or a replacement (None: drop the microbatch)
    verdict.tainted                   # checks further along the route must skip this microbatch
    verdict.sender.strikes, verdict.banned

The steps, in the paper's order: :mod:`profile` (reduce a tensor to token-independent statistics),
:mod:`baseline` (EMA of accepted profiles, and the clean replacement), :mod:`metrics` (distances),
:mod:`thresholds` (Tukey fence over a window of accepted scores), :mod:`drift` (a sender hugging the thresholds),
:mod:`strikes` (violation counter with forgiveness), :mod:`monitor` (all of it for one boundary and direction).
"""

from sentinel_node.verification.baseline import EmaBaseline
from sentinel_node.verification.drift import DriftTest
from sentinel_node.verification.metrics import METRICS
from sentinel_node.verification.monitor import REPLACEMENTS, BoundaryMonitor, MonitorSettings, Verdict, VerdictKind
from sentinel_node.verification.profile import Profile, Profiler
from sentinel_node.verification.strikes import SenderRecord, SenderStrikes
from sentinel_node.verification.thresholds import AdaptiveThreshold

__all__ = [
    "METRICS",
    "REPLACEMENTS",
    "AdaptiveThreshold",
    "BoundaryMonitor",
    "DriftTest",
    "EmaBaseline",
    "MonitorSettings",
    "Profile",
    "Profiler",
    "SenderRecord",
    "SenderStrikes",
    "Verdict",
    "VerdictKind",
]
