"""Text to train on, read as bytes (vocabulary 256).

The default corpus is embedded: the Python standard library's own source files on this machine, real text that
no one here wrote and that needs no download. Files are split into train and validation by a hash of their
relative path, so the split is the same on every run and every peer.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    source: str
    n_files: int


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts)]


def _text_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        raise FileNotFoundError(f"--data {directory} is not a directory; point it at a folder of text files")
    files = [p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")]
    if not files:
        raise FileNotFoundError(f"--data {directory} holds no files; point it at a folder of text files")
    return files


def _is_validation(relative: str, val_fraction: float) -> bool:
    digest = hashlib.sha1(relative.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < val_fraction


def load_corpus(path: str | Path | None = None, val_fraction: float = 0.05, max_bytes: int = 16 * 2**20) -> Corpus:
    """Reads up to `max_bytes` of text; binary files (with NUL bytes) are skipped."""
    root = Path(path) if path is not None else Path(sysconfig.get_paths()["stdlib"])
    files = _text_files(root) if path is not None else stdlib_files()
    # order by hash, not by name, so a byte budget samples the whole tree rather than its first folders
    keyed = sorted((hashlib.sha1(str(f.relative_to(root)).encode()).hexdigest(), f) for f in files)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    total, used = 0, 0
    for _, file in keyed:
        if total >= max_bytes:
            break
        try:
            data = file.read_bytes()
        except OSError:
            continue
        if not data or b"\x00" in data:
            continue
        parts[_is_validation(str(file.relative_to(root)), val_fraction)].append(data)
        total += len(data)
        used += 1
    if not used:
        raise FileNotFoundError(f"--data {root} holds no text files (binary files are skipped)")
    as_array = lambda chunks: np.frombuffer(_SEPARATOR.join(chunks), dtype=np.uint8)  # noqa: E731
    if not parts[False] or not parts[True]:
        # too few files for a split by file (a single input.txt is common): hold out the tail of the text instead
        text = as_array(parts[False] + parts[True])
        cut = int(len(text) * (1 - val_fraction))
        return Corpus(train=text[:cut], val=text[cut:], source=str(root), n_files=used)
    return Corpus(train=as_array(parts[False]), val=as_array(parts[True]), source=str(root), n_files=used)


def sample_batch(
    data: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (batch, seq_len) and the next-byte targets, both int64."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"text of {len(data)} bytes is too short for sequences of {seq_len}")
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    windows = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    tokens = torch.from_numpy(windows)
    return tokens[:, :-1], tokens[:, 1:]


def validation_batches(corpus: Corpus, n: int, batch: int, seq_len: int, seed: int = 0):
    """A fixed list of validation batches, the same for every run with the same seed."""
    rng = np.random.default_rng([seed, 0x7A1])
    return [sample_batch(corpus.val, batch, seq_len, rng) for _ in range(n)]
