"""Step 7 of SENTINEL: the violation counter with forgiveness, per sender."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SenderRecord:
    strikes: int = 0
    clean_streak: int = 0
    checks: int = 0
    flags: int = 0
    banned: bool = False


class SenderStrikes:
    """A flag adds a strike, `forgive_after` clean checks in a row remove one, `strike_limit` strikes ban.

    A ban is final for this ledger: a banned sender is not forgiven by later clean checks.
    """

    def __init__(self, strike_limit: int, forgive_after: int):
        self.strike_limit, self.forgive_after = strike_limit, forgive_after
        self.senders: dict[str, SenderRecord] = {}

    def record(self, sender: str, flagged: bool) -> SenderRecord:
        rec = self.senders.setdefault(sender, SenderRecord())
        rec.checks += 1
        if flagged:
            rec.flags += 1
            rec.clean_streak = 0
            if not rec.banned:
                rec.strikes += 1
                rec.banned = rec.strikes >= self.strike_limit
        else:
            rec.clean_streak += 1
            if rec.clean_streak >= self.forgive_after and rec.strikes > 0 and not rec.banned:
                rec.strikes -= 1
                rec.clean_streak = 0
        return rec

    def convict(self, sender: str) -> SenderRecord:
        """A proven offence (a recomputation audit failed and confirmed by a second replica): a strike worth the
        whole limit, so a ban."""
        rec = self.senders.setdefault(sender, SenderRecord())
        rec.flags += 1
        rec.clean_streak = 0
        rec.strikes = max(rec.strikes, self.strike_limit)
        rec.banned = True
        return rec

    def peek(self, sender: str) -> SenderRecord:
        """The sender's record, counting nothing."""
        return self.senders.setdefault(sender, SenderRecord())

    def is_banned(self, sender: str) -> bool:
        rec = self.senders.get(sender)
        return rec is not None and rec.banned

    def banned(self) -> list[str]:
        return [sender for sender, rec in self.senders.items() if rec.banned]
