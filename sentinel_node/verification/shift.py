"""A fence crossed by several senders at once is the boundary moving, not one sender cheating.

Honest training has phases in which a statistic of the whole boundary moves faster than the thresholds' window
follows. Measured twice: late in the quick profile the gradients' spectral concentration rose at every replica of a
stage within a few steps, and each replica in turn crossed the spectral fence just over it; on the full profile three
of a stage's eight replicas crossed the `scale` and `wasserstein` fences within 13 steps, two of them just before an
averaging round (when replicas have drifted furthest apart). The median reference follows such a shift
within a dozen checks, but the fences learn only from accepted scores, so for a while honest tensors cross them one
after the other: weighed as strikes, those crossings banned an honest replica in each case.

So a flag that is not blatant is set against the other senders' recent checks at the same boundary: when at least a
quarter of the other senders heard from in the last `window` checks (one at least) also crossed one of the same
fences, the crossing is shared, evidence against no one, and the tensor is accepted (and learned from, so the fence
follows). Only a sender's first `repeats` crossings within the window can be excused: an honest replica in a shift
crosses a few times, an attacker whose tensors stay over a fence crosses on every check, and its later crossings
are struck as before.

What that lets through, and why it is bounded: one attacker among honest replicas is excused only when a quarter of
its peers crossed the same fence lately, while an honest check outside a shift crosses a fence about once in a
thousand (12 flags in 8,678 checks in the full profile's clean run, 0 in 1,260 in the quick one). Colluders on one
stage that are a quarter of its other replicas excuse each other, but only `repeats` times per window each, and their
tensors still face the rank test against their peers, the blatant fence (blatant crossings neither excuse nor are
excused: honest tensors never cross that far) and audits. A sender with fewer than two peers is never excused: of
two senders, nobody can tell which one moved, and an attacker excused by its one honest peer's crossing would be
learned into the EMA baseline that such a boundary is judged against (seen with one peer allowed: in the loopback
demo swarm of `tests/test_pipeline_swarm.py`, two replicas a stage, the honest replica left alone after its
attacker's ban was banned on `spectral` gradient flags; the module had passed before). A stage of one or two
replicas gets no exemption here, as before.

Cost: `window` small tuples; a check is O(window).
"""

from __future__ import annotations

from collections import deque


class SharedShift:
    def __init__(self, window: int, share: float = 0.25, repeats: int = 3, min_peers: int = 2):
        self.share, self.repeats, self.min_peers = share, repeats, min_peers
        self.recent: deque[tuple[str, frozenset[str]]] = deque(maxlen=max(window, 1))

    def observe(self, sender: str, over: tuple[str, ...], blatant: bool = False) -> bool:
        """Adds one judged check (the metrics over their fences, possibly none); True when that crossing is shared:
        `over` is not empty, at least `share` of the other recent senders (one at least) crossed one of them too, and
        the sender crossed one of them fewer than `repeats` times in the window before. A blatant crossing is no
        shift (honest tensors never cross that far): it excuses no one, and is not excused."""
        crossed = frozenset() if blatant else frozenset(over)
        others: dict[str, bool] = {}
        mine = 0
        for who, theirs in self.recent:
            if who != sender:
                others[who] = others.get(who, False) or bool(theirs & crossed)
            elif theirs & crossed:
                mine += 1
        self.recent.append((sender, crossed))
        if not crossed or len(others) < self.min_peers or mine >= self.repeats:
            return False
        sharing = sum(others.values())
        return sharing >= 1 and sharing >= self.share * len(others)

    def peer_inside(self, sender: str, over: tuple[str, ...]) -> bool:
        """Whether some other sender heard from in the window crossed none of the fences in `over` there: the
        crossing is then this sender's own, whoever else is at the boundary (of two senders, the one that moved
        is the one that crossed while the other stayed inside)."""
        crossed = frozenset(over)
        others: dict[str, bool] = {}
        for who, theirs in self.recent:
            if who != sender:
                others[who] = others.get(who, False) or bool(theirs & crossed)
        return not all(others.values())

    def forget(self, sender: str) -> None:
        """Leaves a banned sender's crossings out: a sender that was cheating must not excuse the next one."""
        kept = [entry for entry in self.recent if entry[0] != sender]
        self.recent.clear()
        self.recent.extend(kept)
