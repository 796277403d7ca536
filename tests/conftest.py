"""Suite-wide: a SIGTERM (CI cancelling a run, `timeout`, a person's `kill`) stops the suite as Ctrl-C does; the
modules that run in this process alone are marked ``isolated``, and those that train a swarm of real processes
``swarm``.

By default SIGTERM ends the Python process at once, skipping every `with` block and fixture teardown, so the swarms
the network tests started (each node in its own process group, with its p2pd) would outlive the suite. Raised as
KeyboardInterrupt, the signal unwinds the running test: its swarms stop, and pytest reports what ran.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from sentinel_node.forkserver import ForkServer, ForkServerError


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config) -> None:
    signal.signal(signal.SIGTERM, _interrupt)


# Modules whose tests run in the pytest process alone: no node, DHT, socket or subprocess, and no clock they race.
# `make test` runs them beside the image test, niced, while the network tests keep the cores (Makefile, test);
# a module added here must stay so (tests/test_suite_layout.py checks what it can).
ISOLATED = {
    "test_agreement",
    "test_attacks",
    "test_audits",
    "test_bench_overhead",
    "test_bench_verifier",
    "test_cli",
    "test_device",
    "test_drift",
    "test_layers",
    "test_loss_gate",
    "test_model",
    "test_passage",
    "test_placement",
    "test_plan",
    "test_sim",
    "test_sweep",
    "test_state_transfer",
    "test_swarm_config",
    "test_user_messages",
    "test_verdicts",
    "test_verification",
}


# Modules whose module-scoped swarms train for many steps: the most CPU of the network tests (482 of 847 CPU-s on 2
# idle cores, 326 of 737 s). `make test` runs them in a stream of their own beside the other network tests, which
# mostly wait (on partitions, relays, announcements, process starts) and leave a core idle (Makefile, test).
SWARMS = {
    "test_loss_gate_swarm",
    "test_passage_swarm",
    "test_pipeline_swarm",
    "test_real_model_swarm",
    "test_stage_state",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        stem = Path(str(item.fspath)).stem
        if stem in ISOLATED:
            item.add_marker("isolated")
        if stem in SWARMS:
            item.add_marker("swarm")


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory) -> Iterator[ForkServer | None]:
    """One fork server for the session's swarms (LocalSwarm's and DemoSettings' ``forkserver``): each swarm that
    started its own paid its imports, about 10 CPU seconds and, beside the suite's other streams, 20 to 40 s before
    its first node. None where it cannot start: the swarms then start their own (and exec their nodes if that fails
    too). The tests of the fork server itself start their own."""
    try:
        server = ForkServer(tmp_path_factory.mktemp("forkserver") / "forkserver.log")
    except ForkServerError:
        yield None
        return
    yield server
    server.close()
