"""``sentinel-node bench soak``: the demo swarm under churn for a long while (issue 14, item 5).

The demo's swarm (:class:`~sentinel_node.demo.Demo`: a bootstrap, 3 stages x 2 replicas of which one replica of the
middle stage attacks, 2 trusted verifiers, a trainer) trains without end while, every ``interval_s``, one node is
faulted: SIGKILLed (its whole process group, as if its machine lost power) and restarted after a short downtime with
the same identity and state directory, or SIGSTOPped (the process group frozen, as a machine that hangs) and
SIGCONTed after a pause. Targets are drawn among the honest stage replicas, the verifiers and the trainer; a
restarted trainer resumes at the swarm's step.

The schedule is drawn up front from a seeded RNG by small pure functions (:func:`plan_faults`: when, which kind,
how long, and a draw; :meth:`Roster.eligible` and :func:`pick`: which node, among those that may be faulted at that
moment), so the same seed and the same recoveries fault the same nodes the same way. Faults keep the interval
whatever the restarts take (a restart on two loaded cores takes minutes), each in a thread of its own, so several
nodes may be down at once; but a fault never takes a stage's last honest replica that is up, nor the last verifier
that is up (either would stall the whole pipeline for the downtime, which says nothing about recovery), and a fault
with nobody eligible is skipped and counted. With two replicas per stage, the middle stage's honest replica is never
a target (its sibling is the attacker, excluded once banned). The attacker is no target either: it stays in, to be
banned, and to stay banned (or be banned again) while verifiers restart.

Checked (:func:`evaluate`; the command exits non-zero when one fails): the validation loss fell; no honest peer was
excluded in any node's view at any time; the attacker was excluded, and is in every live honest view at the end;
every microbatch of a trainer that lived to the end settled exactly once, and a killed trainer lost at most the
step it was on; the step count never repeated a step; no node exited other than by a fault; every restart served
again; nothing this swarm started outlived it, and no long-lived node nor the driver itself gained file descriptors
beyond a small slack.
"""

from __future__ import annotations

import enum
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hivemind.utils import get_logger

from sentinel_node.demo import DEMO_CONFIG_PATH, Demo, DemoSettings
from sentinel_node.processes import descendants, start_time
from sentinel_node.roles.status import TrainerStatus
from sentinel_node.supervisor import NodeProcess, SwarmStartError

logger = get_logger(__name__)

TRAINER = "trainer"
# File descriptors a node's process tree (python, its DHT child, p2pd) may hold more at the end than at the start
# without counting as a leak: p2pd keeps one socket per live connection, and restarted peers come back on new ports
# before the old connections time out. A leak grows with every fault; 30 faults leave far more than this.
FD_SLACK_TREE = 24
FD_SLACK_DRIVER = 4  # the driver's own: the pipes of the nodes it runs (one per node, whatever its restarts)


class FaultKind(enum.Enum):
    KILL = "kill"  # SIGKILL of the process group, a restart after the downtime
    STOP = "stop"  # SIGSTOP of the process group, SIGCONT after the pause


@dataclass(frozen=True)
class Fault:
    """One planned fault: at ``at_s`` seconds into the soak a node is killed or stopped for ``down_s``; ``draw``
    (in [0, 1)) picks which, among the nodes that may be faulted at that moment (:func:`pick`)."""

    at_s: float
    kind: FaultKind
    down_s: float
    draw: float


@dataclass(frozen=True)
class SoakSettings:
    minutes: float = 30.0
    interval_s: float = 60.0  # one fault per interval
    seed: int = 0
    kill_share: float = 0.5  # the rest are SIGSTOP/SIGCONT
    down_s: tuple[float, float] = (3.0, 15.0)  # a killed node's downtime before its restart, or a stop's pause
    settle_steps: int = 3  # steps the trainer must make after the last fault before the soak ends
    settle_timeout_s: float = 300.0
    # A restart is waited for until it serves, up to this long: the 30-minute soak saw restarts of 2-4.5 minutes at a
    # load average of 25-50 on 2 cores (the imports alone took 3 minutes), and one over the 300 s once allowed
    restart_timeout_s: float = 900.0
    poll_s: float = 2.0
    workdir: Path | None = None
    config_path: Path = DEMO_CONFIG_PATH
    attack: str = "random"

    def __post_init__(self) -> None:
        low, high = self.down_s
        if not 0 <= low <= high:
            raise ValueError(f"down_s must be an interval (low <= high), not {self.down_s}")
        if high >= self.interval_s:
            raise ValueError(f"a fault's downtime ({high}s) must be shorter than the interval ({self.interval_s}s)")
        if not 0 <= self.kill_share <= 1:
            raise ValueError(f"kill_share must be within [0, 1], not {self.kill_share}")


# --- the schedule (pure)


@dataclass(frozen=True)
class Roster:
    """Who the soak may fault: the stage replicas by stage, the attacker among them, the verifiers, the trainer."""

    replicas: dict[int, tuple[str, ...]]
    attacker: str | None
    verifiers: tuple[str, ...]
    trainer: str | None

    def eligible(self, down: AbstractSet[str] = frozenset()) -> list[str]:
        """The nodes a fault may hit while the nodes in ``down`` are faulted (killed and not serving again yet, or
        stopped): an honest replica while another honest replica of its stage is up (the attacker does not count:
        once banned it serves nobody, and a stage without a replica stalls the whole pipeline), a verifier while
        another is up (each serves every boundary), the trainer while it is up. Never the attacker."""
        targets = []
        for stage in sorted(self.replicas):
            honest = [name for name in self.replicas[stage] if name != self.attacker]
            up = [name for name in honest if name not in down]
            if len(up) >= 2:
                targets += up
        up = [name for name in self.verifiers if name not in down]
        if len(up) >= 2:
            targets += up
        if self.trainer is not None and self.trainer not in down:
            targets.append(self.trainer)
        return targets


def pick(fault: Fault, eligible: Sequence[str]) -> str | None:
    """The node ``fault`` hits among ``eligible`` (None: nobody may be faulted now, the fault is skipped)."""
    if not eligible:
        return None
    return eligible[min(int(fault.draw * len(eligible)), len(eligible) - 1)]


def plan_faults(settings: SoakSettings) -> list[Fault]:
    """The soak's faults, one per interval from the first interval on, strictly before the end: a kind, a downtime
    and a draw each, from ``random.Random(settings.seed)``."""
    rng = random.Random(settings.seed)
    duration = settings.minutes * 60.0
    faults, at = [], settings.interval_s
    while at < duration:
        kind = FaultKind.KILL if rng.random() < settings.kill_share else FaultKind.STOP
        down = round(rng.uniform(*settings.down_s), 1)
        faults.append(Fault(at_s=at, kind=kind, down_s=down, draw=rng.random()))
        at += settings.interval_s
    return faults


# --- accounting across trainer restarts (pure)


@dataclass(frozen=True)
class TrainerLife:
    """One trainer process, from its start to its kill or its stop: its last accounting, and how it ended."""

    first_step: int | None
    last_step: int | None  # the last step it completed
    sent: int
    succeeded: int
    dropped: int
    failed: int
    retried: int
    in_flight: int  # when it ended: lost with it when it was killed (from its last status, at most 1 s old)
    killed: bool
    abandoned_at_stop: int = 0  # a stopped trainer settles its in-flight microbatches as failed


@dataclass(frozen=True)
class Microbatches:
    sent: int
    succeeded: int
    dropped: int
    failed: int
    retried: int
    lost_with_killed_trainers: int
    abandoned_at_stop: int
    unsettled_in_live_trainers: int  # must be 0: a trainer that lived to the end settles every microbatch


def merge_accounting(lives: Sequence[TrainerLife]) -> Microbatches:
    """Where every microbatch went, over all of a soak's trainer processes."""
    return Microbatches(
        sent=sum(life.sent for life in lives),
        succeeded=sum(life.succeeded for life in lives),
        dropped=sum(life.dropped for life in lives),
        failed=sum(life.failed for life in lives),
        retried=sum(life.retried for life in lives),
        lost_with_killed_trainers=sum(life.in_flight for life in lives if life.killed),
        abandoned_at_stop=sum(life.abandoned_at_stop for life in lives),
        unsettled_in_live_trainers=sum(
            life.sent - life.succeeded - life.dropped - life.failed for life in lives if not life.killed
        ),
    )


def split_lives(records: Sequence[dict], boundaries: Sequence[int]) -> list[list[dict]]:
    """The metrics records of each trainer process: ``boundaries`` are the record counts at each restart."""
    cuts = [0, *boundaries, len(records)]
    return [list(records[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]


def life_of(records: Sequence[dict], killed: bool, last_status: TrainerStatus | None) -> TrainerLife:
    """One trainer process's figures: from its summary when it wrote one (it was stopped), else from the status it
    last wrote (at most an announce period old when it was killed), else from its last step record."""
    steps = [r for r in records if r.get("event") == "step"]
    summary = next((r for r in records if r.get("event") == "summary"), None)
    if summary is not None:
        accounting = summary["accounting"]
    elif last_status is not None:
        accounting = last_status.accounting.model_dump()
    elif steps:
        accounting = steps[-1]["accounting"]
    else:
        accounting = dict.fromkeys(("sent", "succeeded", "dropped", "failed", "retried", "in_flight"), 0)
    abandoned = 0
    if summary is not None:  # failed at the stop: what it settled since its last step
        before = steps[-1]["accounting"]["failed"] if steps else 0
        abandoned = accounting["failed"] - before
    return TrainerLife(
        first_step=steps[0]["step"] if steps else None,
        last_step=steps[-1]["step"] if steps else None,
        sent=accounting["sent"],
        succeeded=accounting["succeeded"],
        dropped=accounting["dropped"],
        failed=accounting["failed"],
        retried=accounting["retried"],
        in_flight=accounting["in_flight"],
        killed=killed,
        abandoned_at_stop=abandoned,
    )


def repeated_steps(records: Sequence[dict]) -> list[int]:
    """Steps that a trainer trained again (each global step is trained once; a restarted trainer continues)."""
    seen, repeated = set(), []
    for record in records:
        if record.get("event") == "step":
            if record["step"] in seen:
                repeated.append(record["step"])
            seen.add(record["step"])
    return repeated


# --- what happened


@dataclass
class FaultRecord:
    at_s: float  # when it was applied, seconds into the soak
    planned_at_s: float
    target: str
    kind: str
    down_s: float
    back_after_s: float | None = None  # from the fault until the target served again (or was continued)
    error: str | None = None  # a restart that did not serve
    skipped: bool = False  # nobody could be faulted at the time
    orphans: list[int] = field(default_factory=list)  # processes of a killed group still alive after the kill


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakReport:
    settings: dict
    wall_s: float
    faults: list[FaultRecord]
    faults_by_kind: dict[str, int]
    faults_by_target: dict[str, dict[str, int]]
    restarts: int
    restart_s: dict  # from a kill until the node served again: count, median, max
    steps: dict  # first, last, trained, trainer processes, gaps at trainer restarts
    microbatches: Microbatches
    trainer_lives: list[TrainerLife]
    loss: dict  # first and last validation loss, and the training loss of the first and last steps
    attacker: dict  # its name, the step and time it was first excluded, windows it was not since, final views
    honest_excluded: dict[str, str]  # honest peer -> where it was seen excluded first
    honest_strikes: dict[str, dict[str, int]]  # at the end, by verifier
    unexpected_exits: list[dict]
    leaks: dict
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def evaluate(
    *,
    loss: dict,
    honest_excluded: dict[str, str],
    attacker: dict,
    microbatches: Microbatches,
    lives: Sequence[TrainerLife],
    microbatches_per_step: int,
    repeated: Sequence[int],
    unexpected_exits: Sequence[dict],
    faults: Sequence[FaultRecord],
    leaks: dict,
) -> list[Check]:
    """The soak's invariants, each a :class:`Check` (pure: the report's figures in, verdicts out)."""
    first, last = loss.get("first_val_loss"), loss.get("last_val_loss")
    worst_loss = max((life.in_flight for life in lives if life.killed), default=0)
    failed_restarts = [f"{f.target} at {f.at_s:.0f}s: {f.error}" for f in faults if f.error]
    orphans = {f.target: f.orphans for f in faults if f.orphans}
    fd_growth = {name: d["end"] - d["start"] for name, d in leaks["fds"].items() if d["end"] is not None}
    fd_growth |= {
        f"{name} (python)": d["own_end"] - d["own_start"]
        for name, d in leaks["fds"].items()
        if d.get("own_end") is not None and d.get("own_start") is not None
    }
    fd_leaks = {name: grown for name, grown in fd_growth.items() if grown > FD_SLACK_TREE}
    driver = leaks["driver_fds"]
    return [
        Check(
            "loss fell",
            first is not None and last is not None and last < first,
            f"validation loss {first} -> {last}",
        ),
        Check("no honest exclusion", not honest_excluded, json.dumps(honest_excluded) if honest_excluded else "0"),
        Check(
            "attacker excluded",
            attacker.get("first_excluded_step") is not None and attacker.get("excluded_at_end_by_every_peer", False),
            f"first at step {attacker.get('first_excluded_step')}, "
            f"in every live view at the end: {attacker.get('excluded_at_end_by_every_peer')}",
        ),
        Check(
            "accounting consistent",
            microbatches.unsettled_in_live_trainers == 0 and worst_loss <= microbatches_per_step,
            f"{microbatches.unsettled_in_live_trainers} unsettled in trainers that lived; "
            f"{microbatches.lost_with_killed_trainers} lost with killed trainers (at most {worst_loss} at once, "
            f"a step is {microbatches_per_step})",
        ),
        Check("no step trained twice", not repeated, f"repeated: {list(repeated)}" if repeated else "none"),
        Check(
            "no unexpected exit",
            not unexpected_exits,
            "; ".join(f"{e['name']} code {e['code']}" for e in unexpected_exits) or "none",
        ),
        Check("every restart served", not failed_restarts, "; ".join(failed_restarts) or "all"),
        Check(
            "no process leaked",
            not leaks["leftovers"] and not orphans,
            f"after stop: {leaks['leftovers'] or 'none'}; after kills: {orphans or 'none'}",
        ),
        Check(
            "no file descriptor leaked",
            not fd_leaks and driver["end"] - driver["start"] <= FD_SLACK_DRIVER,
            f"long-lived nodes' growth {fd_growth} (slack {FD_SLACK_TREE}); driver {driver['start']} -> "
            f"{driver['end']} (slack {FD_SLACK_DRIVER})",
        ),
    ]


# --- file descriptors


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def tree_fds(pid: int) -> int | None:
    """Open file descriptors of ``pid`` and every process below it (a node: python, its DHT child, p2pd)."""
    own = fd_count(pid)
    if own is None:
        return None
    return own + sum(count for child in descendants(pid) if (count := fd_count(child)) is not None)


# --- the driver


class Soak:
    """Runs the soak: ``Soak(settings).run()`` starts the swarm, applies the schedule, stops every process, and
    returns the :class:`SoakReport`."""

    def __init__(self, settings: SoakSettings = SoakSettings(), echo: Callable[[str], None] = lambda _: None):
        self.settings, self.echo = settings, echo
        self.demo = Demo(
            DemoSettings(
                steps=0,
                attack=settings.attack,
                workdir=settings.workdir,
                config_path=settings.config_path,
                state=True,
                metrics=False,
                start_timeout=400.0,
            ),
            echo=echo,
        )
        self.faults: list[FaultRecord] = []
        self.trainer_cuts: list[int] = []  # metrics record counts at each trainer restart
        self.killed_statuses: list[TrainerStatus | None] = []  # the status each killed trainer last wrote
        self.honest_excluded: dict[str, str] = {}
        self.unexpected_exits: list[dict] = []
        self.down: set[str] = set()  # faulted nodes: killed and not serving again yet, or stopped
        # Faults run in threads of their own (a restart on two loaded cores can take minutes, longer than the
        # interval); this lock keeps their kills and restarts apart from each other and from the observer
        self.lock = threading.Lock()
        self.started = 0.0

    # --- running

    def run(self) -> SoakReport:
        demo, settings = self.demo, self.settings
        driver_start = fd_count(os.getpid())
        try:
            demo.start()
            demo.start_trainer(TRAINER, steps=0)
            self.started = time.monotonic()
            self._wait_for_steps(3, timeout=settings.settle_timeout_s)
            self.started = time.monotonic()  # the schedule's clock starts once the swarm trains
            start_fds = {name: (node.process.pid, tree_fds(node.process.pid)) for name, node in self._nodes()}
            start_own = {name: fd_count(node.process.pid) for name, node in self._nodes()}
            driver_mid = fd_count(os.getpid())
            replicas: dict[int, list[str]] = {}
            for name in demo.stage_names():
                replicas.setdefault(int(name.split("-")[0].removeprefix("stage")), []).append(name)
            roster = Roster(
                replicas={k: tuple(v) for k, v in replicas.items()},
                attacker=demo.attacker_name(),
                verifiers=tuple(demo.verifier_names()),
                trainer=TRAINER,
            )
            plan = plan_faults(settings)
            self.echo(
                f"soak: {len(plan)} faults over {settings.minutes:g} minutes among {', '.join(roster.eligible())}"
            )
            threads = []
            for fault in plan:
                self._idle_until(self.started + fault.at_s)
                thread = self._fault(fault, roster)
                if thread is not None:
                    threads.append(thread)
            self._idle_until(self.started + settings.minutes * 60.0)
            deadline = time.monotonic() + settings.restart_timeout_s + settings.down_s[1] + 30
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                self._idle_for(settings.poll_s)
            settled_from = self._step_count()
            self._wait_for_steps(settled_from + settings.settle_steps, timeout=settings.settle_timeout_s)
            views = demo.wait_for_consensus(60.0)
            self._observe()
            end_fds = {
                name: tree_fds(node.process.pid) if node.process.pid == start_fds[name][0] else None
                for name, node in self._nodes()
                if name in start_fds
            }
            end_own = {
                name: fd_count(node.process.pid) if node.process.pid == start_fds[name][0] else None
                for name, node in self._nodes()
                if name in start_fds
            }
            driver_end = fd_count(os.getpid())
            honest_strikes = self._honest_strikes()
            trainer_status = self._stop_trainer()
            records = self._records()
        finally:
            demo.stop()
        leftovers = demo.swarm.leftovers() if demo.swarm is not None else {}
        return self._report(
            records,
            views,
            honest_strikes,
            trainer_status,
            leaks={
                "leftovers": {str(pid): name for pid, name in leftovers.items()},
                "fds": {
                    name: {
                        "start": count,
                        "end": end_fds.get(name),
                        "own_start": start_own.get(name),  # the node's python process alone
                        "own_end": end_own.get(name),
                    }
                    for name, (_pid, count) in start_fds.items()
                    if count is not None
                },
                "driver_fds": {"before_swarm": driver_start, "start": driver_mid, "end": driver_end},
            },
        )

    def _nodes(self) -> list[tuple[str, NodeProcess]]:
        with self.lock:
            return list(self.demo.swarm.nodes.items())

    def _now(self) -> float:
        return time.monotonic() - self.started

    def _fault(self, fault: Fault, roster: Roster) -> threading.Thread | None:
        """Picks the fault's target among those that may be faulted now and runs the fault in a thread."""
        with self.lock:
            eligible = roster.eligible(frozenset(self.down))
            name = pick(fault, eligible)
            record = FaultRecord(
                at_s=round(self._now(), 1),
                planned_at_s=fault.at_s,
                target=name or "-",
                kind=fault.kind.value,
                down_s=fault.down_s,
            )
            self.faults.append(record)
            if name is None:
                record.error = None
                record.skipped = True
                self.echo(f"[{record.at_s:7.1f}s] skipped: nobody may be faulted now (down: {sorted(self.down)})")
                return None
            self.down.add(name)
        self.echo(f"[{record.at_s:7.1f}s] {fault.kind.value} {name} for {fault.down_s:.1f}s")
        thread = threading.Thread(target=self._apply, args=(fault, name, record), name=f"fault-{name}", daemon=True)
        thread.start()
        return thread

    def _apply(self, fault: Fault, name: str, record: FaultRecord) -> None:
        swarm = self.demo.swarm
        began = time.monotonic()
        try:
            if fault.kind is FaultKind.STOP:
                with self.lock:
                    swarm.kill(name, signal.SIGSTOP)
                time.sleep(fault.down_s)
                with self.lock:
                    swarm.kill(name, signal.SIGCONT)
                record.back_after_s = round(time.monotonic() - began, 1)
                return
            with self.lock:
                node = swarm.nodes[name]
                group = {pid: start_time(pid) for pid in [node.process.pid, *descendants(node.process.pid)]}
                swarm.kill(name, signal.SIGKILL)
                if name == TRAINER:  # before the restart overwrites them
                    self.killed_statuses.append(self._trainer_status())
                    self.trainer_cuts.append(len(self._records()))
            time.sleep(fault.down_s)
            record.orphans = [pid for pid, started in group.items() if _alive(pid) and start_time(pid) == started]
            with self.lock:
                restarted = swarm.restart(name)
            try:
                swarm.wait_ready([restarted], self.settings.restart_timeout_s)
            except SwarmStartError as e:
                record.error = str(e)[-600:]
                logger.warning(f"soak: {name} did not serve again: {e}")
                return
            record.back_after_s = round(time.monotonic() - began, 1)
        except Exception as e:  # noqa: BLE001 - recorded (and failing the soak) rather than lost in a thread
            record.error = f"{type(e).__name__}: {e}"
            logger.warning(f"soak: the fault on {name} failed: {e}", exc_info=True)
        finally:
            with self.lock:
                self.down.discard(name)
            self.echo(f"[{self._now():7.1f}s]   {name} back after {record.back_after_s}s")

    def _idle_for(self, seconds: float) -> None:
        self._idle_until(time.monotonic() + seconds)

    def _idle_until(self, deadline: float) -> None:
        """Waits, watching the swarm every poll: honest exclusions in any node's view, nodes that exited."""
        while True:
            self._observe()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(self.settings.poll_s, left))

    def _observe(self) -> None:
        honest = self._honest()
        for name, node in self._nodes():
            if node.role == "bootstrap":
                continue
            if not node.alive:
                with self.lock:
                    expected = name in self.down
                if not expected and not any(e["pid"] == node.process.pid for e in self.unexpected_exits):
                    code = node.process.poll()
                    self.unexpected_exits.append(
                        {
                            "name": name,
                            "pid": node.process.pid,
                            "code": code,
                            "at_s": round(self._now(), 1),
                            "log": node.log_tail(1500),
                        }
                    )
                    logger.warning(f"soak: {name} exited with code {code} unasked")
                continue
            try:
                status = node.status()
            except ValueError:
                continue
            for peer in status.excluded if status is not None else []:
                if peer in honest and honest[peer] not in self.honest_excluded:
                    # who struck it, as that node read the records: what tells a ban apart from a view's glitch
                    by = {honest.get(v, v[:12]): n for v, n in status.strikes.get(peer, {}).items()}
                    self.honest_excluded[honest[peer]] = f"in {name}'s view at {self._now():.0f}s (strikes by {by})"

    def _honest(self) -> dict[str, str]:
        with self.lock:
            honest = self.demo.honest_peers()
            trainer = self.demo.swarm.nodes.get(TRAINER)
        if trainer is not None and trainer.peer_id:
            honest[trainer.peer_id] = TRAINER
        return honest

    def _records(self) -> list[dict]:
        path = self.demo.metrics_path(TRAINER)
        records = []
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        return records

    def _step_count(self) -> int:
        return sum(1 for r in self._records() if r.get("event") == "step")

    def _wait_for_steps(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._step_count() < count and time.monotonic() < deadline:
            self._idle_for(self.settings.poll_s)

    def _trainer_status(self) -> TrainerStatus | None:
        try:
            status = self.demo.node(TRAINER).status()
        except ValueError:
            return None
        return status if isinstance(status, TrainerStatus) else None

    def _stop_trainer(self) -> TrainerStatus | None:
        """SIGTERM to the trainer (it settles what is in flight and writes its summary), then its last status."""
        node = self.demo.node(TRAINER)
        with self.lock:
            self.down.add(TRAINER)
        if node.alive:
            node.process.send_signal(signal.SIGTERM)
            try:
                node.process.wait(timeout=90)
            except Exception:  # noqa: BLE001 - the swarm's stop kills it; the report says it wrote no summary
                logger.warning("soak: the trainer did not stop within 90s of SIGTERM")
        return self._trainer_status()

    def _honest_strikes(self) -> dict[str, dict[str, int]]:
        honest, struck = self._honest(), {}
        for name in self.demo.verifier_names():
            try:
                status = self.demo.node(name).status()
            except ValueError:
                continue
            for peer, record in getattr(status, "ledger", {}).items():
                if peer in honest and record.strikes:
                    struck.setdefault(honest[peer], {})[name] = record.strikes
        return struck

    # --- the report

    def _report(self, records, views, honest_strikes, final_status, leaks) -> SoakReport:
        demo, settings = self.demo, self.settings
        lives_records = split_lives(records, self.trainer_cuts)
        statuses = [*self.killed_statuses, final_status]
        lives = [
            life_of(part, killed=i < len(self.trainer_cuts), last_status=statuses[i])
            for i, part in enumerate(lives_records)
        ]
        microbatches = merge_accounting(lives)
        steps = [r for r in records if r.get("event") == "step"]
        honest = self._honest()
        for record in steps:  # the trainer's view at every step, beside the polled status files
            for peer in record["excluded"]:
                if peer in honest and honest[peer] not in self.honest_excluded:
                    self.honest_excluded[honest[peer]] = f"in the trainer's view at step {record['step']}"
        # every trainer process validates when it starts (a "validation" record), then every eval_every steps
        validations = [
            (r["step"], r["val_loss"])
            for r in records
            if r.get("event") in ("validation", "step") and r.get("val_loss") is not None
        ]
        losses = [r["loss"] for r in steps if r.get("loss") is not None]
        window = 10
        loss = {
            "first_val_loss": validations[0][1] if validations else None,
            "first_val_step": validations[0][0] if validations else None,
            "last_val_loss": validations[-1][1] if validations else None,
            "last_val_step": validations[-1][0] if validations else None,
            "first_train_loss": round(sum(losses[:window]) / len(losses[:window]), 4) if losses else None,
            "last_train_loss": round(sum(losses[-window:]) / len(losses[-window:]), 4) if losses else None,
        }
        attacker = self._attacker(steps, views)
        applied = [f for f in self.faults if not f.skipped]
        by_kind = {kind.value: sum(f.kind == kind.value for f in applied) for kind in FaultKind}
        by_target: dict[str, dict[str, int]] = {}
        for f in applied:
            by_target.setdefault(f.target, dict.fromkeys(by_kind, 0))[f.kind] += 1
        gaps = [
            {"killed_after": before[-1]["step"], "resumed_at": after[0]["step"]}
            for before, after in zip(
                [[r for r in part if r.get("event") == "step"] for part in lives_records],
                [[r for r in part if r.get("event") == "step"] for part in lives_records[1:]],
                strict=False,
            )
            if before and after
        ]
        leaks["driver_fds"].setdefault("end", None)
        repeated = repeated_steps(records)
        checks = evaluate(
            loss=loss,
            honest_excluded=self.honest_excluded,
            attacker=attacker,
            microbatches=microbatches,
            lives=lives,
            microbatches_per_step=demo.config.pipeline.microbatches_per_step,
            repeated=repeated,
            unexpected_exits=self.unexpected_exits,
            faults=self.faults,
            leaks=leaks,
        )
        return SoakReport(
            settings={k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()},
            wall_s=round(self._now(), 1),
            faults=self.faults,
            faults_by_kind=by_kind,
            faults_by_target=by_target,
            restarts=sum(f.kind == FaultKind.KILL.value and f.back_after_s is not None for f in applied),
            restart_s=_spread([f.back_after_s for f in applied if f.kind == FaultKind.KILL.value]),
            steps={
                "first": steps[0]["step"] if steps else None,
                "last": steps[-1]["step"] if steps else None,
                "trained": len(steps),
                "trainer_processes": len(lives),
                "gaps_at_trainer_restarts": gaps,
                "skipped_faults": sum(f.skipped for f in self.faults),
            },
            microbatches=microbatches,
            trainer_lives=lives,
            loss=loss,
            attacker=attacker,
            honest_excluded=dict(self.honest_excluded),
            honest_strikes=honest_strikes,
            unexpected_exits=self.unexpected_exits,
            leaks=leaks,
            checks=checks,
        )

    def _attacker(self, steps: list[dict], views: dict[str, list[str] | None]) -> dict:
        demo = self.demo
        peer, name = demo.attacker, demo.attacker_name()
        if peer is None:
            return {}
        first, windows, out_since = None, [], None
        for record in steps:
            excluded = peer in record["excluded"]
            if excluded and first is None:
                first = record
            if first is not None and not excluded and out_since is None:
                out_since = record["step"]
            if excluded and out_since is not None:
                windows.append([out_since, record["step"] - 1])
                out_since = None
        if out_since is not None:
            windows.append([out_since, steps[-1]["step"]])
        others = {n: v for n, v in views.items() if n != name}
        return {
            "name": name,
            "peer_id": peer,
            "first_excluded_step": None if first is None else first["step"],
            "not_excluded_windows": windows,  # steps after its first ban when the trainer's view did not exclude it
            "excluded_at_end_by_every_peer": bool(others)
            and all(v is not None and peer in v for v in others.values()),
            "views_without_it": sorted(n for n, v in others.items() if v is None or peer not in v),
        }


def _spread(values: Sequence[float | None]) -> dict:
    found = sorted(v for v in values if v is not None)
    if not found:
        return {"count": 0, "median": None, "max": None}
    return {"count": len(found), "median": found[len(found) // 2], "max": found[-1]}


def _alive(pid: int) -> bool:
    from sentinel_node.processes import alive

    return alive(pid)


def run_soak(settings: SoakSettings = SoakSettings(), echo: Callable[[str], None] = lambda _: None) -> SoakReport:
    """Runs the soak (every process it started stopped, also when interrupted) and returns its report."""
    from sentinel_node.demo import sigterm_interrupts

    with sigterm_interrupts():
        return Soak(settings, echo).run()


def write_report(report: SoakReport, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "soak.json"
    path.write_text(json.dumps(report.as_dict(), indent=2, default=str))
    return path


def table(report: SoakReport) -> str:
    """The report as a short table for people."""
    s, m, loss, a = report.steps, report.microbatches, report.loss, report.attacker
    kinds = ", ".join(f"{k} {v}" for k, v in report.faults_by_kind.items())
    resumed = ", ".join(f"{g['killed_after']}->{g['resumed_at']}" for g in s["gaps_at_trainer_restarts"]) or "-"
    lines = [
        f"churn soak: {report.settings['minutes']:g} min (+ start and settle: {report.wall_s:.0f}s), "
        f"seed {report.settings['seed']}, a fault every {report.settings['interval_s']:g}s",
        f"faults: {sum(report.faults_by_kind.values())} ({kinds}), "
        f"restarts {report.restarts} (kill to serving again: median {report.restart_s['median']}s, max "
        f"{report.restart_s['max']}s), skipped (nobody could be faulted) {s['skipped_faults']}",
        f"  {'target':<10} {'kill':>4} {'stop':>4}",
        *(f"  {t:<10} {c['kill']:>4} {c['stop']:>4}" for t, c in sorted(report.faults_by_target.items())),
        f"steps {s['first']} -> {s['last']} ({s['trained']} trained, {s['trainer_processes']} trainer processes; "
        f"after trainer kills, last step -> resumed at: {resumed})",
        f"validation loss {loss['first_val_loss']} (step {loss['first_val_step']}) -> {loss['last_val_loss']} "
        f"(step {loss['last_val_step']}); training loss {loss['first_train_loss']} -> {loss['last_train_loss']}",
        f"microbatches: sent {m.sent}, succeeded {m.succeeded}, dropped {m.dropped}, failed {m.failed} "
        f"(of which abandoned at the final stop {m.abandoned_at_stop}), retried {m.retried}, "
        f"lost with killed trainers {m.lost_with_killed_trainers}, unsettled in live trainers "
        f"{m.unsettled_in_live_trainers}",
    ]
    if a:
        lines.append(
            f"attacker {a['name']}: first excluded at step {a['first_excluded_step']}; not excluded since: "
            f"{a['not_excluded_windows'] or 'never'}; "
            f"in every live view at the end: {a['excluded_at_end_by_every_peer']}"
        )
    lines.append(
        f"honest exclusions: {len(report.honest_excluded)}"
        + (f" {report.honest_excluded}" if report.honest_excluded else "")
        + f"; honest peers with strikes at the end: {report.honest_strikes or 'none'}"
    )
    fds = report.leaks["fds"]
    lines.append(
        f"leaks: processes after stop {len(report.leaks['leftovers'])}; fds of long-lived nodes (process tree) "
        + ", ".join(
            f"{n} {d['start']}->{d['end']} (python {d.get('own_start')}->{d.get('own_end')})"
            for n, d in fds.items()
            if d["end"] is not None
        )
        + f"; driver {report.leaks['driver_fds']['start']}->{report.leaks['driver_fds']['end']}"
    )
    lines += [f"{'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}" for c in report.checks]
    return "\n".join(lines)
