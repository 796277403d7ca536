"""Metadata that travels beside the tensors: strict pydantic models, packed with msgpack.

Models reject unknown keys and mistyped values, so a peer that sends garbage gets a precise "malformed" answer
instead of a half-understood request. The sender of a message is never a field here: it is the authenticated
peer id of the connection.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sentinel_node.transport.errors import MalformedMessageError

MAX_METADATA_BYTES = 64 * 1024
PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{16,128}$"  # base58, as PeerID.to_base58() writes it

PeerIdStr = Annotated[str, Field(pattern=PEER_ID_PATTERN)]
M = TypeVar("M", bound="WireModel")


class WireModel(BaseModel):
    """Base of every metadata model: strict, frozen, no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class RequestMetadata(WireModel):
    """What every request carries: the absolute unix time by which the whole call must be answered."""

    deadline: float = Field(allow_inf_nan=False)


class Hop(WireModel):
    """One remaining hop of a route: a stage replica, or a verifier (then ``boundary`` says which it checks)."""

    peer_id: PeerIdStr
    boundary: int | None = Field(None, ge=0, le=1024)
    alternates: list[PeerIdStr] = Field(default_factory=list, max_length=4)


class MicrobatchMetadata(RequestMetadata):
    """A microbatch's forward or backward call along its route."""

    microbatch_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    step: int = Field(ge=0)
    kind: Literal["forward", "backward"]
    route: list[Hop] = Field(default_factory=list, max_length=64)
    taint: list[int] = Field(default_factory=list, max_length=64)

    def advance(self) -> tuple[Hop, MicrobatchMetadata]:
        """The next hop, and the metadata to send it (the route without that hop)."""
        if not self.route:
            raise ValueError(f"microbatch {self.microbatch_id}: route is empty, no hop to call")
        return self.route[0], self.model_copy(update={"route": self.route[1:]})

    def tainted(self, boundary: int) -> MicrobatchMetadata:
        """A copy with ``boundary`` added to the taint flags."""
        if boundary in self.taint:
            return self
        return self.model_copy(update={"taint": [*self.taint, boundary]})


class MicrobatchReply(WireModel):
    """What comes back with a microbatch's answer: its loss once known, and the boundaries found tainted.

    ``held``: the last stage held the update back (its loss was above the ceiling the loss gate named): no gradient
    comes back, nothing was learned, and the trainer sends the microbatch again on other replicas. ``expected``: the
    loss its text predicts, as the gate's verifier reckons it (what the loss evidence takes off)."""

    loss: float | None = None
    taint: list[int] = Field(default_factory=list, max_length=64)
    held: bool = False
    expected: float | None = Field(None, gt=0, allow_inf_nan=False)


class Envelope(WireModel):
    """The transport's own framing around a model: how many tensor parts follow, or an error instead."""

    meta: dict | None = None
    parts: int = Field(0, ge=0, le=1 << 20)
    error: str | None = Field(None, max_length=1024)


def pack_envelope(meta: WireModel | None, parts: int, error: str | None = None) -> bytes:
    data = msgpack.packb(
        {"meta": None if meta is None else meta.model_dump(mode="python"), "parts": parts, "error": error}
    )
    if len(data) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata of {len(data)} bytes exceeds the {MAX_METADATA_BYTES}-byte limit")
    return data


def unpack_envelope(data: bytes) -> Envelope:
    """Parses the framing; raises MalformedMessageError with a readable reason."""
    if len(data) > MAX_METADATA_BYTES:
        raise MalformedMessageError(f"metadata of {len(data)} bytes exceeds the {MAX_METADATA_BYTES}-byte limit")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MalformedMessageError(f"metadata is not msgpack: {type(e).__name__}") from None
    if not isinstance(raw, dict):
        raise MalformedMessageError(f"metadata must be a map, not {type(raw).__name__}")
    return _validate(Envelope, raw, "envelope")


def parse_metadata(meta: dict | None, model: type[M]) -> M:
    """Validates the model part of an envelope against ``model`` (absent metadata counts as empty)."""
    return _validate(model, meta or {}, model.__name__)


def _validate(model: type[M], raw: dict, what: str) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in e.errors()[:5])
        raise MalformedMessageError(f"{what}: {problems}") from None
