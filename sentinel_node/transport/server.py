"""Serving tensor handlers on a P2P: admission, decoding, compute off the event loop, coded errors.

A role registers a function per handler name; the server answers both the unary and the streamed form of the
call and never lets an exception escape as a bare string: every failure goes back as a coded error (see
``errors.py``) in the reply's envelope. The server knows nothing of stages or verifiers.

Admission before memory: a streamed call is read by this module, one bounded message at a time (``streams.py``),
not by hivemind's stream handler (which reads every message whole and ahead of the handler). ``admit(caller)``
runs on the caller's authenticated peer id before a byte of the stream is read; the first message must fit one
chunk and its envelope; its metadata goes through ``authorize``; and the tensors it announces must fit
``max_bytes`` (the handler's expected tensors) before any more is read. A refused caller gets its answer and at
most a short, bounded drain, never a buffer of what it sends.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto.runtime_pb2 import ExpertRequest, ExpertResponse
from hivemind.proto.runtime_pb2 import Tensor as WireTensor
from hivemind.utils.logging import get_logger

from sentinel_node.transport.codec import TensorSpec, check_tensors, deserialize_tensors, serialize_tensors
from sentinel_node.transport.deadlines import serving_until, time_left
from sentinel_node.transport.errors import (
    HopDeadlineExceeded,
    HopError,
    HopInternal,
    HopMalformed,
    HopOverloaded,
    HopUnavailable,
    MalformedMessageError,
    encode_error,
)
from sentinel_node.transport.framing import (
    STREAM_SUFFIX,
    PartAssembler,
    error_message,
    max_parts,
    payload_bytes,
    stream_messages,
    unary_message,
)
from sentinel_node.transport.messages import (
    MAX_METADATA_BYTES,
    Envelope,
    RequestMetadata,
    WireModel,
    parse_metadata,
    unpack_envelope,
)
from sentinel_node.transport.settings import UNARY_MAX_BYTES, TransportSettings
from sentinel_node.transport.streams import discard, parse_request, read_message, send_messages

logger = get_logger(__name__)

M = TypeVar("M", bound=RequestMetadata)


@dataclass(frozen=True)
class Incoming(Generic[M]):
    """A checked request. ``caller`` is the authenticated peer id of the connection; ``deadline`` is this hop's
    (the caller's minus the hop margin), already applied to any call made while handling it."""

    tensors: list[torch.Tensor]
    metadata: M
    caller: str
    handler: str
    deadline: float

    def time_left(self) -> float:
        return time_left(self.deadline)


@dataclass(frozen=True)
class Answer:
    """What a handler returns: tensors, and metadata the caller parses with its ``reply_model``."""

    tensors: Sequence[torch.Tensor] = ()
    metadata: WireModel | None = None


Handler = Callable[[Incoming[Any]], Awaitable[Answer] | Answer]
Admitter = Callable[[str], Awaitable[None] | None]
Authorizer = Callable[[str, Any], Awaitable[None] | None]
Expectation = Sequence[TensorSpec] | Callable[[Any], Sequence[TensorSpec] | None] | None
# Honest senders cut tensors into chunks of at most ``chunk_bytes``; a message also holds protobuf framing and, the
# first one, the envelope.
_FRAMING_BYTES = 16 * 1024


@dataclass(frozen=True)
class _Route:
    name: str
    handler: Handler
    request_model: type[RequestMetadata]
    admit: Admitter | None
    authorize: Authorizer | None
    expect: Expectation
    require_finite: bool
    max_bytes: int | None


def _vacant(incoming) -> None:
    raise HopUnavailable("this node is changing what it serves; try another peer")


def expected_bytes(specs: Sequence[TensorSpec]) -> int | None:
    """What ``specs`` take on the wire at most (a bfloat16 tensor may travel as float32), or None when a dimension
    is open."""
    total = 0
    for spec in specs:
        if any(d is None for d in spec.shape):
            return None
        numel = math.prod(spec.shape)
        total += numel * max(torch.empty(0, dtype=spec.dtype).element_size(), 4)
    return total


class TensorServer:
    """Registers tensor handlers on ``p2p``.

    A handler is either ``async def f(incoming) -> Answer`` (it may await calls to other peers; heavy compute
    inside it belongs in ``asyncio.to_thread``) or a plain ``def f(incoming) -> Answer``, which runs in a thread.
    To refuse, raise ``HopRefused``/``HopBanned``/``HopOverloaded``/``HopMalformed`` (or MalformedTensorError);
    a HopError from a call it made travels back as a ``downstream`` failure naming the peer that failed.
    """

    def __init__(self, p2p: P2P, settings: TransportSettings, *, max_inflight: int | None = None) -> None:
        self.p2p = p2p
        self.settings = settings
        self.max_inflight = max_inflight
        self.inflight = 0
        self._routes: dict[str, _Route] = {}
        # names registered with p2pd: a name stays registered while its route changes (a stage that moves serves
        # its new stage under the same names; p2pd did not always take a name back once removed, measured)
        self._registered: set[str] = set()

    async def add_handler(
        self,
        name: str,
        handler: Handler,
        request_model: type[RequestMetadata] = RequestMetadata,
        *,
        admit: Admitter | None = None,
        authorize: Authorizer | None = None,
        expect: Expectation = None,
        require_finite: bool = True,
        max_bytes: int | None = None,
    ) -> None:
        """Serves ``name`` (unary) and ``name + STREAM_SUFFIX`` (streamed). ``admit(caller)`` runs on the caller's
        peer id before anything of the request is read and raises to refuse; ``authorize(caller, metadata)`` runs
        before any tensor is decoded and raises to refuse; ``max_bytes`` bounds what the request's tensors may
        declare (default: what ``expect`` takes when its shapes are fixed, else the transport's limits);
        ``expect`` (specs, or a function of the metadata giving them) and ``require_finite`` check the decoded
        tensors."""
        if max_bytes is None and expect is not None and not callable(expect):
            max_bytes = expected_bytes(expect)
        self._routes[name] = _Route(name, handler, request_model, admit, authorize, expect, require_finite, max_bytes)
        if name in self._registered:
            return

        async def serve_unary(request: ExpertRequest, context: P2PContext) -> ExpertResponse:
            return await self._serve_unary(self._route(name), request, context)

        async def serve_stream(stream_info: StreamInfo, reader: asyncio.StreamReader, writer) -> None:
            await self._serve_stream(self._route(name), stream_info, reader, writer)

        await self.p2p.add_protobuf_handler(name, serve_unary, ExpertRequest)
        await self.p2p.add_binary_stream_handler(name + STREAM_SUFFIX, serve_stream)
        self._registered.add(name)

    def _route(self, name: str) -> _Route:
        route = self._routes.get(name)
        return route if route is not None else _Route(name, _vacant, RequestMetadata, None, None, None, True, None)

    async def remove_handlers(self, unregister: bool = True) -> None:
        """Stops serving every handler; ``unregister=False`` keeps the names registered with p2pd (callers are told
        the handler is unavailable) for a node that serves them again in a moment."""
        self._routes.clear()
        if not unregister:
            return
        for name in list(self._registered):
            await self.p2p.remove_protobuf_handler(name)
            await self.p2p.remove_binary_stream_handler(name + STREAM_SUFFIX)
            self._registered.discard(name)

    @property
    def max_message_bytes(self) -> int:
        """The longest message a stream may send us: one chunk of a tensor, its framing and (first) the envelope."""
        return self.settings.chunk_bytes + MAX_METADATA_BYTES + _FRAMING_BYTES

    async def _serve_unary(self, route: _Route, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        caller = context.remote_id.to_base58()
        try:
            await self._admit_caller(route, caller)
            envelope = unpack_envelope(request.metadata)
            metadata, deadline = await self._admit(route, envelope, caller)
            with self._slot():
                assembler = PartAssembler(envelope.parts, self.settings.limits, route.max_bytes)
                for proto in request.tensors:
                    assembler.add(proto)
                answer, protos = await self._run(route, assembler.finish(), metadata, caller, deadline)
            if payload_bytes(protos) > UNARY_MAX_BYTES:
                raise HopInternal(
                    f"reply of {payload_bytes(protos) / 2**20:.1f} MiB is too large for a unary call; "
                    "call this handler with stream=True"
                )
            return unary_message(ExpertResponse, answer.metadata, protos)
        except Exception as e:
            return error_message(ExpertResponse, self._report(route, caller, e))

    async def _serve_stream(
        self, route: _Route, stream_info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        caller = stream_info.peer_id.to_base58()
        with closing(writer):
            try:
                messages = await self._answer_stream(route, reader, caller)
                refused = False
            except _CallerGone:
                logger.debug(f"{route.name}: {caller} went away before the answer; its work was cancelled")
                return
            except Exception as e:
                messages = [error_message(ExpertResponse, self._report(route, caller, e))]
                refused = True
            if messages is None:  # the caller opened a stream and sent nothing
                return
            try:
                await send_messages(writer, messages)
            except Exception:  # the caller went away; it will see why on its side
                return
            # Closing at once may reset the stream under the caller's writes and lose the answer: read what it
            # still sends until it closes, within a bound (a refused caller gets a short one, never a buffer).
            budget = self.max_message_bytes if refused else max_parts(self.settings.limits) * self.max_message_bytes
            await discard(reader, self.max_message_bytes, budget, self.settings.drain_timeout_s)

    async def _answer_stream(
        self, route: _Route, reader: asyncio.StreamReader, caller: str
    ) -> list[ExpertResponse] | None:
        await self._admit_caller(route, caller)  # before a byte of the stream is read
        try:
            data = await asyncio.wait_for(read_message(reader, self.max_message_bytes), self.settings.drain_timeout_s)
        except asyncio.TimeoutError:
            data = None
        if data is None:
            return None
        head = parse_request(data)
        envelope = unpack_envelope(head.metadata)
        metadata, deadline = await self._admit(route, envelope, caller)
        with self._slot():
            assembler = PartAssembler(envelope.parts, self.settings.limits, route.max_bytes)
            for proto in head.tensors:
                assembler.add(proto)
            await asyncio.wait_for(self._receive(reader, assembler), time_left(deadline))
            work = self._run(route, assembler.finish(), metadata, caller, deadline)
            answer, protos = await _while_caller_waits(reader, work)
        return stream_messages(ExpertResponse, answer.metadata, protos, self.settings.chunk_bytes)

    async def _receive(self, reader: asyncio.StreamReader, assembler: PartAssembler) -> None:
        """Reads messages until every announced part is in (then stops: the end-of-stream marker may follow)."""
        while not assembler.complete:
            data = await read_message(reader, self.max_message_bytes)
            if data is None:
                return  # short: finish() says how short
            for proto in parse_request(data).tensors:
                assembler.add(proto)

    async def _admit_caller(self, route: _Route, caller: str) -> None:
        if route.admit is not None:
            verdict = route.admit(caller)
            if inspect.isawaitable(verdict):
                await verdict

    async def _admit(self, route: _Route, envelope: Envelope, caller: str) -> tuple[RequestMetadata, float]:
        if envelope.error is not None:
            raise MalformedMessageError("a request cannot carry an error")
        metadata = parse_metadata(envelope.meta, route.request_model)
        now = time.time()
        deadline = min(metadata.deadline, now + self.settings.max_call_s) - self.settings.hop_margin_s
        if deadline <= now:
            raise HopDeadlineExceeded(
                f"arrived with {metadata.deadline - now:.3f} s left, under the {self.settings.hop_margin_s} s margin"
            )
        if route.authorize is not None:
            verdict = route.authorize(caller, metadata)
            if inspect.isawaitable(verdict):
                await verdict
        return metadata, deadline

    @contextmanager
    def _slot(self) -> Iterator[None]:
        if self.max_inflight is not None and self.inflight >= self.max_inflight:
            raise HopOverloaded(f"{self.inflight} calls in flight, the limit is {self.max_inflight}")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    async def _run(
        self, route: _Route, protos: list[WireTensor], metadata: RequestMetadata, caller: str, deadline: float
    ) -> tuple[Answer, list[WireTensor]]:
        expect = route.expect(metadata) if callable(route.expect) else route.expect
        tensors = await asyncio.to_thread(_decode, protos, self.settings, expect, route.require_finite)
        incoming = Incoming(tensors, metadata, caller, route.name, deadline)
        with serving_until(deadline):
            if inspect.iscoroutinefunction(route.handler):
                work = route.handler(incoming)
            else:
                work = asyncio.to_thread(route.handler, incoming)
            # Half a margin past the hop's deadline, so a late downstream call reports itself (naming the peer
            # that was slow) before this backstop fires, and either answer still reaches the caller in time.
            backstop = time_left(deadline) + self.settings.hop_margin_s / 2
            try:
                answer = await asyncio.wait_for(work, backstop)
            except asyncio.TimeoutError:
                raise HopDeadlineExceeded(f"{route.name} did not finish before the deadline") from None
        if not isinstance(answer, Answer):
            raise TypeError(f"handler {route.name} returned {type(answer).__name__}, not Answer")
        compression, limits = self.settings.compression_type, self.settings.limits
        protos = await asyncio.to_thread(serialize_tensors, answer.tensors, compression, limits)
        return answer, protos

    def _report(self, route: _Route, caller: str, error: Exception) -> str:
        """The coded string for ``error``, logged at a level that matches whose fault it is."""
        if isinstance(error, MalformedMessageError):
            error = HopMalformed(str(error))
        elif isinstance(error, asyncio.TimeoutError):
            error = HopDeadlineExceeded(f"{route.name}: the request did not arrive before the deadline")
        elif not isinstance(error, HopError):
            logger.error(f"{route.name} failed on a request from {caller}", exc_info=error)
            error = HopInternal(f"{type(error).__name__}: {error}")
        text = encode_error(error)
        if isinstance(error, HopMalformed):
            logger.warning(f"{route.name}: malformed request from {caller}: {error.detail}")
        elif error.peer is not None:
            logger.info(f"{route.name}: a call made for {caller} failed: {text}")
        else:
            logger.debug(f"{route.name}: answered {caller} with {text}")
        return text


class _CallerGone(Exception):
    """The caller closed its end of the stream before the answer was ready."""


async def _while_caller_waits(reader: asyncio.StreamReader, work: Awaitable[Any]) -> Any:
    """``work``'s result, or _CallerGone once the caller closes its end meanwhile: it gave up, so the work is
    cancelled (as hivemind's own stream handler cancels it), and a cancellation reaches every hop down the route
    instead of each finishing, and accumulating gradients, for nobody."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_until_closed(reader))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await task
        raise _CallerGone()
    finally:
        watch.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await watch
        if not task.done():
            task.cancel()


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Returns once the peer has closed its end (what it still sends after its request is dropped)."""
    with suppress(Exception):
        while await reader.read(2**16):
            pass


def _decode(
    protos: list[WireTensor], settings: TransportSettings, expect: Sequence[TensorSpec] | None, require_finite: bool
) -> list[torch.Tensor]:
    tensors = deserialize_tensors(protos, settings.limits)
    check_tensors(tensors, expect, require_finite)
    return tensors
