"""The loss a microbatch's text predicts, the excess its route added, and a gate that keeps poisoned updates out.

Some attacks keep every statistic of a tensor honest: values at the wrong token, sequences blended into each other,
a rotation in a few planes. Only a recomputation audit proves them, and at a base rate of a few percent a replica
waits tens of steps for one while training stands still (docs/decisions.md, "Damage directs the audits"). What
they cannot hide is the damage: the microbatches they touch end with a higher loss. A microbatch's loss, though,
depends mostly on its text (hard and easy text differ by about 7% in log loss on the full profile at step 150),
which buries what a route added.

The verifier of the last boundary relays every microbatch's targets to the last stage and the loss back. So it
predicts each microbatch's log loss from a running bigram model of the text it has relayed (the microbatch's bigram
cross-entropy under the counts of those before it) and the training's progress, fitted on recent microbatches whose
updates were applied: ``log loss = a + b log(bigram cross-entropy) + c t``. Measured on the full profile (steps 150
and 300, 200 microbatches each): the bigram cross-entropy alone explains about 90% of the variance of the model's
log loss across microbatches (correlation 0.95-0.96; spread 0.068-0.085 before, 0.022-0.025 after). What is left,
the **excess**, is what the route did: a one-position token shift raised it by 0.13-0.25 at step 150, blending in
another sequence by 0.27-0.49.

Two uses:

1. **The gate.** With every microbatch it hands the last stage, the verifier names a ceiling: ``k`` robust
   deviations of excess above the recent ones. The last stage computes the loss; above the ceiling it runs no
   backward pass and answers that it held the update back, so no stage learns from the microbatch, and the trainer
   sends it again on a route that avoids every replica of the held one. A microbatch held twice here is text the
   model finds hard, or the whole swarm moved: a third attempt that does no worse than the best before it (within
   ``agree``) has its update applied, and the excesses it leaves let the gate follow.
2. **Evidence.** The excess, not the raw loss, is what the loss evidence ranks (:mod:`losses`); and every stage
   of a held microbatch is audited on its forward half (:mod:`sentinel_node.pipeline.audits`): the gate saw
   damage, the audit says whose.

Why a minority cannot open the gate: the fit learns only from applied microbatches, which are at most at the
ceiling; the ceiling's location and scale come from the low quantiles of recent excesses (the 5th and 25th
percentiles), which held microbatches, being high, move only by displacing honest ones: with a share ``e`` of them
in the window, the 25th percentile reads the honest ``0.25 / (1 - e)`` quantile (the 45th at ``e`` = 0.44, the
full profile's share of routes through one of its corrupting replicas), half a deviation above where it was.
What the gate cannot see: an attack on gradients (the loss was computed before the gradient existed) and one that
does no damage to the microbatch it touches.

Cost: a table of ``buckets`` counts (4 MiB at most; exact for a byte vocabulary, hashed above 1,024 tokens) and
O(tokens) per microbatch; a least-squares fit of ``window`` points per applied microbatch.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# the 25th and 5th percentiles of a normal distribution lie this far below its mean, in deviations
_Z25, _Z05 = 0.6745, 1.6449


class BigramText:
    """A running bigram model of the tokens sent: the cross-entropy of a microbatch under what came before it."""

    def __init__(self, vocab: int, buckets: int = 1 << 20, smoothing: float = 4.0):
        self.vocab = vocab
        self.buckets = min(buckets, vocab * vocab)
        self.smoothing = smoothing
        self.pairs = np.zeros(self.buckets, dtype=np.float32)
        self.contexts = np.zeros(vocab, dtype=np.float64)
        self.unigrams = np.zeros(vocab, dtype=np.float64)

    def _pairs(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = inputs.reshape(-1).to(torch.int64).numpy().clip(0, self.vocab - 1)
        y = targets.reshape(-1).to(torch.int64).numpy().clip(0, self.vocab - 1)
        return x, y, (x * self.vocab + y) % self.buckets

    def cross_entropy(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean negative log-likelihood, in nats per token, of ``targets`` after ``inputs`` (the same shape: each
        target is the token after its input) under the counts so far (smoothed: uniform before any)."""
        x, y, index = self._pairs(inputs, targets)
        unigram = (self.unigrams[y] + 0.5) / (self.unigrams.sum() + 0.5 * self.vocab)
        p = (self.pairs[index] + self.smoothing * unigram) / (self.contexts[x] + self.smoothing)
        return float(-np.mean(np.log(p)))

    def learn(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        x, y, index = self._pairs(inputs, targets)
        np.add.at(self.pairs, index, 1.0)
        np.add.at(self.contexts, x, 1.0)
        np.add.at(self.unigrams, y, 1.0)


@dataclass(frozen=True)
class Expectation:
    """What the gate knows of a microbatch before the last stage computes it: its text's difficulty (the log of its
    bigram cross-entropy) and its place in the stream."""

    difficulty: float
    index: int


@dataclass(frozen=True)
class GateSettings:
    k: float = 6.0  # robust deviations of excess above the recent ones at which a microbatch is held back (0: off)
    agree: float = 0.05  # log-loss margin within which a later attempt does no worse than the best before it
    window: int = 256  # applied microbatches the prediction is fitted on
    residuals: int = 128  # recent excesses the ceiling is read from
    warmup: int = 64  # applied microbatches before anything is predicted
    min_scale: float = 0.01  # the smallest deviation of the excess (in log loss) the ceiling assumes


class ExcessLoss:
    """Per microbatch: the log loss its text predicts, the excess its route added, and the loss that holds it back."""

    def __init__(self, vocab: int, settings: GateSettings = GateSettings()):
        self.settings = settings
        self.text = BigramText(vocab)
        self.fitted: deque[tuple[float, int, float]] = deque(maxlen=settings.window)
        self.recent: deque[float] = deque(maxlen=settings.residuals)
        self.sent = 0
        self.held = 0
        self.applied = 0
        self._fit: np.ndarray | None = None
        self._origin = 0  # the stream index the fit's progress is measured from (its newest point)

    def expect(self, targets: torch.Tensor) -> Expectation:
        """Scores a microbatch's text, its (batch, tokens) ``targets``, by the bigrams within each sequence, then
        learns them: once per microbatch."""
        targets = targets.reshape(targets.shape[0], -1) if targets.dim() > 1 else targets.reshape(1, -1)
        before, after = targets[:, :-1], targets[:, 1:]
        difficulty = math.log(max(self.text.cross_entropy(before, after), 1e-6))
        self.text.learn(before, after)
        self.sent += 1
        return Expectation(difficulty, self.sent)

    def predicted(self, expectation: Expectation) -> float | None:
        """The log loss the microbatch's text predicts; None until `warmup` microbatches were applied."""
        coefficients = self._coefficients()
        if coefficients is None:
            return None
        return float(coefficients @ self._features(expectation.difficulty, expectation.index))

    def excess(self, expectation: Expectation, loss: float) -> float | None:
        """log(loss) less the prediction; None before the fit or for a loss that is not a positive number."""
        predicted = self.predicted(expectation)
        if predicted is None or not math.isfinite(loss) or loss <= 0:
            return None
        return math.log(loss) - predicted

    def ceiling(self, expectation: Expectation, held: Sequence[float] = ()) -> float | None:
        """The loss above which this attempt is held back (None: never). A microbatch already held twice (its
        ``held`` losses) is applied if it does no worse than the best of them."""
        if self.settings.k <= 0:
            return None
        predicted = self.predicted(expectation)
        if predicted is None or len(self.recent) < self.settings.warmup // 2:
            return None
        q05, q25 = np.percentile(np.fromiter(self.recent, float), [5, 25])
        scale = max((q25 - q05) / (_Z05 - _Z25), self.settings.min_scale)
        limit = math.exp(predicted + q25 + _Z25 * scale + self.settings.k * scale)
        if len(held) >= 2:
            limit = max(limit, min(held) * math.exp(self.settings.agree))
        return limit

    def settled(self, expectation: Expectation, loss: float | None, applied: bool) -> None:
        """One attempt ended with ``loss`` (None: no loss came back), applied or held back."""
        if loss is None or not math.isfinite(loss) or loss <= 0:
            return
        excess = self.excess(expectation, loss)
        if excess is not None:
            self.recent.append(excess)
        if applied:
            self.applied += 1
            self.fitted.append((expectation.difficulty, expectation.index, math.log(loss)))
            self._fit = None
        else:
            self.held += 1

    def _features(self, difficulty: float, index: int) -> np.ndarray:
        # progress in windows from the fit's newest point, so the numbers stay of one size however long it runs
        return np.array([1.0, difficulty, (index - self._origin) / self.settings.window])

    def _coefficients(self) -> np.ndarray | None:
        if len(self.fitted) < self.settings.warmup:
            return None
        if self._fit is None:
            rows = np.array(self.fitted)
            self._origin = int(rows[:, 1].max())
            features = np.stack([self._features(d, int(i)) for d, i, _ in rows])
            self._fit = np.linalg.lstsq(features, rows[:, 2], rcond=None)[0]
        return self._fit


@dataclass
class Gated:
    """One attempt of a microbatch at the gate: what its text predicts and the loss above which it is held."""

    content: int
    expectation: Expectation
    ceiling: float | None


class LossGate:
    """The gate as the verifier of the last boundary keeps it: before it hands a microbatch to the last stage it
    names the ceiling (:meth:`before`), and when the loss comes back it learns whether the update was applied or
    held (:meth:`after`). Attempts of one microbatch (the same targets, ``content``) are told apart by the losses
    it was held at here, at most ``remember`` microbatches' worth."""

    def __init__(self, vocab: int, settings: GateSettings = GateSettings(), remember: int = 4096):
        self.excess = ExcessLoss(vocab, settings)
        self.remember = remember
        # content -> its first attempt's expectation, and the losses it was held at here
        self._seen: OrderedDict[int, tuple[Expectation, list[float]]] = OrderedDict()

    @property
    def settings(self) -> GateSettings:
        return self.excess.settings

    def before(self, content: int, targets: torch.Tensor) -> Gated:
        """The attempt's ceiling. Its text is scored and learnt at its first attempt; a later one keeps that score
        (scored again, its own bigrams would make it look easier than it is)."""
        seen = self._seen.get(content)
        if seen is None:
            seen = self._seen[content] = (self.excess.expect(targets), [])
            while len(self._seen) > self.remember:
                self._seen.popitem(last=False)
        self._seen.move_to_end(content)
        expectation, held = seen
        return Gated(content, expectation, self.excess.ceiling(expectation, held))

    def expected(self, gated: Gated) -> float | None:
        """The loss the microbatch's text predicts (None before the fit)."""
        predicted = self.excess.predicted(gated.expectation)
        return None if predicted is None else math.exp(predicted)

    def holds(self, gated: Gated, loss: float) -> bool:
        """Whether the last stage should hold back an attempt that ended with ``loss``."""
        return gated.ceiling is not None and not (loss <= gated.ceiling)

    def after(self, gated: Gated, loss: float | None, held: bool) -> None:
        """The attempt ended with ``loss`` (None: none came back), ``held`` back or applied."""
        self.excess.settled(gated.expectation, loss, applied=not held)
        if held and loss is not None and math.isfinite(loss) and gated.content in self._seen:
            self._seen[gated.content][1].append(loss)
