"""Fuzzed bytes against the tensor wire format and the RPC messages, in-process and at a real server.

The receiving path is the server's, piece by piece: the bounded stream reader (``streams.read_message``), the
protobuf parse, the envelope and the request metadata (``messages``), the part assembler (``framing``), and the
tensor codec with the handler's expectations (``codec``). Inputs: honest messages (real tensors, every dtype and
compression, cut into stream parts) and their corruptions (truncated streams, wrong part counts, declared sizes
up to 2**64 - 1, unknown dtypes and compressions, shapes that overflow or go negative, buffers that do not match,
garbage protobuf and msgpack).

What must hold: an honest message decodes to its tensors; anything else ends in a ``MalformedMessageError`` (the
server turns it into a ``malformed: ...`` answer to the sender) and nothing else: any other exception is what the
server would log as an internal error. The assembler never holds more bytes than the handler takes. At the end,
fuzzed streams and unary calls go to a real server in a process of its own (tests/stream_flood.py's): every
answer is a coded error, the server survives, and its peak RSS growth is measured.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest
import torch
from fuzzing import Tally, fuzz_settings
from hivemind.p2p import P2P
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse
from hivemind.proto.runtime_pb2 import Tensor as WireTensor
from hypothesis import given
from hypothesis import strategies as st

from sentinel_node.roles.wire import PipelineRequest, StepRequest
from sentinel_node.transport import (
    MalformedMessageError,
    TensorLimits,
    TensorSpec,
    check_tensors,
    deserialize_tensors,
    serialize_tensors,
)
from sentinel_node.transport.codec import COMPRESSIONS, bitsandbytes_problem
from sentinel_node.transport.framing import PartAssembler, stream_messages
from sentinel_node.transport.messages import RequestMetadata, parse_metadata, unpack_envelope
from sentinel_node.transport.server import expected_bytes
from sentinel_node.transport.settings import TransportSettings
from sentinel_node.transport.streams import StreamError, parse_request, read_message

SETTINGS = TransportSettings()
LIMITS = TensorLimits(max_tensor_mib=1.0, max_tensors=4)  # small limits: the checks, not the sizes, are fuzzed
MAX_MESSAGE = SETTINGS.chunk_bytes + 64 * 1024 + 16 * 1024  # TensorServer.max_message_bytes
CHUNK = 2**16  # the smallest chunk an honest sender uses: more parts per tensor
SPECS = [TensorSpec((2, 8, 16), torch.float32)]  # a stage's activation, as a handler expects it
DTYPES = ["float32", "float16", "bfloat16", "int64"]
CODECS = ["none", "float16"] + ["blockwise_8bit"] * (bitsandbytes_problem() is None)

TALLY = Tally("wire")
LOOP = asyncio.new_event_loop()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    TALLY.dump()
    LOOP.close()


def framed(data: bytes, marker: bytes = P2P.MESSAGE_MARKER, length: int | None = None) -> bytes:
    """hivemind's framing of one message: marker, 8-byte big-endian length, bytes."""
    return marker + (len(data) if length is None else length).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


# --- honest messages ------------------------------------------------------------------------------------------


@st.composite
def honest_tensors(draw) -> tuple[list[torch.Tensor], str]:
    n = draw(st.integers(1, 3))
    tensors = []
    for _ in range(n):
        shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
        dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
        seed = draw(st.integers(0, 2**31))
        generator = torch.Generator().manual_seed(seed)
        if dtype == torch.int64:
            tensor = torch.randint(-(2**40), 2**40, shape, generator=generator)
        else:
            tensor = torch.randn(shape, generator=generator).to(dtype)
        tensors.append(tensor)
    if draw(st.booleans()):  # 8-bit compression only takes tensors of a block (4096 values) or more
        tensors.append(torch.randn(4096 + draw(st.integers(0, 100))))
    return tensors, draw(st.sampled_from(CODECS))


def decode_parts(parts: list[WireTensor], expected_parts: int, max_bytes: int | None) -> list[torch.Tensor]:
    """The server's receiving path from parts on: assembler, codec, expectations (if the count fits SPECS)."""
    assembler = PartAssembler(expected_parts, LIMITS, max_bytes)
    held_peak = 0
    for part in parts:
        assembler.add(part)
        held = sum(len(p.buffer) for p in assembler._pending) + sum(len(t.buffer) for t in assembler.tensors)
        held_peak = max(held_peak, held)
    # the assembler holds no more than the headers declared, and never more than the handler takes
    assert held_peak <= assembler.declared
    if max_bytes is not None:
        assert held_peak <= max_bytes
    tensors = deserialize_tensors(assembler.finish(), LIMITS)
    check_tensors(tensors, SPECS if max_bytes is not None else None, require_finite=False)
    return tensors


async def _read_all(data: bytes, max_bytes: int) -> list[bytes]:
    reader = asyncio.StreamReader(limit=2**20)
    reader.feed_data(data)
    reader.feed_eof()
    messages = []
    while (message := await read_message(reader, max_bytes)) is not None:
        assert len(message) <= max_bytes
        messages.append(message)
    return messages


def receive(stream: bytes, max_bytes: int | None = None) -> list[torch.Tensor]:
    """Everything the server does with a request stream's bytes, up to the decoded, checked tensors."""
    messages = LOOP.run_until_complete(_read_all(stream, MAX_MESSAGE))
    if not messages:
        raise StreamError("empty stream")  # the server just closes it
    head = parse_request(messages[0])
    envelope = unpack_envelope(head.metadata)
    parse_metadata(envelope.meta, RequestMetadata)
    parts = [*head.tensors, *(t for m in messages[1:] for t in parse_request(m).tensors)]
    return decode_parts(parts, envelope.parts, max_bytes)


def honest_stream(tensors: list[torch.Tensor], codec: str, deadline: float = 1e12) -> bytes:
    protos = serialize_tensors(tensors, COMPRESSIONS[codec], LIMITS)
    messages = stream_messages(ExpertRequest, RequestMetadata(deadline=deadline), protos, CHUNK)
    return b"".join(framed(m.SerializeToString()) for m in messages)


def _outcome(target: str, run) -> object:
    try:
        result = run()
    except MalformedMessageError as e:
        assert str(e), "an error must say what was wrong"
        TALLY.add(target, "malformed (clear error)")
        return e
    except Exception:
        TALLY.add(target, "CRASH")
        raise
    TALLY.add(target, "accepted")
    return result


@fuzz_settings(100)
@given(honest=honest_tensors())
def test_honest_messages_decode_to_their_tensors(honest):
    tensors, codec = honest
    TALLY.add("honest messages", "tried")
    got = _outcome("honest messages", lambda: receive(honest_stream(tensors, codec)))
    assert not isinstance(got, Exception), got
    assert len(got) == len(tensors)
    for sent, back in zip(tensors, got, strict=True):
        assert back.dtype == sent.dtype and back.shape == sent.shape
        if codec == "none" or sent.dtype == torch.int64:
            assert torch.equal(back, sent)


# --- corrupted messages ---------------------------------------------------------------------------------------


def _flip(data: bytes, position: int, bit: int) -> bytes:
    position %= max(len(data), 1)
    return data[:position] + bytes([data[position] ^ (1 << bit)]) + data[position + 1 :] if data else data


# hivemind's Tensor: uint32 dimensions (a product of ten overflows any integer type), int32 chunks, an open enum
dimension = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**16, 2**31, 2**32 - 1]), st.integers(0, 100))
chunk_count = st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 100)
big = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([-1, 0, 1, 2**20, 2**20 + 1, 2**31, 2**63 - 1]))


CORRUPTIONS = ["truncated", "bit-flip", "parts", "size", "dtype", "compression", "buffer", "chunks", "length"]
CORRUPTIONS += ["marker", "garbage-protobuf", "garbage-metadata", "metadata", "tensors"]


@st.composite
def corrupted_stream(draw, kinds: tuple[str, ...] = tuple(CORRUPTIONS)) -> tuple[str, bytes]:
    tensors, codec = draw(honest_tensors())
    protos = serialize_tensors(tensors, COMPRESSIONS[codec], LIMITS)
    how = draw(st.sampled_from(kinds))
    parts_delta = 0
    if how in ("size", "dtype", "compression", "buffer", "chunks"):
        proto = protos[draw(st.integers(0, len(protos) - 1))]
        if how == "size":
            shape = draw(st.lists(dimension, min_size=0, max_size=10))
            del proto.size[:]
            proto.size.extend(shape)
        elif how == "dtype":
            proto.dtype = draw(st.sampled_from(["uint8", "float64", "bool", "int8", "complex64", ""]) | st.text())
        elif how == "compression":
            proto.compression = draw(st.integers(-(2**31), 2**31 - 1))
        elif how == "buffer":
            cut = draw(st.integers(0, len(proto.buffer) + 8))
            proto.buffer = proto.buffer[:cut] + draw(st.binary(max_size=8))
        else:
            proto.chunks = draw(chunk_count)
    elif how == "tensors":
        extra = serialize_tensors([torch.zeros(3)], COMPRESSIONS["none"], LIMITS)
        protos = protos + extra * draw(st.integers(1, 6))
    elif how == "parts":
        parts_delta = draw(st.integers(-5, 5).filter(bool) | st.sampled_from([2**20, 2**20 + 1, 2**31]))
    deadline = 1e12
    meta = RequestMetadata(deadline=deadline)
    messages = stream_messages(ExpertRequest, meta, protos, CHUNK)
    if how == "parts":
        envelope = msgpack.unpackb(messages[0].metadata)
        envelope["parts"] = max(0, envelope["parts"] + parts_delta) if parts_delta < 2**20 else parts_delta
        messages[0].metadata = msgpack.packb(envelope)
    elif how == "metadata":
        envelope = msgpack.unpackb(messages[0].metadata)
        envelope["meta"] = draw(
            st.dictionaries(
                st.sampled_from(["deadline", "step", "route", "x"]),
                st.one_of(st.floats(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.none()),
            )
        )
        messages[0].metadata = msgpack.packb(envelope)
    elif how == "garbage-metadata":
        messages[0].metadata = draw(st.binary(max_size=200))
    data = [m.SerializeToString() for m in messages]
    if how == "garbage-protobuf":
        index = draw(st.integers(0, len(data) - 1))
        data[index] = draw(st.binary(max_size=300))
    stream = b"".join(framed(d) for d in data)
    if how == "truncated":
        stream = stream[: draw(st.integers(0, len(stream) - 1))]
    elif how == "bit-flip":
        for _ in range(draw(st.integers(1, 4))):
            stream = _flip(stream, draw(st.integers(0, len(stream))), draw(st.integers(0, 7)))
    elif how == "length":  # a declared length up to 2**64 - 1, with or without the bytes behind it
        length = draw(st.integers(0, 2**64 - 1) | st.sampled_from([MAX_MESSAGE, MAX_MESSAGE + 1, 2**63]))
        stream = framed(data[0][: draw(st.integers(0, len(data[0])))], length=length) + stream
    elif how == "marker":
        marker = draw(st.binary(min_size=1, max_size=1))
        stream = framed(draw(st.binary(max_size=64)), marker=marker) + stream
    return how, stream


@fuzz_settings(200)
@given(case=corrupted_stream(), expecting=st.booleans())
def test_corrupted_streams_get_a_clear_error_and_nothing_else(case, expecting):
    """Any corruption of an honest stream: decoded (a harmless flip), or a MalformedMessageError; never another
    exception; the assembler never holds more than declared nor more than the handler takes."""
    how, stream = case
    TALLY.add("corrupted streams", "tried")
    TALLY.add("corrupted streams", f"kind {how}")
    max_bytes = expected_bytes(SPECS) if expecting else None
    _outcome("corrupted streams", lambda: receive(stream, max_bytes))


wire_tensor = st.builds(
    WireTensor,
    buffer=st.binary(max_size=256),
    size=st.lists(dimension, max_size=10),
    requires_grad=st.booleans(),
    dtype=st.sampled_from(DTYPES + ["uint8", "float64", "bool", ""]) | st.text(max_size=12),
    compression=st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]) | st.integers(-(2**31), 2**31 - 1),
    chunks=chunk_count,
)


@fuzz_settings(150)
@given(parts=st.lists(wire_tensor, max_size=8), expected=big, expecting=st.booleans())
def test_tensor_headers_from_nowhere_never_crash_the_codec(parts, expected, expecting):
    """Parts with any header at all (dtype, compression, shape up to 2**63 per dimension and overflowing in
    product, chunk count), against any announced count."""
    TALLY.add("tensor headers", "tried")
    max_bytes = expected_bytes(SPECS) if expecting else None
    _outcome("tensor headers", lambda: decode_parts(parts, expected, max_bytes))


@fuzz_settings(200)
@given(
    raw=st.binary(max_size=300)
    | st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    ["meta", "parts", "error", "deadline", "step", "route", "kind", "microbatch_id", "taint"]
                )
                | st.text(max_size=4),
                children,
                max_size=6,
            )
        ),
        max_leaves=16,
    ).map(lambda v: msgpack.packb(v, use_bin_type=True))
    | st.fixed_dictionaries(
        {
            "meta": st.dictionaries(
                st.sampled_from(["deadline", "step", "route", "kind", "microbatch_id", "taint", "train"]),
                st.none() | st.booleans() | st.floats() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
            ),
            "parts": big,
            "error": st.none() | st.text(max_size=2000),
        }
    ).map(lambda v: msgpack.packb(v, use_bin_type=True)),
    model=st.sampled_from([RequestMetadata, PipelineRequest, StepRequest]),
)
def test_envelopes_and_metadata_from_nowhere_get_a_clear_error(raw, model):
    """The metadata of a request (any msgpack, any bytes) against the envelope and every request model."""
    TALLY.add("envelopes and metadata", "tried")

    def parse():
        envelope = unpack_envelope(raw)
        return parse_metadata(envelope.meta, model)

    _outcome("envelopes and metadata", parse)
    _outcome("protobuf", lambda: parse_request(raw))


# --- the network edge -----------------------------------------------------------------------------------------


@st.composite
def network_case(draw) -> tuple[str, bytes]:
    """Corrupted streams the server answers at once: whole messages, so no wait for bytes that never come (a
    length header longer than what follows waits out the first message's timeout, 5 s: tested in-process)."""
    waiting = ("truncated", "bit-flip", "parts", "length")
    return draw(corrupted_stream(tuple(k for k in CORRUPTIONS if k not in waiting)))


async def _send_stream(p2p, peer, handler: str, stream: bytes) -> str:
    """Sends the bytes on a new stream and returns the error the server answered (or why none came)."""
    from sentinel_node.transport.streams import parse_response

    _, reader, writer = await p2p.call_binary_stream_handler(peer, handler + ".stream")
    try:
        writer.write(stream + framed(b"", marker=P2P.ERROR_MARKER))  # then the end-of-stream marker
        await writer.drain()
        data = await asyncio.wait_for(read_message(reader, 2**20), 15)
        if data is None:
            return "closed"
        return unpack_envelope(parse_response(data).metadata).error or "answered"
    finally:
        writer.close()


async def _send_unary(p2p, peer, handler: str, raw: bytes) -> str:
    try:
        request = ExpertRequest.FromString(raw)
    except Exception:
        request = ExpertRequest(metadata=raw)
    reply = await p2p.call_protobuf_handler(peer, handler, request, ExpertResponse)
    return unpack_envelope(reply.metadata).error or "answered"


def test_fuzzed_streams_and_calls_at_a_real_server():
    """Corrupted streams and garbage unary requests to a server that admits the caller (the worst case: every
    check after admission is exercised): each gets a coded error back, the server lives on, its memory stays
    within the per-message bound."""
    import stream_flood
    from hivemind.p2p import PeerID

    root = str(Path(__file__).resolve().parent.parent)
    server = stream_flood.Server(root, admitted=True)
    p2p = LOOP.run_until_complete(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=server.maddrs))
    peer = PeerID.from_base58(server.peer_id)
    sent = {"streams": 0, "unary calls": 0}
    lost: list[str] = []

    @fuzz_settings(12, 2000)  # streams and unary calls (about 5 to 1 in make fuzz)
    @given(case=network_case() | st.binary(max_size=400).map(lambda raw: ("unary", raw)))
    def run(case) -> None:
        how, data = case
        if how == "unary":
            sent["unary calls"] += 1
            call = _send_unary(p2p, peer, stream_flood.HANDLER, data)
        else:
            sent["streams"] += 1
            call = _send_stream(p2p, peer, stream_flood.HANDLER, data)
        answer = LOOP.run_until_complete(asyncio.wait_for(call, 60))
        code = answer.split(":")[0]
        TALLY.add("network edge", f"answer {code}")
        # a coded error naming the problem, or an answer (a corruption that left a valid request); a stream is
        # closed unanswered when its first message is an end-of-stream marker, and (rarely, under load, and not
        # when the same bytes are sent again) when the answer is lost as the server closes: counted, bounded below
        assert code in ("malformed", "deadline", "answered", "closed"), (how, answer)  # deadline: one in the past
        if code == "closed" and how != "marker":
            lost.append(how)

    try:
        before = server.memory()
        run()
        after = server.memory()
    finally:
        LOOP.run_until_complete(p2p.shutdown())
        server.stop()
    grew_kib = after["self"]["VmHWM"] - before["self"]["VmRSS"]
    TALLY.figures["network edge"] = {
        **sent,
        "rss_before_mib": round(before["self"]["VmRSS"] / 1024, 1),
        "rss_peak_mib": round(after["self"]["VmHWM"] / 1024, 1),
        "rss_after_mib": round(after["self"]["VmRSS"] / 1024, 1),
        "peak_growth_mib": round(grew_kib / 1024, 1),
        "max_message_mib": round(MAX_MESSAGE / 2**20, 2),
    }
    TALLY.figures["network edge"]["answers lost"] = len(lost)
    assert grew_kib < 64 * 1024, TALLY.figures["network edge"]
    assert len(lost) <= max(1, sent["streams"] // 100), f"{len(lost)} answers lost: {lost[:10]}"
    TALLY.add("network edge", "server alive after")


@pytest.mark.parametrize("shape", [[0, 2**32 - 1, 2**32 - 1], [2**32 - 1, 0], [0, 2**31, 2**31, 2**31]])
def test_an_empty_tensor_with_huge_dimensions_is_malformed(shape):
    """Regression (found by make fuzz): a shape with a 0 declares 0 bytes, passed the size check, and torch then
    raised RuntimeError (numel: integer multiplication overflow) out of the codec: an internal error, not a clear
    one."""
    proto = WireTensor(dtype="float32", size=shape, buffer=b"")
    with pytest.raises(MalformedMessageError, match="dimension"):
        deserialize_tensors([proto], LIMITS)
