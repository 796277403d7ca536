"""The wire contract between the pipeline roles: handler names, the metadata of a microbatch's nested call and of a
global step, and the tensor shapes every hop expects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field

from sentinel_node.config import Config
from sentinel_node.transport import MicrobatchMetadata, RequestMetadata, TensorSpec, TransportSettings, WireModel
from sentinel_node.transport.messages import PeerIdStr

# A global step more than this far ahead of a replica's own (and of the swarm's, as its live replicas announce it)
# is refused and logged as an attack: one call with step 2**62 once froze every replica for good.
MAX_STEP_AHEAD = 16

# Handler names on every node's libp2p daemon (the transport adds a ".stream" twin for each).
STAGE_FORWARD = "sentinel.stage.forward"
STAGE_STEP = "sentinel.stage.step"
VERIFIER_RELAY = "sentinel.verifier.relay"
# recomputation audits (sentinel_node/roles/audits.py)
STAGE_RECOMPUTE = "sentinel.stage.recompute"
VERIFIER_CROSSING = "sentinel.verifier.crossing"


class PipelineRequest(MicrobatchMetadata):
    """One microbatch's nested call. ``route`` holds the hops after the callee; ``taint`` the boundaries whose
    tensor a verifier replaced on the way forward. ``train=False`` is a validation pass: forward and loss only.

    ``first_tokens``: the first token of each sequence. Targets are the inputs shifted by one, so with it the
    verifier of boundary 0|1 knows stage 0's whole input and can have stage 0's work recomputed.

    ``loss_ceiling``: the loss above which the last stage holds the microbatch's update back (the loss gate,
    :mod:`sentinel_node.verification.excess`); only the verifier of the last boundary sets it."""

    train: bool = True
    first_tokens: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(default_factory=list, max_length=4096)
    # set by the verifier of the last boundary for the last stage (its caller: no stage can change it on the way)
    loss_ceiling: float | None = Field(None, gt=0)


class StepRequest(RequestMetadata):
    """The trainer's global step ``step`` is complete: apply the gradients accumulated for it."""

    step: int = Field(ge=0)


class StepReply(WireModel):
    stepped: bool
    microbatches: int = Field(ge=0)
    averaging: bool = False


@dataclass(frozen=True)
class Shapes:
    """The fixed tensor shapes of this swarm's microbatches, and the wire dtype of its hidden states."""

    batch: int
    seq_len: int
    hidden: int
    vocab: int
    dtype: torch.dtype = torch.float32  # pipeline.wire_dtype: activations and gradients

    @classmethod
    def of(cls, config: Config) -> Shapes:
        pipe = config.pipeline
        wire = getattr(torch, pipe.wire_dtype)
        return cls(pipe.microbatch_size, pipe.seq_len, config.model.hidden_size, config.model.vocab_size, wire)

    @property
    def activation(self) -> tuple[int, int, int]:
        return (self.batch, self.seq_len, self.hidden)

    @property
    def tokens(self) -> TensorSpec:
        return TensorSpec((self.batch, self.seq_len), torch.int64)

    @property
    def hidden_spec(self) -> TensorSpec:
        return TensorSpec(self.activation, self.dtype)

    @property
    def activation_bytes(self) -> int:
        """The most a reply carrying one activation or gradient takes (float32)."""
        return self.batch * self.seq_len * self.hidden * 4

    @property
    def tokens_per_microbatch(self) -> int:
        return self.batch * self.seq_len


def transport_settings(config: Config) -> TransportSettings:
    return TransportSettings(compression=config.pipeline.compression, max_tensor_mib=config.pipeline.max_tensor_mib)


# --- recomputation audits


class RecomputeRequest(RequestMetadata):
    """A verifier asks a stage replica for the work of the stage on a microbatch of global step ``step`` (tensors:
    stage 0 its input tokens; a middle stage its input and the output gradient; the last stage its input and the
    targets), recomputed with its reference parameters for that step."""

    microbatch_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    step: int = Field(ge=0)
    # a microbatch the loss gate held back: a middle stage gets its input alone and recomputes its output alone
    forward_only: bool = False


class RecomputeReply(WireModel):
    """The recomputed work (tensors: stage 0 its output and its embeddings; a middle stage its output and input
    gradient; the last stage its input gradient) and the reference it was computed with; ``available=False`` (no
    tensors) when the replica holds no reference for that step (it just joined, or its rounds failed)."""

    available: bool
    round_step: int = Field(-1, ge=-1)
    applies_from: int = Field(0, ge=0)
    digest: str = Field("", pattern=r"^([0-9a-f]{16})?$")
    members: list[PeerIdStr] | None = Field(None, max_length=1024)
    # how far the replica's own parameters carried it from the reference on this microbatch (the audit's allowance)
    drift_steps: int = Field(0, ge=0)
    drift: dict[Literal["activation", "gradient"], Annotated[float, Field(ge=0)]] = Field(default_factory=dict)


class CrossingRequest(RequestMetadata):
    """One verifier asks another for what it relayed across ``boundary`` for a microbatch. With ``rows``, it asks
    only for those rows (token positions) of the gradient passed back: the verifier below judges the passage of a
    middle stage on them (:mod:`sentinel_node.verification.passage`), and the reply then holds that one tensor.
    A verifier from before the field refuses such a request, and the passage is not judged."""

    microbatch_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    boundary: int = Field(ge=0, le=1024)
    rows: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(None, min_length=1, max_length=65536)


class CrossingReply(WireModel):
    """What was relayed (tensors: the activation passed on and the gradient passed back, or the activation alone when
    ``held``), who sent the activation and who answered; ``found=False`` (no tensors) when this verifier holds no
    settled, untainted crossing of that microbatch any more."""

    found: bool
    step: int = Field(0, ge=0)
    sender: PeerIdStr | None = None
    receiver: PeerIdStr | None = None
    held: bool = False  # the loss gate held the microbatch back: the activation alone, no gradient
