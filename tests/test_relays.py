"""roles.relays: the p2pd options for each way a node stands toward relays (tests/test_netns_relay.py proves them on
real daemons across namespaces)."""

from __future__ import annotations

from hivemind.p2p import P2P

from sentinel_node.roles.relays import p2p_options

BOOTSTRAP = "/ip4/11.213.0.1/tcp/31337/p2p/12D3KooWGjRCv8e1aaCbsGjVScgnbCpDJir9yotDUnYr8pd1CWuL"


def test_a_node_behind_a_nat_takes_its_initial_peers_as_static_relays_and_is_private_at_once():
    assert p2p_options(False, [BOOTSTRAP]) == {"use_relay": True, "use_auto_relay": False}
    assert p2p_options(False, [BOOTSTRAP], use_relay=False) == {"use_relay": False, "use_auto_relay": False}
    # behind a NAT: private at once, its initial peers its static relays (and a relay it cannot do without)
    assert p2p_options(True, [BOOTSTRAP], use_relay=False) == {
        "use_relay": True,
        "use_auto_relay": True,
        "force_reachability": "private",
        "trusted_relays": [BOOTSTRAP],
    }
    assert "trusted_relays" not in p2p_options(True, [])


def test_static_relays_turn_relay_discovery_off_on_the_daemons_command_line_and_nothing_else():
    p2p_options(True, [BOOTSTRAP])  # installs the change to hivemind's command line
    static = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=BOOTSTRAP, relay=True)
    assert static == ["p2pd", "-autoRelay=1", f"-trustedRelays={BOOTSTRAP}", "-relay=1", "-relayDiscovery=0"]
    # without trusted relays (or without auto-relay) the daemon's own defaults stand
    assert P2P._make_process_args("p2pd", autoRelay=True, relay=True) == ["p2pd", "-autoRelay=1", "-relay=1"]
    assert P2P._make_process_args("p2pd", autoRelay=False, trustedRelays=BOOTSTRAP) == [
        "p2pd",
        "-autoRelay=0",
        f"-trustedRelays={BOOTSTRAP}",
    ]
    p2p_options(True, [BOOTSTRAP])  # a second install changes nothing
    assert P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=BOOTSTRAP).count("-relayDiscovery=0") == 1
