"""Step 4 of SENTINEL: adaptive thresholds, a Tukey fence over a window of recently accepted scores."""

from __future__ import annotations

import bisect
import math
from collections import deque

SPACES = ("relative_log", "linear")


class AdaptiveThreshold:
    """threshold = Q3 + k * IQR of the last `window` accepted scores, never below `floor`.

    In "relative_log" space the fence is taken over log(1 + score / median): honest distances are right-skewed
    with heavy tails, and a linear fence over them flags about one honest tensor in a hundred per metric; a plain
    log blows up on scores near zero. The transform is linear below the median and logarithmic far above it.
    """

    def __init__(self, window: int, k: float, floor: float, space: str = "relative_log"):
        if space not in SPACES:
            raise ValueError(f"fence space must be one of {SPACES}, not {space!r}")
        self.k, self.floor, self.space = k, floor, space
        self.scores: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []  # the same scores in order: quartiles without sorting on every check
        self._cached: tuple[float, float, float] | None = None  # (scale, median, fence), fence in transformed space

    def accept(self, score: float) -> None:
        score = float(score)
        if len(self.scores) == self.scores.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self.scores[0])]
        self.scores.append(score)
        bisect.insort(self._sorted, score)
        self._cached = None

    def _fence(self) -> tuple[float, float, float] | None:
        if len(self.scores) < 4:
            return None
        if self._cached is None:
            ordered = self._sorted
            scale = max(quantile(ordered, 0.5), self.floor, 1e-12) if self.space == "relative_log" else 1.0
            # the transform is increasing, so the order statistics of the transformed scores are the transformed
            # order statistics: interpolating between those is numpy's quantile of the transformed window
            q1, median, q3 = (quantile(ordered, q, lambda x: self._transform(x, scale)) for q in (0.25, 0.5, 0.75))
            fence = max(q3 + self.k * (q3 - q1), self._transform(self.floor, scale))
            self._cached = (scale, median, fence)
        return self._cached

    def _transform(self, score: float, scale: float) -> float:
        return math.log1p(max(score, 0.0) / scale) if self.space == "relative_log" else score

    def threshold(self) -> float:
        fence = self._fence()
        if fence is None:
            return math.inf
        scale, _, limit = fence
        if self.space != "relative_log":
            return limit
        return scale * math.expm1(limit) if limit < 700 else math.inf  # past e^700 a float overflows

    def severity(self, score: float) -> float:
        """Where `score` lies between the window's median (0) and the threshold (1); the drift test averages it."""
        fence = self._fence()
        if fence is None:
            return 0.0
        scale, median, limit = fence
        return (self._transform(score, scale) - median) / max(limit - median, 1e-9)


def quantile(ordered: list[float], q: float, transform=lambda x: x) -> float:
    """The q-quantile of transform(ordered), ``ordered`` sorted and ``transform`` increasing, with numpy's default
    rule: linear interpolation between the order statistics around position q * (n - 1)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    below, above = transform(ordered[low]), transform(ordered[high])
    return below + (above - below) * (position - low)
