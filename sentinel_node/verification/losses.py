"""Damage directs the audits: the losses of the microbatches a replica computed, ranked against its peers'.

Some attacks keep every statistic of the tensor honest (values at the wrong token, sequences blended into each
other, a free-rider's tensors of other text): only a recomputation audit sees them, and at a base rate of a few
percent a replica waits tens of steps for one. But an attack worth making raises the loss: the microbatches whose
activations went through a corrupting replica end with a higher loss than those through its peers in the same
steps. The loss travels back along the route with the gradient, so the verifier that audits a replica (the one of
the boundary below it) sees the loss of every microbatch that replica computed.

So each settled microbatch's log loss is ranked against the boundary's recent ones computed by other replicas, a
rank CUSUM per replica as in :mod:`peers` (what the boundary shares, the loss falling as the model learns, is taken
off with the median score). A replica whose evidence reaches `share` of the limit is a suspect: its work is
recomputed at the suspect audit rate, which turns a consistent difference into proof. Nothing is ever struck from a
loss: text varies, an honest replica between averaging rounds may do a little worse than its peers, and the loss
is what the last stage reports, so it may lie. Either costs audits of honest work, which pass; none of it can ban.

What it cannot see: a gradient attack (the microbatch's loss was computed before the gradient existed; the harm
falls on the receiver's later updates) and any attack that does no damage (which need not be seen).

Cost: the pool holds `pool` numbers, the sums `max_senders`; an observation is O(pool).
"""

from __future__ import annotations

import math

from sentinel_node.verification.peers import PeerEvidence


class LossEvidence:
    """Per replica, the evidence that the microbatches it computed end with a higher loss than its peers'."""

    def __init__(self, pool: int, kappa: float, limit: float, share: float, max_senders: int):
        self.share = share
        self._ranks = PeerEvidence(("loss",), pool, kappa, limit, max_senders)

    @property
    def enabled(self) -> bool:
        return self.share > 0 and self._ranks.enabled

    def observe(self, replica: str, loss: float | None, expected: float | None = None) -> None:
        """The loss of one microbatch ``replica`` computed, and the loss its text predicts (``expected``, the
        trainer's :mod:`excess`: what is ranked is then the excess, the text's difficulty taken off); a missing,
        non-finite or non-positive loss (a malformed report) is ignored, and so is such an ``expected``."""
        if not self.enabled or loss is None or not math.isfinite(loss) or loss <= 0:
            return
        excess = math.log(loss)
        if expected is not None and math.isfinite(expected) and expected > 0:
            excess -= math.log(expected)
        self._ranks.observe(replica, {"loss": excess})

    def evidence(self, replica: str) -> float:
        return self._ranks.evidence(replica)

    def suspicious(self, replica: str) -> bool:
        """Whether the replica's evidence has reached `share` of the limit."""
        return self.enabled and self.evidence(replica) >= self.share * self._ranks.limit

    def forget(self, replica: str) -> None:
        self._ranks.forget(replica)
