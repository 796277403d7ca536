"""Messages on the wire: tensors plus an envelope that announces how many tensor parts follow.

A unary message carries whole tensors; a stream cuts them with ``split_for_streaming`` and puts the envelope in
its first message. A stream whose sender dies just ends early, so the receiver counts parts against the envelope
and treats a short count as an error. Parts are checked as they arrive, so a peer cannot make us buffer more
than its tensors' declared (and limited) sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse
from hivemind.proto.runtime_pb2 import Tensor as WireTensor
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from sentinel_node.transport.codec import TensorLimits, check_header
from sentinel_node.transport.errors import MalformedMessageError, MalformedTensorError, TruncatedStreamError
from sentinel_node.transport.messages import WireModel, pack_envelope

STREAM_SUFFIX = ".stream"
# The smallest chunk an honest sender uses (hivemind's default); bounds how many parts a tensor may be cut into.
MIN_CHUNK_BYTES = 2**16

Message = TypeVar("Message", ExpertRequest, ExpertResponse)


def payload_bytes(protos: Sequence[WireTensor]) -> int:
    return sum(len(proto.buffer) for proto in protos)


def unary_message(kind: type[Message], meta: WireModel | None, protos: Sequence[WireTensor]) -> Message:
    return kind(tensors=list(protos), metadata=pack_envelope(meta, len(protos)))


def stream_messages(
    kind: type[Message], meta: WireModel | None, protos: Sequence[WireTensor], chunk_bytes: int
) -> list[Message]:
    parts = [part for proto in protos for part in split_for_streaming(proto, chunk_bytes)]
    head = kind(tensors=parts[:1], metadata=pack_envelope(meta, len(parts)))
    return [head, *(kind(tensors=[part]) for part in parts[1:])]


def error_message(kind: type[Message], error: str) -> Message:
    return kind(metadata=pack_envelope(None, 0, error))


def max_parts(limits: TensorLimits) -> int:
    # Wire size can exceed the declared size (the codebook of a small 8-bit tensor): allow twice that.
    return limits.max_tensors * (2 * limits.max_tensor_bytes // MIN_CHUNK_BYTES + 2)


class PartAssembler:
    """Rebuilds whole wire tensors from parts, checking each tensor's header as soon as its first part arrives."""

    def __init__(self, expected_parts: int, limits: TensorLimits, max_bytes: int | None = None) -> None:
        """``max_bytes``: what all the message's tensors together may declare (None: what ``limits`` allow)."""
        if expected_parts > max_parts(limits):
            raise MalformedMessageError(f"{expected_parts} parts announced, over the limit of {max_parts(limits)}")
        self.expected_parts = expected_parts
        self.max_bytes = max_bytes
        self.declared = 0
        self.received_parts = 0
        self.tensors: list[WireTensor] = []
        self._limits = limits
        self._pending: list[WireTensor] = []
        self._chunks_left = 0
        self._budget = 0
        self._bytes = 0

    @property
    def complete(self) -> bool:
        return self.received_parts == self.expected_parts and not self._chunks_left

    def add(self, part: WireTensor) -> None:
        self.received_parts += 1
        if self.received_parts > self.expected_parts:
            raise MalformedMessageError(f"more tensor parts than the {self.expected_parts} announced")
        index = len(self.tensors)
        if not self._chunks_left:
            self._start_tensor(index, part)
        else:
            self._chunks_left -= 1
        self._pending.append(part)
        self._bytes += len(part.buffer)
        if self._bytes > self._budget:
            raise MalformedTensorError(f"tensor {index}: more than the {self._budget} bytes its header allows")
        if not self._chunks_left:
            self.tensors.append(combine_from_streaming(self._pending))
            self._pending = []

    def _start_tensor(self, index: int, part: WireTensor) -> None:
        if index >= self._limits.max_tensors:
            raise MalformedTensorError(f"more than {self._limits.max_tensors} tensors in one message")
        self._budget = check_header(index, part, self._limits)
        self.declared += self._budget
        if self.max_bytes is not None and self.declared > self.max_bytes:
            raise MalformedTensorError(
                f"tensor {index}: the message's tensors declare {self.declared} bytes, over the {self.max_bytes} "
                "bytes this handler takes"
            )
        # split_for_streaming marks an empty tensor as 0 chunks but still sends one part.
        chunks = max(part.chunks, 1)
        if chunks > self._budget // MIN_CHUNK_BYTES + 1:
            raise MalformedTensorError(f"tensor {index}: cut into {chunks} parts, too many for {self._budget} bytes")
        self._chunks_left = chunks - 1
        self._bytes = 0

    def finish(self) -> list[WireTensor]:
        """The whole tensors; TruncatedStreamError if parts announced never came."""
        if not self.complete:
            raise TruncatedStreamError(
                f"stream ended after {self.received_parts} of the {self.expected_parts} tensor parts it announced"
            )
        return self.tensors
