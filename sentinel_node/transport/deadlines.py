"""Absolute deadlines that nest: a call made while serving a request never outlives that request.

A handler runs with its hop's deadline in a context variable; every call it makes is clamped to it, so the
shortest deadline in the chain wins even when a handler asks for more time than its caller gave it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_HOP_DEADLINE: ContextVar[float | None] = ContextVar("sentinel_hop_deadline", default=None)


def current_deadline() -> float | None:
    """The deadline of the request being served by this task, if any."""
    return _HOP_DEADLINE.get()


def clamp_deadline(deadline: float) -> float:
    """``deadline``, or the enclosing request's deadline if that is sooner."""
    enclosing = _HOP_DEADLINE.get()
    return deadline if enclosing is None else min(deadline, enclosing)


def time_left(deadline: float) -> float:
    return deadline - time.time()


@contextmanager
def serving_until(deadline: float) -> Iterator[None]:
    """Marks the code inside (and tasks and threads it starts) as serving a request due at ``deadline``."""
    token = _HOP_DEADLINE.set(clamp_deadline(deadline))
    try:
        yield
    finally:
        _HOP_DEADLINE.reset(token)
