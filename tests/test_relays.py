"""roles.relays: the p2pd options for each way a node stands toward relays (tests/test_netns_relay.py proves them on
real daemons across namespaces)."""

from __future__ import annotations

from hivemind.p2p import P2P

from sentinel_node.roles.relays import RelayUse, p2p_options, relay_use

BOOTSTRAP = "/ip4/11.213.0.1/tcp/31337/p2p/12D3KooWGjRCv8e1aaCbsGjVScgnbCpDJir9yotDUnYr8pd1CWuL"


def test_each_node_gets_the_relay_options_of_its_place():
    assert relay_use(use_auto_relay=False, relay_service=False) is RelayUse.DIRECT
    assert relay_use(use_auto_relay=False, relay_service=True) is RelayUse.SERVE
    assert relay_use(use_auto_relay=True, relay_service=False) is RelayUse.AUTO
    assert p2p_options(RelayUse.DIRECT, [BOOTSTRAP]) == {"use_relay": True, "use_auto_relay": False}
    assert p2p_options(RelayUse.DIRECT, [BOOTSTRAP], use_relay=False) == {"use_relay": False, "use_auto_relay": False}
    # a bootstrap relays from its start: reachability forced public, whatever AutoNAT would say later
    assert p2p_options(RelayUse.SERVE, []) == {
        "use_relay": True,
        "use_auto_relay": False,
        "force_reachability": "public",
    }
    # behind a NAT: private at once, its initial peers its static relays (and a relay it cannot do without)
    assert p2p_options(RelayUse.AUTO, [BOOTSTRAP], use_relay=False) == {
        "use_relay": True,
        "use_auto_relay": True,
        "force_reachability": "private",
        "trusted_relays": [BOOTSTRAP],
    }
    assert "trusted_relays" not in p2p_options(RelayUse.AUTO, [])


def test_static_relays_turn_relay_discovery_off_on_the_daemons_command_line_and_nothing_else():
    p2p_options(RelayUse.AUTO, [BOOTSTRAP])  # installs the change to hivemind's command line
    static = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=BOOTSTRAP, relay=True)
    assert static == ["p2pd", "-autoRelay=1", f"-trustedRelays={BOOTSTRAP}", "-relay=1", "-relayDiscovery=0"]
    # without trusted relays (or without auto-relay) the daemon's own defaults stand
    assert P2P._make_process_args("p2pd", autoRelay=True, relay=True) == ["p2pd", "-autoRelay=1", "-relay=1"]
    assert P2P._make_process_args("p2pd", autoRelay=False, trustedRelays=BOOTSTRAP) == [
        "p2pd",
        "-autoRelay=0",
        f"-trustedRelays={BOOTSTRAP}",
    ]
    p2p_options(RelayUse.AUTO, [BOOTSTRAP])  # a second install changes nothing
    assert P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=BOOTSTRAP).count("-relayDiscovery=0") == 1
