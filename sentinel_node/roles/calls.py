"""Calling the next hop of a microbatch's route, as stages and verifiers both do, and learning from failures."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import torch
from hivemind.p2p import P2P

from peers import LivenessBlacklist, SwarmView, order_candidates
from sentinel_node.transport import (
    Hop,
    HopError,
    HopRefused,
    MicrobatchMetadata,
    Reply,
    TransportSettings,
    call_first_available,
)


def note_failures(blacklist: LivenessBlacklist, errors: Sequence[HopError]) -> None:
    """Suspends the peers that failed to answer (not those that refused or were refused)."""
    for error in errors:
        if error.cause.unresponsive and error.culprit:
            blacklist.register_failure(error.culprit)


async def call_hop(
    p2p: P2P,
    hop: Hop,
    view: SwarmView,
    blacklist: LivenessBlacklist,
    handler: str,
    tensors: Sequence[torch.Tensor],
    metadata: MicrobatchMetadata,
    settings: TransportSettings,
    *,
    nobody: str,
    allowed: Callable[[str], bool],
    skip: Callable[[str], bool] = lambda _: False,
    max_reply_bytes: int | None = None,
    refresh: Callable[[], Awaitable[SwarmView]] | None = None,
) -> Reply:
    """Calls ``handler`` on the hop's chosen peer, or an alternate when that one fails before answering; peers that
    failed to answer are suspended. Only peers ``allowed`` at this place of the route are called (the route comes
    from the caller, who may be anyone: a hop it names is never trusted for being named); when none is, the view
    is refreshed once (``refresh``, rate-limited by its owner) and asked again. ``allowed`` reads the current
    view. HopRefused saying ``nobody`` when no candidate is left to call."""
    candidates = order_candidates(hop.peer_id, hop.alternates, view, blacklist, lambda p: skip(p) or not allowed(p))
    if not candidates and refresh is not None:  # a peer that just joined: this node's view may be behind
        view = await refresh()
        candidates = order_candidates(
            hop.peer_id, hop.alternates, view, blacklist, lambda p: skip(p) or not allowed(p)
        )
    if not candidates:
        raise HopRefused(nobody)
    try:
        reply = await call_first_available(
            p2p, candidates, handler, tensors, metadata, settings=settings, max_reply_bytes=max_reply_bytes
        )
    except HopError as e:
        note_failures(blacklist, e.failures or [e])
        raise
    note_failures(blacklist, reply.failures)
    return reply
