"""Where documents come from: local files (.txt, .jsonl, .parquet) or a hub dataset, read with ``datasets`` in
streaming mode, one shard at a time.

A source is an ordered list of :class:`Shard` (a local file, or one shard of a hub dataset, as ``datasets``
splits it), each an ordered sequence of rows. A position in a source is therefore (shard, row): the stream
(:mod:`sentinel_node.data.stream`) resumes from one by opening that shard and skipping rows, never by reading the
source from its beginning. In a .jsonl or .parquet file (and most hub datasets) a row is a document; in a .txt
file a row is a line and the whole file is one document.

Memory: ``datasets`` reads a file in chunks (a few MB of JSON, one parquet row group) and rows are handed on in
batches of at most :data:`BATCH_ROWS` rows or :data:`BATCH_CHARS` characters, so nothing holds a whole file.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.utils import get_logger

from sentinel_node.data import hub
from sentinel_node.data.errors import DataError

logger = get_logger(__name__)

BATCH_ROWS = 64
BATCH_CHARS = 1 << 18
TEXT_PIECE_CHARS = 1 << 16  # lines of a text file are joined into pieces of about this size before tokenizing
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class RowBatch:
    """Consecutive rows of one shard: their text pieces, whether each ends a document, and the row to resume at."""

    texts: list[str]
    ends: list[bool]
    next_row: int


@dataclass(frozen=True)
class Shard:
    name: str
    document_per_row: bool  # False: a text file, whose lines together are one document
    open: Callable[[int], Iterator[dict[str, Any]]]  # rows from the given row on
    text_column: str = "text"

    def batches(self, start_row: int = 0) -> Iterator[RowBatch]:
        """The shard's rows from ``start_row`` on, in batches; DataError for a row without text."""
        rows = self._texts(self.open(start_row))
        row = start_row
        texts: list[str] = []
        size = 0
        while True:
            try:
                text = next(rows)
            except StopIteration:
                break
            except DataError:
                raise
            except Exception as e:  # datasets and pyarrow raise many types for a damaged or binary file
                raise DataError(f"{self.name} cannot be read as text ({type(e).__name__}: {_first_line(e)})") from None
            row += 1
            texts.append(text)
            size += len(text)
            if len(texts) >= BATCH_ROWS or size >= BATCH_CHARS:
                yield self._batch(texts, row)
                texts, size = [], 0
        if texts:
            yield self._batch(texts, row)

    def _texts(self, rows: Iterator[dict]) -> Iterator[str]:
        for row in rows:
            if self.text_column not in row:
                raise DataError(
                    f"{self.name} has no column {self.text_column!r} (its columns: {', '.join(sorted(row))}); "
                    "set data.text_column to the one that holds the text"
                )
            text = row[self.text_column]
            if text is None:  # a null cell: an empty document
                yield ""
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"{self.name}: column {self.text_column!r} holds {type(text).__name__}, not text; "
                    "set data.text_column to a column of strings"
                )
            yield text

    def _batch(self, texts: list[str], next_row: int) -> RowBatch:
        if self.document_per_row:
            return RowBatch(texts, [True] * len(texts), next_row)
        pieces, piece, size = [], [], 0  # lines of one document: join them so the tokenizer sees longer text
        for line in texts:
            piece.append(line)
            size += len(line)
            if size >= TEXT_PIECE_CHARS:
                pieces.append("".join(piece))
                piece, size = [], 0
        if piece:
            pieces.append("".join(piece))
        return RowBatch(pieces, [False] * len(pieces), next_row)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _datasets():
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _looks_binary(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return b"\x00" in f.read(_SNIFF_BYTES)
    except OSError:
        return True


def list_files(path: str | Path) -> list[Path]:
    """The data files under ``path`` (a file, or a folder searched recursively), sorted by relative path; empty
    files, hidden ones and text files that look binary are left out. DataError when none is left."""
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"data.path {root} does not exist; point it at a folder or a file of .txt, .jsonl or .parquet")
    candidates = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    files, binary = [], []
    for file in candidates:
        relative = file.relative_to(root) if root.is_dir() else Path(file.name)
        if any(part.startswith(".") for part in relative.parts) or file.stat().st_size == 0:
            continue
        if file.suffix.lower() not in _FORMATS and _looks_binary(file):
            binary.append(file)
            continue
        files.append(file)
    if binary:
        logger.warning(f"data.path {root}: skipping {len(binary)} binary file(s), e.g. {binary[0]}")
    if not files:
        raise DataError(
            f"data.path {root} holds no text: no non-empty .txt, .jsonl or .parquet file"
            + (f" ({len(binary)} binary file(s) skipped)" if binary else "")
            + "; point it at your documents"
        )
    return files


def _streamed(dataset: Any, start_row: int) -> Iterator[dict[str, Any]]:
    return iter(dataset.skip(start_row) if start_row else dataset)


def _text_lines(path: Path, start_row: int, errors: str = "strict") -> Iterator[dict[str, Any]]:
    """A text file's lines (line breaks kept), read as it goes; UnicodeDecodeError for a file that is not UTF-8
    (unless ``errors`` says otherwise)."""
    with path.open(encoding="utf-8", errors=errors, newline="") as f:
        for line in itertools.islice(f, start_row, None):
            yield {"text": line}


def file_shards(files: list[Path], text_column: str = "text", errors: str = "strict") -> list[Shard]:
    """One shard per file; the format comes from the suffix (.jsonl/.json, .parquet; anything else is text).

    JSON lines and parquet go through ``datasets`` (streaming); text files are read line by line directly, since
    opening each through ``datasets`` cost 130 ms a file here (a folder of 1,800 source files: 4 minutes)."""
    shards = []
    for file in files:
        builder = _FORMATS.get(file.suffix.lower(), "text")
        if builder == "text":
            shards.append(Shard(str(file), False, lambda row, file=file: _text_lines(file, row, errors)))
            continue

        def open_file(row: int, file=file, builder=builder):
            dataset = _datasets().load_dataset(builder, data_files=[str(file)], split="train", streaming=True)
            return _streamed(dataset, row)

        shards.append(Shard(str(file), True, open_file, text_column))
    return shards


def hub_shards(dataset: str, config: str | None, split: str, text_column: str) -> list[Shard]:
    """The shards of a hub dataset's split, streamed; DataError when it cannot be found or reached."""
    hub.require_hub("data.dataset", dataset)
    datasets = _datasets()
    try:
        streamed = datasets.load_dataset(dataset, config, split=split, streaming=True)
    except Exception as e:  # DatasetNotFoundError, ConnectionError, ValueError (unknown split or config), ...
        raise DataError(
            f"data.dataset {dataset!r}"
            + (f" (config {config!r})" if config else "")
            + f", split {split!r}, cannot be opened: {type(e).__name__}: {_first_line(e)}"
        ) from None
    n = streamed.num_shards
    per_row = getattr(streamed.info, "builder_name", None) != "text"
    return [
        Shard(
            f"{dataset} [{split}] shard {i}/{n}",
            per_row,
            lambda row, i=i: _streamed(streamed.shard(num_shards=n, index=i), row),
            text_column,
        )
        for i in range(n)
    ]


def stdlib_shards() -> list[Shard]:
    """The embedded corpus (the standard library's sources) as text shards, in a fixed order."""
    from sentinel_node.model.corpus import stdlib_files

    files = sorted(stdlib_files())
    # a few of its test files are deliberately not UTF-8: replaced characters, as the byte corpus reads them
    return file_shards([f for f in files if not _looks_binary(f)], errors="replace")


def shards_of(data_path: str | None, dataset: str | None, config: str | None, split: str, column: str) -> list[Shard]:
    if dataset is not None:
        return hub_shards(dataset, config, split, column)
    if data_path is None:
        return stdlib_shards()
    return file_shards(list_files(data_path), column)


def iter_texts(shards: list[Shard], max_chars: int | None = None) -> Iterator[str]:
    """The text pieces of ``shards`` in order, up to about ``max_chars`` characters (None: all)."""
    total = 0
    for batch in itertools.chain.from_iterable(shard.batches() for shard in shards):
        for text in batch.texts:
            yield text
            total += len(text)
            if max_chars is not None and total >= max_chars:
                return
