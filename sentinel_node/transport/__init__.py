"""Tensor transport for the networked pipeline: hivemind P2P handlers carrying checked tensors under deadlines.

Caller side: :func:`call_peer`, :func:`call_first_available`. Serving side: :class:`TensorServer`. Everything a
caller may catch derives from :class:`HopError`; everything wrong with bytes from a peer from
:class:`MalformedMessageError`.
"""

from sentinel_node.transport.client import Reply, call_first_available, call_peer
from sentinel_node.transport.codec import (
    ALLOWED_DTYPES,
    COMPRESSIONS,
    TensorLimits,
    TensorSpec,
    check_tensors,
    deserialize_tensors,
    resolve_compression,
    serialize_tensors,
)
from sentinel_node.transport.deadlines import clamp_deadline, current_deadline, time_left
from sentinel_node.transport.errors import (
    HopBanned,
    HopDeadlineExceeded,
    HopDownstreamFailed,
    HopError,
    HopInternal,
    HopMalformed,
    HopOverloaded,
    HopRefused,
    HopUnavailable,
    MalformedMessageError,
    MalformedTensorError,
    TruncatedStreamError,
)
from sentinel_node.transport.framing import STREAM_SUFFIX
from sentinel_node.transport.messages import (
    Hop,
    MicrobatchMetadata,
    MicrobatchReply,
    RequestMetadata,
    WireModel,
)
from sentinel_node.transport.server import Answer, Incoming, TensorServer, expected_bytes
from sentinel_node.transport.settings import TransportSettings

__all__ = [
    "ALLOWED_DTYPES",
    "COMPRESSIONS",
    "STREAM_SUFFIX",
    "Answer",
    "Hop",
    "HopBanned",
    "HopDeadlineExceeded",
    "HopDownstreamFailed",
    "HopError",
    "HopInternal",
    "HopMalformed",
    "HopOverloaded",
    "HopRefused",
    "HopUnavailable",
    "Incoming",
    "MalformedMessageError",
    "MalformedTensorError",
    "MicrobatchMetadata",
    "MicrobatchReply",
    "Reply",
    "RequestMetadata",
    "TensorLimits",
    "TensorServer",
    "expected_bytes",
    "TensorSpec",
    "TransportSettings",
    "TruncatedStreamError",
    "WireModel",
    "call_first_available",
    "call_peer",
    "check_tensors",
    "clamp_deadline",
    "current_deadline",
    "deserialize_tensors",
    "resolve_compression",
    "serialize_tensors",
    "time_left",
]
