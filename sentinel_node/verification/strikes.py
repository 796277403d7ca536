"""Step 7 of SENTINEL: the violation counter with forgiveness, per sender, weighted by the evidence.

A flag barely over a threshold is one strike; a blatant one (far over it, or a copy of another tensor) is two, and
also leaves a blatant mark that is forgiven far more slowly. Honest peers glitch now and then, just over a fence;
they essentially never produce a blatant flag. So a glitch is forgiven after a clean streak, while an attacker who
corrupts one tensor in fifty, blatantly, is banned at its second such tensor, and one who does it sparsely enough
to be forgiven its strikes still collects blatant marks.

Probation (issue 14): a banned peer can come back at once under a fresh identity, so a sender that first shows up in
a running swarm starts on probation until it has passed ``probation`` clean checks. On probation a blatant flag bans
at once and no strike is forgiven; the verifier's audits also draw its work more often (``probation_audit_rate``,
:class:`sentinel_node.pipeline.relay_cache.AuditDraw`). A verifier that has itself recorded fewer than
``probation`` checks puts no one on probation: at its start every sender is new to it, not to the swarm. Honest
newcomers lose nothing by it, as honest peers essentially never produce a blatant flag (docs/decisions.md,
"Identities, liars and quiet verifiers").
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
    founder: bool = False  # first heard while the ledger itself was new: never on probation
    struck_step: int | None = None  # the global step of the last strike a non-blatant flag gave
    flagged_step: int | None = None  # the global step of its last flag that came with one (a lone sender's)
    suspicions: int = 0  # flags that carry no strike (the gradient passage), not yet forgiven: audits decide
    quiet_since: int | None = None  # the global step of its last flag, or of its last strike forgiven by time
    flagged_check: int | None = None  # `checks` at its last flag of any kind

    @property
    def clean(self) -> int:
        """Checks that found nothing wrong."""
        return self.checks - self.flags


class SenderStrikes:
    """Strikes per sender: a flag adds `weight` strikes, `forgive_after` clean checks in a row remove one, and so do
    `forgive_steps` global steps without a flag (0: checks alone), `strike_limit` strikes ban. A blatant flag also
    adds a mark; `blatant_forgive_after` clean checks in a row remove one, `blatant_limit` marks ban. A sender on
    probation (fewer than `probation` clean checks, and not a founder) is banned by its first blatant flag and
    forgiven nothing.

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
        probation: int = 0,
        forgive_steps: int = 0,
        repeat_within: int = 0,
    ):
        self.strike_limit, self.forgive_after = strike_limit, forgive_after
        self.repeat_within = repeat_within
        self.forgive_steps = forgive_steps
        self.probation = probation
        self.recorded = 0  # checks recorded in all, for telling founders from newcomers
        self.blatant_limit, self.blatant_forgive_after = blatant_limit, blatant_forgive_after
        self._standing: RecentSenders[SenderRecord] = RecentSenders(max_senders, SenderRecord)
        self._banned: RecentSenders[SenderRecord] = RecentSenders(max_senders, SenderRecord)

    @property
    def senders(self) -> dict[str, SenderRecord]:
        """Every remembered sender's record (a snapshot: changing the dict changes nothing)."""
        return {**dict(self._standing.items()), **dict(self._banned.items())}

    def _record(self, sender: str) -> SenderRecord:
        banned = self._banned.peek(sender)
        if banned is not None:
            return banned
        known = sender in self._standing
        rec = self._standing.get(sender)
        if not known:
            rec.founder = self.recorded < self.probation
        return rec

    def on_probation(self, sender: str) -> bool:
        """Whether `sender` is still on probation here (an unknown sender is: it has passed no check yet)."""
        if self.probation <= 0 or self.recorded < self.probation:
            return False
        rec = self._banned.peek(sender) or self._standing.peek(sender)
        return rec is None or self._probation(rec)

    def suspect(self, sender: str) -> bool:
        """Whether `sender` holds a strike, a blatant mark or a suspicion not yet forgiven (and is not banned): its
        work is then worth recomputing more often (:class:`sentinel_node.pipeline.relay_cache.AuditDraw`)."""
        rec = self._standing.peek(sender)
        return rec is not None and (rec.strikes > 0 or rec.blatant > 0 or rec.suspicions > 0)

    def _probation(self, rec: SenderRecord) -> bool:
        return self.probation > 0 and not rec.founder and rec.clean < self.probation

    def record(
        self,
        sender: str,
        flagged: bool,
        weight: int = 1,
        blatant: bool = False,
        step: int | None = None,
        now: int | None = None,
        strike: bool = True,
        repeated_only: bool = False,
    ) -> SenderRecord:
        """Counts one check of `sender`; a flag adds `weight` strikes (and a mark when `blatant`), or with `strike`
        False a suspicion only: a flag of a test that cannot tell the sender's lie from honest work gone wrong
        (the gradient passage of a replica whose parameters an attacker disturbed), which makes the sender a
        :meth:`suspect` whose work audits recompute, and is forgiven as a strike is.

        `step` is the global step the check falls in, as the caller knows it independently of the sender (the
        swarm's step estimate): a flag that is not blatant adds no strike in a step in which one already did. The
        microbatches of one step are computed with the same parameters, so their flags are one piece of evidence,
        not several: an honest replica whose tensors all shift together (a loss spike, an averaging round, the only
        replica of a stage with no peers to share the shift) is flagged on several of them in a row. And such a flag
        strikes only when it repeats (the sender was flagged in this step or the one before); an isolated one is a
        suspicion. Where `step` is given the sender has no majority of peers, only the EMA of its own past, which
        lags its honest training; a sender whose tensors stay off the reference crosses check after check and is
        struck in each step from its second flag (docs/decisions.md, "A lone sender's isolated flag").

        `now` is that step for any check (``step`` is given only where flags of one step count once): a clean
        check `forgive_steps` or more steps after the sender's last flag (or last strike forgiven so) forgives a
        strike. Checks alone forgive too slowly where a sender is checked rarely: with eight replicas of a stage a
        replica is checked at a boundary about once in two steps, so 100 clean checks took 200 steps, and an honest
        replica of the full profile that crossed a fence just over its threshold at steps 88 and 144 still held both
        strikes at step 298, when a third just-over crossing banned it (docs/decisions.md, "Strikes are forgiven
        by time too").

        `repeated_only`, for a moderate fence crossing of a sender with peers (with `repeat_within` > 0): the flag
        strikes only when it repeats, the sender's previous flag (of any test) having come within its last
        `repeat_within` checks here; an isolated one is a suspicion. The same rule as a lone sender's, counted in
        the sender's own checks, as a replica of a stage of many is checked once in several steps. Honest replicas'
        crossings are events of training, isolated among their checks; an attacker's tensors cross again and again
        (docs/decisions.md, "An isolated crossing is a suspicion for every sender")."""
        rec = self._record(sender)
        self.recorded += 1
        probation = self._probation(rec)
        rec.checks += 1
        if flagged:
            rec.flags += 1
            rec.clean_streak = 0
            previous, rec.flagged_check = rec.flagged_check, rec.checks
            if now is not None:
                rec.quiet_since = now
            judged_on_repeats = repeated_only and self.repeat_within > 0 and not blatant
            isolated_here = previous is None or rec.checks - previous > self.repeat_within
            if not strike or (judged_on_repeats and isolated_here):
                return self._suspect_more(rec)
            stepped = not blatant and step is not None
            repeated = stepped and rec.struck_step == step
            isolated = stepped and (rec.flagged_step is None or not 0 <= step - rec.flagged_step <= 1)
            if stepped:
                rec.flagged_step = step
            if isolated and not rec.banned:
                return self._suspect_more(rec)
            if not rec.banned and not repeated:
                if stepped:
                    rec.struck_step = step
                rec.strikes += max(1, weight)
                if blatant:
                    rec.blatant += 1
                    rec.blatant_streak = 0
                    if probation:
                        rec.strikes = max(rec.strikes, self.strike_limit)
                self._judge(sender, rec)
        elif not rec.banned:
            rec.clean_streak += 1
            if probation:
                return rec  # nothing is forgiven on probation
            if rec.clean_streak >= self.forgive_after and (rec.strikes > 0 or rec.suspicions > 0):
                _forgive_one(rec)
                rec.clean_streak = 0
            elif self._quiet_long_enough(rec, now):
                _forgive_one(rec)
                rec.quiet_since = now
            rec.blatant_streak += 1
            if rec.blatant_streak >= self.blatant_forgive_after and rec.blatant > 0:
                rec.blatant -= 1
                rec.blatant_streak = 0
        else:
            rec.clean_streak += 1
        return rec

    def _suspect_more(self, rec: SenderRecord) -> SenderRecord:
        """A flag that carries no strike: one suspicion more (at most the strike limit's worth)."""
        rec.suspicions = min(rec.suspicions + 1, self.strike_limit)
        return rec

    def _quiet_long_enough(self, rec: SenderRecord, now: int | None) -> bool:
        if self.forgive_steps <= 0 or now is None or rec.quiet_since is None:
            return False
        if rec.strikes <= 0 and rec.suspicions <= 0:
            return False
        return now - rec.quiet_since >= self.forgive_steps

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


def _forgive_one(rec: SenderRecord) -> None:
    """One strike and one suspicion forgiven (each where there is one)."""
    rec.strikes, rec.suspicions = max(0, rec.strikes - 1), max(0, rec.suspicions - 1)
