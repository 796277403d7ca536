"""Calling a peer's tensor handler under a deadline, and retrying once on another candidate.

Every failure comes out as a :class:`HopError` subclass naming the peer, so a caller can decide between retrying
elsewhere (``retryable``), failing the microbatch back, and blacklisting the peer that failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from contextlib import closing, suppress
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse
from hivemind.proto.runtime_pb2 import Tensor as WireTensor
from hivemind.utils.logging import get_logger

from sentinel_node.transport.codec import TensorSpec, check_tensors, deserialize_tensors, serialize_tensors
from sentinel_node.transport.deadlines import clamp_deadline, time_left
from sentinel_node.transport.errors import (
    HopDeadlineExceeded,
    HopError,
    HopInternal,
    HopMalformed,
    HopUnavailable,
    MalformedMessageError,
    TruncatedStreamError,
    decode_error,
)
from sentinel_node.transport.framing import (
    STREAM_SUFFIX,
    PartAssembler,
    payload_bytes,
    stream_messages,
    unary_message,
)
from sentinel_node.transport.messages import (
    MAX_METADATA_BYTES,
    Envelope,
    MicrobatchReply,
    RequestMetadata,
    WireModel,
    parse_metadata,
    unpack_envelope,
)
from sentinel_node.transport.settings import TransportSettings
from sentinel_node.transport.streams import parse_response, read_message, send_messages

logger = get_logger(__name__)

R = TypeVar("R", bound=WireModel)

# Failures of the connection itself, as opposed to an answer: the peer is dead, unreachable or went away.
_CONNECTION_ERRORS = (P2PDaemonError, ConnectionError, EOFError, asyncio.IncompleteReadError, OSError)


@dataclass
class Reply(Generic[R]):
    """A peer's answer: its tensors and metadata, who answered, and which candidates failed before it."""

    tensors: list[torch.Tensor]
    metadata: R
    peer: str
    elapsed_s: float
    failures: list[HopError] = field(default_factory=list)


@dataclass(frozen=True)
class _Call:
    """A request already encoded, so a retry does not serialize the tensors again."""

    handler: str
    protos: list[WireTensor]
    metadata: RequestMetadata
    settings: TransportSettings
    reply_model: type[WireModel]
    expect: Sequence[TensorSpec] | None
    require_finite: bool
    stream: bool
    max_reply_bytes: int | None = None


async def call_peer(
    p2p: P2P,
    peer: PeerID | str,
    handler: str,
    tensors: Sequence[torch.Tensor],
    metadata: RequestMetadata,
    *,
    settings: TransportSettings,
    reply_model: type[R] = MicrobatchReply,
    expect: Sequence[TensorSpec] | None = None,
    require_finite: bool = False,
    stream: bool | None = None,
    max_reply_bytes: int | None = None,
) -> Reply[R]:
    """Calls ``handler`` on ``peer`` and waits until ``metadata.deadline`` at most (clamped to the request being
    served, if any). Requests over ``settings.stream_threshold_bytes`` are streamed; pass ``stream=True`` when the
    reply may exceed the unary cap although the request does not. ``max_reply_bytes`` bounds the tensors a reply
    may declare (default: the transport's limits). Raises a HopError subclass on any failure."""
    call = await _encode(
        handler, tensors, metadata, settings, reply_model, expect, require_finite, stream, max_reply_bytes
    )
    return await _attempt(p2p, str(peer), call)


async def call_first_available(
    p2p: P2P,
    candidates: Sequence[PeerID | str],
    handler: str,
    tensors: Sequence[torch.Tensor],
    metadata: RequestMetadata,
    *,
    settings: TransportSettings,
    reply_model: type[R] = MicrobatchReply,
    expect: Sequence[TensorSpec] | None = None,
    require_finite: bool = False,
    stream: bool | None = None,
    max_attempts: int = 2,
    max_reply_bytes: int | None = None,
) -> Reply[R]:
    """Like :func:`call_peer` on ``candidates[0]``; if that fails before answering (unreachable, dead, overloaded),
    tries the next candidate, up to ``max_attempts`` peers while time is left. The reply's ``failures`` (or the
    raised error's ``failures``, which includes itself) list every failed attempt with its peer, for blacklisting.
    A refusal, a malformed exchange or a downstream failure is raised at once: another candidate would not help."""
    if not candidates:
        raise ValueError("call_first_available needs at least one candidate")
    call = await _encode(
        handler, tensors, metadata, settings, reply_model, expect, require_finite, stream, max_reply_bytes
    )
    failures: list[HopError] = []
    for peer in list(dict.fromkeys(map(str, candidates)))[:max_attempts]:
        if failures and time_left(call.metadata.deadline) <= settings.hop_margin_s:
            break
        try:
            reply = await _attempt(p2p, peer, call)
        except HopError as e:
            failures.append(e)
            if not e.retryable:
                break
            logger.debug(f"{handler} on {peer} failed ({e.code}: {e.detail}); trying another candidate")
            continue
        reply.failures = failures
        return reply
    error = failures[-1]
    error.failures = failures
    raise error


async def _encode(
    handler: str,
    tensors: Sequence[torch.Tensor],
    metadata: RequestMetadata,
    settings: TransportSettings,
    reply_model: type[WireModel],
    expect: Sequence[TensorSpec] | None,
    require_finite: bool,
    stream: bool | None,
    max_reply_bytes: int | None = None,
) -> _Call:
    deadline = clamp_deadline(metadata.deadline)
    if deadline < metadata.deadline:
        metadata = metadata.model_copy(update={"deadline": deadline})
    protos = await asyncio.to_thread(serialize_tensors, tensors, settings.compression_type, settings.limits)
    if stream is None:
        stream = payload_bytes(protos) > settings.stream_threshold_bytes
    return _Call(handler, protos, metadata, settings, reply_model, expect, require_finite, stream, max_reply_bytes)


async def _attempt(p2p: P2P, peer: str, call: _Call) -> Reply:
    started = time.perf_counter()
    timeout = time_left(call.metadata.deadline)
    if timeout <= 0:
        raise HopDeadlineExceeded(f"{call.handler}: the deadline passed before the call", peer=peer)
    try:
        peer_id = PeerID.from_base58(peer)
    except ValueError:
        raise HopUnavailable(f"{peer[:60]!r} is not a peer id", peer=peer) from None
    try:
        tensors, metadata = await asyncio.wait_for(_exchange(p2p, peer_id, call), timeout)
    except HopError as e:
        e.peer = e.peer or peer
        e.culprit = e.culprit or peer
        raise
    except asyncio.TimeoutError:
        raise HopDeadlineExceeded(f"{call.handler}: no answer within {timeout:.2f} s", peer=peer) from None
    except TruncatedStreamError as e:
        raise HopUnavailable(f"{call.handler}: reply cut short: {e}", peer=peer) from None
    except MalformedMessageError as e:
        raise HopMalformed(f"{call.handler}: reply: {e}", peer=peer) from None
    except P2PHandlerError as e:
        raise decode_error(str(e), peer) from None
    except _CONNECTION_ERRORS as e:
        raise HopUnavailable(f"{call.handler}: {type(e).__name__}: {e}", peer=peer) from None
    except DecodeError as e:
        raise HopMalformed(f"{call.handler}: reply is not a protobuf: {e}", peer=peer) from None
    except Exception as e:  # anything else a peer's bytes can provoke in hivemind: still a failed hop, not a crash
        logger.warning(f"{call.handler} on {peer} failed unexpectedly", exc_info=True)
        raise HopInternal(f"{call.handler}: {type(e).__name__}: {e}", peer=peer) from None
    return Reply(tensors, metadata, peer, time.perf_counter() - started)


async def _exchange(p2p: P2P, peer_id: PeerID, call: _Call) -> tuple[list[torch.Tensor], WireModel]:
    limits = call.settings.limits
    if call.stream:
        envelope, protos = await _exchange_stream(p2p, peer_id, call)
    else:
        request = unary_message(ExpertRequest, call.metadata, call.protos)
        response = await p2p.call_protobuf_handler(peer_id, call.handler, request, ExpertResponse)
        envelope = _open(response.metadata, str(peer_id))
        assembler = PartAssembler(envelope.parts, limits, call.max_reply_bytes)
        for proto in response.tensors:
            assembler.add(proto)
        protos = assembler.finish()
    metadata = parse_metadata(envelope.meta, call.reply_model)
    tensors = await asyncio.to_thread(_decode, protos, call)
    return tensors, metadata


async def _exchange_stream(p2p: P2P, peer_id: PeerID, call: _Call) -> tuple[Envelope, list[WireTensor]]:
    """Writes the request while reading the reply, one bounded message at a time (``streams.py``): a callee
    cannot make us buffer more than one chunk per message, nor more tensor bytes than ``max_reply_bytes``."""
    requests = stream_messages(ExpertRequest, call.metadata, call.protos, call.settings.chunk_bytes)
    max_message = call.settings.chunk_bytes + MAX_METADATA_BYTES + 16 * 1024
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, call.handler + STREAM_SUFFIX)
    with closing(writer):
        writing = asyncio.create_task(send_messages(writer, requests, end=True))
        try:
            data = await read_message(reader, max_message)
            if data is None:
                raise TruncatedStreamError("the reply stream ended before its first message")
            head = parse_response(data)
            envelope = _open(head.metadata, str(peer_id))
            assembler = PartAssembler(envelope.parts, call.settings.limits, call.max_reply_bytes)
            for proto in head.tensors:
                assembler.add(proto)
            # Stop as soon as all announced parts are in: reading on to the end would only wait for the close.
            while not assembler.complete:
                data = await read_message(reader, max_message)
                if data is None:
                    break
                for proto in parse_response(data).tensors:
                    assembler.add(proto)
            return envelope, assembler.finish()
        finally:
            writing.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await writing


def _open(data: bytes, peer: str) -> Envelope:
    envelope = unpack_envelope(data)
    if envelope.error is not None:
        raise decode_error(envelope.error, peer)
    return envelope


def _decode(protos: list[WireTensor], call: _Call) -> list[torch.Tensor]:
    tensors = deserialize_tensors(protos, call.settings.limits)
    check_tensors(tensors, call.expect, call.require_finite)
    return tensors
