"""The streamed data path: a tokenizer trained by `tokenizer train`, documents from .jsonl and .parquet files
packed into sequences with end-of-text between them, the stream's position a function of the global step, and a
clear error for every bad input."""

import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from sentinel_node.cli import main
from sentinel_node.config import load_config
from sentinel_node.data import DataError, StreamedData, load_tokenizer, load_training_data
from tests.realdata import VOCAB, make_dataset, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("data") / "docs")


def _config(tokenizer_dir, dataset_dir, **data):
    return load_config().with_overrides(
        model={"vocab_size": VOCAB},
        pipeline={"microbatch_size": 4, "seq_len": 32, "microbatches_per_step": 2},
        data={
            "tokenizer": str(tokenizer_dir),
            "path": str(dataset_dir),
            "shuffle_buffer": 32,
            "val_sequences": 8,
            **data,
        },
    )


def test_the_trained_tokenizer_loads_with_autotokenizer(tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert len(hf) == VOCAB and hf.eos_token == "<|endoftext|>" and hf.is_fast
    text = "def main():\n    return 42\n"
    assert hf.decode(hf(text)["input_ids"]) == text
    assert load_tokenizer(str(tokenizer_dir), VOCAB).eos == [hf.eos_token_id]


def test_documents_are_packed_with_end_of_text_between_them(tokenizer_dir, dataset_dir):
    data = load_training_data(_config(tokenizer_dir, dataset_dir), seed=0)
    assert isinstance(data, StreamedData) and "2 shard(s)" in data.description
    batches = data.step_batches(0)
    assert len(batches) == 2 and batches[0][0].shape == (4, 32) and batches[0][0].dtype == torch.int64
    inputs, targets = batches[0]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # next-token targets
    eos = data.tokenizer.eos[0]
    blocks = data.stream.blocks(0, 1000)
    assert (blocks == eos).sum() > 0 and blocks.max() < VOCAB
    # validation is held out: none of its sequences is trained on
    trained = {b.tobytes() for b in blocks}
    assert not any(v.tobytes() in trained for v in data.val)


def test_the_stream_position_is_a_function_of_the_step(tokenizer_dir, dataset_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("sentinel_node.data.sources.BATCH_ROWS", 2)  # resumable states every 2 documents
    config = _config(tokenizer_dir, dataset_dir)
    straight = load_training_data(config, seed=0)
    expected = [straight.step_batches(step) for step in range(40)]  # several epochs of this small dataset
    for step in (0, 13, 39):  # a trainer started at the swarm's step: the same sequences as the one that ran on
        fresh = load_training_data(config, seed=0)
        got = fresh.step_batches(step)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected[step], strict=True))
    # back to an earlier step in the same process (a restart at --start-step)
    assert torch.equal(straight.step_batches(5)[1][0], expected[5][1][0])
    # with a state dir, a restart starts from the kept state instead of re-packing from the beginning
    kept = StreamedData(config, seed=0, state_dir=str(tmp_path))
    kept.stream.snapshot_every = 16
    for step in range(30):
        kept.step_batches(step)
        kept.save_position(step)
    resumed = StreamedData(config, seed=0, state_dir=str(tmp_path))
    assert resumed.stream.latest_snapshot().produced > 0
    got = resumed.step_batches(33)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected[33], strict=True))
    assert resumed.stream.replayed < 33 * 8 - 16
    # another seed: another order, the same validation
    other = load_training_data(config, seed=1)
    assert not torch.equal(other.step_batches(0)[0][0], expected[0][0][0])
    assert torch.equal(other.validation_batches(2)[0][0], straight.validation_batches(2)[0][0])


def test_text_files_are_one_document_each(tokenizer_dir, tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"line one of file {i}\n" * 200)
    data = load_training_data(_config(tokenizer_dir, tmp_path / "docs", shuffle_buffer=1), seed=0)
    blocks = data.stream.blocks(0, 100)  # about 2 of the 3 files (and none of the 600 lines) ends in it
    assert 1 <= (blocks == data.tokenizer.eos[0]).sum() <= 3


def test_a_vocabulary_mismatch_names_both_numbers(tokenizer_dir, dataset_dir):
    config = _config(tokenizer_dir, dataset_dir).with_overrides(model={"vocab_size": 1000})
    with pytest.raises(DataError, match=r"has 512 tokens but model.vocab_size is 1000"):
        load_training_data(config, seed=0)
    with pytest.raises(DataError, match="bytes.*256.*model.vocab_size is 1000"):
        load_training_data(load_config().with_overrides(model={"vocab_size": 1000}), seed=0)


def test_empty_and_binary_datasets_and_an_unknown_column_are_clear_errors(tokenizer_dir, dataset_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text("")
    with pytest.raises(DataError, match="holds no text"):
        load_training_data(_config(tokenizer_dir, empty), seed=0)
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "blob.bin").write_bytes(bytes(range(256)) * 64)
    with pytest.raises(DataError, match=r"holds no text.*1 binary file"):
        load_training_data(_config(tokenizer_dir, binary), seed=0)
    blanks = tmp_path / "blanks"
    blanks.mkdir()
    (blanks / "a.jsonl").write_text('{"text": ""}\n' * 50)
    with pytest.raises(DataError, match="fewer than the 8 held out"):
        load_training_data(_config(tokenizer_dir, blanks), seed=0)
    with pytest.raises(DataError, match=r"no column 'body' \(its columns: id, text\); set data.text_column"):
        load_training_data(_config(tokenizer_dir, dataset_dir, text_column="body"), seed=0)


def test_too_few_validation_sequences_is_a_clear_error(tokenizer_dir, dataset_dir):
    data = load_training_data(_config(tokenizer_dir, dataset_dir), seed=0)
    with pytest.raises(DataError, match="raise data.val_sequences"):
        data.validation_batches(3)  # 3 x 4 > 8


@pytest.mark.parametrize("field", ["dataset", "tokenizer"])
def test_an_unreachable_hub_id_fails_within_seconds(monkeypatch, field):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    config = load_config().with_overrides(data={field: "no-such-org/no-such-thing"})
    started = time.monotonic()
    with pytest.raises(DataError, match="no-such-org/no-such-thing.*cannot be reached"):
        load_training_data(config, seed=0)
    assert time.monotonic() - started < 30


def test_offline_mode_with_an_id_not_in_the_cache_fails_at_once(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    started = time.monotonic()
    with pytest.raises(DataError, match="no-such-org/no-such-tokenizer"):
        load_tokenizer("no-such-org/no-such-tokenizer")
    assert time.monotonic() - started < 30


def test_tokenizer_train_on_too_little_text_fails_and_writes_nothing(tmp_path):
    (tmp_path / "tiny.txt").write_text("a b c\n")
    result = CliRunner().invoke(
        main,
        [
            "tokenizer",
            "train",
            "--data",
            str(tmp_path / "tiny.txt"),
            "--vocab-size",
            "5000",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 1 and "yields only" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["tiny.txt"]


def test_a_trainer_with_bad_data_stops_with_a_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  vocab_size: 300\ndata:\n  tokenizer: ./no-such-tokenizer-folder\n")
    result = CliRunner().invoke(main, ["join", "--role", "trainer", "--config", str(bad)])
    assert result.exit_code == 1 and "cannot read the training data" in result.output
    assert "no-such-tokenizer-folder" in result.output and "Traceback" not in result.output


def test_block_packing_keeps_every_token_once():
    from sentinel_node.data.stream import Packer

    packer = Packer(4)
    blocks = packer.pack([np.arange(3, dtype=np.int32), np.arange(3, 9, dtype=np.int32)])
    assert [b.tolist() for b in blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]] and packer.leftover.tolist() == [8]
