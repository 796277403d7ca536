"""What a running node tells the processes that supervise it (the demo, the benches, the tests), as typed files.

With ``--status-file PATH`` a pipeline role keeps one JSON file up to date: a :class:`StageStatus`,
:class:`VerifierStatus` or :class:`TrainerStatus`, written atomically through :func:`write_status` (a reader never
sees half a file) and read back through :func:`read_status`. Both sides go through these models, so a field
renamed on one side fails loudly on the other instead of reading as missing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from hivemind.utils import get_logger
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from peers import SwarmView

logger = get_logger(__name__)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReachabilityStatus(_Model):
    reachable: bool | None
    checked: list[str]
    answered_by: list[str]
    reachable_at: list[str]


class ConnectionsStatus(_Model):
    """The peers this node's libp2p host had open connections with, the last time it looked: ``relayed`` are those
    reached only through a relay (every connection a ``/p2p-circuit``), ``direct`` the others (its own dials, or
    dials to it, NATed or not). At most :data:`MAX_LISTED` of each."""

    direct: list[str]
    relayed: list[str]


MAX_LISTED = 64


class NodeStatus(_Model):
    """What every role reports: who it is, when it wrote this, and what it sees of the swarm's verdicts."""

    peer_id: str
    time: float
    excluded: list[str] = Field(default_factory=list, description="peers excluded swarm-wide in this node's view")
    strikes: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="accused peer -> verifier -> strikes, in this node's view"
    )
    connections: ConnectionsStatus | None = None  # None until the node first listed its connections

    @staticmethod
    def view_fields(view: SwarmView) -> dict:
        """The fields that come from the node's swarm view."""
        return {
            "excluded": sorted(view.excluded),
            "strikes": {
                peer: {record.verifier: record.strikes for record in view.ledger.about(peer)}
                for peer in view.ledger.accused()
            },
        }


class StageStatus(NodeStatus):
    role: Literal["stage"] = "stage"
    stage: int
    attacker: bool
    last_step: int
    resumed_from: int | None
    synced_from: str | None
    resyncs: int = 0  # states it took from a live replica after it missed global steps while serving
    checkpoints: int
    checkpoint_failures: int = 0
    checkpoint_problem: str | None = None  # why the last checkpoint could not be written, until one is
    reachability: ReachabilityStatus | None
    averaging_rounds: int
    averaged_with: list[str]
    throughput: float
    forward_cpu_ms: float | None  # CPU time of one training forward: what a verifier's check is weighed against
    compute_cpu_s: float
    served: int
    evaluated: int
    dropped: int
    held: int = 0  # microbatches whose update the loss gate held back (it ran no backward pass for them)
    failed: int
    attacked: int
    steps: int
    recomputations: dict[str, int] = {}  # audits this replica recomputed for verifiers: served, unavailable
    recompute_cpu_s: float = 0.0  # CPU time of those recomputations
    reference: str | None = None  # digest of its audits' reference parameters


class SenderCounts(_Model):
    strikes: int
    checks: int
    flags: int
    banned: bool


class VerifierStatus(NodeStatus):
    role: Literal["verifier"] = "verifier"
    boundaries: list[int]
    verify: bool
    ledger: dict[str, SenderCounts]
    banned: list[str]
    published: int
    reachability: ReachabilityStatus | None
    checks: dict[str, int]
    flags: dict[str, int]
    skipped: int
    malformed: int
    relayed: int
    held: int = 0  # microbatches whose update the last stage held back (the loss gate), relayed back through here
    check_cpu_s: float
    cpu_ms_per_check: float | None
    audits: dict[str, int] = {}  # recomputation audits by outcome, and what was drawn, dropped, left incomplete
    audit_failures: list[dict] = []  # evidence of the latest audits that did not pass


class AccountingStatus(_Model):
    sent: int
    succeeded: int
    dropped: int
    failed: int
    retried: int
    held: int = 0  # attempts the loss gate held back (absent from the status of nodes before it)
    in_flight: int
    consistent: bool


class TrainerStatus(NodeStatus):
    role: Literal["trainer"] = "trainer"
    step: int
    accounting: AccountingStatus
    val_curve: list[tuple[int, float]]
    quiet_verifiers: list[str] = Field(default_factory=list)  # flagging far less than their boundary's others


AnyStatus = Annotated[StageStatus | VerifierStatus | TrainerStatus, Field(discriminator="role")]
_STATUS = TypeAdapter(AnyStatus)


def write_status(path: str | os.PathLike | None, status: NodeStatus) -> None:
    """Writes ``status`` to ``path`` atomically (readers never see half a file); no-op without a path."""
    if path is None:
        return
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(status.model_dump_json())
        temporary.replace(path)
    except OSError as e:
        logger.warning(f"cannot write status file {path}: {e}")


def read_status(path: str | os.PathLike) -> StageStatus | VerifierStatus | TrainerStatus | None:
    """The status a node last wrote to ``path``; None before it wrote one. A file that does not fit the models
    (another version of the node, say) is a ValueError naming the file."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    try:
        return _STATUS.validate_json(text)
    except ValidationError as e:
        raise ValueError(f"status file {path} does not fit its model: {e}") from None
