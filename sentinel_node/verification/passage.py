"""A middle stage's input gradient against the gradient it was given: the residual stream carries one into the other.

Every stage boundary of a residual decoder lies on the residual stream: a middle stage computes
``h_out = h_in + F(h_in)``, so the gradient it sends back is ``g_in = g_out + J_F(h_in)^T g_out``: the gradient it was
given, plus what its layers add. Measured on the full profile (4 stages of one layer, width 128; 24 microbatches at
steps 40, 150 and 300): the cosine of ``g_in`` and ``g_out`` was 0.75-0.99 for honest stages (median 0.83 at the
first middle stage and 0.94 at the second, at step 150), and 0.00-0.17 for a gradient sent at the wrong tokens
(shifted by 1 or 8 positions), -0.01-0.03 for another sequence's, -0.75 to -0.99 for an inverted one. No
statistic of ``g_in`` alone sees those attacks (their tensors are honest ones moved, or mirrored); this pairwise
test does, and needs no model: the verifier that checks ``g_in`` asks the next one on the route for what it passed
back to the stage.

The score is ``1 - cos`` (0 aligned, 1 unrelated, 2 inverted), judged by a linear fence over the boundary's recent
accepted scores (:mod:`thresholds`), never below ``floor`` (0.5: a cosine under one half, which no honest stage
measured came near). The fence judges only once it holds ``min_scores`` scores, and learns none over the floor.

Where it cannot judge: stage 0 (it sends no gradient) and the last stage (the loss gives it its output gradient, no
verifier did), a blend of another sequence's gradient that keeps most of the tensor (a fifth of it: 0.81-0.96, inside
the honest spread; too weak to matter on the full profile, +0.25%), and an architecture without a residual stream
across its stage boundaries (its honest cosines are low, the fence learnt from them wide).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sentinel_node.verification.thresholds import AdaptiveThreshold


@dataclass(frozen=True)
class PassageScore:
    """``score`` = 1 - cos(g_in, g_out); ``threshold`` the fence it was judged by (inf: not judged yet);
    ``severity`` its place between the window's median (0) and the fence (1)."""

    score: float
    threshold: float
    severity: float

    @property
    def over(self) -> bool:
        return self.score > self.threshold


class GradientPassage:
    """The fence of one boundary's gradient passage scores."""

    def __init__(self, window: int, k: float, floor: float, min_scores: int = 16):
        self.fence = AdaptiveThreshold(window, k, floor, space="linear")
        self.floor, self.min_scores = floor, min_scores

    @property
    def enabled(self) -> bool:
        return self.floor > 0

    def judge(self, sent: torch.Tensor, given: torch.Tensor) -> PassageScore | None:
        """The score of ``sent`` (a stage's input gradient) against ``given`` (the output gradient it was given);
        None when the two cannot be compared (another shape, a zero or non-finite tensor)."""
        if not self.enabled or tuple(sent.shape) != tuple(given.shape):
            return None
        a, b = sent.detach().reshape(-1).double(), given.detach().reshape(-1).double()
        norms = float(a.norm() * b.norm())
        if not norms > 0 or norms == float("inf"):
            return None
        score = 1.0 - float(a @ b) / norms
        if score != score:  # NaN
            return None
        if len(self.fence.scores) < self.min_scores:
            return PassageScore(score, float("inf"), 0.0)
        return PassageScore(score, self.fence.threshold(), self.fence.severity(score))

    def accept(self, passage: PassageScore) -> None:
        """Learns an accepted gradient's score; never one over the floor, so that an attack under way before the
        fence could judge (the first `min_scores` checks) does not widen it."""
        if passage.score <= self.floor:
            self.fence.accept(passage.score)
