"""Suite-wide: a SIGTERM (CI cancelling a run, `timeout`, a person's `kill`) stops the suite as Ctrl-C does.

By default SIGTERM ends the Python process at once, skipping every `with` block and fixture teardown, so the swarms
the network tests started (each node in its own process group, with its p2pd) would outlive the suite. Raised as
KeyboardInterrupt, the signal unwinds the running test: its swarms stop, and pytest reports what ran.
"""

from __future__ import annotations

import signal


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config) -> None:
    signal.signal(signal.SIGTERM, _interrupt)
