"""Shared by the fuzz tests (test_fuzz_records.py, test_fuzz_wire.py): how many examples, and the tally of outcomes.

Two volumes, chosen by the environment variable ``SENTINEL_FUZZ``:

- unset (``suite``): a few hundred examples per test, so the fuzz tests together stay well under 30 s in
  ``make test``;
- ``volume`` (``make fuzz``): at least 10,000 examples per record type and per wire target.

Either way the examples are derandomized (hypothesis derives them from each test's name), so a failure in CI is the
same failure on a laptop, and no example database is written. With ``SENTINEL_FUZZ_REPORT=DIR`` every fuzz test
module writes what it tried and what came of it to ``DIR/<module>.json`` (docs/reliability.md quotes them).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings

VOLUME = os.environ.get("SENTINEL_FUZZ", "suite") == "volume"
VOLUME_EXAMPLES = 10_000


def fuzz_settings(suite_examples: int, volume_examples: int = VOLUME_EXAMPLES) -> settings:
    """Settings for one fuzz test: ``suite_examples`` in the suite, ``volume_examples`` under ``make fuzz``."""
    return settings(
        max_examples=volume_examples if VOLUME else suite_examples,
        derandomize=True,
        database=None,
        deadline=None,  # RSA signing and a loaded machine make per-example times vary; volume is what counts
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,  # the network-edge tests draw all their cases in one example
        ],
        print_blob=True,
    )


class Tally:
    """Counts of (target, outcome) for one test module, written out on :meth:`dump`."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.counts: Counter[tuple[str, str]] = Counter()
        self.figures: dict[str, object] = {}

    def add(self, target: str, outcome: str) -> None:
        self.counts[(target, outcome)] += 1

    def by_target(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for (target, outcome), n in sorted(self.counts.items()):
            table.setdefault(target, {})[outcome] = n
        return table

    def dump(self) -> None:
        directory = os.environ.get("SENTINEL_FUZZ_REPORT")
        if not directory:
            return
        path = Path(directory) / f"{self.module}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        report = {"volume": VOLUME, "outcomes": self.by_target(), "figures": self.figures}
        path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
