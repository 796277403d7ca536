"""Real data for the tests of the real-model path: a tokenizer trained by ``sentinel-node tokenizer train`` on the
embedded corpus, and a dataset of JSON lines and parquet files made of standard-library sources."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from sentinel_node.cli import main
from sentinel_node.model.corpus import stdlib_files

VOCAB = 512


def train_tokenizer(out: Path, vocab: int = VOCAB) -> Path:
    result = CliRunner().invoke(
        main, ["tokenizer", "train", "--vocab-size", str(vocab), "--out", str(out), "--max-bytes", "1500000"]
    )
    assert result.exit_code == 0, result.output
    return out


def documents(n: int, skip: int = 0) -> list[str]:
    files = sorted(stdlib_files(), key=lambda p: str(p))
    texts = []
    for file in files[skip:]:
        text = file.read_text(errors="replace")
        if 1500 < len(text) < 12000:
            texts.append(text)
        if len(texts) == n:
            break
    return texts


def make_dataset(directory: Path, n_docs: int = 120) -> Path:
    """Half the documents in a .jsonl file, half in a .parquet file of small row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    docs = documents(n_docs, skip=300)
    half = len(docs) // 2
    with (directory / "part-a.jsonl").open("w") as f:
        for i, text in enumerate(docs[:half]):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    pq.write_table(
        pa.table({"text": docs[half:], "id": list(range(half, len(docs)))}),
        directory / "part-b.parquet",
        row_group_size=16,
    )
    return directory
