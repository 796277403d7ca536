"""``sentinel-node demo``: a whole swarm on this machine, on loopback, with one attacker.

:class:`Demo` builds the demo's swarm on a :class:`~sentinel_node.supervisor.LocalSwarm`: a bootstrap, 3 stages x
2 replicas of which one replica of the middle stage is a red-team attacker (so an honest replica remains on every
stage), 2 verifiers serving every boundary, and a trainer; it shows a live view of training and ends with a
:class:`DemoSummary`.

Trust roots: the demo's swarm is closed (docs/security.md). It creates an organiser key and the verifiers' identity
files first, lists the verifiers' peer ids as the swarm's ``trusted_verifiers`` with ``ban_quorum`` 1 (one trusted
verifier's ban excludes a peer swarm-wide; an open verifier set would need a quorum of at least 2), and gives each
trainer it starts a certificate signed by the organiser (:meth:`Demo.certify`), so both ways of admission run.
Both verifiers still serve every boundary, so losing one does not stop the pipeline.
"""

from __future__ import annotations

import contextlib
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict

from sentinel_node.config import Config, load_config
from sentinel_node.forkserver import ForkServer
from sentinel_node.roles.status import AccountingStatus, VerifierStatus
from sentinel_node.supervisor import LocalSwarm, NodeProcess, Placement, SwarmStartError, follow_json_lines

DEMO_CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "demo.yaml"

__all__ = ["DEMO_CONFIG_PATH", "Demo", "DemoResult", "DemoSettings", "DemoSummary", "SwarmStartError", "run_demo"]


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 40
    attack: str | None = "random"  # None: an honest swarm
    attack_target: str = "both"
    attack_start: int = 14  # after the verifiers' warm-up
    replicas: int = 2  # per stage; on the middle stage one of them is the attacker
    verifiers: int = 2
    config_path: Path = DEMO_CONFIG_PATH
    workdir: Path | None = None  # None: a temporary directory, removed afterwards
    start_timeout: float = 150.0
    eval_every: int = 5
    verify: bool = True  # False: verifiers relay without checking
    microbatch_timeout: float = 20.0
    consensus_timeout: float = 20.0  # seconds to wait, after training, for every node to see the exclusion
    metrics: bool = True  # every node serves Prometheus metrics on a free port
    state: bool = False  # stages keep checkpoints in WORKDIR/state/NAME
    checkpoint_every: int = 10
    trusted_verifiers: bool = True  # False: an open verifier set, where a ban takes two verifiers (ban_quorum 2)
    silent_verifiers: int = 0  # the first N verifiers relay without checking (a verifier that stopped checking)
    placement: Callable[[str], Placement | None] | None = None  # where each node runs (None: here, on loopback)
    forkserver: ForkServer | None = None  # one shared with other swarms (None: the swarm starts its own)


class AttackerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    peer_id: str


class DemoSummary(BaseModel):
    """The demo's verdict (``demo --json`` prints it): did the loss fall, is the attacker excluded in every view,
    was any honest peer struck or excluded, where every microbatch went."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int
    first_loss: float | None
    last_loss: float | None
    first_val_loss: float | None
    last_val_loss: float | None
    loss_fell: bool
    attacker: AttackerInfo | None
    excluded: list[str]
    attacker_excluded_by_every_peer: bool
    honest_excluded: list[str]
    honest_peers_with_strikes: dict[str, dict[str, int]]
    verifier_checks: int
    microbatches: AccountingStatus | None
    tokens_per_s: float | None
    wall_s: float


@dataclass
class DemoResult:
    summary: DemoSummary
    steps: list[dict]


class Demo:
    """The demo swarm: ``with Demo(settings) as demo: demo.start(); demo.train(); demo.summary()``."""

    def __init__(self, settings: DemoSettings = DemoSettings(), echo: Callable[[str], None] = lambda _: None):
        self.settings, self.echo = settings, echo
        self._tempdir = None
        if settings.workdir is None:
            self._tempdir = tempfile.TemporaryDirectory(prefix="sentinel-demo-")
            self.workdir = Path(self._tempdir.name)
        else:
            self.workdir = Path(settings.workdir)
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.config: Config | None = None
        self.swarm: LocalSwarm | None = None
        self.steps: list[dict] = []
        self.trainer_summary: dict | None = None
        self.started = time.monotonic()
        self.attacker: str | None = None
        self.organiser = None  # the organiser's identity, once start() created it

    def __enter__(self) -> Demo:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with _signals_ignored():  # a second Ctrl-C must not cut the stop short and orphan the nodes
            self.stop()

    def stop(self) -> None:
        if self.swarm is not None:
            self.swarm.stop()
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None

    # --- names

    def stage_names(self) -> list[str]:
        n_stages = self.config.pipeline.n_stages
        return [f"stage{k}-{r}" for k in range(n_stages) for r in range(self.settings.replicas)]

    def verifier_names(self) -> list[str]:
        return [f"verifier{i}" for i in range(self.settings.verifiers)]

    def attacker_name(self) -> str | None:
        if self.settings.attack is None:
            return None
        return f"stage{self.config.pipeline.n_stages // 2}-{self.settings.replicas - 1}"

    def node(self, name: str) -> NodeProcess:
        return self.swarm.nodes[name]

    def peer(self, name: str) -> str:
        return self.node(name).peer_id

    def honest_peers(self) -> dict[str, str]:
        """Peer id -> name of every honest stage replica and verifier."""
        names = [n for n in self.stage_names() + self.verifier_names() if n != self.attacker_name()]
        return {self.peer(n): n for n in names if n in self.swarm.nodes}

    # --- starting

    def start(self) -> None:
        """Writes the swarm config (trusting the verifiers it creates identities for) and starts every node but
        the trainer."""
        from dht import create_identity_file, load_identity_file

        settings = self.settings
        base = load_config(settings.config_path)
        if settings.replicas < 2 and settings.attack is not None:
            raise ValueError("with an attacker, every stage needs at least 2 replicas so an honest one remains")
        (self.workdir / "identities").mkdir(parents=True, exist_ok=True, mode=0o700)
        self.swarm = LocalSwarm(
            self.workdir, self.workdir / "swarm.yaml", settings.placement, forkserver=settings.forkserver
        )
        verifier_ids = []
        for name in self.verifier_names():  # a workdir used before keeps its identities
            path = self.swarm.identity(name)
            identity = load_identity_file(path) if path.exists() else create_identity_file(path)
            verifier_ids.append(identity.peer_id)
        organiser = self.organiser_path()
        self.organiser = load_identity_file(organiser) if organiser.exists() else create_identity_file(organiser)
        trust = {"organiser": self.organiser.public_key.decode(), "open_trainers": False}
        if settings.trusted_verifiers:
            trust |= {"trusted_verifiers": verifier_ids, "ban_quorum": 1, "open_verifiers": False}
        else:  # an open verifier set: anyone may verify, a ban takes two verifiers seen for min_voter_age
            trust |= {"trusted_verifiers": [], "ban_quorum": 2, "open_verifiers": True}
        self.config = base.with_overrides(swarm=trust)
        (self.workdir / "swarm.yaml").write_text(yaml.safe_dump(self.config.model_dump(), sort_keys=False))

        self.echo(f"starting a local swarm in {self.workdir}")
        bootstrap = self.swarm.start("bootstrap", "bootstrap", metrics=settings.metrics)
        self.swarm.wait_ready([bootstrap], settings.start_timeout)
        (self.workdir / "initial-peers.txt").write_text("\n".join(bootstrap.maddrs) + "\n")
        self.echo(f"bootstrap {bootstrap.peer_id}; join this swarm, or watch it, with:")
        self.echo(f"  --initial-peers {bootstrap.maddrs[0]}   (also in {self.workdir / 'initial-peers.txt'})")
        self.echo(f"  e.g. sentinel-node swarm status --initial-peers {bootstrap.maddrs[0]}")
        nodes = []
        for name in self.stage_names():
            stage = name.split("-")[0].removeprefix("stage")
            args = ["--stage", stage]
            if name == self.attacker_name():
                args += [
                    "--attack",
                    settings.attack,
                    "--attack-target",
                    settings.attack_target,
                    "--attack-start",
                    str(settings.attack_start),
                ]
            if settings.state:
                args += ["--state-dir", str(self.state_dir(name))]
                args += ["--checkpoint-every", str(settings.checkpoint_every)]
            nodes.append(self.swarm.start(name, "stage", *args, metrics=settings.metrics))
        for i, name in enumerate(self.verifier_names()):
            verify = [] if settings.verify and i >= settings.silent_verifiers else ["--no-verify"]
            nodes.append(self.swarm.start(name, "verifier", *verify, metrics=settings.metrics))
        self.swarm.wait_ready(nodes, settings.start_timeout)
        self.attacker = self.peer(self.attacker_name()) if self.attacker_name() else None
        n_stages = self.config.pipeline.n_stages
        self.echo(
            f"{n_stages} stages x {settings.replicas} replicas, {settings.verifiers} verifiers"
            + (
                f"; attacker {self.attacker_name()} ({self.attacker}) runs '{settings.attack}' "
                f"on {settings.attack_target} from step {settings.attack_start}"
                if self.attacker
                else "; every peer is honest"
            )
            + f" ({time.monotonic() - self.started:.0f}s)"
        )
        for name, node in self.swarm.nodes.items():
            if node.metrics_port is not None:
                self.echo(f"  {name:<10} metrics: curl http://127.0.0.1:{node.metrics_port}/metrics")

    def state_dir(self, name: str) -> Path:
        return self.workdir / "state" / name

    def organiser_path(self) -> Path:
        return self.workdir / "identities" / "organiser.key"

    def certify(self, name: str, role: str = "trainer", days: float = 1.0) -> Path:
        """A certificate for node ``name`` (its identity created if needed), signed by the demo's organiser."""
        from dht import create_identity_file, load_identity_file
        from sentinel_node.organiser import admit, write_certificate

        path = self.swarm.identity(name)
        identity = load_identity_file(path) if path.exists() else create_identity_file(path)
        certificate = admit(self.config, self.organiser_path(), role, identity.peer_id, days=days)
        (self.workdir / "certificates").mkdir(exist_ok=True)
        out = self.workdir / "certificates" / f"{name}.cert"
        write_certificate(certificate, out)
        return out

    # --- training

    def train(
        self, on_step: Callable[[dict], None] | None = None, steps: int | None = None, name: str = "trainer"
    ) -> dict:
        """Runs a trainer (named ``name``) to the end with a live view; returns its summary. ``on_step`` sees each
        step's record (e.g. to kill a node mid-run). A later trainer resumes at the swarm's step."""
        steps = self.settings.steps if steps is None else steps
        trainer = self.start_trainer(name, steps)
        metrics = self.metrics_path(name)
        self.echo(f"{'step':>4} {'loss':>7} {'val':>7} {'tok/s':>7} {'flags':>5} {'strikes':>7}  excluded")
        for record in follow_json_lines(metrics, trainer):
            if record.get("event") == "validation":
                self.echo(f"{'-':>4} {'':>7} {record['val_loss']:7.3f}  (before training)")
            elif record.get("event") == "step":
                self.steps.append(record)
                self.echo(self._step_line(record))
                if on_step is not None:
                    on_step(record)
            elif record.get("event") == "summary":
                self.trainer_summary = record
        code = trainer.process.wait(timeout=30)
        if code != 0 or self.trainer_summary is None:
            raise SwarmStartError(f"the trainer exited with code {code}; its log ends with:\n{trainer.log_tail()}")
        return self.trainer_summary

    def metrics_path(self, name: str = "trainer") -> Path:
        """The JSON lines trainer ``name`` appends (one per step, then a summary), across its restarts."""
        return self.workdir / f"{name}-metrics.jsonl"

    def start_trainer(self, name: str = "trainer", steps: int | None = None) -> NodeProcess:
        """Starts a trainer named ``name`` for ``steps`` global steps (0: until stopped) and waits until it serves;
        its records go to :meth:`metrics_path`. ``LocalSwarm.restart(name)`` starts it again with the same identity,
        certificate and metrics file, and it resumes at the swarm's step."""
        steps = self.settings.steps if steps is None else steps
        metrics = self.metrics_path(name)
        trainer = self.swarm.start(
            name,
            "trainer",
            "--certificate",
            str(self.certify(name)),
            "--steps",
            str(steps),
            "--eval-every",
            str(self.settings.eval_every),
            "--microbatch-timeout",
            str(self.settings.microbatch_timeout),
            "--metrics-out",
            str(metrics),
            "--no-progress",
            metrics=self.settings.metrics,
        )
        self.swarm.wait_ready([trainer], self.settings.start_timeout)
        if trainer.metrics_port is not None:
            self.echo(f"  {name:<10} metrics: curl http://127.0.0.1:{trainer.metrics_port}/metrics")
        return trainer

    def _step_line(self, record: dict) -> str:
        names = {node.peer_id: name for name, node in self.swarm.nodes.items()}
        excluded = ", ".join(names.get(peer, peer[:12]) for peer in record["excluded"]) or "-"
        loss = "-" if record["loss"] is None else f"{record['loss']:.3f}"
        val = "" if record["val_loss"] is None else f"{record['val_loss']:.3f}"
        return (
            f"{record['step']:>4} {loss:>7} {val:>7} {record['tokens_per_s']:>7.0f} {record['flags']:>5} "
            f"{record['strikes']:>7}  {excluded}"
        )

    # --- the verdict

    def views(self) -> dict[str, list[str] | None]:
        """Each live node's (and the trainer's last) view of who is excluded."""
        found = {}
        for name, node in self.swarm.nodes.items():
            if node.role == "bootstrap" or (not node.alive and name != "trainer"):
                continue
            status = node.status()
            found[name] = None if status is None else status.excluded
        return found

    def wait_for_consensus(self, timeout: float) -> dict[str, list[str] | None]:
        """Waits until every live node sees the attacker excluded (or ``timeout``); returns the views."""
        deadline = time.monotonic() + timeout
        while True:
            views = self.views()
            done = self.attacker is None or all(
                view is not None and self.attacker in view
                for name, view in views.items()
                if name != self.attacker_name()
            )
            if done or time.monotonic() > deadline:
                return views
            time.sleep(0.5)

    def summary(self) -> DemoSummary:
        """The demo's verdict: did the loss fall, is the attacker excluded in every view, was any honest peer
        struck (strikes from any verifier) or excluded."""
        trainer = self.trainer_summary or {}
        views = self.wait_for_consensus(self.settings.consensus_timeout)
        honest = self.honest_peers()
        struck: dict[str, dict[str, int]] = {}
        checks = 0
        for name in self.verifier_names():
            status = self.node(name).status()
            if not isinstance(status, VerifierStatus):
                continue
            for peer, record in status.ledger.items():
                checks += record.checks
                if peer in honest and record.strikes:
                    struck.setdefault(honest[peer], {})[name] = record.strikes
        excluded = sorted({peer for view in views.values() if view for peer in view})
        names = {node.peer_id: name for name, node in self.swarm.nodes.items()}
        losses = [s["loss"] for s in self.steps if s["loss"] is not None]
        val_curve = trainer.get("val_curve", [])
        others = {name: view for name, view in views.items() if name != self.attacker_name()}
        accounting = trainer.get("accounting")
        return DemoSummary(
            steps=trainer.get("steps", len(self.steps)),
            first_loss=losses[0] if losses else None,
            last_loss=losses[-1] if losses else None,
            first_val_loss=val_curve[0][1] if val_curve else None,
            last_val_loss=val_curve[-1][1] if val_curve else None,
            loss_fell=bool(len(val_curve) > 1 and val_curve[-1][1] < val_curve[0][1]),
            attacker=None if self.attacker is None else AttackerInfo(name=self.attacker_name(), peer_id=self.attacker),
            excluded=[names.get(peer, peer) for peer in excluded],
            attacker_excluded_by_every_peer=self.attacker is not None
            and all(view is not None and self.attacker in view for view in others.values()),
            honest_excluded=[names[p] for p in excluded if p in honest],
            honest_peers_with_strikes=struck,
            verifier_checks=checks,
            microbatches=None if accounting is None else AccountingStatus.model_validate(accounting),
            tokens_per_s=trainer.get("tokens_per_s"),
            wall_s=round(time.monotonic() - self.started, 1),
        )


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While entered (in the main thread), SIGTERM raises KeyboardInterrupt like Ctrl-C: the demo then stops every
    process it started on its way out, where the default action would end it at once and orphan them all."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(settings: DemoSettings = DemoSettings(), echo: Callable[[str], None] = lambda _: None) -> DemoResult:
    """Starts the demo swarm, trains with a live view through ``echo``, and stops every process it started, also
    when interrupted (Ctrl-C or SIGTERM: KeyboardInterrupt is raised once they are stopped)."""
    with sigterm_interrupts(), Demo(settings, echo) as demo:
        demo.start()
        demo.train()
        summary = demo.summary()
    return DemoResult(summary, demo.steps)


def render_summary(summary: DemoSummary) -> str:
    """The summary as a few readable lines."""
    lines = [
        f"steps {summary.steps} in {summary.wall_s:.0f}s; training loss {_num(summary.first_loss)} -> "
        f"{_num(summary.last_loss)}, validation loss {_num(summary.first_val_loss)} -> "
        f"{_num(summary.last_val_loss)} ({'falling' if summary.loss_fell else 'NOT falling'})",
    ]
    accounting = summary.microbatches
    if accounting is not None:
        lines.append(
            f"microbatches: {accounting.sent} sent, {accounting.succeeded} succeeded, "
            f"{accounting.dropped} dropped by verifiers, {accounting.retried} retried, {accounting.failed} failed"
        )
    if summary.attacker:
        seen = "excluded in every peer's view" if summary.attacker_excluded_by_every_peer else "NOT excluded"
        lines.append(f"attacker {summary.attacker.name}: {seen}")
    lines.append(f"excluded: {', '.join(summary.excluded) or 'nobody'}")
    honest = summary.honest_peers_with_strikes
    lines.append(
        "honest peers excluded: "
        + (", ".join(summary.honest_excluded) or "none")
        + "; honest peers with strikes: "
        + (", ".join(f"{name} {votes}" for name, votes in honest.items()) or "none")
    )
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
