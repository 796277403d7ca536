"""How a node uses libp2p circuit relays (v2): the p2pd options that make a node behind a NAT reachable through its
initial peers, and a public node relay for it from its first second.

Three ways a node stands (:class:`RelayUse`):

- ``DIRECT``: reachable at its own addresses; it can still dial peers that are reachable only through a relay.
- ``SERVE``: a public node whose job is to be found (a bootstrap): its reachability is forced public, so that
  go-libp2p starts its configured relay service when the daemon starts rather than when AutoNAT first says public.
  That later start swaps the relay that answers the hop protocol, and every reservation made with the one before
  is lost: circuits to a NATed node then fail with ``NO_RESERVATION`` until its reservation is renewed (an hour).
- ``AUTO`` (``--use-auto-relay``): behind a NAT. Its reachability is forced private (auto-relay only starts once
  reachability is private, and AutoNAT cannot say so on a network with no public address to dial back), and its
  initial peers are its static relays, asked for a reservation at once. Without static relays, p2pd's relay
  discovery waits for four candidates or three minutes before it reserves a slot anywhere (go-libp2p's
  ``minCandidates`` and ``bootDelay``), measured: the first circuit address 180 s after start with one relay.

hivemind 1.1.12 does not pass p2pd's ``-relayDiscovery`` flag (its ``use_relay_discovery`` argument is ignored), and
p2pd uses ``-trustedRelays`` as static relays only with ``-relayDiscovery=0``. :func:`install_static_relays` adds
that flag to the daemon's command line when a node has both auto-relay and trusted relays, and nothing else.

Relayed traffic stays end-to-end encrypted (the circuit carries the two peers' own Noise/TLS session), so a relay
sees who talks to whom and how much, never what; and a circuit address names the relay by its peer id, so a
caller reaches the relay the NATed node chose, not one posing as it. A relay circuit is slower than a direct
connection: trainers route to relayed stages only when no direct one is left (``relayed`` in announcements).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence

from hivemind.p2p import P2P
from hivemind.utils import get_logger

logger = get_logger(__name__)

_installed = threading.Lock()
_original_process_args = None


class RelayUse(enum.Enum):
    DIRECT = "direct"
    SERVE = "serve"
    AUTO = "auto"


def relay_use(use_auto_relay: bool, relay_service: bool) -> RelayUse:
    if use_auto_relay:
        return RelayUse.AUTO
    return RelayUse.SERVE if relay_service else RelayUse.DIRECT


def p2p_options(use: RelayUse, initial_peers: Sequence[str], use_relay: bool = True) -> dict:
    """The keyword arguments of ``hivemind.DHT`` (passed on to ``P2P.create``) for ``use``."""
    options: dict = {"use_relay": use_relay or use is not RelayUse.DIRECT, "use_auto_relay": use is RelayUse.AUTO}
    if use is RelayUse.SERVE:
        options["force_reachability"] = "public"
    elif use is RelayUse.AUTO:
        options["force_reachability"] = "private"
        if initial_peers:
            options["trusted_relays"] = list(initial_peers)
            install_static_relays()
    return options


def install_static_relays() -> None:
    """Makes hivemind start p2pd with ``-relayDiscovery=0`` whenever it passes both ``-autoRelay`` and
    ``-trustedRelays`` (idempotent). hivemind builds p2pd's command line in ``P2P._make_process_args``; the DHT's
    process is forked from this one, so it inherits the change."""
    global _original_process_args
    with _installed:
        if _original_process_args is not None:
            return
        original = P2P._make_process_args
        if not callable(original):
            logger.warning("hivemind's P2P has no _make_process_args: auto-relay falls back to relay discovery")
            return

        def process_args(*args, **kwargs):
            if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
                kwargs["relayDiscovery"] = False
            return original(*args, **kwargs)

        _original_process_args = original
        P2P._make_process_args = staticmethod(process_args)
