"""What the trainer feeds the swarm: one :class:`TrainingData` per trainer, built by :func:`load_training_data`.

- :class:`CorpusData`: the byte corpus held in memory (the tiny default, or a folder of text files read as bytes),
  sampled at random windows exactly as the trainer always did.
- :class:`StreamedData`: documents streamed from local files or the hub, tokenized, packed and shuffled
  (:mod:`sentinel_node.data.stream`), step ``s`` always getting the same sequences.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from hivemind.utils import get_logger

from sentinel_node.config import Config
from sentinel_node.data.errors import DataError
from sentinel_node.data.tokenizer import TextTokenizer, load_tokenizer, train_tokenizer

logger = get_logger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]

__all__ = [
    "Batch",
    "CorpusData",
    "DataError",
    "StreamedData",
    "TextTokenizer",
    "TrainingData",
    "load_tokenizer",
    "load_training_data",
    "train_tokenizer",
]


class TrainingData(Protocol):
    description: str

    def step_batches(self, step: int) -> list[Batch]:
        """The microbatches of global step ``step``: (inputs, next-token targets), int64 (batch, seq_len)."""

    def validation_batches(self, n: int) -> list[Batch]:
        """``n`` fixed validation microbatches."""

    def save_position(self, step: int) -> None:
        """Keeps what lets a restarted trainer reach step ``step``'s data quickly (no-op where nothing is kept)."""


class CorpusData:
    """The byte corpus, sampled as the trainer always did (random windows from a generator seeded once)."""

    def __init__(self, config: Config, seed: int) -> None:
        from sentinel_node.model.corpus import load_corpus

        data, pipe = config.data, config.pipeline
        if config.model.vocab_size != 256:
            raise DataError(
                f"data.tokenizer is bytes (256 tokens) but model.vocab_size is {config.model.vocab_size}; set "
                "model.vocab_size: 256, or data.tokenizer to a tokenizer of that size"
            )
        try:
            self.corpus = load_corpus(data.path, data.val_fraction, data.max_bytes)
        except (OSError, ValueError) as e:
            raise DataError(str(e)) from None
        self.seed, self.batch, self.seq_len, self.per_step = (
            seed,
            pipe.microbatch_size,
            pipe.seq_len,
            pipe.microbatches_per_step,
        )
        self.rng = np.random.default_rng([seed, 0xDA7A])
        self.description = f"{self.corpus.n_files} files of {self.corpus.source} as bytes"

    def step_batches(self, step: int) -> list[Batch]:
        from sentinel_node.model.corpus import sample_batch

        return [sample_batch(self.corpus.train, self.batch, self.seq_len, self.rng) for _ in range(self.per_step)]

    def validation_batches(self, n: int) -> list[Batch]:
        from sentinel_node.model.corpus import validation_batches

        return validation_batches(self.corpus, n, self.batch, self.seq_len, self.seed)

    def save_position(self, step: int) -> None:
        return None


class StreamedData:
    """Tokenized documents, packed and shuffled; step ``s`` is blocks ``[s * N, (s + 1) * N)`` of the stream.

    ``state_dir``: where resumable stream states are kept (``stream-state.npz``), so a restarted trainer reaches
    the swarm's step without re-packing everything before it."""

    STATE_FILE = "stream-state.npz"

    def __init__(self, config: Config, seed: int, state_dir: str | None = None) -> None:
        from sentinel_node.data.sources import shards_of
        from sentinel_node.data.stream import BlockStream, load_state, validation_slice

        data, pipe = config.data, config.pipeline
        self.tokenizer = load_tokenizer(data.tokenizer, config.model.vocab_size)
        self.batch, self.per_step, self.block = pipe.microbatch_size, pipe.microbatches_per_step, pipe.seq_len + 1
        source = data.dataset if data.dataset is not None else (data.path or "the embedded corpus")
        shards = shards_of(data.path, data.dataset, data.dataset_config, data.split, data.text_column)
        if data.val_split is not None:
            val_shards = shards_of(None, data.dataset, data.dataset_config, data.val_split, data.text_column)
            self.val, _ = validation_slice(
                val_shards, self.tokenizer, self.block, data.val_sequences, f"{source} [{data.val_split}]"
            )
            start = None
        else:
            self.val, start = validation_slice(shards, self.tokenizer, self.block, data.val_sequences, source)
        from sentinel_node.data.stream import Position

        self.stream = BlockStream(
            shards,
            self.tokenizer,
            self.block,
            seed,
            data.shuffle_buffer,
            start if start is not None else Position(0, 0),
        )
        self.fingerprint = self._fingerprint(config, seed)
        self.state_path = Path(state_dir) / self.STATE_FILE if state_dir else None
        self._saved = 0
        if self.state_path is not None:
            saved = load_state(self.state_path, self.fingerprint)
            if saved is not None:
                self.stream.add_snapshot(saved)
                logger.info(f"data stream: resumable state at sequence {saved.produced} from {self.state_path}")
        self.description = (
            f"{source} ({len(shards)} shard(s)), tokenizer {data.tokenizer} ({self.tokenizer.vocab_size} tokens), "
            f"{data.val_sequences} validation sequences"
        )

    @staticmethod
    def _fingerprint(config: Config, seed: int) -> str:
        data = config.data.model_dump(exclude={"val_fraction", "max_bytes"})
        blob = json.dumps({"data": data, "seq_len": config.pipeline.seq_len, "seed": seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def per_step_sequences(self) -> int:
        return self.batch * self.per_step

    def step_batches(self, step: int) -> list[Batch]:
        blocks = torch.from_numpy(
            self.stream.blocks(step * self.per_step_sequences, self.per_step_sequences).astype(np.int64)
        )
        return [(b[:, :-1], b[:, 1:]) for b in blocks.split(self.batch)]

    def validation_batches(self, n: int) -> list[Batch]:
        need = n * self.batch
        if need > len(self.val):
            raise DataError(
                f"{n} validation batches of {self.batch} sequences need {need} held-out sequences, but "
                f"data.val_sequences is {len(self.val)}; raise data.val_sequences (every trainer must agree) or "
                "lower --eval-batches"
            )
        # spread over the whole held-out slice (it is contiguous text: its first sequences are one document)
        chosen = np.unique(np.linspace(0, len(self.val) - 1, need).round().astype(int))
        blocks = torch.from_numpy(self.val[chosen].astype(np.int64))
        return [(b[:, :-1], b[:, 1:]) for b in blocks.split(self.batch)]

    def save_position(self, step: int) -> None:
        if self.state_path is None:
            return
        from sentinel_node.data.stream import save_state

        state = self.stream.latest_snapshot(at_most=(step + 1) * self.per_step_sequences)  # what the next step needs
        if state.produced == 0 or state.produced == self._saved:
            return
        try:
            save_state(state, self.state_path, self.fingerprint)
            self._saved = state.produced
        except OSError as e:
            logger.warning(f"cannot keep the data stream's state in {self.state_path}: {e}")


def load_training_data(config: Config, seed: int, state_dir: str | None = None) -> TrainingData:
    """The trainer's data: the byte corpus or a stream, as ``config.data`` says; DataError with what to fix."""
    if config.data.streamed:
        return StreamedData(config, seed, state_dir)
    if config.data.path is not None and not Path(config.data.path).is_dir():
        raise DataError(
            f"data.path {config.data.path} is not a folder: with data.tokenizer bytes it must be a folder of text "
            "files; set data.tokenizer to stream .txt, .jsonl or .parquet files"
        )
    return CorpusData(config, seed)
