"""Parameter averaging between the replicas of one stage, through hivemind's DecentralizedAverager, never with a
peer the swarm has excluded.

hivemind's averager runs in a forked process of its own and knows nothing of exclusion, so
:class:`ExcludingAverager` is told the excluded set through the averager's control pipe and (1) refuses excluded
peers that ask to join a group it leads, (2) refuses to run all-reduce in a group that holds one (a group led by
an excluded peer). :class:`ReplicaAverager` keeps the stage's parameters out of the averager's shared memory: it
averages a snapshot and applies the change (average - snapshot), so optimizer steps taken while a round runs are
not lost.

State sharing: a replica that joins a stage downloads the current state (parameters, optimizer moments, global
step) from live replicas the swarm view names, never from whoever the DHT's averager list puts first (an
excluded peer could be there); excluded peers are refused a download in turn.
"""

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

# hivemind's ServicerBase recognises a streaming handler only by typing.AsyncIterator (collections.abc's generic
# alias has no _name): with the other one, callers await a generator and every join request fails.
from typing import Any, AsyncIterator  # noqa: UP035

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_tensor_stream
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger

StateProvider = Callable[[], tuple[Any, Sequence[torch.Tensor]]]

logger = get_logger(__name__)

# Rounds fail as a matter of course when replicas come and go or a peer is excluded; hivemind's averager logs
# each such failure with a whole traceback.
EXPECTED_FAILURES = (AllreduceException, MatchmakingException, asyncio.TimeoutError, TimeoutError)


class OneLineRoundFailures(logging.Filter):
    """Turns hivemind's traceback for an averaging round that failed in an expected way into one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], EXPECTED_FAILURES):
            error = record.exc_info[1]
            record.msg, record.args = f"averaging round failed: {type(error).__name__}: {error}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_round_failures() -> None:
    """Installs :class:`OneLineRoundFailures` on hivemind's averaging loggers (before the averager forks, so its
    process inherits the filter)."""
    for name in ("hivemind.averaging.averager", "hivemind.averaging.matchmaking", "hivemind.averaging.allreduce"):
        target = logging.getLogger(name)
        if not any(isinstance(f, OneLineRoundFailures) for f in target.filters):
            target.addFilter(OneLineRoundFailures())


class ExcludingAverager(DecentralizedAverager):
    """A DecentralizedAverager that leaves out the peers named by :meth:`set_excluded`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._excluded: frozenset[str] = frozenset()  # read in the averager's process
        self._excluded_sent: frozenset[str] = frozenset()  # what this (the parent) process last sent it
        self.state_provider: StateProvider | None = None  # called in this (the parent) process

    def set_excluded(self, peers: Iterable[str]) -> None:
        """Called in the owner's process; takes effect in the averager's process within a moment."""
        peers = frozenset(peers)
        if peers != self._excluded_sent and self.is_alive():
            self._excluded_sent = peers
            self._outer_pipe.send(("_set_excluded", [sorted(peers)], {}))

    async def _set_excluded(self, peers: list[str]) -> None:
        self._excluded = frozenset(peers)

    async def _shutdown(self, timeout: float | None) -> None:
        """Stops every all-reduce round still running. hivemind 1.1.12's own calls ``finalize`` on the futures that
        hold each registered group's runner (an AttributeError traceback in the log of a stage stopped during a
        round: the netns swarm's stage0-1, 2026-12-04): here a runner is finalized, a group still forming
        cancelled, and the averager's handle on p2pd is closed."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for registered in list(self._running_groups.values()):
            if registered.done() and not registered.cancelled() and registered.exception() is None:
                registered.result().finalize(cancel=True)
            else:
                registered.cancel()
        # the averager's own handle on the DHT's p2pd listens on a unix socket in /tmp that hivemind's shutdown
        # never closes: every stopped stage left one file behind (2026-12-07). Closing the handle is local (p2pd
        # and the DHT stay up for the node) and removes the file.
        await self._p2p.shutdown()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if context.remote_id.to_base58() in self._excluded:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if context.remote_id.to_base58() in self._excluded:
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:
        if self.state_provider is None:
            raise RuntimeError("this replica has no state to share yet")
        metadata, tensors = self.state_provider()
        return metadata, tensors, None

    def download_state(self, peer: str, timeout: float, max_bytes: int) -> tuple[Any, list[torch.Tensor]] | None:
        """(metadata, tensors) of ``peer``'s current state; None if it sent none, or more than ``max_bytes``, or
        did not finish within ``timeout`` seconds."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state", [peer, timeout, max_bytes], {"future": future}))
        return future.result(timeout=timeout + 5)

    async def _download_state(self, peer: str, timeout: float, max_bytes: int, future: MPFuture) -> None:
        try:
            future.set_result(
                await asyncio.wait_for(self._download_from(PeerID.from_base58(peer), max_bytes), timeout)
            )
        except Exception as e:
            logger.info(f"state download from {peer} failed: {type(e).__name__}: {e}")
            if not future.done():
                future.set_result(None)

    async def _download_from(self, peer: PeerID, max_bytes: int) -> tuple[Any, list[torch.Tensor]] | None:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, received = None, 0

        async def parts():
            nonlocal metadata, received
            async for message in stream:
                if message.metadata and metadata is None:
                    metadata = self.serializer.loads(message.metadata)
                received += len(message.tensor_part.buffer)
                if received > max_bytes:
                    raise ValueError(f"the state exceeds {max_bytes} bytes, more than this stage can hold")
                yield [message.tensor_part]

        tensors = await deserialize_tensor_stream(parts())
        return None if metadata is None else (metadata, tensors)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        excluded = [peer.to_base58() for peer in group_info.peer_ids if peer.to_base58() in self._excluded]
        if excluded:
            raise AllreduceException(f"the group holds excluded peers {excluded}; not averaging with it")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)


class ReplicaAverager:
    """Averages ``module``'s parameters with the same stage's other replicas (``prefix`` names the stage).

    Call :meth:`snapshot` and :meth:`apply` where the module's parameters are not in use (a stage's compute
    lane) and :meth:`average` (blocking, seconds) anywhere else.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        dht: DHT,
        prefix: str,
        matchmaking_time: float,
        timeout: float,
        start_timeout: float = 60.0,
    ) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.timeout = timeout
        buffers = [p.detach().clone() for p in self.params]
        quiet_round_failures()
        self.averager = ExcludingAverager(
            buffers,
            dht,
            start=False,
            prefix=prefix,
            min_matchmaking_time=matchmaking_time,
            request_timeout=max(0.5, matchmaking_time / 2),
            allreduce_timeout=timeout,
            min_group_size=2,
            allow_state_sharing=False,  # until share_state: a replica still syncing has nothing to give
        )
        # start() directly: run_in_background() would set SIGINT to SIG_IGN in this process, undoing the role's trap
        self.averager.start()
        self.averager.wait_until_ready(start_timeout)
        self.rounds = 0
        self.failed = 0

    def set_excluded(self, peers: Iterable[str]) -> None:
        self.averager.set_excluded(peers)

    def share_state(self, provider: StateProvider) -> None:
        """Lets the stage's other replicas download ``provider()``'s (metadata, tensors); ``provider`` is called
        from a background thread and must return copies."""
        self.averager.state_provider = provider
        self.averager.allow_state_sharing = True

    def download_state(self, peer: str, timeout: float, max_bytes: int) -> tuple[Any, list[torch.Tensor]] | None:
        """``peer``'s current state as it shared it (unchecked), or None (blocking, up to ``timeout`` seconds)."""
        return self.averager.download_state(peer, timeout, max_bytes)

    @torch.no_grad()
    def snapshot(self) -> list[torch.Tensor]:
        """Copies the parameters into the averager; returns the copy to diff against after the round."""
        snapshot = [p.detach().clone() for p in self.params]
        with self.averager.get_tensors() as buffers:
            for buffer, value in zip(buffers, snapshot, strict=True):
                buffer.copy_(value)
        return snapshot

    def average(self, step: int) -> list[str] | None:
        """One averaging round; the peer ids averaged with (self included), or None if no group formed."""
        try:
            gathered = self.averager.step(gather={"step": step}, timeout=self.timeout, allow_retries=True)
        except Exception as e:  # matchmaking and all-reduce failures are normal when replicas come and go
            logger.debug(f"averaging round for step {step} failed: {type(e).__name__}: {e}")
            gathered = None
        if not gathered:
            self.failed += 1
            return None
        self.rounds += 1
        return sorted(peer.to_base58() for peer in gathered)

    @torch.no_grad()
    def averaged(self) -> list[torch.Tensor]:
        """Copies of the last round's result: what every replica of its group averaged to (recomputation audits
        keep it as the stage's reference parameters)."""
        with self.averager.get_tensors() as buffers:
            return [buffer.detach().clone() for buffer in buffers]

    @torch.no_grad()
    def apply(self, snapshot: list[torch.Tensor]) -> None:
        with self.averager.get_tensors() as buffers:
            for param, buffer, before in zip(self.params, buffers, snapshot, strict=True):
                param.add_(buffer - before)

    def shutdown(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()
