"""The swarm's global step as a verifier counts it between reads of the DHT.

A verifier gives a sender one strike at most per global step for flags that are not blatant (the tensors of one
step come from the same parameters: one piece of evidence). It must not take the step from the sender, who could
claim the same one forever, so it takes the swarm's estimate (:meth:`peers.SwarmView.step_estimate`, a median of
what the stage replicas announce). That estimate moves only when the replicas announce (every announce period) and
the verifier's view is read again (as often), so it lags the training by a few steps and moves in jumps. The lag
is harmless; the jumps are not: measured in the loopback demo swarm (2 s announce period, about 0.6 s a step), the
verifiers' estimate stood still for 3 to 6 real steps at a time, so an attacker flagged on every tensor got a strike
every few steps rather than every step, and on a loaded CI machine, where reads of the DHT slow down, one was
flagged 19 times in 18 steps without being banned.

So the clock goes on counting while the estimate stands still: it follows the estimate's pace (seconds per step,
an average over its advances, as :class:`hivemind.utils.performance_ema.PerformanceEMA` follows a rate) and adds
the steps that pace says have gone by since the estimate last moved. It never goes back: when a fresh estimate is
behind what the clock counted, the clock waits for it. What a sender can do to it: nothing directly (it is one
replica among those the estimate takes a median of); slowing the whole swarm slows the clock with it. An honest
replica loses nothing: the clock ticks about once per real step, so flags of one step still give one strike; and
without traffic there are no checks and so no flags to count.
"""

from __future__ import annotations

import math

# how far one advance of the estimate moves the pace (the rest is the pace before it)
ALPHA = 0.3
# pace samples are clipped to this range of seconds per step (a read after a long silence is not a slow swarm)
MIN_STEP_S, MAX_STEP_S = 0.01, 600.0


class StepClock:
    """`read(estimate, now)` is the step now: the estimate, or more when it has stood still a while at the pace
    it moved at before. Monotone; `now` in seconds of a monotonic clock."""

    def __init__(self, alpha: float = ALPHA):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.step_s: float | None = None  # seconds per step, once the estimate has moved twice
        self._anchor: tuple[int, float] | None = None  # the estimate and when it was first read at that value
        self._last = -1  # the last step returned

    def read(self, estimate: int, now: float) -> int:
        if self._anchor is None or estimate > self._anchor[0]:
            self._advance(estimate, now)
        step, since = self._anchor
        counted = step
        if self.step_s is not None and now > since:
            counted += math.floor((now - since) / self.step_s)
        self._last = max(self._last, counted)
        return self._last

    def _advance(self, estimate: int, now: float) -> None:
        if self._anchor is not None and self._anchor[0] >= 0:  # the wait for the first step is no pace
            step, since = self._anchor
            sample = min(max((now - since) / (estimate - step), MIN_STEP_S), MAX_STEP_S)
            self.step_s = sample if self.step_s is None else self.alpha * sample + (1 - self.alpha) * self.step_s
        self._anchor = (estimate, now)
