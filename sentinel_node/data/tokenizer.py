"""Tokenizers: bytes (the default, vocabulary 256), or a fast tokenizer loaded with ``transformers.AutoTokenizer``
from a folder or a hub id; and :func:`train_tokenizer`, a byte-level BPE trained with ``tokenizers`` on one's own
text and saved in the standard format (``tokenizer.json`` and its config), which AutoTokenizer loads.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hivemind.utils import get_logger

from sentinel_node.data import hub
from sentinel_node.data.errors import DataError

logger = get_logger(__name__)

BYTES = "bytes"
END_OF_TEXT = "<|endoftext|>"
BYTE_SEPARATOR = b"\n\n"  # bytes have no spare id for an end-of-text token: documents are separated as the corpus is


@dataclass
class TextTokenizer:
    """Text to token ids, in batches; ``eos`` is appended after every document (the byte tokenizer: two newlines)."""

    name: str
    vocab_size: int
    eos: list[int]
    backend: Any = None  # a tokenizers.Tokenizer; None: bytes
    hf: Any = None  # the transformers tokenizer it came from, saved with an exported model

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self.backend is None:
            return [
                np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)
                for text in texts
            ]
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def save(self, directory: str | Path) -> None:
        """Writes the tokenizer files beside an exported model (nothing for bytes, which needs no files)."""
        if self.hf is not None:
            self.hf.save_pretrained(str(directory))


def byte_tokenizer() -> TextTokenizer:
    return TextTokenizer(BYTES, 256, list(BYTE_SEPARATOR))


def load_tokenizer(name: str, vocab_size: int | None = None) -> TextTokenizer:
    """``bytes``, or a fast tokenizer from a folder or hub id. With ``vocab_size`` (the model's), a tokenizer of
    another size is a DataError naming both numbers."""
    tokenizer = byte_tokenizer() if name == BYTES else _load_pretrained(name)
    if vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise DataError(
            f"data.tokenizer {name!r} has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}; "
            f"set model.vocab_size: {tokenizer.vocab_size} (every node must use the same config), or use the "
            "tokenizer the model was made for"
        )
    return tokenizer


def _load_pretrained(name: str) -> TextTokenizer:
    local = hub.is_local(name)
    if local and not Path(name).expanduser().is_dir():
        raise DataError(
            f"data.tokenizer {name!r} is not a folder; give the folder `sentinel-node tokenizer train --out` wrote "
            "(or save_pretrained), or a hub id"
        )
    if not local:
        hub.require_hub("data.tokenizer", name)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(
            str(Path(name).expanduser()) if local else name, use_fast=True, local_files_only=local or hub.offline()
        )
    except Exception as e:  # OSError (not found, unreachable), ValueError (no fast tokenizer), ...
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data.tokenizer {name!r} does not load: {text[:300]}") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"data.tokenizer {name!r} has no fast (Rust) version; convert it or train one of your own")
    if hf.eos_token_id is None:
        raise DataError(
            f"data.tokenizer {name!r} has no end-of-text (eos) token to separate documents; set eos_token in its "
            "tokenizer_config.json"
        )
    return TextTokenizer(name, len(hf), [int(hf.eos_token_id)], backend, hf)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: str | Path, min_frequency: int = 2) -> TextTokenizer:
    """Trains a byte-level BPE of exactly ``vocab_size`` tokens (``<|endoftext|>`` included) on ``texts`` and saves
    it in ``out`` (created; refused if it exists and is not empty). Written to a temporary folder beside ``out``
    and renamed at the end, so a failure leaves nothing half-written. DataError when the text is too small to
    learn that many tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out} exists and is not an empty folder; choose a new folder")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least {len(alphabet) + 1}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    seen = 0

    def counted():
        nonlocal seen
        for text in texts:
            seen += len(text)
            yield text

    tokenizer.train_from_iterator(counted(), trainer=trainer)
    if seen == 0:
        raise DataError("--data holds no text to train a tokenizer on")
    if tokenizer.get_vocab_size() != vocab_size:
        raise DataError(
            f"the text ({seen} characters) yields only {tokenizer.get_vocab_size()} tokens, not --vocab-size "
            f"{vocab_size}; give more text or ask for fewer tokens"
        )
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        hf.save_pretrained(str(staging))
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(f"trained a byte-level BPE of {vocab_size} tokens on {seen} characters into {out}")
    return TextTokenizer(str(out), len(hf), [int(hf.eos_token_id)], tokenizer, hf)
