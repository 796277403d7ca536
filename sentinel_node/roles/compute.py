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

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
