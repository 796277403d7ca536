"""A reference a minority cannot walk: the median of what the senders recently sent, each sender counted alike.

An EMA of accepted tensors follows whoever feeds it, so an attacker who moves a little at a time drags it along.
Here the reference is the coordinate-wise median of a pool of recent profiles in which every sender heard from in
the last `horizon` checks has the same share: its last ceil(`pool` / senders) profiles (flagged ones too: a shift of
the whole boundary must be followed, or every honest tensor after it would be flagged forever). While attackers
are fewer than half of those senders they hold fewer than half of the pool, and no coordinate of the median can
leave the range of the honest senders' values, however far or however slowly the attackers move
(docs/decisions.md). The pool spans about the last `pool` checks of the boundary whatever the number of senders, so
the reference lags the honest traffic by about as much as an EMA would. With fewer than `min_senders` senders there is
no majority to lean on, and `reference()` returns None (the monitor falls back on its EMA of accepted tensors).

Memory and time are linear in the profile's size: at most ceil(`pool` / `min_senders`) profiles for at most
`max_senders` senders.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from sentinel_node.verification.profile import Profile
from sentinel_node.verification.senders import RecentSenders


def median_profile(profiles: list[Profile]) -> Profile:
    """The coordinate-wise median of profiles, field by field (the lower middle value for an even count)."""
    if len(profiles) == 1:
        return profiles[0]
    columns = zip(*(p.fields() for p in profiles), strict=True)
    return Profile(*(torch.stack(column).median(dim=0).values for column in columns))


@dataclass
class _Recent:
    profiles: deque[Profile]
    last_check: int = 0


class PeerReference:
    def __init__(self, pool: int, horizon: int, max_senders: int, min_senders: int = 3):
        self.pool, self.horizon, self.min_senders = pool, horizon, min_senders
        depth = math.ceil(pool / min_senders)
        self.senders: RecentSenders[_Recent] = RecentSenders(max_senders, lambda: _Recent(deque(maxlen=depth)))
        self.checks = 0
        self._reference: Profile | None = None
        self._stale = True

    def observe(self, sender: str, profile: Profile) -> None:
        self.checks += 1
        recent = self.senders.get(sender)
        recent.profiles.append(profile)
        recent.last_check = self.checks
        self._stale = True

    def forget(self, sender: str) -> None:
        """Leaves a sender out from now on (it was banned)."""
        if self.senders.pop(sender) is not None:
            self._stale = True

    def live(self) -> list[str]:
        return [s for s, recent in self.senders.items() if self.checks - recent.last_check < self.horizon]

    def reference(self) -> Profile | None:
        """The median of the live senders' last profiles, an equal number each; None with fewer than
        `min_senders` live senders."""
        if self._stale:
            live = [r for _, r in self.senders.items() if self.checks - r.last_check < self.horizon]
            if len(live) < self.min_senders:
                self._reference = None
            else:
                share = math.ceil(self.pool / len(live))
                self._reference = median_profile([p for r in live for p in list(r.profiles)[-share:]])
            self._stale = False
        return self._reference
