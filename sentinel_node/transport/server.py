"""Serving tensor handlers on a P2P: admission, decoding, compute off the event loop, coded errors.

A role registers a function per handler name; the server answers both the unary and the streamed form of the
call and never lets an exception escape as a bare string: every failure goes back as a coded error (see
``errors.py``) in the reply's envelope. The server knows nothing of stages or verifiers.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from hivemind.p2p import P2P, P2PContext
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
from sentinel_node.transport.messages import Envelope, RequestMetadata, WireModel, parse_metadata, unpack_envelope
from sentinel_node.transport.settings import UNARY_MAX_BYTES, TransportSettings

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
Authorizer = Callable[[str, Any], Awaitable[None] | None]
Expectation = Sequence[TensorSpec] | Callable[[Any], Sequence[TensorSpec] | None] | None


@dataclass(frozen=True)
class _Route:
    name: str
    handler: Handler
    request_model: type[RequestMetadata]
    authorize: Authorizer | None
    expect: Expectation
    require_finite: bool


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

    async def add_handler(
        self,
        name: str,
        handler: Handler,
        request_model: type[RequestMetadata] = RequestMetadata,
        *,
        authorize: Authorizer | None = None,
        expect: Expectation = None,
        require_finite: bool = True,
    ) -> None:
        """Serves ``name`` (unary) and ``name + STREAM_SUFFIX`` (streamed). ``authorize(caller, metadata)`` runs
        before any tensor is decoded and raises to refuse; ``expect`` (specs, or a function of the metadata giving
        them) and ``require_finite`` check the decoded tensors."""
        route = _Route(name, handler, request_model, authorize, expect, require_finite)
        self._routes[name] = route

        async def serve_unary(request: ExpertRequest, context: P2PContext) -> ExpertResponse:
            return await self._serve_unary(route, request, context)

        async def serve_stream(
            requests: AsyncIterator[ExpertRequest], context: P2PContext
        ) -> AsyncIterator[ExpertResponse]:
            for message in await self._serve_stream(route, requests, context):
                yield message
            # Returning closes our end at once, and the daemon may drop what it has not yet delivered: wait for the
            # caller to close first (hivemind cancels this generator when it does).
            await asyncio.sleep(self.settings.drain_timeout_s)

        await self.p2p.add_protobuf_handler(name, serve_unary, ExpertRequest)
        await self.p2p.add_protobuf_handler(
            name + STREAM_SUFFIX, serve_stream, ExpertRequest, stream_input=True, stream_output=True
        )

    async def remove_handlers(self) -> None:
        for name in list(self._routes):
            await self.p2p.remove_protobuf_handler(name)
            await self.p2p.remove_protobuf_handler(name + STREAM_SUFFIX, stream_input=True, stream_output=True)
            del self._routes[name]

    async def _serve_unary(self, route: _Route, request: ExpertRequest, context: P2PContext) -> ExpertResponse:
        caller = context.remote_id.to_base58()
        try:
            envelope = unpack_envelope(request.metadata)
            metadata, deadline = await self._admit(route, envelope, caller)
            with self._slot():
                assembler = PartAssembler(envelope.parts, self.settings.limits)
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
        self, route: _Route, requests: AsyncIterator[ExpertRequest], context: P2PContext
    ) -> list[ExpertResponse]:
        caller = context.remote_id.to_base58()
        try:
            head = await asyncio.wait_for(anext(requests, None), self.settings.drain_timeout_s)
        except asyncio.TimeoutError:
            head = None
        if head is None:  # the caller opened a stream and sent nothing
            return []
        received_all = False
        try:
            envelope = unpack_envelope(head.metadata)
            metadata, deadline = await self._admit(route, envelope, caller)
            with self._slot():
                assembler = PartAssembler(envelope.parts, self.settings.limits)
                for proto in head.tensors:
                    assembler.add(proto)
                await asyncio.wait_for(_receive(requests, assembler), time_left(deadline))
                received_all = True
                answer, protos = await self._run(route, assembler.finish(), metadata, caller, deadline)
            return stream_messages(ExpertResponse, answer.metadata, protos, self.settings.chunk_bytes)
        except Exception as e:
            if not received_all:
                # An answer sent before the request is read to its end can be lost (the stream is reset under
                # the caller's writes), and the caller would take a refusal for a dead peer.
                await self._drain(requests)
            return [error_message(ExpertResponse, self._report(route, caller, e))]

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

    async def _drain(self, requests: AsyncIterator[ExpertRequest]) -> None:
        budget = max_parts(self.settings.limits)

        async def discard() -> None:
            seen = 0
            async for message in requests:
                seen += len(message.tensors) + 1
                if seen > budget:
                    return

        # If the caller went away or keeps sending past any honest size, there is nothing more to do for it.
        with suppress(Exception):
            await asyncio.wait_for(discard(), self.settings.drain_timeout_s)

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


async def _receive(requests: AsyncIterator[ExpertRequest], assembler: PartAssembler) -> None:
    async for message in requests:
        for proto in message.tensors:
            assembler.add(proto)


def _decode(
    protos: list[WireTensor], settings: TransportSettings, expect: Sequence[TensorSpec] | None, require_finite: bool
) -> list[torch.Tensor]:
    tensors = deserialize_tensors(protos, settings.limits)
    check_tensors(tensors, expect, require_finite)
    return tensors
