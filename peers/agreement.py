"""Verifiers that stop checking, noticed by the trainer (issue 14).

A verifier that relays without checking costs nothing while every stage is honest and hides everything once one is
not: its boundary's tensors reach the next stage unchecked. Nobody needs to trust its word to notice. The trainer
sends every microbatch along a route it drew at random, a verifier per boundary chosen regardless of the senders,
and each reply says which boundaries replaced a tensor (its ``taint``). So the verifiers of one boundary are handed
the same mixture of tensors and, if they all check, flag about the same share of them. A verifier that flags far
fewer than the others of its boundary did over the same recent microbatches is *quiet*.

Two tests, over each boundary's last ``window`` judged relays (a relay counts when no other boundary tainted the
microbatch, since a tainted microbatch is not judged downstream). Per boundary: verifier V relayed n and flagged f; the
others flagged F of N; under "V judges as they do" its flags are Binomial(n, F / (N + 1)), and V is quiet when P(X <=
f) < ``alpha`` and the others flagged at least ``min_flags``. With V and the others relaying as many tensors each, V is
noticed once the others have flagged about ln(1 / alpha) tensors (9 at the default alpha 1e-4) while it flagged none.
Per sender (the stage replicas on either side of the boundary, since the taint does not say which direction was
replaced): the same test on the relays of one sender from the first time any verifier flagged it (an attacker that
turns later was honest before, and its honest relays would dilute the rate), once the others flagged it at least
``min_sender_flags`` times. That one is what notices a silent verifier after an honest one banned an attacker: the
honest verifier then refuses the attacker (below an open set's quorum the attacker is not excluded), every one of the
attacker's microbatches goes through the silent one, and two flags out of two by the honest verifier make nine
unflagged relays by the other improbable. The window lets a verifier that checks again (a restarted one, out of its
warm-up) back in.

What it cannot tell: a quiet verifier from a lying one that flags honest tensors, since the others look quiet next to
a liar. So a trainer acts on it (keeps the quiet verifier off its routes while another serves the boundary) only in a
closed verifier set, where verifiers are trusted not to lie and with a quorum of one already exclude alone; in an
open set it says so, in its log and its status, and routes as before (docs/security.md).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_WINDOW = 400
DEFAULT_ALPHA = 1e-4
DEFAULT_MIN_FLAGS = 5
DEFAULT_MIN_SENDER_FLAGS = 2


@dataclass(frozen=True)
class Quiet:
    """A verifier that flagged less than the others of its boundary (of one ``sender``'s tensors, or of all when
    None): ``flags`` of ``relays`` against their ``others_flags`` of ``others_relays``; ``p`` the chance of so few
    flags had it judged as they do."""

    verifier: str
    boundary: int
    relays: int
    flags: int
    others_relays: int
    others_flags: int
    p: float
    sender: str | None = None


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (exact for the window's sizes)."""
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0 if k < n else 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        for i in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


class VerifierAgreement:
    """The recent judged relays of each boundary, as the trainer saw them; :meth:`quiet` names the quiet verifiers."""

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        alpha: float = DEFAULT_ALPHA,
        min_flags: int = DEFAULT_MIN_FLAGS,
        min_sender_flags: int = DEFAULT_MIN_SENDER_FLAGS,
    ) -> None:
        if window < 2 or not 0 < alpha < 1 or min_flags < 1 or min_sender_flags < 1:
            raise ValueError(
                f"window >= 2, 0 < alpha < 1 and min_flags, min_sender_flags >= 1, got {window}, {alpha}, "
                f"{min_flags}, {min_sender_flags}"
            )
        self.window, self.alpha = window, alpha
        self.min_flags, self.min_sender_flags = min_flags, min_sender_flags
        self._relays: dict[int, deque[tuple[str, tuple[str, ...], bool]]] = {}

    def settled(
        self, verifiers: dict[int, str], taint: Iterable[int], senders: dict[int, tuple[str, ...]] | None = None
    ) -> None:
        """One microbatch came back: ``verifiers`` maps each boundary to the verifier its route relayed it through,
        ``senders`` to the stage replicas on either side of it, ``taint`` the boundaries that replaced one of its
        tensors."""
        tainted = set(taint)
        senders = senders or {}
        for boundary, verifier in verifiers.items():
            if tainted - {boundary}:
                continue  # tainted elsewhere: this boundary may not have judged it
            relays = self._relays.setdefault(boundary, deque(maxlen=self.window))
            relays.append((verifier, tuple(senders.get(boundary, ())), boundary in tainted))

    def quiet(self) -> list[Quiet]:
        """The verifiers that flagged improbably few of their boundary's recent tensors (or of one sender's), most
        certain first, each named once."""
        found: dict[str, Quiet] = {}
        for boundary, relays in self._relays.items():
            groups: dict[str | None, tuple[Counter, Counter]] = {None: (Counter(), Counter())}
            for verifier, senders, flagged in relays:
                for sender in (None, *senders):
                    if sender not in groups:
                        if not flagged:
                            continue  # a sender's relays count from its first flag: before it, it may have been honest
                        groups[sender] = (Counter(), Counter())
                    n, f = groups[sender]
                    n[verifier] += 1
                    f[verifier] += flagged
            for sender, (n, f) in groups.items():
                least = self.min_flags if sender is None else self.min_sender_flags
                total_n, total_f = sum(n.values()), sum(f.values())
                for verifier in n:
                    others_n, others_f = total_n - n[verifier], total_f - f[verifier]
                    if others_f < least:
                        continue
                    # the others' rate shrunk by one relay: two flags of two are not a certainty
                    p = binomial_cdf(f[verifier], n[verifier], others_f / (others_n + 1))
                    if p < self.alpha and (verifier not in found or p < found[verifier].p):
                        found[verifier] = Quiet(
                            verifier, boundary, n[verifier], f[verifier], others_n, others_f, p, sender
                        )
        return sorted(found.values(), key=lambda q: q.p)
