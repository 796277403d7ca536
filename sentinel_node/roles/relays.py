"""How a node behind a NAT is reached through libp2p circuit relays (v2): the p2pd options that make it reserve a
slot at its initial peers at once and announce a ``/p2p-circuit`` address through them.

With ``--use-auto-relay``:

- its initial peers (the bootstraps it joins through, the peers a swarm already trusts to be public and up) are
  its *static* relays. Without static relays, p2pd's relay discovery reserves a slot only once it has four
  candidate relays, or after three minutes (go-libp2p's ``minCandidates`` and ``bootDelay``): measured, the first
  circuit address 180 s after start with one relay. hivemind 1.1.12 does not pass p2pd's ``-relayDiscovery`` flag
  (its ``use_relay_discovery`` argument is ignored), and p2pd uses ``-trustedRelays`` as static relays only with
  ``-relayDiscovery=0``: :func:`install_static_relays` adds that flag to the daemon's command line when a node has
  both auto-relay and trusted relays, and nothing else;
- its reachability is forced private: auto-relay starts only on a private verdict, which AutoNAT cannot reach
  where no public address of the node can be dialed back (the usual NAT).

The relays' side is p2pd's own, left as hivemind starts it (docs/decisions.md, "Relays", says why a bootstrap's
reachability is not forced): a public node runs its configured relay service (30 minutes, 4 GiB each way per
circuit) from its first public AutoNAT verdict on. A reservation made before that verdict is lost with the relay
that held it until the NATed node renews it, within the hour; a NATed node joining a bootstrap in its first
seconds is in that case (restarting the NATed node renews at once).

Relayed traffic stays end-to-end encrypted (the circuit carries the two peers' own Noise/TLS session), so a relay
sees who talks to whom and how much, never what; and a circuit address names the relay by its peer id. A relay
circuit is slower than a direct connection: trainers route to relayed stages only when no direct one is left
(``relayed`` in announcements), and libp2p's hole punching turns a relayed connection direct where the NAT allows.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hivemind.p2p import P2P
from hivemind.utils import get_logger

logger = get_logger(__name__)

_install_lock = threading.Lock()
_installed = False


def p2p_options(use_auto_relay: bool, initial_peers: Sequence[str], use_relay: bool = True) -> dict:
    """The keyword arguments of ``hivemind.DHT`` (passed on to ``P2P.create``) for a node's relay use."""
    if not use_auto_relay:
        return {"use_relay": use_relay, "use_auto_relay": False}
    options: dict = {"use_relay": True, "use_auto_relay": True, "force_reachability": "private"}
    if initial_peers:
        options["trusted_relays"] = list(initial_peers)
        install_static_relays()
    return options


def install_static_relays() -> None:
    """Makes hivemind start p2pd with ``-relayDiscovery=0`` whenever it passes both ``-autoRelay`` and
    ``-trustedRelays`` (idempotent). hivemind builds p2pd's command line in ``P2P._make_process_args``; the DHT's
    process is forked from this one, so it inherits the change."""
    global _installed
    with _install_lock:
        if _installed:
            return
        original = getattr(P2P, "_make_process_args", None)
        if not callable(original):
            logger.warning("hivemind's P2P has no _make_process_args: auto-relay falls back to relay discovery")
            return

        def process_args(*args, **kwargs):
            if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
                kwargs["relayDiscovery"] = False
            return original(*args, **kwargs)

        P2P._make_process_args = staticmethod(process_args)
        _installed = True
