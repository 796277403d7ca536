"""Evidence accumulated per sender that its activations' mean departs from its peers' the same way, check after check.

Replicas of one stage hold (nearly) the same weights and are sent microbatches of the same text distribution, so the
mean row of the activations they send (per channel, in units of the tensor's RMS: the profile's ``mean``) differs
from one replica to the next only by what the tokens of each microbatch put in it, which has no lasting direction.
An attack that keeps every norm and every channel's spread, such as a rotation of a plane of the hidden space
(``plane_rotation`` in the sweep), or a bias too small for any fence, moves the part of the mean that lies in what it
touches, the same way on every tensor. So each check's **deviation**, its mean row less the coordinate-wise median
of the last ``pool`` accepted mean rows of the other senders of the boundary, goes through the whitened
CUSUM of :mod:`coherence` (:class:`~sentinel_node.verification.coherence.CoherenceEvidence`): judged in the spread of
its peers' own deviations, which take a few directions with a sign that changes from microbatch to microbatch,
and accumulated against the other senders' scores.

The median of the others, each check judged against senders other than itself, cannot be dragged by a minority: while
attackers hold fewer than half of the pool no coordinate of it leaves the range of the honest senders' means; and
only accepted tensors enter it. A change of the whole boundary moves the median with it, so it is evidence against
no one.

Needs mean rows of at least ``min_others`` other senders in the pool (five senders at the boundary by default): with
fewer, one attacker would be a large share of every honest sender's reference, and its offset would show, halved
and reversed, in every honest deviation; a stage served by one replica has no peers at all, and its mean moves with
training (the network's clean swarm of single replicas never reaches this test, nor does the quick profile's four
replicas).

Measured (docs/decisions.md, "The drift test"): on the full profile's eight replicas a stage, ``plane_rotation`` 30
degrees on activations banned in 48 steps (F1 0.86 before, one attacker of two never banned), 180 degrees in 4
(11.5); one honest alarm in about 11,500 activation checks of a clean run of 1,000 steps. Cost: ``pool`` vectors of
``hidden`` floats per boundary and direction, a median over them per check (numpy's partition), and the coherence
test's state: 1.6 ms of CPU per check at width 4,096, where the profile takes 44-75 ms.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class PeerMeans:
    """The last ``pool`` accepted mean rows of a boundary, with their senders; judged against at least ``min_others``
    other senders."""

    def __init__(self, pool: int = 16, min_others: int = 4):
        self.min_others = min_others
        self.recent: deque[tuple[str, torch.Tensor]] = deque(maxlen=pool)

    def deviation(self, sender: str, mean: torch.Tensor) -> torch.Tensor | None:
        """``mean`` less the coordinate-wise median of the other senders' recent mean rows (taken in float32, as the
        profile's mean is; returned in float64); None when fewer than ``min_others`` other senders are in the pool,
        or for a mean of another width."""
        others = [(who, row) for who, row in self.recent if who != sender and row.shape == mean.shape]
        if len({who for who, _ in others}) < self.min_others:
            return None
        # numpy's partition finds the lower middle value, torch.median's, in a third of its time (0.5 ms against
        # 1.3 for 14 rows of 4,096)
        stacked = torch.stack([row for _, row in others]).numpy()
        middle = (len(stacked) - 1) // 2
        median = torch.from_numpy(np.partition(stacked, middle, axis=0)[middle])
        return (mean.float().cpu() - median).double()

    def accept(self, sender: str, mean: torch.Tensor) -> None:
        self.recent.append((sender, mean.detach().float().cpu()))

    def forget(self, sender: str) -> None:
        """Leaves a banned sender's mean rows out of the median from now on."""
        kept = [(who, row) for who, row in self.recent if who != sender]
        self.recent.clear()
        self.recent.extend(kept)
