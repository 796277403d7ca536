"""The model cut into pipeline stages and the corpus it trains on (docs/architecture.md section 9)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sentinel_node.config import load_config
from sentinel_node.model import build_stage, layer_range, load_corpus
from sentinel_node.model.corpus import sample_batch, validation_batches

HIDDEN, VOCAB = 32, 256


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=2**20)


def model_config(n_layers: int = 4):
    return (
        load_config()
        .with_overrides(
            model=dict(hidden_size=HIDDEN, intermediate_size=86, n_layers=n_layers, n_heads=4, n_kv_heads=2)
        )
        .model
    )


def chain(stages, tokens: torch.Tensor) -> torch.Tensor:
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    return hidden


def tokens(batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


# --- layer_range ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers, n_stages", [(11, 4), (4, 4), (12, 3), (7, 2), (5, 1), (176, 11)])
def test_layer_range_splits_contiguously_and_covers_every_layer(n_layers, n_stages):
    ranges = [layer_range(n_layers, k, n_stages) for k in range(n_stages)]
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier stages take the remainder


def test_layer_range_of_11_layers_over_4_stages():
    assert [len(layer_range(11, k, 4)) for k in range(4)] == [3, 3, 3, 2]


@pytest.mark.parametrize("stage", [-1, 4, 10])
def test_layer_range_rejects_a_stage_outside_the_pipeline(stage):
    with pytest.raises(ValueError, match=f"stage {stage} is outside 0..3"):
        layer_range(11, stage, 4)


def test_layer_range_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="3 layers cannot fill 4 stages"):
        layer_range(3, 0, 4)


# --- stages --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers, n_stages", [(4, 4), (4, 3), (4, 2)])
def test_chained_stages_reproduce_the_unsplit_model(n_layers, n_stages):
    cfg = model_config(n_layers)
    whole = build_stage(cfg, 0, 1, seed=3)
    stages = [build_stage(cfg, k, n_stages, seed=3) for k in range(n_stages)]
    x = tokens()
    with torch.no_grad():
        assert torch.equal(chain(stages, x), whole(x))
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in whole.parameters())


def test_replicas_built_with_the_same_seed_are_identical():
    cfg = model_config()
    for stage in range(4):
        a, b = build_stage(cfg, stage, 4, seed=11).state_dict(), build_stage(cfg, stage, 4, seed=11).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[name], b[name]) for name in a)
    other = build_stage(cfg, 1, 4, seed=12).state_dict()
    same_seed = build_stage(cfg, 1, 4, seed=11).state_dict()
    assert any(not torch.equal(other[name], same_seed[name]) for name in other if other[name].dim() > 1)


def test_stages_take_and_return_the_designed_shapes():
    cfg = model_config()
    stages = [build_stage(cfg, k, 4) for k in range(4)]
    x = tokens(batch=3, seq_len=10)
    assert x.dtype == torch.int64
    with torch.no_grad():
        hidden = stages[0](x)
        assert hidden.shape == (3, 10, HIDDEN) and hidden.dtype == torch.float32
        for stage in stages[1:-1]:
            hidden = stage(hidden)
            assert hidden.shape == (3, 10, HIDDEN)
        assert stages[-1](hidden).shape == (3, 10, VOCAB)
    assert stages[0].embed is not None and stages[0].head is None
    assert stages[-1].embed is None and stages[-1].head is not None and stages[-1].norm is not None
    assert all(s.embed is None and s.head is None for s in stages[1:-1])


def mean_loss(stages, batches) -> float:
    with torch.no_grad():
        return float(np.mean([stages[-1].loss(chain(stages, x), y).item() for x, y in batches]))


def test_a_few_adamw_steps_on_corpus_text_lower_the_loss(corpus):
    cfg = model_config()
    stages = [build_stage(cfg, k, 2) for k in range(2)]
    optimizer = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=3e-3)
    held_out = validation_batches(corpus, n=2, batch=8, seq_len=32)
    before = mean_loss(stages, held_out)
    rng = np.random.default_rng(0)
    for _ in range(30):
        x, y = sample_batch(corpus.train, 8, 32, rng)
        stages[-1].loss(chain(stages, x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = mean_loss(stages, held_out)
    assert before == pytest.approx(np.log(VOCAB), rel=0.05)  # an untrained model knows nothing of bytes
    assert after < before - 0.5


# --- corpus --------------------------------------------------------------------------------------------------------


def test_the_embedded_corpus_split_is_deterministic(corpus):
    again = load_corpus(max_bytes=2**20)
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)
    assert corpus.train.dtype == np.uint8 and len(corpus.val) > 0
    assert len(corpus.train) + len(corpus.val) >= 2**20
    assert corpus.n_files > 10


def test_the_embedded_corpus_keeps_each_file_on_one_side(corpus):
    from sentinel_node.model.corpus import stdlib_files

    train, val = corpus.train.tobytes(), corpus.val.tobytes()
    sides = []
    for path in stdlib_files():
        data = path.read_bytes()
        if len(data) > 4000:  # long enough not to occur by chance inside another file
            sides.append((data in train, data in val))
    assert not any(in_train and in_val for in_train, in_val in sides)
    assert any(in_train for in_train, _ in sides) and any(in_val for _, in_val in sides)


def write_text_files(directory, n: int) -> dict[str, bytes]:
    contents = {}
    for i in range(n):
        data = f"# document {i}\n".encode() + f"unique line {i:04d} of a user's own text\n".encode() * (20 + i)
        (directory / f"doc{i}.txt").write_bytes(data)
        contents[f"doc{i}.txt"] = data
    return contents


def test_data_dir_reads_the_users_text_files_and_skips_binary_ones(tmp_path):
    contents = write_text_files(tmp_path, 40)
    binary = b"BINARY-MARKER\x00\x01\x02" * 50
    (tmp_path / "blob.bin").write_bytes(binary)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "nested.md").write_bytes(b"nested markdown file\n" * 10)
    corpus = load_corpus(tmp_path, val_fraction=0.3)
    assert corpus.n_files == 41
    assert corpus.source == str(tmp_path)
    train, val = corpus.train.tobytes(), corpus.val.tobytes()
    assert b"BINARY-MARKER" not in train + val
    assert b"nested markdown file" in train + val
    on_train = [name for name, data in contents.items() if data in train]
    on_val = [name for name, data in contents.items() if data in val]
    assert on_train and on_val
    assert not set(on_train) & set(on_val)
    assert len(on_train) + len(on_val) == len(contents)


def test_data_dir_split_is_deterministic(tmp_path):
    write_text_files(tmp_path, 30)
    first, second = load_corpus(tmp_path, val_fraction=0.3), load_corpus(tmp_path, val_fraction=0.3)
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)


def test_a_missing_data_dir_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-folder"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_corpus(missing)


def test_an_empty_data_dir_is_a_clear_error(tmp_path):
    (tmp_path / ".hidden").write_text("dot files are not text to train on")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*no files"):
        load_corpus(tmp_path)


def test_a_data_dir_of_only_binary_files_is_a_clear_error(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(FileNotFoundError, match="no text files"):
        load_corpus(tmp_path)


def test_a_single_text_file_is_split_by_its_tail(tmp_path):
    text = bytes(range(32, 127)) * 100
    (tmp_path / "input.txt").write_bytes(text)
    corpus = load_corpus(tmp_path, val_fraction=0.1)
    assert corpus.n_files == 1
    assert len(corpus.val) == len(text) - int(len(text) * 0.9)
    assert bytes(corpus.train) + bytes(corpus.val) == text


# --- batches -------------------------------------------------------------------------------------------------------


def test_sample_batch_targets_are_the_inputs_shifted_by_one():
    data = (np.arange(5000) % 251).astype(np.uint8)  # every window is a run of consecutive values
    inputs, targets = sample_batch(data, batch=6, seq_len=20, rng=np.random.default_rng(0))
    assert inputs.shape == targets.shape == (6, 20)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets, (inputs + 1) % 251)


def test_sample_batch_on_real_text(corpus):
    inputs, targets = sample_batch(corpus.train, batch=4, seq_len=64, rng=np.random.default_rng(1))
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < VOCAB and int(inputs.min()) >= 0


def test_sample_batch_rejects_text_shorter_than_a_sequence():
    with pytest.raises(ValueError, match="too short"):
        sample_batch(np.zeros(10, dtype=np.uint8), batch=1, seq_len=16, rng=np.random.default_rng(0))


def test_validation_batches_are_fixed_by_the_seed(corpus):
    first = validation_batches(corpus, n=3, batch=2, seq_len=16, seed=5)
    again = validation_batches(corpus, n=3, batch=2, seq_len=16, seed=5)
    other = validation_batches(corpus, n=3, batch=2, seq_len=16, seed=6)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))
