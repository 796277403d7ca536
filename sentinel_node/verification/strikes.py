"""Step 7 of SENTINEL: the violation counter with forgiveness, per sender, weighted by the evidence.

A flag barely over a threshold is one strike; a blatant one (far over it, or a copy of another tensor) is two, and
also leaves a blatant mark that is forgiven far more slowly. Honest peers glitch now and then, just over a fence;
they essentially never produce a blatant flag. So a glitch is forgiven after a clean streak, while an attacker who
corrupts one tensor in fifty, blatantly, is banned at its second such tensor, and one who does it sparsely enough
to be forgiven its strikes still collects blatant marks.
"""

from __future__ import annotations

from dataclasses import dataclass

from sentinel_node.verification.senders import RecentSenders


@dataclass
class SenderRecord:
    strikes: int = 0
    clean_streak: int = 0
    checks: int = 0
    flags: int = 0
    banned: bool = False
    blatant: int = 0  # blatant flags not yet forgiven
    blatant_streak: int = 0  # clean checks since the last blatant flag or the last forgiven mark


class SenderStrikes:
    """Strikes per sender: a flag adds `weight` strikes, `forgive_after` clean checks in a row remove one,
    `strike_limit` strikes ban. A blatant flag also adds a mark; `blatant_forgive_after` clean checks in a row
    remove one, `blatant_limit` marks ban.

    A ban is final for this ledger: a banned sender is not forgiven by later clean checks. At most `max_senders`
    senders in good standing are remembered (the one heard from longest ago is forgotten first), and as many
    banned ones (beyond that the oldest ban is forgotten here; the swarm's exclusion record still stands).
    """

    def __init__(
        self,
        strike_limit: int,
        forgive_after: int,
        blatant_limit: int = 3,
        blatant_forgive_after: int = 1000,
        max_senders: int = 64,
    ):
        self.strike_limit, self.forgive_after = strike_limit, forgive_after
        self.blatant_limit, self.blatant_forgive_after = blatant_limit, blatant_forgive_after
        self._standing: RecentSenders[SenderRecord] = RecentSenders(max_senders, SenderRecord)
        self._banned: RecentSenders[SenderRecord] = RecentSenders(max_senders, SenderRecord)

    @property
    def senders(self) -> dict[str, SenderRecord]:
        """Every remembered sender's record (a snapshot: changing the dict changes nothing)."""
        return {**dict(self._standing.items()), **dict(self._banned.items())}

    def _record(self, sender: str) -> SenderRecord:
        banned = self._banned.peek(sender)
        return banned if banned is not None else self._standing.get(sender)

    def record(self, sender: str, flagged: bool, weight: int = 1, blatant: bool = False) -> SenderRecord:
        """Counts one check of `sender`; a flag adds `weight` strikes (and a mark when `blatant`)."""
        rec = self._record(sender)
        rec.checks += 1
        if flagged:
            rec.flags += 1
            rec.clean_streak = 0
            if not rec.banned:
                rec.strikes += max(1, weight)
                if blatant:
                    rec.blatant += 1
                    rec.blatant_streak = 0
                self._judge(sender, rec)
        elif not rec.banned:
            rec.clean_streak += 1
            if rec.clean_streak >= self.forgive_after and rec.strikes > 0:
                rec.strikes -= 1
                rec.clean_streak = 0
            rec.blatant_streak += 1
            if rec.blatant_streak >= self.blatant_forgive_after and rec.blatant > 0:
                rec.blatant -= 1
                rec.blatant_streak = 0
        else:
            rec.clean_streak += 1
        return rec

    def _judge(self, sender: str, rec: SenderRecord) -> None:
        rec.banned = rec.strikes >= self.strike_limit or rec.blatant >= self.blatant_limit
        if rec.banned:
            self._standing.pop(sender)
            self._banned.put(sender, rec)

    def convict(self, sender: str) -> SenderRecord:
        """A proven offence (a recomputation audit failed and confirmed by a second replica): a strike worth the
        whole limit, so a ban."""
        rec = self._record(sender)
        rec.checks += 1  # an audit is a check: a record never shows more flags than checks
        rec.flags += 1
        rec.clean_streak = 0
        rec.strikes = max(rec.strikes, self.strike_limit)
        if not rec.banned:
            self._judge(sender, rec)
        return rec

    def peek(self, sender: str) -> SenderRecord:
        """The sender's record, counting nothing."""
        return self._record(sender)

    def is_banned(self, sender: str) -> bool:
        return sender in self._banned

    def banned(self) -> list[str]:
        return [sender for sender, _ in self._banned.items()]
