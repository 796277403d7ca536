"""The one thread in which a node runs torch, so its event loop stays free to move tensors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeLane:
    """One worker thread for all of a node's torch work: a stage's forward, backward and optimizer step never
    overlap (they share parameters and gradients), and the event loop stays free for the network."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.pending = 0  # calls submitted and not yet finished
        self._idle: asyncio.Event | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        self.pending += 1
        if self._idle is not None:
            self._idle.clear()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))
        finally:
            self.pending -= 1
            if self.pending == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until nothing runs or waits in the lane, at most ``timeout`` seconds (work that can wait, such as
        an audit's recomputation, goes after the training work already queued); whether it went idle."""
        if self.pending == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout))
            return True
        except asyncio.TimeoutError:
            return False

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
