"""Presets and the plan: every stage of every preset built on the meta device matches the closed-form parameter
count, the activation model matches what autograd really keeps, and a stage too big for its device fails at start."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaForCausalLM

from sentinel_node.cli import main
from sentinel_node.config import ModelConfig, load_config
from sentinel_node.model import build_stage
from sentinel_node.model.plan import activation_bytes, model_params, plan, stage_params
from sentinel_node.model.stage import llama_config
from sentinel_node.pipeline import StageWorker
from sentinel_node.pipeline.device import DeviceError

CONFIGS = Path(__file__).resolve().parent.parent / "sentinel_node" / "configs"
PRESETS = ["tiny", "demo", "small", "llama-0.6b", "llama-1b", "llama-4b"]


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", PRESETS)
def test_every_stage_of_every_preset_matches_the_formula(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    m, n = config.model, config.pipeline.n_stages
    total = 0
    for k in range(n):
        stage = build_stage(m, k, n, device="meta")
        assert all(p.is_meta for p in stage.parameters())
        assert _count(stage) == stage_params(m, k, n).total, f"{name} stage {k}"
        total += _count(stage)
    # the closed form, against transformers' own whole model (untied: the stages keep embedding and head apart)
    with torch.device("meta"):
        whole = LlamaForCausalLM(llama_config(m))
    assert total == model_params(m) == _count(whole)


def test_preset_sizes_are_what_their_comments_say():
    sizes = {name: model_params(load_config(CONFIGS / f"{name}.yaml").model) / 1e9 for name in PRESETS}
    assert 0.12 <= sizes["small"] <= 0.14
    assert 0.55 <= sizes["llama-0.6b"] <= 0.65
    assert 1.45 <= sizes["llama-1b"] <= 1.55  # Llama-3.2-1B is 1.24B tied, + 0.26B for the separate head
    assert 3.5 <= sizes["llama-4b"] <= 3.7  # Llama-3.2-3B: 3.21B tied, + 0.39B
    one_b = load_config(CONFIGS / "llama-1b.yaml").model
    assert (one_b.n_layers, one_b.hidden_size, one_b.n_heads, one_b.n_kv_heads) == (16, 2048, 32, 8)
    assert (one_b.intermediate_size, one_b.vocab_size) == (8192, 128256)


def test_presets_fit_home_gpus():
    for name in ("small", "llama-0.6b", "llama-1b", "llama-4b"):
        result = plan(load_config(CONFIGS / f"{name}.yaml"))
        sizes = [s.smallest_gpu_gib for s in result.stages]
        assert all(size is not None and size <= 24 for size in sizes), (name, sizes)


def test_the_swarm_hash_ignores_later_model_fields_at_their_defaults_and_node_local_ones():
    """A swarm whose config predates `max_position_embeddings`/`rope_scaling` keeps its hash (its nodes agree with
    newer ones), where the weights lie on each machine is no one else's business, and a real change is one."""
    for config in (load_config(), load_config(CONFIGS / "demo.yaml")):
        shared = config.model_dump(include={"model", "pipeline", "verification", "swarm"})
        shared["pipeline"].pop("mixed_precision")
        for name in ("init_from", "max_position_embeddings", "rope_scaling"):
            shared["model"].pop(name)
        blob = json.dumps(shared, sort_keys=True, separators=(",", ":")).encode()
        assert config.swarm_hash() == hashlib.sha256(blob).hexdigest()[:16]
    base = load_config()
    assert base.with_overrides(model={"init_from": "/somewhere/else"}).swarm_hash() == base.swarm_hash()
    assert base.with_overrides(model={"max_position_embeddings": 8192}).swarm_hash() != base.swarm_hash()
    assert base.with_overrides(swarm={"open_trainers": False}).swarm_hash() != base.swarm_hash()


def _saved_bytes(cfg: ModelConfig, stage: int, n: int, tokens: tuple[int, int], autocast: bool) -> int:
    module = build_stage(cfg, stage, n)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = torch.randn(*tokens, cfg.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(x)
        if stage == n - 1:
            module.loss(out, torch.randint(0, cfg.vocab_size, tokens))
    return sum(seen.values())


@pytest.mark.parametrize("autocast", [False, True])
def test_activation_model_matches_what_autograd_keeps(autocast):
    cfg = ModelConfig(vocab_size=2000, hidden_size=192, intermediate_size=512, n_layers=4, n_heads=6, n_kv_heads=2)
    for stage in (1, 3):
        measured = _saved_bytes(cfg, stage, 4, (2, 96), autocast)
        estimate = activation_bytes(cfg, stage_params(cfg, stage, 4), 192, "bf16" if autocast else "fp32", stage == 3)
        assert abs(estimate - measured) / measured < 0.1, (stage, autocast, estimate, measured)


def test_a_stage_too_big_for_its_device_fails_at_start_with_the_plan():
    config = load_config(CONFIGS / "llama-4b.yaml").with_overrides(pipeline={"n_stages": 2})
    with pytest.raises(DeviceError) as caught:
        StageWorker(config.model, config.pipeline, 0, device="cpu")  # 1.8B parameters: over 24 GiB before anything
    message = str(caught.value)
    assert "stage 0 does not fit cpu" in message and "optimizer state" in message and "sentinel-node plan" in message


def test_plan_command_prints_tables_and_json():
    runner = CliRunner()
    result = runner.invoke(main, ["plan", "--config", str(CONFIGS / "llama-1b.yaml")])
    assert result.exit_code == 0, result.output
    assert "| 7 | 14-15 |" in result.output and "12 GB" in result.output
    result = runner.invoke(main, ["plan", "--config", str(CONFIGS / "small.yaml"), "--json", "--step-seconds", "30"])
    data = json.loads(result.output)
    assert len(data["stages"]) == 4 and len(data["boundaries"]) == 3
    assert data["boundaries"][0]["activation_bytes"]["float32"] == 4 * 1024 * 768 * 4
