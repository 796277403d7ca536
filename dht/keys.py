"""The swarm's key schema (docs/architecture.md section 6): every record lives under one prefix.

| key                         | subkey             | value                 |
|-----------------------------|--------------------|-----------------------|
| ``{prefix}.stage.{k}``      | author's owner tag | StageAnnouncement     |
| ``{prefix}.verifiers``      | author's owner tag | VerifierAnnouncement  |
| ``{prefix}.trainers``       | author's owner tag | TrainerAnnouncement   |
| ``{prefix}.bootstraps``     | author's owner tag | BootstrapAnnouncement |
| ``{prefix}.strikes.{peer}`` | verifier owner tag | StrikeRecord          |
| ``sentinel:swarm-config``   | publisher's tag    | SwarmConfigRecord     |

and hivemind's own averager keys for the replicas of stage k (prefix ``{prefix}_stage{k}``, default group bits):
``{prefix}_stage{k}.0b`` (subkey: a peer id's bytes, value: looking for a group) and
``{prefix}_stage{k}.all_averagers`` (subkey: a peer id's bytes, value: state-sharing priority or None). Nothing
else lives in a swarm's DHT: every other key is read as a strike key.

The config key is the same for every swarm: a node joining with nothing but an address learns the prefix from it.
Its ``:`` cannot occur in a prefix, so it never collides with a swarm's own keys.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")

# Validators must agree across the swarm without reading its config, so stage keys are recognised up to a fixed
# bound rather than up to the config's n_stages.
MAX_STAGES = 1024

# where the swarm's config is published (dht.records.SwarmConfigRecord), whatever the prefix
CONFIG_KEY = "sentinel:swarm-config"


@dataclass(frozen=True)
class SwarmKeys:
    """The DHT keys of one swarm, all under ``prefix``."""

    prefix: str

    def __post_init__(self) -> None:
        if not PREFIX_PATTERN.match(self.prefix):
            raise ValueError(
                f"swarm prefix {self.prefix!r} must be non-empty and use only letters, digits, '-' and '_'"
            )

    def stage(self, index: int) -> str:
        if not 0 <= index < MAX_STAGES:
            raise ValueError(f"stage index {index} is outside [0, {MAX_STAGES})")
        return f"{self.prefix}.stage.{index}"

    @property
    def verifiers(self) -> str:
        return f"{self.prefix}.verifiers"

    @property
    def trainers(self) -> str:
        return f"{self.prefix}.trainers"

    @property
    def bootstraps(self) -> str:
        return f"{self.prefix}.bootstraps"

    def strikes(self, accused: str) -> str:
        return f"{self.prefix}.strikes.{accused}"

    def averager(self, stage: int) -> str:
        """The prefix of the hivemind averager the replicas of ``stage`` average parameters with."""
        self.stage(stage)  # the same range check
        return f"{self.prefix}_stage{stage}"

    def averager_group(self, stage: int) -> str:
        """The averager's matchmaking key (hivemind's ``{prefix}.0b{group bits}``; our averagers use no bits)."""
        return f"{self.averager(stage)}.0b"

    def averager_state(self, stage: int) -> str:
        """The averager's key of replicas offering their state for download."""
        return f"{self.averager(stage)}.all_averagers"
