"""A fence crossed by most senders at once is the boundary moving, not one sender cheating.

Honest training has phases in which a statistic of the whole boundary moves faster than the thresholds' window
follows (measured: late in the quick profile, the gradients' spectral concentration rose at every replica of a
stage within a few steps, and each replica in turn crossed the spectral fence just over it). The median reference
follows such a shift within a dozen checks, but the fences learn only from accepted scores, so for a while honest
tensors cross them one after the other: weighed as strikes, those crossings banned an honest replica.

So a flag that is not blatant is set against the other senders' recent checks at the same boundary: when at least
half of the other senders heard from in the last `window` checks also crossed one of the same fences, the crossing
is shared, evidence against no one, and the tensor is accepted (and learned from, so the fence follows). One
attacker among honest replicas is rarely in that position: its honest peers cross a fence about once in a hundred
checks, and it needs half of them to have done so lately; colluders on one stage need to be half of its other
replicas, as they would need to be to move the median reference. Blatant crossings neither excuse nor are excused
(honest tensors never cross that far), and a sender with no peers is not excused either: a stage of one replica gets
no exemption here (its verifier judges it against its own past alone).

Cost: `window` small tuples; a check is O(window).
"""

from __future__ import annotations

from collections import deque


class SharedShift:
    def __init__(self, window: int):
        self.recent: deque[tuple[str, frozenset[str]]] = deque(maxlen=max(window, 1))

    def observe(self, sender: str, over: tuple[str, ...], blatant: bool = False) -> bool:
        """Adds one judged check (the metrics over their fences, possibly none); True when that crossing is shared:
        `over` is not empty and at least half of the other recent senders (one at least) crossed one of them too.
        A blatant crossing is no shift (honest tensors never cross that far): it excuses no one, and is not
        excused."""
        crossed = frozenset() if blatant else frozenset(over)
        others: dict[str, bool] = {}
        for who, theirs in self.recent:
            if who != sender:
                others[who] = others.get(who, False) or bool(theirs & crossed)
        self.recent.append((sender, crossed))
        if not crossed or not others:
            return False
        return 2 * sum(others.values()) >= len(others)

    def forget(self, sender: str) -> None:
        """Leaves a banned sender's crossings out: a sender that was cheating must not excuse the next one."""
        kept = [entry for entry in self.recent if entry[0] != sender]
        self.recent.clear()
        self.recent.extend(kept)
