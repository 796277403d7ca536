"""Microbatch-level detection counts: which checked tensors were attacked, which flagged, by which metric."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from sentinel_node.verification import Verdict, VerdictKind


@dataclass
class DetectionStats:
    """Counts over checked tensors (a tainted microbatch's tensors are not checked), per direction."""

    counts: Counter = field(default_factory=Counter)  # (direction, attacked, flagged) -> n
    metric_hits: Counter = field(default_factory=Counter)  # (direction, attacked, metric) -> n over threshold

    def record(self, direction: str, attacked: bool, verdict: Verdict) -> None:
        if verdict.skipped or (verdict.warming_up and not verdict.flagged):
            return  # nothing but peer and replay flags can come during warm-up: the others are not counted
        self.counts[direction, attacked, verdict.flagged] += 1
        if verdict.kind is VerdictKind.METRIC:
            for metric in verdict.over:
                self.metric_hits[direction, attacked, metric] += 1
        elif verdict.kind in (VerdictKind.PEER, VerdictKind.REPLAY, VerdictKind.COHERENCE, VerdictKind.DRIFT):
            self.metric_hits[direction, attacked, verdict.kind.value] += 1

    @property
    def flags(self) -> int:
        return sum(n for (_, _, flagged), n in self.counts.items() if flagged)

    def checked(self, direction: str | None = None, attacked: bool | None = None) -> int:
        return sum(
            n
            for (d, a, _), n in self.counts.items()
            if (direction is None or d == direction) and (attacked is None or a == attacked)
        )

    def precision_recall(self, direction: str | None = None) -> tuple[float | None, float | None]:
        """Flag precision and recall over checked tensors; None where undefined (nothing flagged / attacked)."""

        def total(attacked: bool, flagged: bool) -> int:
            return sum(
                n
                for (d, a, f), n in self.counts.items()
                if (direction is None or d == direction) and a == attacked and f == flagged
            )

        tp, fp, fn = total(True, True), total(False, True), total(True, False)
        precision = tp / (tp + fp) if tp + fp else None
        recall = tp / (tp + fn) if tp + fn else None
        return precision, recall

    def metric_rates(self, direction: str, attacked: bool) -> dict[str, float]:
        """Share of checked tensors (attacked or honest) on which each metric alone was over its threshold."""
        n = self.checked(direction, attacked)
        metrics = sorted({m for (d, a, m) in self.metric_hits if d == direction})
        return {m: self.metric_hits[direction, attacked, m] / n for m in metrics} if n else {}
