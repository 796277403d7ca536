"""Pretrained weights in (model.init_from) and a Hugging Face checkpoint out, on a tiny LlamaForCausalLM that the
test makes and saves: the chained stages reproduce its logits, and so does the exported checkpoint."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from sentinel_node.config import Config, ModelConfig, PipelineConfig
from sentinel_node.model import build_stage
from sentinel_node.model.stage import llama_config
from sentinel_node.model.weights import WeightsError, export_checkpoint, load_pretrained, to_hf

TINY = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, n_layers=3, n_heads=4, n_kv_heads=2)


def _config(n_stages: int, model: ModelConfig = TINY) -> Config:
    return Config(model=model, pipeline=PipelineConfig(n_stages=n_stages))


def _saved_model(directory: Path, tied: bool = False, shard: str | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hf_config = llama_config(TINY)
    hf_config.tie_word_embeddings = tied
    model = LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # RMSNorm gains start at 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(directory), **({"max_shard_size": shard} if shard else {}))
    return model


def _stages(config: Config, source: str) -> list:
    n = config.pipeline.n_stages
    stages = []
    for k in range(n):
        stage = build_stage(config.model, k, n, init=False)
        load_pretrained(stage, config, k, source)
        stages.append(stage.eval())
    return stages


def _chain(stages, tokens):
    hidden = tokens
    with torch.no_grad():
        for stage in stages:
            hidden = stage(hidden)
    return hidden


TOKENS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("n_stages", [2, 3])
def test_stages_loaded_from_a_checkpoint_reproduce_its_logits_and_export_back(tmp_path, n_stages):
    model = _saved_model(tmp_path / "hf", shard="60KB")  # sharded: each stage opens only its own files
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        expected = model(TOKENS).logits
    config = _config(n_stages)
    stages = _stages(config, str(tmp_path / "hf"))
    torch.testing.assert_close(_chain(stages, TOKENS), expected, atol=1e-5, rtol=0)

    out = export_checkpoint(config, {k: s.state_dict() for k, s in enumerate(stages)}, tmp_path / "out")
    again = LlamaForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, expected, atol=1e-5, rtol=0)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_tied_checkpoint_gives_the_last_stage_the_embedding_as_its_head(tmp_path):
    model = _saved_model(tmp_path / "hf", tied=True)
    with torch.no_grad():
        expected = model(TOKENS).logits
    stages = _stages(_config(2), str(tmp_path / "hf"))
    torch.testing.assert_close(_chain(stages, TOKENS), expected, atol=1e-5, rtol=0)
    assert torch.equal(stages[1].head.weight, stages[0].embed.weight)


def test_the_name_mapping_is_one_for_both_directions():
    assert to_hf("layers.1.self_attn.q_proj.weight", first_layer=2) == "model.layers.3.self_attn.q_proj.weight"
    assert to_hf("embed.weight", 0) == "model.embed_tokens.weight"
    assert to_hf("head.weight", 5) == "lm_head.weight" and to_hf("norm.weight", 5) == "model.norm.weight"


def test_a_checkpoint_of_another_shape_says_what_differs(tmp_path):
    _saved_model(tmp_path / "hf")
    wider = TINY.model_copy(update={"intermediate_size": 256, "n_kv_heads": 4})
    config = _config(2, wider)
    stage = build_stage(config.model, 0, 2, init=False)
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    with pytest.raises(WeightsError) as caught:
        load_pretrained(stage, config, 0, str(tmp_path / "hf"))
    message = str(caught.value)
    assert (
        "intermediate_size: config 256, checkpoint 128" in message and "n_kv_heads: config 4, checkpoint 2" in message
    )
    assert all(torch.equal(before[k], v) for k, v in stage.state_dict().items())


def test_a_tensor_of_another_shape_and_a_missing_shard_are_named(tmp_path):
    _saved_model(tmp_path / "hf", shard="60KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    last_file = index["weight_map"]["lm_head.weight"]
    (tmp_path / "hf" / last_file).unlink()
    config = _config(2)
    with pytest.raises(WeightsError, match=f"shard {last_file} is missing"):
        load_pretrained(build_stage(config.model, 1, 2, init=False), config, 1, str(tmp_path / "hf"))
    # stage 0 reads only its own files: it loads unless the lost file also holds some of its tensors
    own = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.")
    if last_file not in {f for name, f in index["weight_map"].items() if name.startswith(own)}:
        load_pretrained(build_stage(config.model, 0, 2, init=False), config, 0, str(tmp_path / "hf"))


def test_a_checkpoint_with_tensors_the_model_has_no_place_for_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    _saved_model(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    config = _config(2)
    with pytest.raises(WeightsError, match="no place for: model.layers.0.self_attn.q_proj.bias"):
        load_pretrained(build_stage(config.model, 0, 2, init=False), config, 0, str(tmp_path / "hf"))


def test_export_refuses_missing_stages_and_leaves_nothing_behind(tmp_path):
    config = _config(3)
    states = {k: build_stage(config.model, k, 3).state_dict() for k in (0, 2)}
    with pytest.raises(WeightsError, match=r"stages \[1\] are missing"):
        export_checkpoint(config, states, tmp_path / "out")
    states[1] = {k: v[:1] for k, v in build_stage(config.model, 1, 3).state_dict().items()}  # another shape
    with pytest.raises(WeightsError, match="the config makes it"):
        export_checkpoint(config, states, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_init_from_an_unreachable_hub_id_fails_fast(monkeypatch):
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    config = _config(2)
    started = time.monotonic()
    with pytest.raises(WeightsError) as caught:
        load_pretrained(build_stage(config.model, 0, 2, init=False), config, 0, "no-such-org/no-such-model")
    assert time.monotonic() - started < 30
    assert "cannot be reached" in str(caught.value) and "no-such-org/no-such-model" in str(caught.value)


def test_a_stage_worker_with_init_from_starts_from_the_checkpoint(tmp_path):
    from sentinel_node.pipeline import StageWorker

    model = _saved_model(tmp_path / "hf")
    with torch.no_grad():
        expected = model(TOKENS).logits
    pretrained = TINY.model_copy(update={"init_from": str(tmp_path / "hf")})
    workers = [StageWorker(pretrained, PipelineConfig(n_stages=2), k, device="cpu") for k in range(2)]
    torch.testing.assert_close(_chain([w.module.eval() for w in workers], TOKENS), expected, atol=1e-5, rtol=0)
