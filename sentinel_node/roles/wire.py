"""The wire contract between the pipeline roles: handler names, the metadata of a microbatch's nested call and of a
global step, and the tensor shapes every hop expects."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from sentinel_node.config import Config
from sentinel_node.transport import MicrobatchMetadata, RequestMetadata, TensorSpec, TransportSettings, WireModel

# A global step more than this far ahead of a replica's own (and of the swarm's, as its live replicas announce it)
# is refused and logged as an attack: one call with step 2**62 once froze every replica for good.
MAX_STEP_AHEAD = 16

# Handler names on every node's libp2p daemon (the transport adds a ".stream" twin for each).
STAGE_FORWARD = "sentinel.stage.forward"
STAGE_STEP = "sentinel.stage.step"
VERIFIER_RELAY = "sentinel.verifier.relay"


class PipelineRequest(MicrobatchMetadata):
    """One microbatch's nested call. ``route`` holds the hops after the callee; ``taint`` the boundaries whose
    tensor a verifier replaced on the way forward. ``train=False`` is a validation pass: forward and loss only."""

    train: bool = True


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
