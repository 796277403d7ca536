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

The cosine is taken over rows (token positions) the judging verifier draws at random for each microbatch
(:class:`Given`; 256 of the 512 of a tiny-config microbatch by default): it needs only those rows of the gradient
from the next verifier, and a stage cannot know which will be compared; an attack that moves every row is as far
off over some rows as over all.

The score is ``1 - cos`` (0 aligned, 1 unrelated, 2 inverted), judged by a linear fence over the boundary's recent
accepted scores (:mod:`thresholds`), never below ``floor`` (0.8, the config's default: a cosine under 0.2; 0 turns
the test off). A flag is a suspicion, not a strike (:mod:`monitor`): an honest replica whose parameters an attacker
disturbed through averaging fails it too (it was banned by it on the network while a flag was a strike,
docs/decisions.md), so the flagged crossing is audited and only the audit bans. Honest cosines dip in phases
of training: a replica of the demo swarm was flagged at 0.35 by a floor of 0.5, and the demo's model (lr 0.003) went
to 0.29 over 256 rows in 8 seeds x 120 microbatches from initialisation (0.12 over 128 rows with a warm-up four
times shorter), while a shifted gradient stays under 0.17. The fence judges only once it holds ``min_scores``
scores, and learns none over the floor.

Where it cannot judge: stage 0 (it sends no gradient) and the last stage (the loss gives it its output gradient, no
verifier did), a blend of another sequence's gradient that keeps most of the tensor (a fifth of it: 0.81-0.96, inside
the honest spread; too weak to matter on the full profile, +0.25%), and an architecture without a residual stream
across its stage boundaries (its honest cosines are low, the fence learnt from them wide).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sentinel_node.verification.coherence import mean_row
from sentinel_node.verification.thresholds import AdaptiveThreshold


@dataclass(frozen=True)
class Given:
    """The output gradient a middle stage was given: ``values`` holds the rows ``rows`` of it (indices into the
    tensor's rows of ``hidden`` values, all of them in order when ``rows`` is None)."""

    values: torch.Tensor
    rows: torch.Tensor | None = None

    @classmethod
    def sample(cls, gradient: torch.Tensor, n_rows: int, generator: torch.Generator | None = None) -> Given:
        """``n_rows`` rows of ``gradient`` drawn without replacement (all of them when it has no more)."""
        flat = gradient.detach().reshape(-1, gradient.shape[-1])
        if n_rows <= 0 or n_rows >= flat.shape[0]:
            return cls(flat)
        rows = torch.randperm(flat.shape[0], generator=generator)[:n_rows].sort().values
        return cls(flat[rows], rows)

    def of(self, sent: torch.Tensor) -> torch.Tensor | None:
        """The same rows of ``sent``, flattened; None when ``sent`` has no such rows (another width, too few)."""
        if sent.dim() < 1 or self.values.dim() != 2 or sent.shape[-1] != self.values.shape[-1]:
            return None
        flat = sent.detach().reshape(-1, sent.shape[-1])
        if self.rows is None:
            return flat.reshape(-1) if flat.shape == self.values.shape else None
        if self.rows.dim() != 1 or len(self.rows) != len(self.values) or not len(self.rows):
            return None
        if int(self.rows.min()) < 0 or int(self.rows.max()) >= flat.shape[0]:
            return None
        return flat[self.rows].reshape(-1)


@dataclass(frozen=True)
class PassageScore:
    """``score`` = 1 - cos(g_in, g_out); ``threshold`` the fence it was judged by (inf: not judged yet);
    ``severity`` its place between the window's median (0) and the fence (1); ``offset`` the direction the rows of the
    stage's own contribution ``g_in - g_out`` share (:func:`coherence.mean_row`; None: undefined)."""

    score: float
    threshold: float
    severity: float
    offset: torch.Tensor | None = None

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

    def judge(self, sent: torch.Tensor, given: Given) -> PassageScore | None:
        """The score of ``sent`` (a stage's input gradient) against ``given`` (rows of the output gradient it was
        given); None when the two cannot be compared (other shapes, a zero or non-finite tensor)."""
        if not self.enabled:
            return None
        a = given.of(sent)
        if a is None:
            return None
        a, b = a.double(), given.values.detach().reshape(-1).double()
        norms = float(a.norm() * b.norm())
        if not norms > 0 or norms == float("inf"):
            return None
        score = 1.0 - float(a @ b) / norms
        if score != score:  # NaN
            return None
        offset = mean_row((a - b).reshape(given.values.shape))
        if len(self.fence.scores) < self.min_scores:
            return PassageScore(score, float("inf"), 0.0, offset)
        return PassageScore(score, self.fence.threshold(), self.fence.severity(score), offset)

    def accept(self, passage: PassageScore) -> None:
        """Learns an accepted gradient's score; never one over the floor, so that an attack under way before the
        fence could judge (the first `min_scores` checks) does not widen it."""
        if passage.score <= self.floor:
            self.fence.accept(passage.score)
