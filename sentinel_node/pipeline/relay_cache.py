"""What a verifier keeps of the microbatches it relayed, for recomputation audits after the fact.

For each (microbatch, boundary) it relayed: the activation it passed to the next stage, the gradient that stage
answered with and it passed back, who sent each, the targets, and (on boundary 0, when known) stage 0's input
tokens; SHA-256 digests of the tensors name them in evidence. The cache is bounded by bytes and evicts the oldest
crossings first. It also remembers at which global steps each stage replica completed a training microbatch
through this verifier, which tells an audit whether that replica must have applied an optimizer step since.
"""

from __future__ import annotations

import random
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from sentinel_node.verification.audit import digest


@dataclass
class Crossing:
    """One microbatch across one boundary b, as the verifier relayed it: ``activation`` from ``sender`` (a stage b
    replica) to the next stage; ``gradient`` from ``receiver`` (the stage b+1 replica that answered) back."""

    microbatch: str
    step: int
    boundary: int
    sender: str
    activation: torch.Tensor
    targets: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    receiver: str | None = None
    gradient: torch.Tensor | None = None
    settled: bool = False  # the gradient went back to the sender: the microbatch is complete on both sides
    tainted: bool = False  # some verifier replaced or dropped one of its tensors: nothing here is the stages' own
    held: bool = False  # the trainer's loss gate held the microbatch back: no gradient, the forward half is all
    dropped: bool = False  # the gradient failed its passage and was not passed back: audited here, served to none
    _digests: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        tensors = (self.activation, self.targets, self.tokens, self.gradient)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def digest(self, name: str) -> str | None:
        """The digest of ``activation``, ``gradient``, ``targets`` or ``tokens`` (computed once)."""
        tensor = getattr(self, name)
        if tensor is None:
            return None
        if name not in self._digests:
            self._digests[name] = digest(tensor)
        return self._digests[name]


class RelayCache:
    """Crossings by (microbatch, boundary), at most ``max_bytes`` of tensors, the oldest evicted first."""

    def __init__(self, max_bytes: int, completions_per_peer: int = 64, max_peers: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evicted = 0
        self._crossings: OrderedDict[tuple[str, int], Crossing] = OrderedDict()
        self._completions: OrderedDict[str, deque[int]] = OrderedDict()
        self._per_peer, self._max_peers = completions_per_peer, max_peers

    def __len__(self) -> int:
        return len(self._crossings)

    def open(self, crossing: Crossing) -> None:
        """Keeps the forward half of a crossing (a crossing of the same microbatch and boundary is replaced: the
        microbatch was sent again)."""
        key = (crossing.microbatch, crossing.boundary)
        self._drop(key)
        self._crossings[key] = crossing
        self.bytes += crossing.nbytes
        self._evict()

    def answer(self, microbatch: str, boundary: int, receiver: str, gradient: torch.Tensor | None) -> None:
        """The gradient the next stage's replica ``receiver`` answered with, as passed back."""
        crossing = self._crossings.get((microbatch, boundary))
        if crossing is None:
            return
        self.bytes -= crossing.nbytes
        crossing.receiver, crossing.gradient = receiver, None if gradient is None else gradient.detach()
        self.bytes += crossing.nbytes
        self._evict()

    def settle(self, microbatch: str, boundary: int, tainted: bool) -> Crossing | None:
        """The microbatch is complete at this boundary; returns its crossing (None if evicted meanwhile, or settled
        already as :meth:`suspected`: its audit is under way)."""
        crossing = self._crossings.get((microbatch, boundary))
        if crossing is None or crossing.dropped:
            return None
        crossing.settled, crossing.tainted = True, tainted
        return crossing

    def hold(self, microbatch: str, boundary: int, receiver: str) -> Crossing | None:
        """The microbatch was held back by the trainer's loss gate after ``receiver`` (the next stage's replica)
        took its activation: no gradient will come, and the forward half is complete (None if evicted)."""
        crossing = self._crossings.get((microbatch, boundary))
        if crossing is not None and crossing.gradient is None:
            crossing.receiver, crossing.settled, crossing.held = receiver, True, True
        return crossing

    def suspected(self, microbatch: str, boundary: int, receiver: str, gradient: torch.Tensor) -> Crossing | None:
        """``receiver`` answered with ``gradient``, which failed its passage and was dropped: the crossing is kept
        whole, as the stages sent it, for an audit of ``receiver`` (None if evicted meanwhile, or its activation was
        not the sender's own)."""
        crossing = self._crossings.get((microbatch, boundary))
        if crossing is None or crossing.tainted or crossing.held:
            return None
        self.answer(microbatch, boundary, receiver, gradient)
        if self._crossings.get((microbatch, boundary)) is not crossing:
            return None
        crossing.settled, crossing.dropped = True, True
        return crossing

    def get(self, microbatch: str, boundary: int) -> Crossing | None:
        return self._crossings.get((microbatch, boundary))

    def _drop(self, key: tuple[str, int]) -> None:
        old = self._crossings.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and len(self._crossings) > 1:
            _, old = self._crossings.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1

    # --- who completed training microbatches when

    def completed(self, peer: str, step: int) -> None:
        """``peer`` completed a training microbatch of global step ``step`` (it ran the backward pass)."""
        steps = self._completions.pop(peer, None) or deque(maxlen=self._per_peer)
        if not steps or steps[-1] != step:
            steps.append(step)
        self._completions[peer] = steps
        while len(self._completions) > self._max_peers:
            self._completions.popitem(last=False)

    def completed_between(self, peer: str, after: int, before: int) -> bool:
        """Whether ``peer`` completed a training microbatch at a step strictly between ``after`` and ``before``."""
        return any(after < step < before for step in self._completions.get(peer, ()))


class AuditDraw:
    """Which settled microbatches to audit: a share ``rate`` of them, drawn by the verifier after the stage has
    answered, from randomness of its own (the operating system's, unless a seed is given for a simulation). A
    replica on probation (a new identity, :mod:`sentinel_node.verification.strikes`) is drawn at
    ``probation_rate`` instead, and a suspect (one holding a strike not yet forgiven) at ``suspect_rate``, when
    those are higher: a sender that was flagged once may be cheating in ways only a recomputation shows (a free-rider
    that hands on a tensor computed for other tokens looks honest to every statistic)."""

    def __init__(
        self, rate: float, seed: int | None = None, probation_rate: float = 0.0, suspect_rate: float = 0.0
    ) -> None:
        self.rate, self.probation_rate, self.suspect_rate = rate, probation_rate, suspect_rate
        self._random = random.Random(secrets.randbits(128) if seed is None else seed)

    def __call__(self, probation: bool = False, suspect: bool = False) -> bool:
        rate = max(self.rate, self.probation_rate if probation else 0.0, self.suspect_rate if suspect else 0.0)
        return rate > 0 and self._random.random() < rate

    def shuffle(self, items: list) -> list:
        items = list(items)
        self._random.shuffle(items)
        return items
