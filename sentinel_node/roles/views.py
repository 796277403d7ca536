"""A node's view of the swarm, kept fresh in the background, and who may call a handler, decided from it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from hivemind.utils import get_logger

from dht import DHTUnavailable, RecordStore
from peers import SwarmView, SwarmWatcher
from sentinel_node.config import Config
from sentinel_node.transport import HopBanned, HopRefused

logger = get_logger(__name__)

# A caller missing from the view is looked up again at most this often (an unknown peer must not flood the DHT).
_FORCED_REFRESH_INTERVAL = 1.0
# Background refreshes may read the strike keys of peers nobody accused a share at a time (SwarmWatcher.refresh).
# Off (1): at rotation 4, on a loaded machine (load 25-40), a trainer saw a verifier's ban 90 s after it was
# published, where four refreshes should take a few seconds; reads that time out are retried four times less
# often. Not enabled until that is understood (docs/decisions.md, "The suite's time").
STRIKE_ROTATION = 1


class ViewKeeper:
    """The node's swarm view, refreshed every ``period`` seconds in the background, and at once (rate-limited)
    when a caller is not in it yet.

    ``listeners`` are called (in the event loop) with each new view, e.g. to tell an averager whom to leave out.
    """

    def __init__(self, store: RecordStore, config: Config, period: float | None = None) -> None:
        self.watcher = SwarmWatcher(store, config.pipeline.n_stages, config.swarm.exclusion_policy())
        self.period = config.swarm.announce_period if period is None else period
        self.listeners: list[Callable[[SwarmView], None]] = []
        self._refreshing: asyncio.Task | None = None
        self._last_refresh = 0.0
        self.read_at: float | None = None  # time.monotonic() when a refresh last read the DHT successfully

    @property
    def view(self) -> SwarmView:
        return self.watcher.view

    async def refresh(self, force: bool = False) -> SwarmView:
        """A fresh view; without ``force``, or within the rate limit, the latest one (joining a refresh already
        under way)."""
        if self._refreshing is None:
            recent = time.monotonic() - self._last_refresh < _FORCED_REFRESH_INTERVAL
            if self._last_refresh and (not force or recent):
                return self.view
            self._refreshing = asyncio.create_task(self._refresh(full=True))
        return await asyncio.shield(self._refreshing)

    async def _refresh(self, full: bool = False) -> SwarmView:
        rotation = 1 if full or not self._last_refresh else STRIKE_ROTATION
        try:
            view = await asyncio.to_thread(self.watcher.refresh, (), rotation)
            self.read_at = time.monotonic()
        except DHTUnavailable as e:
            logger.debug(f"swarm view not refreshed: {e}")
            view = self.view
        finally:
            self._last_refresh = time.monotonic()
            self._refreshing = None
        for listener in self.listeners:
            try:
                listener(view)
            except Exception:
                logger.warning("a swarm view listener failed", exc_info=True)
        return view

    async def read(self, timeout: float, shows: Callable[[SwarmView], bool] | None = None) -> SwarmView | None:
        """A view the DHT answered after this call began, for which ``shows(view)`` holds, refreshing (at most once a
        second) until it comes or ``timeout`` seconds passed (then None). Unlike :meth:`refresh`, never the view kept
        from before: when the reads fail, that is the empty view of a node that just started, which looks like an
        empty swarm."""
        asked = time.monotonic()
        deadline = asked + timeout
        while True:
            view = await self.refresh(force=True)
            if self.read_at is not None and self.read_at >= asked and (shows is None or shows(view)):
                return view
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(min(_FORCED_REFRESH_INTERVAL, max(0.0, deadline - time.monotonic())))

    async def run(self) -> None:
        """Refreshes forever (cancel the task to stop)."""
        while True:
            if self._refreshing is None:
                self._refreshing = asyncio.create_task(self._refresh())
            await asyncio.shield(self._refreshing)
            await asyncio.sleep(self.period)


def shows_others(view: SwarmView, me: str) -> bool:
    """Whether ``view`` holds any node's announcement but ``me``'s: a running swarm always shows someone (its
    bootstraps announce themselves); a view showing nobody comes from a DHT that has not reached the swarm yet."""
    return any(a.peer_id != me for a in view.announcements())


def live_trainer(view: SwarmView, peer: str) -> bool:
    """Whether ``peer`` is a live trainer: the view holds only trainers the swarm's trust roots admit."""
    announcement = view.trainers.get(peer)
    return announcement is not None and view.is_live(announcement)


def live_verifier(view: SwarmView, peer: str, boundary: int) -> bool:
    """Whether ``peer`` is a live verifier admitted for ``boundary`` (an announcement's boundaries are within its
    certificate's, or its peer id is listed: the store checked that)."""
    return any(v.peer_id == peer for v in view.live_verifiers(boundary))


def live_replica(view: SwarmView, peer: str, stage: int) -> bool:
    return any(a.peer_id == peer for a in view.live_replicas(stage))


def stage_of(view: SwarmView, peer: str) -> int | None:
    """The stage ``peer`` serves as a live replica, or None."""
    for k in range(view.n_stages):
        if any(a.peer_id == peer for a in view.live_replicas(k)):
            return k
    return None


class Gatekeeper:
    """Decides from the swarm view whether a caller may use a handler; raises a coded refusal when not."""

    def __init__(self, views: ViewKeeper) -> None:
        self.views = views

    async def require(self, caller: str, allowed: Callable[[SwarmView], bool], what: str) -> SwarmView:
        """The view in which ``allowed(view)`` held. HopBanned for an excluded caller; HopRefused, saying ``what``
        the handler accepts, for any other caller it does not allow (after one refresh: it may have just joined)."""
        view = self.views.view
        for attempt in range(2):
            if view.is_excluded(caller):
                voters = ", ".join(view.excluded[caller].voters)
                raise HopBanned(f"{caller} is excluded from the swarm (banned by {voters}); nothing accepted from it")
            if allowed(view):
                return view
            if attempt == 0:
                view = await self.views.refresh(force=True)
        raise HopRefused(f"{what}; the caller {caller} is not one")
