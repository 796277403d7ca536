"""The suite's own layout: the modules `make test` runs beside the image test (conftest.ISOLATED) exist and start
nothing they would wait on, so a niced process sharing the cores with the network tests cannot make them fail."""

from __future__ import annotations

from pathlib import Path

from conftest import ISOLATED, SWARMS

TESTS = Path(__file__).parent
# what a test that starts processes, nodes or sockets, or races a clock, uses (tests/netns.py, raw_dht.py, ...)
WAITS_ON = (
    "subprocess",
    "Popen",
    "start_dht",
    "hivemind.DHT",
    "Demo(",
    "LocalSwarm",
    "status_server",
    "netns",
    "raw_dht",
    "time.sleep",
    "monotonic()",
    "P2P",
)


def test_every_isolated_module_exists_and_starts_nothing_it_waits_on():
    for name in sorted(ISOLATED):
        path = TESTS / f"{name}.py"
        assert path.is_file(), f"conftest.ISOLATED names {name}, which is not a test module"
        source = path.read_text()
        used = [word for word in WAITS_ON if word in source]
        assert not used, f"{name} is marked isolated but uses {used}: take it out of conftest.ISOLATED"


def test_every_swarm_module_exists_and_is_a_network_module():
    for name in sorted(SWARMS):
        assert (TESTS / f"{name}.py").is_file(), f"conftest.SWARMS names {name}, which is not a test module"
    assert not SWARMS & ISOLATED, f"{sorted(SWARMS & ISOLATED)} cannot run in-process alone and start swarms"
