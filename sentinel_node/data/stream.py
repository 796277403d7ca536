"""Documents to training sequences: tokenized on the fly, packed into blocks of ``seq_len + 1`` tokens with the
end-of-text token between documents, shuffled through a seeded buffer.

**Position is a function of the global step.** Step ``s`` trains on blocks ``[s * N, (s + 1) * N)`` of one
deterministic block sequence (``N`` = microbatches per step x microbatch size), which depends only on the source,
the tokenizer, the sequence length, the buffer size and the trainer's seed. A trainer that starts at the swarm's
step ``s`` (a restart, or another machine) therefore feeds exactly the blocks an uninterrupted trainer would
have, without reading anything twice for training: :meth:`BlockStream.blocks` fast-forwards from the nearest
resumable state (the start, or a snapshot kept in memory or on disk) by re-packing what lies in between.

**Resumable states** are taken between row batches of a shard (see :mod:`sentinel_node.data.sources`): the epoch,
the shard and row to read next, the tokens left over from the last packed block, the shuffle buffer and its
generator's state. Batches are cut the same way from any row where a state was taken, so resuming reproduces
the sequence exactly. Blocks are never changed once packed, so a state shares them with the live buffer.

**Epochs.** The training shards are read in a permuted order per epoch (seeded), each from its first training row.

**Validation** is a fixed slice, the same for every trainer whatever its seed: the first ``val_sequences`` blocks
of the held-out split when there is one, else of the source in its natural order (shard 0 onward), which the
training stream then skips: it starts at the first row after the slice.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hivemind.utils import get_logger

from sentinel_node.data.errors import DataError
from sentinel_node.data.sources import Shard
from sentinel_node.data.tokenizer import TextTokenizer

logger = get_logger(__name__)

SNAPSHOT_FORMAT = "sentinel-node/stream-state"


@dataclass(frozen=True)
class Position:
    """Where reading goes on: shard ``shard`` of the list, at row ``row``."""

    shard: int
    row: int


@dataclass
class StreamState:
    """Everything the block sequence depends on from here on (see the module docstring)."""

    produced: int  # blocks that have left the shuffle buffer so far
    epoch: int
    order_index: int  # index into the epoch's shard order
    row: int  # next row of that shard
    leftover: np.ndarray
    buffer: list[np.ndarray] = field(default_factory=list)
    rng: dict = field(default_factory=dict)


class Packer:
    """Token arrays in, blocks of ``block`` tokens out; the remainder waits for the next document."""

    def __init__(self, block: int, leftover: np.ndarray | None = None) -> None:
        self.block = block
        self.leftover = np.zeros(0, dtype=np.int32) if leftover is None else leftover

    def pack(self, pieces: list[np.ndarray]) -> list[np.ndarray]:
        if not pieces:
            return []
        tokens = np.concatenate([self.leftover, *pieces])
        whole = len(tokens) // self.block
        blocks = [tokens[i * self.block : (i + 1) * self.block].copy() for i in range(whole)]
        self.leftover = tokens[whole * self.block :].copy()
        return blocks


def tokenize_batch(tokenizer: TextTokenizer, texts: list[str], ends: list[bool]) -> list[np.ndarray]:
    """The batch's tokens, with the end-of-text token after each piece that ends a (non-empty) document."""
    eos = np.asarray(tokenizer.eos, dtype=np.int32)
    out = []
    for ids, end in zip(tokenizer.encode_batch(texts), ends, strict=True):
        if len(ids):
            out.append(ids)
            if end:
                out.append(eos)
    return out


def validation_slice(
    shards: list[Shard], tokenizer: TextTokenizer, block: int, count: int, what: str
) -> tuple[np.ndarray, Position]:
    """The first ``count`` blocks of ``shards`` in order, and where the rows they used end."""
    packer, blocks = Packer(block), []
    for index, shard in enumerate(shards):
        for batch in shard.batches():
            blocks += packer.pack(tokenize_batch(tokenizer, batch.texts, batch.ends))
            if len(blocks) >= count:
                return np.stack(blocks[:count]), Position(index, batch.next_row)
        if not shard.document_per_row:
            blocks += packer.pack([np.asarray(tokenizer.eos, dtype=np.int32)])
    raise DataError(
        f"{what} holds {len(blocks)} whole sequences of {block} tokens, fewer than the {count} held out for "
        "validation (data.val_sequences); give more text, or lower data.val_sequences"
    )


class BlockStream:
    """The training blocks of a source: ``blocks(start, count)`` are blocks ``start .. start + count - 1``."""

    def __init__(
        self,
        shards: list[Shard],
        tokenizer: TextTokenizer,
        block: int,
        seed: int,
        buffer_size: int,
        start: Position = Position(0, 0),
        snapshot_every: int = 4096,
        keep_snapshots: int = 8,
    ) -> None:
        if not shards or start.shard >= len(shards):
            raise DataError("no training data is left after the validation slice; give more text")
        self.shards = shards[start.shard :]
        self.first_row = start.row  # of self.shards[0], in every epoch
        self.tokenizer, self.block, self.seed, self.buffer_size = tokenizer, block, seed, buffer_size
        self.snapshot_every, self.keep_snapshots = snapshot_every, keep_snapshots
        self.eos = np.asarray(tokenizer.eos, dtype=np.int32)
        empty = np.zeros(0, dtype=np.int32)
        initial = StreamState(0, 0, 0, self._row_to_start(0, 0), empty, [], self._new_rng().bit_generator.state)
        self._initial = initial
        self._snapshots: list[StreamState] = [initial]
        self._restore(initial)
        self.replayed = 0  # blocks packed again to reach a requested position (for logs and tests)

    # --- the public side

    def blocks(self, start: int, count: int) -> np.ndarray:
        """(count, block) int32: blocks ``start`` on, the same whatever was asked before."""
        nearest = [s for s in self._snapshots if s.produced <= start][-1]
        if start < self._next or nearest.produced > self._next:  # behind us, or a kept state is closer
            self._restore(nearest)
        if start > self._next:
            skipped = start - self._next
            if skipped > 1000:
                logger.info(f"data stream: fast-forwarding {skipped} sequences to reach sequence {start}")
            while self._next < start:
                self._take()
                self.replayed += 1
        return np.stack([self._take() for _ in range(count)])

    def add_snapshot(self, state: StreamState) -> None:
        """A resumable state from elsewhere (a file); used when it helps reach a requested position."""
        self._snapshots.append(state)
        self._snapshots.sort(key=lambda s: s.produced)

    def latest_snapshot(self, at_most: int | None = None) -> StreamState:
        """The newest resumable state, of those before block ``at_most`` if given."""
        usable = [s for s in self._snapshots if at_most is None or s.produced <= at_most]
        return usable[-1]

    # --- the machinery

    def _new_rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, 0x5B0F])

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 0x0EDE, epoch]).permutation(len(self.shards))

    def _row_to_start(self, epoch: int, order_index: int) -> int:
        """Shard 0 (of the training shards) starts after the validation slice in every epoch; the others at 0."""
        if order_index >= len(self.shards):
            return 0
        return self.first_row if int(self._order(epoch)[order_index]) == 0 else 0

    def _restore(self, state: StreamState) -> None:
        self._epoch, self._order_index, self._row = state.epoch, state.order_index, state.row
        self._packer = Packer(self.block, state.leftover)
        self._buffer = list(state.buffer)
        self._rng = self._new_rng()
        self._rng.bit_generator.state = state.rng
        self._produced = state.produced
        self._pending: deque[np.ndarray] = deque()
        self._next = state.produced
        self._batches = None  # the open shard's batch iterator
        self._epoch_tokens = 0
        # whether this epoch has been read from its start in this process: only then does "no token" mean empty
        self._whole_epoch = state.order_index == 0 and state.row == self._row_to_start(state.epoch, 0)

    def _state(self) -> StreamState:
        return StreamState(
            self._produced,
            self._epoch,
            self._order_index,
            self._row,
            self._packer.leftover,
            list(self._buffer),
            dict(self._rng.bit_generator.state),
        )

    def _take(self) -> np.ndarray:
        while not self._pending:
            self._advance()
        self._next += 1
        return self._pending.popleft()

    def _advance(self) -> None:
        """Reads one row batch (or closes a shard, or an epoch) and shuffles the blocks it made."""
        if self._order_index >= len(self.shards):
            if self._whole_epoch and self._epoch_tokens == 0:
                raise DataError(
                    f"the training data ({len(self.shards)} shard(s), e.g. {self.shards[0].name}) holds no text; "
                    "check data.path or data.dataset"
                )
            self._epoch += 1
            self._order_index, self._epoch_tokens, self._whole_epoch = 0, 0, True
            self._row = self._row_to_start(self._epoch, 0)
            logger.info(f"data stream: starting epoch {self._epoch}")
            return
        shard_index = int(self._order(self._epoch)[self._order_index])
        shard = self.shards[shard_index]
        if self._batches is None:
            self._batches = shard.batches(self._row)
        batch = next(self._batches, None)
        if batch is None:
            pieces = [] if shard.document_per_row else [self.eos]
            self._batches = None
            self._order_index += 1
            self._row = self._row_to_start(self._epoch, self._order_index)
        else:
            pieces = tokenize_batch(self.tokenizer, batch.texts, batch.ends)
            self._row = batch.next_row
        self._epoch_tokens += sum(len(p) for p in pieces)
        for block in self._packer.pack(pieces):
            self._shuffle(block)
        if self._produced - self._snapshots[-1].produced >= self.snapshot_every:
            self._snapshots.append(self._state())
            if len(self._snapshots) > self.keep_snapshots + 1:  # the initial state always stays
                del self._snapshots[1]

    def _shuffle(self, block: np.ndarray) -> None:
        if len(self._buffer) < self.buffer_size:
            self._buffer.append(block)
            return
        index = int(self._rng.integers(self.buffer_size))
        self._pending.append(self._buffer[index])
        self._buffer[index] = block
        self._produced += 1


# --- resumable states on disk (a trainer's --state-dir)


def save_state(state: StreamState, path: str | Path, fingerprint: str) -> None:
    """Writes ``state`` atomically (temporary file, rename); ``fingerprint`` names the stream it belongs to."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": SNAPSHOT_FORMAT,
        "fingerprint": fingerprint,
        "produced": state.produced,
        "epoch": state.epoch,
        "order_index": state.order_index,
        "row": state.row,
        "rng": state.rng,
    }
    buffer = np.stack(state.buffer) if state.buffer else np.zeros((0, 0), dtype=np.int32)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        np.savez(
            f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), leftover=state.leftover, buffer=buffer
        )
    tmp.replace(path)


def load_state(path: str | Path, fingerprint: str) -> StreamState | None:
    """The state saved in ``path`` if it belongs to the stream ``fingerprint`` names; None otherwise (logged)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        with np.load(path) as saved:
            meta = json.loads(bytes(saved["meta"]).decode())
            leftover, buffer = saved["leftover"].astype(np.int32), saved["buffer"].astype(np.int32)
    except Exception as e:  # a damaged file costs a replay, never a wrong stream
        logger.warning(f"data stream state {path} is unreadable ({type(e).__name__}); replaying from the start")
        return None
    if meta.get("format") != SNAPSHOT_FORMAT or meta.get("fingerprint") != fingerprint:
        logger.info(f"data stream state {path} belongs to another stream (data, tokenizer or seed); not used")
        return None
    return StreamState(
        meta["produced"], meta["epoch"], meta["order_index"], meta["row"], leftover, list(buffer), meta["rng"]
    )
