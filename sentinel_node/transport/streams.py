"""Streams of protobuf messages over a libp2p stream, read one bounded message at a time.

The wire format is hivemind's (``P2P.send_protobuf``): a marker byte (0 for a message, 1 for an ``RPCError``; an
empty error ends a request stream), an 8-byte big-endian length, the serialized message. hivemind's own stream
handler reads every message whole, whatever length it declares, and prefetches several while the handler is still
deciding whether to serve the caller at all: a peer that no handler admits once made a verifier buffer 512 MiB.
Here a message longer than the reader allows is refused from its length header, before a byte of it is read, and
nothing is read ahead of the handler: until it asks for the next message, the bytes stay with the daemon, and
libp2p's flow control holds back the sender.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

from hivemind.p2p import P2P
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse

from sentinel_node.transport.errors import MalformedMessageError, TruncatedStreamError

MESSAGE_MARKER = P2P.MESSAGE_MARKER
ERROR_MARKER = P2P.ERROR_MARKER
HEADER_LEN = P2P.HEADER_LEN
# An error message (hivemind's RPCError) carries a short string; an empty one ends a request stream.
MAX_ERROR_BYTES = 64 * 1024


class StreamError(MalformedMessageError):
    """The peer sent something that is not a message this stream takes (too long, or not a protobuf)."""


async def read_message(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next message's bytes; None once the peer ended the stream (an end-of-stream marker, or it closed).
    StreamError for a message declaring more than ``max_bytes`` (refused from its header, unread) or for an error
    the peer sent instead."""
    try:
        marker = await reader.readexactly(1)
        length = int.from_bytes(await reader.readexactly(HEADER_LEN), P2P.BYTEORDER)
    except asyncio.IncompleteReadError:
        return None
    if marker == ERROR_MARKER:
        if length > MAX_ERROR_BYTES:
            raise StreamError(f"an error message of {length} bytes, over the {MAX_ERROR_BYTES} an error takes")
        try:
            data = await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            return None
        if not data:  # hivemind's END_OF_STREAM: an empty RPCError
            return None
        raise StreamError(f"the peer sent an error instead of a message ({len(data)} bytes)")
    if marker != MESSAGE_MARKER:
        raise StreamError(f"not a message: marker {marker!r}")
    if length > max_bytes:
        raise StreamError(f"a message of {length} bytes, over the {max_bytes} bytes this stream takes")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise TruncatedStreamError(f"the stream ended inside a message ({len(e.partial)} of {length} bytes)") from None


def parse_request(data: bytes) -> ExpertRequest:
    try:
        return ExpertRequest.FromString(data)
    except Exception as e:  # protobuf's DecodeError, or worse on garbage
        raise StreamError(f"a request message is not a protobuf: {type(e).__name__}") from None


def parse_response(data: bytes) -> ExpertResponse:
    try:
        return ExpertResponse.FromString(data)
    except Exception as e:
        raise StreamError(f"a reply message is not a protobuf: {type(e).__name__}") from None


async def send_messages(writer: asyncio.StreamWriter, messages, end: bool = False) -> None:
    """Writes protobuf messages (each drained before the next: nothing piles up in this process), then the
    end-of-stream marker if ``end``."""
    for message in messages:
        await P2P.send_protobuf(message, writer)
    if end:
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)


async def discard(reader: asyncio.StreamReader, max_message: int, budget: int, timeout: float) -> None:
    """Reads and drops what the peer still sends, up to ``budget`` bytes in all and ``timeout`` seconds, so that an
    answer already sent is not lost to a reset stream; gives up quietly on anything odd."""

    async def drop() -> None:
        seen = 0
        while seen <= budget:
            data = await read_message(reader, max_message)
            if data is None:
                return
            seen += len(data) + HEADER_LEN + 1

    with suppress(Exception):
        await asyncio.wait_for(drop(), timeout)
