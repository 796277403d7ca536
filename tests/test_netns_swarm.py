"""A swarm across hosts: every node in a network namespace of its own (tests/netns.py), on addresses of the test's
own, the pipeline's traffic crossing real links and a real NAT.

One swarm for the module (2 stages, to keep it small on two cores): a bootstrap; stage 0 with two replicas,
stage0-0 and stage0-1; stage 1's only replica, stage1-0, on a host behind a NAT router (masqueraded, no inbound
port) that joins with ``--use-auto-relay``; two trusted verifiers; a trainer. While the trainer trains, stage0-1's
host is cut off from everyone (every packet on its link dropped) for PARTITION_S seconds, longer than an
announcement lives, then healed; then the same for verifier1. The tests read what the nodes wrote (their status
files, the trainer's step records and summary) and assert:

- training went on through the other replicas while one was cut off, and no microbatch was lost or settled twice;
- the cut-off replica rejoined, took the stage's state from the live replica and served again; the cut-off
  verifier relayed again;
- every node's view of who is excluded converged (no honest peer excluded or struck anywhere);
- the NATed replica found it cannot be reached directly, was announced as relayed, and served every microbatch of
  stage 1, over the connections it opened out through the NAT.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import netns
import pytest
import yaml

from sentinel_node.config import load_config
from sentinel_node.demo import DEMO_CONFIG_PATH, Demo, DemoSettings
from sentinel_node.roles.status import StageStatus, VerifierStatus
from sentinel_node.supervisor import Placement

STEPS = 40
CUT_STAGE_AT = 3  # step at which stage0-1 is cut off
PARTITION_S = 16.0  # longer than the demo config's announce_ttl (12 s): the cut node drops out of every view
AFTER_HEAL = 3  # steps the healed stage replica serves before the verifier is cut
# After its heal the verifier is back on routes once its announcement (expired while it was cut) is stored again
# and read into the trainer's and the stages' views: 11 s on idle cores (status files, written every 2 s, showed
# its first relay 11.0-11.6 s after the heal). Steps after the partitions take 0.2 s there, so the run's last 30
# steps took 8 s and it relayed nothing (CI-like run, 2026-12-03). Until it relays, the trainer is made a slow one
# (stopped, SIGSTOP, for what is left of PACE_S after each step, then continued): 30 s for it whatever the speed of
# the machine, and the claim stays about the running trainer taking the healed verifier back.
PACE_S = 1.0

# the swarm starts and trains in the fixture; on two cores shared with other swarms (load 25-40) that took 12-15
# minutes, so the limit leaves room (see docs/reliability.md for the measured times)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, forkserver) -> Iterator[Demo]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    workdir = tmp_path_factory.mktemp("netns")
    config = load_config(DEMO_CONFIG_PATH).with_overrides(pipeline={"n_stages": 2})
    config_path = workdir / "two-stages.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(), sort_keys=False))
    with netns.Network() as network:
        hosts = {
            name: network.add(name, hidden=name == "stage1-0")
            for name in ("bootstrap", "stage0-0", "stage0-1", "stage1-0", "verifier0", "verifier1", "trainer")
        }

        def place(name: str) -> Placement:
            host = hosts[name]
            return Placement(host=host.ip, args=("--use-auto-relay",) if host.hidden else (), netns=host.namespace)

        settings = DemoSettings(
            forkserver=forkserver,
            steps=STEPS,
            attack=None,
            replicas=1,
            verifiers=2,
            config_path=config_path,
            workdir=workdir,
            eval_every=STEPS,
            metrics=False,  # a metrics port listens on its namespace's loopback: out of this process's reach
            start_timeout=300.0,
            placement=place,
        )
        with Demo(settings) as demo:
            demo.network = network
            demo.start()
            second = demo.swarm.start("stage0-1", "stage", "--stage", "0")
            demo.swarm.wait_ready([second], settings.start_timeout)
            demo.events = []
            chaos = Chaos(demo)
            demo.train(on_step=chaos)
            demo.chaos = chaos
            demo.result = demo.summary()
            yield demo
        assert not demo.swarm.leftovers()
    assert not network.leftovers()


class Chaos:
    """Cuts stage0-1 off at CUT_STAGE_AT and heals it PARTITION_S later, once the other replica's status shows it
    served since the cut; AFTER_HEAL steps later, does the same to verifier1 (healed once verifier0 relayed since).
    Remembers what the nodes said at each moment. After the last heal, makes the trainer slow until verifier1
    relays again (PACE_S).

    Waiting on what the other replica did, not only on the clock: a step whose microbatches were all routed to the
    cut replica waits out their deadline (20 s, longer than the partition), and the retries the other replica then
    served reached its status file (written every announce period) after the heal was due."""

    def __init__(self, demo: Demo) -> None:
        self.demo = demo
        self.phase = "before"
        self.moments: dict[str, dict] = {}
        self.cut_at = 0.0
        self.step_began = 0.0

    def snapshot(self, label: str, step: int) -> None:
        statuses = {name: node.status() for name, node in self.demo.swarm.nodes.items() if node.role != "bootstrap"}
        self.moments[label] = {"step": step, "time": time.monotonic(), "status": statuses}

    def __call__(self, record: dict) -> None:
        step, network = record["step"], self.demo.network
        if self.phase == "before" and step >= CUT_STAGE_AT:
            self.snapshot("stage cut", step)
            network.cut("stage0-1")
            self.phase, self.cut_at = "stage cut", time.monotonic()
        elif self.phase == "stage cut" and self._stood_in("stage cut", "stage0-0"):
            self.snapshot("stage healed", step)
            network.heal("stage0-1")
            self.phase = "stage healed"
        elif self.phase == "stage healed" and step >= self.moments["stage healed"]["step"] + AFTER_HEAL:
            self.snapshot("verifier cut", step)
            network.cut("verifier1")
            self.phase, self.cut_at = "verifier cut", time.monotonic()
        elif self.phase == "verifier cut" and self._stood_in("verifier cut", "verifier0"):
            self.snapshot("verifier healed", step)
            network.heal("verifier1")
            self.phase, self.step_began = "verifier healed", time.monotonic()
        elif self.phase == "verifier healed":
            self._pace_until_back()

    def _pace_until_back(self) -> None:
        """Makes the step just done last PACE_S (the trainer stopped for the rest) until verifier1's status shows a
        relay since its heal."""
        if self._served_now("verifier1") > served(self.moments["verifier healed"], "verifier1"):
            self.phase = "verifier back"
            return
        rest = self.step_began + PACE_S - time.monotonic()
        trainer = self.demo.node("trainer").process
        if rest > 0 and trainer.poll() is None:
            os.kill(trainer.pid, signal.SIGSTOP)
            try:
                time.sleep(rest)
            finally:
                os.kill(trainer.pid, signal.SIGCONT)
        self.step_began = time.monotonic()

    def _stood_in(self, cut: str, other: str) -> bool:
        """Whether the partition lasted PARTITION_S and ``other`` served since the cut, as its status says."""
        if time.monotonic() - self.cut_at < PARTITION_S:
            return False
        return self._served_now(other) > served(self.moments[cut], other)

    def _served_now(self, name: str) -> int:
        """What ``name``'s status file says it served (a stage) or relayed (a verifier) so far."""
        return served({"status": {name: self.demo.node(name).status()}}, name)


def verdicts_logged(swarm: Demo) -> list[str]:
    """The verifiers' flag and ban lines: what an assertion about exclusions says when it fails."""
    lines = []
    for name in ("verifier0", "verifier1"):
        lines += [
            f"{name}: {line}"
            for line in swarm.node(name).log_tail(200000).splitlines()
            if "flagged" in line or "banned" in line
        ]
    return lines


def served(moment: dict, name: str) -> int:
    status = moment["status"][name]
    return status.served if isinstance(status, StageStatus) else status.relayed


def status_after_the_last_step(swarm: Demo, name: str) -> StageStatus:
    """The stage replica's status once it says it applied the last step, or its latest after five periods.

    A replica applies the last step as training ends and writes its status file every announce period, so a file
    read straight after training can predate that step: stage1-0's once said 37 steps and 154 served of 160, and
    the file held 40 and 164 two seconds later (2026-12-07, on idle cores, where the last 30 steps take 8 s)."""
    deadline = time.monotonic() + 5 * swarm.config.swarm.announce_period
    status = swarm.node(name).status()
    while getattr(status, "last_step", None) != STEPS - 1 and time.monotonic() < deadline:
        time.sleep(swarm.config.swarm.announce_period / 4)
        status = swarm.node(name).status()
    return status


def test_training_goes_on_through_the_partitions_and_no_microbatch_is_lost_or_settled_twice(swarm):
    chaos = swarm.chaos
    assert chaos.phase in ("verifier healed", "verifier back"), (
        f"training ended before the partitions were done: {chaos.phase}"
    )
    steps = [record["step"] for record in swarm.steps]
    assert steps == list(range(STEPS))
    accounting = swarm.result.microbatches
    per_step = swarm.config.pipeline.microbatches_per_step
    assert accounting.consistent and accounting.in_flight == 0
    assert accounting.sent == STEPS * per_step, accounting
    assert accounting.failed == 0 and accounting.dropped == 0, (accounting, verdicts_logged(swarm))
    assert accounting.succeeded == accounting.sent
    # during each partition the stage went on through the other replica, the boundary through the other verifier
    cut, healed = chaos.moments["stage cut"], chaos.moments["stage healed"]
    assert healed["step"] > cut["step"]  # a step or more (a stuck microbatch waits out its deadline, about 20 s)
    assert served(healed, "stage0-0") > served(cut, "stage0-0")
    vcut, vhealed = chaos.moments["verifier cut"], chaos.moments["verifier healed"]
    assert vhealed["step"] > vcut["step"]
    assert served(vhealed, "verifier0") > served(vcut, "verifier0")
    assert swarm.result.loss_fell or swarm.result.last_loss < swarm.result.first_loss


def test_the_cut_replica_rejoins_syncs_and_serves_again(swarm):
    chaos = swarm.chaos
    healed = chaos.moments["stage healed"]
    now = status_after_the_last_step(swarm, "stage0-1")
    assert now.served > served(healed, "stage0-1"), "stage0-1 served nothing after the heal"
    assert now.resyncs >= 1 and now.synced_from == swarm.peer("stage0-0"), now
    assert now.last_step == STEPS - 1
    vnow = swarm.node("verifier1").status()
    assert vnow.relayed > served(chaos.moments["verifier healed"], "verifier1"), "verifier1 relayed nothing after"


def test_every_view_converges_with_nobody_honest_excluded_or_struck(swarm):
    result = swarm.result
    views = swarm.views()
    assert set(views) == {"stage0-0", "stage0-1", "stage1-0", "verifier0", "verifier1", "trainer"}
    assert all(view == [] for view in views.values()), (views, verdicts_logged(swarm))
    # the strike records every running node reads come to be the same, none with more than one strike (audits
    # publish records too; one published as training ends reaches each view within a refresh or two, and a status
    # file within a period after that). The trainer has stopped: its last status may lack a record published after it
    # (a passed audit's, 2026-12-03), never hold one the others do not.
    running = [name for name in views if swarm.node(name).alive]
    assert "trainer" not in running and len(running) == len(views) - 1, running
    deadline = time.monotonic() + 10 * swarm.config.swarm.announce_period
    while True:
        strikes = {name: swarm.node(name).status().strikes for name in views}
        if len({repr(sorted(strikes[name].items())) for name in running}) == 1 or time.monotonic() > deadline:
            break
        time.sleep(swarm.config.swarm.announce_period / 2)
    assert len({repr(sorted(strikes[name].items())) for name in running}) == 1, strikes
    seen = strikes[running[0]]
    assert all(set(by) <= set(seen.get(accused, {})) for accused, by in strikes["trainer"].items()), strikes
    # one strike at most: stage 1's only replica is judged against its own EMA, and an honest moderate crossing of
    # it costs one strike, forgiven after `forgive_after` clean checks (one run in about ten here: a gradient's
    # wasserstein 0.161 over its fence of 0.151, 2026-12-04; the full profile's honest run: 0.65 flags per 1,000
    # checks). What a partition would break (stale parameters served after a heal, a view that never rejoins)
    # gives a flag on every tensor, or an exclusion
    assert all(n <= 1 for s in strikes.values() for by in s.values() for n in by.values()), strikes
    assert result.honest_excluded == []
    assert all(n <= 1 for by in result.honest_peers_with_strikes.values() for n in by.values()), result
    assert result.verifier_checks > 0


def test_a_node_behind_a_nat_is_reached_through_a_relay(swarm):
    hidden = swarm.node("stage1-0")
    status = status_after_the_last_step(swarm, "stage1-0")
    assert isinstance(status, StageStatus)
    assert status.reachability.reachable is False and status.reachability.answered_by == [swarm.peer("bootstrap")]
    log = hidden.log_tail(200000)
    assert "other peers cannot connect to this node" in log and "this node uses auto-relay" in log
    assert "announced as relayed" in log
    # it served every microbatch of the last stage, to callers that cannot dial it: over the connections it opened
    # to them through the NAT (libp2p reuses a connection either side opened), or through the bootstrap's relay
    # circuit when its reservation there outlived the bootstrap's first AutoNAT verdict (docs/decisions.md,
    # "Relays"; a caller that had only the circuit: tests/test_netns_relay.py)
    assert status.served >= STEPS * swarm.config.pipeline.microbatches_per_step
    listed = [moment["status"]["stage1-0"].connections for moment in swarm.chaos.moments.values()]
    assert None not in listed, listed
    reached = {peer for connections in listed for peer in (*connections.direct, *connections.relayed)}
    assert {swarm.peer(name) for name in ("verifier0", "verifier1", "trainer")} <= reached, listed
    for name in ("verifier0", "verifier1"):
        assert isinstance(swarm.node(name).status(), VerifierStatus)
