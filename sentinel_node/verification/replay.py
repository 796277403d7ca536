"""Replays and near-copies: a free-rider hands on a tensor it already sent (or another sender's) instead of computing.

Honest microbatches carry different text, so their tensors are unrelated row by row. Each checked tensor leaves a
small sketch: per sequence, a signed sum over its tokens of the rows projected on `width` fixed random directions,
after taking off what every sequence of the microbatch shares at a position (the channels' means, the first tokens'
distinctive rows), giving each channel and each token the same weight, leaving out the first tokens (sequences
that open alike, as indented code does, have the same rows there), and taking off the few directions most of the
tensor's rows share (a model early in training can point every row nearly one way). That is `batch x width`
numbers, kept in float16 (8 x 32: 512 bytes). A sequence of a replayed tensor, exact or with a little noise, has
nearly the same sketch as the one it copies (cosine ~1); two different sequences are nearly orthogonal (|cosine| of
order 1/sqrt(width)). A tensor all of whose sequences find a match (the lowest of their best cosines reaches
`threshold`) among the sketches of the last `keep` tensors is a near-copy; matching sequence by sequence finds a
copy with its sequences shuffled too. Measured on the quick benchmark's honest traffic (width 16): the best such
score against the last 256 tensors stayed at or below 0.6 for gradients and 0.77 for activations.

The protocol makes identical inputs in two places only: a microbatch retried on a new route after a failed hop,
and duplicate computation (two replicas computing the same microbatch as a baseline). Both carry the same tokens,
so a near-copy whose `content` (a hash of the microbatch's targets) is the one of the tensor it matches is not
a replay. Projection directions and token signs are drawn from the monitor's seed: every verifier computes the
same sketches.

Cost: one (rows x hidden) @ (hidden x width) product per tensor, linear in its size; the store holds `keep`
sketches; a comparison is O(keep x batch^2 x width).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

_SALT = 0x5E7C4  # keeps these directions apart from the profile's, drawn from the same seed
SKIPPED_TOKENS = 16
# Early in training a model's rows can all point nearly one way (measured: `bench overhead`'s 12-layer byte model,
# from about step 12 the top direction held 30/32 of the projected rows' energy), and per-sequence sketches of any
# two such tensors then agree whatever their text: honest stage-0 activations scored 0.95-0.99 against tensors of
# other tokens and both replicas of the stage were banned as replays. So a direction that holds most of the
# projected rows' energy (of what the larger ones left; at most DOMINANT_DIRECTIONS of them) is taken off every
# sketch: there, three or four went, and the best honest scores fell to 0.49-0.67. Tensors without such a direction
# (the honest test streams' largest holds 20-40%) lose nothing, so a copy with a little noise still matches it;
# a copy has the same dominant directions as its original, so it matches itself exactly.
DOMINANT_DIRECTIONS = 4
_SLICE_FLOATS = 1 << 18  # 1 MiB of float32: a slice that stays in a core's cache


def content_of(targets: torch.Tensor) -> int:
    """A name for a microbatch's tokens: tensors computed from the same tokens may be near-copies of each other."""
    return zlib.crc32(np.ascontiguousarray(targets.detach().cpu().numpy()).tobytes())


@dataclass(frozen=True)
class ReplayMatch:
    """The tensor is a near-copy of one `sender` sent `age` checks ago: `similarity` of its sequences, in [0, 1]."""

    sender: str
    age: int
    similarity: float


def _dominant_directions(second_moment: torch.Tensor) -> torch.Tensor:
    """The (width, d) axes, largest first, each holding more than half of the energy the larger ones left."""
    energies, axes = torch.linalg.eigh(second_moment.cpu().double())
    energies, axes = energies.flip(0).clamp_min(0), axes.flip(1)
    left = energies.flip(0).cumsum(0).flip(0)  # left[i]: the energy of axes i and after
    count = 0
    while count < min(DOMINANT_DIRECTIONS, len(energies) - 1) and energies[count] > 0.5 * left[count]:
        count += 1
    return axes[:, :count].to(second_moment.dtype)


class ReplaySketcher:
    def __init__(self, hidden_size: int, width: int, seed: int):
        generator = torch.Generator().manual_seed(seed ^ _SALT)
        self.directions = torch.randn(hidden_size, width, generator=generator) / hidden_size**0.5
        self.seed = seed
        self._signs: dict[int, torch.Tensor] = {}

    def _token_signs(self, tokens: int) -> torch.Tensor:
        if tokens not in self._signs:
            generator = torch.Generator().manual_seed(self.seed ^ _SALT ^ tokens)
            self._signs[tokens] = torch.randint(0, 2, (tokens,), generator=generator).float() * 2 - 1
        return self._signs[tokens]

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """(batch, width) unit rows in float16: one sketch per sequence of a (batch, tokens, hidden) tensor.

        Two passes over slices of about 1 MiB (all sequences, a few positions), each centred while it sits in a
        core's cache: the first sums the channels' squares, the second projects. Done on the whole tensor at once,
        the same arithmetic made three tensor-sized temporaries and took 1.7x as long at width 4096 (73 against
        43 ms of CPU per 2 x 1024 x 4096 tensor, docs/decisions.md); the sketches agree to float16 rounding."""
        rows = tensor.detach().float()
        # the first tokens of a sequence carry little context: two sequences that open alike (indentation) have the
        # same rows there, so they are left out
        rows = rows[:, min(SKIPPED_TOKENS, rows.shape[1] // 4) :]
        batch, tokens, hidden = rows.shape
        # what all sequences share at a position is no one sequence's (one sequence: its channels' means)
        shared = rows.mean(dim=0 if batch > 1 else 1, keepdim=True)
        step = max(1, _SLICE_FLOATS // max(1, batch * hidden))
        spans = [(start, min(tokens, start + step)) for start in range(0, tokens, step)]

        def centred(start: int, stop: int) -> torch.Tensor:
            return rows[:, start:stop] - (shared[:, start:stop] if batch > 1 else shared)

        # every channel and every token weighs alike, or a few large channels (or tokens) make every sketch point
        # the same way: channels are scaled to unit spread (folded into the directions) and rows to unit norm
        squares = torch.zeros(hidden, dtype=rows.dtype, device=rows.device)
        for start, stop in spans:
            squares += centred(start, stop).square().sum(dim=(0, 1))
        inverse_spread = (squares / (batch * tokens)).clamp_min(1e-30).rsqrt()
        weights, directions = inverse_spread.square(), self.directions.to(rows.device) * inverse_spread[:, None]
        signs = self._token_signs(tokens).to(rows.device)
        width = directions.shape[1]
        sketch = torch.zeros(batch, width, dtype=rows.dtype, device=rows.device)
        second_moment = torch.zeros(width, width, dtype=rows.dtype, device=rows.device)
        for start, stop in spans:
            part = centred(start, stop)
            row_norms = (part.square() @ weights).sqrt_().clamp_min_(1e-30)
            projected = (part @ directions) / row_norms[..., None]
            sketch += (projected * signs[start:stop, None]).sum(dim=1)
            flat = projected.reshape(-1, width)
            second_moment += flat.T @ flat
        # the directions most rows share are no sequence's own: projected out (the projection commutes with the sum)
        dominant = _dominant_directions(second_moment)
        if dominant.shape[1]:
            dominant = dominant.to(rows.device)
            sketch -= (sketch @ dominant) @ dominant.T
        return (sketch / sketch.norm(dim=1, keepdim=True).clamp_min(1e-30)).half().cpu()


class ReplayStore:
    """The sketches of the last `keep` tensors checked at one boundary, with their sender and content.

    Sketches of another batch size than the first one stored are neither stored nor compared (a monitor without an
    expected shape may see several; a replay keeps its copy's shape).
    """

    def __init__(self, keep: int, threshold: float):
        self.keep, self.threshold = keep, threshold
        self.sketches: torch.Tensor | None = None  # (keep, batch, width) float16, a ring
        self.senders: list[str] = [""] * keep
        self.contents: list[int | None] = [None] * keep
        self.checks = 0

    @property
    def enabled(self) -> bool:
        return self.keep > 0

    def _fits(self, sketch: torch.Tensor) -> bool:
        return self.sketches is None or tuple(self.sketches.shape[1:]) == tuple(sketch.shape)

    def match(self, sketch: torch.Tensor, content: int | None) -> ReplayMatch | None:
        """The most similar stored tensor of other content, if its similarity reaches the threshold."""
        stored = min(self.checks, self.keep)
        if not stored or not self._fits(sketch):
            return None
        cosines = torch.einsum("bw,kcw->kbc", sketch.float(), self.sketches[:stored].float())
        # each sequence's best match in the stored tensor (copies may come shuffled); the worst of those: a copy
        # matches in every sequence, an honest tensor at most by chance in a few
        similarity = cosines.max(dim=2).values.clamp_min(0).min(dim=1).values  # (stored,)
        if content is not None:
            same = torch.tensor([c == content for c in self.contents[:stored]])
            similarity = similarity.masked_fill(same, 0.0)  # the same tokens: a retry or a duplicate computation
        best = int(similarity.argmax())
        if float(similarity[best]) < self.threshold:
            return None
        age = (self.checks - 1 - best) % self.keep + 1 if self.checks > self.keep else self.checks - best
        return ReplayMatch(self.senders[best], age, float(similarity[best]))

    def add(self, sketch: torch.Tensor, sender: str, content: int | None) -> None:
        if not self.enabled or not self._fits(sketch):
            return
        if self.sketches is None:
            self.sketches = torch.zeros((self.keep, *sketch.shape), dtype=torch.float16)
        slot = self.checks % self.keep
        self.sketches[slot] = sketch
        self.senders[slot], self.contents[slot] = sender, content
        self.checks += 1
