"""Peak memory of the streamed data path on a large generated JSON-lines file (docs/decisions.md quotes it).

    python scripts/stream_rss.py --tokenizer DIR [--gib 1.0] [--keep]

Writes a JSON-lines file of about ``--gib`` GiB (standard-library sources, repeated with a counter so no two rows are
equal) in a temporary folder, streams one whole epoch of it through the trainer's data path (tokenize, pack into
1025-token blocks, shuffle buffer of 1024), prints the peak RSS before and after, and deletes the file."""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def generate(path: Path, size: int) -> int:
    from sentinel_node.model.corpus import stdlib_files

    texts = [f.read_text(errors="replace") for f in sorted(stdlib_files())[:400]]
    rows = 0
    with path.open("w") as out:
        while out.tell() < size:
            text = texts[rows % len(texts)]
            out.write(json.dumps({"id": rows, "text": f"# copy {rows}\n{text}"}) + "\n")
            rows += 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()

    from sentinel_node.config import load_config
    from sentinel_node.data import load_tokenizer, load_training_data

    vocab = load_tokenizer(args.tokenizer).vocab_size
    workdir = Path(tempfile.mkdtemp(prefix="stream-rss-"))
    try:
        path = workdir / "big.jsonl"
        started = time.monotonic()
        rows = generate(path, int(args.gib * 2**30))
        print(f"generated {path.stat().st_size / 2**30:.2f} GiB, {rows} rows in {time.monotonic() - started:.0f}s")
        config = load_config().with_overrides(
            model={"vocab_size": vocab},
            pipeline={"microbatch_size": 8, "seq_len": 1024, "microbatches_per_step": 8},
            data={"tokenizer": args.tokenizer, "path": str(path), "shuffle_buffer": 1024, "val_sequences": 64},
        )
        data = load_training_data(config, seed=0)
        before = peak_rss_mib()
        print(f"peak RSS after opening the stream and its validation slice: {before:.0f} MiB")
        started, step, tokens = time.monotonic(), 0, 0
        while data.stream._epoch == 0:
            batches = data.step_batches(step)
            tokens += sum(x.numel() for x, _ in batches)
            step += 1
            if step % 500 == 0:
                print(f"  step {step}: {tokens / 1e6:.0f}M tokens, peak RSS {peak_rss_mib():.0f} MiB", flush=True)
        elapsed = time.monotonic() - started
        print(
            f"one epoch: {step} steps, {tokens / 1e6:.0f}M tokens in {elapsed:.0f}s "
            f"({tokens / elapsed / 1e6:.2f}M tokens/s); peak RSS {peak_rss_mib():.0f} MiB"
        )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
