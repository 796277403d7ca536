"""Device, optimizer and precision choices of a stage, decided on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from sentinel_node.config import ModelConfig, PipelineConfig
from sentinel_node.pipeline import StageWorker
from sentinel_node.pipeline.device import (
    BNB_ADAMW8BIT,
    TORCH_ADAMW,
    DeviceError,
    Precision,
    choose_precision,
    make_optimizer,
    resolve_device,
)

MODEL = ModelConfig(hidden_size=32, intermediate_size=64, n_layers=2, n_heads=2, n_kv_heads=2)


def pipeline(**overrides) -> PipelineConfig:
    return PipelineConfig(n_stages=2, microbatch_size=2, seq_len=16, warmup_steps=0, lr=3e-3, **overrides)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_auto_picks_cuda_only_when_visible(no_cuda):
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_auto_picks_cuda_when_visible(one_cuda):
    assert resolve_device("AUTO") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")


def test_cuda_without_a_gpu_says_what_to_do(no_cuda):
    with pytest.raises(
        DeviceError, match="no CUDA device is visible; pass --device cpu or run the image with --gpus all"
    ):
        resolve_device("cuda")


def test_missing_cuda_index_and_unknown_device(one_cuda):
    with pytest.raises(DeviceError, match="shows 1 CUDA device.*cuda:0"):
        resolve_device("cuda:3")
    with pytest.raises(DeviceError, match="unknown device 'gpu7'"):
        resolve_device("gpu7")


def params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(4, 4).parameters())


def test_cpu_always_gets_torch_adamw(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake_bitsandbytes())  # installed or not: the CPU ignores it
    optimizer, name = make_optimizer(params(), pipeline(), torch.device("cpu"))
    assert name == TORCH_ADAMW and type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["lr"] == 3e-3 and optimizer.defaults["weight_decay"] == 0.01


def fake_bitsandbytes() -> types.ModuleType:
    module = types.ModuleType("bitsandbytes")

    class AdamW8bit(torch.optim.AdamW):
        pass

    module.optim = types.SimpleNamespace(AdamW8bit=AdamW8bit)
    return module


def test_cuda_with_bitsandbytes_gets_8bit_adamw(monkeypatch):
    fake = fake_bitsandbytes()
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    optimizer, name = make_optimizer(params(), pipeline(weight_decay=0.1), torch.device("cuda"))
    assert name == BNB_ADAMW8BIT and type(optimizer) is fake.optim.AdamW8bit
    assert optimizer.defaults["lr"] == 3e-3 and optimizer.defaults["weight_decay"] == 0.1


def test_cuda_without_bitsandbytes_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    with caplog.at_level("WARNING"):
        optimizer, name = make_optimizer(params(), pipeline(), torch.device("cuda:0"))
    assert name == TORCH_ADAMW and type(optimizer) is torch.optim.AdamW
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bitsandbytes is unavailable" in warnings[0].getMessage()
    assert "sentinel-node[gpu]" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("device", "mode", "bf16", "expected"),
    [
        ("cuda", "auto", True, torch.bfloat16),
        ("cuda", "auto", False, None),
        ("cuda", "bf16", True, torch.bfloat16),
        ("cuda", "off", True, None),
        ("cpu", "auto", None, None),
        ("cpu", "off", None, None),
        ("cpu", "bf16", None, torch.bfloat16),
        ("mps", "auto", None, None),
    ],
)
def test_precision_follows_device_and_config(device, mode, bf16, expected):
    assert choose_precision(device, mode, cuda_bf16=bf16) == Precision(expected)


def test_bf16_demanded_where_it_cannot_run():
    with pytest.raises(DeviceError, match="does not support bfloat16.*auto or off"):
        choose_precision("cuda", "bf16", cuda_bf16=False)
    with pytest.raises(DeviceError, match="not supported on mps"):
        choose_precision("mps", "bf16")
    assert Precision(None).name == "fp32" and Precision(torch.bfloat16).name == "bfloat16"


def train(worker_cls_args: dict, steps: int) -> tuple[list[float], StageWorker, StageWorker]:
    """A two-stage pipeline trained on one fixed batch; returns the losses and the two workers."""
    pipe = pipeline(**worker_cls_args)
    wire = getattr(torch, pipe.wire_dtype)
    first, last = StageWorker(MODEL, pipe, 0, seed=1), StageWorker(MODEL, pipe, 1, seed=1)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(steps):
        hidden = first.forward(f"m{step}", tokens[:, :-1])
        assert hidden.dtype == wire  # the wire dtype, whatever the compute dtype
        loss, grad = last.forward_backward_loss(f"m{step}", hidden, tokens[:, 1:])
        assert grad is not None and grad.dtype == wire
        assert first.backward(f"m{step}", grad) is None
        first.step(step), last.step(step)
        losses.append(loss)
    return losses, first, last


def test_cpu_stage_trains_in_fp32_with_torch_adamw():
    losses, first, last = train({}, 12)
    assert first.device == torch.device("cpu") and first.precision == Precision(None)
    assert first.optimizer_name == TORCH_ADAMW and type(first.optimizer) is torch.optim.AdamW
    assert all(p.dtype == torch.float32 for p in last.module.parameters())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize(
    ("cuda_build", "why", "fix"),
    [
        (None, "is a CPU-only build", "use the sentinel-node:cuda image"),
        ("13.0", "(CUDA 13.0) sees no CUDA device", "run the container with --gpus all"),
    ],
)
def test_auto_on_a_machine_without_a_gpu_says_so_in_one_line(no_cuda, monkeypatch, caplog, cuda_build, why, fix):
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    with caplog.at_level("INFO"):
        worker = StageWorker(MODEL, pipeline(), 1, device="auto")
        StageWorker(MODEL, pipeline(), 0, device="cpu")  # an explicit CPU is no fallback: nothing to say
    assert worker.device == torch.device("cpu")
    lines = [r.getMessage() for r in caplog.records if "--device auto" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("stage 1: --device auto: torch ") and why in lines[0] and fix in lines[0]
    assert "computing on the CPU (fp32, torch.AdamW)" in lines[0] and "--device cpu makes it explicit" in lines[0]


def test_cpu_fp32_forward_is_the_plain_module():
    """Unchanged behaviour on the CPU: no autocast, the module's own output, bit for bit."""
    worker = StageWorker(MODEL, pipeline(), 1, seed=3, device="cpu")
    hidden = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = worker.module(hidden)
    assert torch.equal(worker.forward("m", hidden), expected)


def test_bf16_autocast_keeps_the_wire_float32():
    losses, first, last = train({"mixed_precision": "bf16"}, 6)
    assert first.precision == Precision(torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in first.module.parameters())  # master weights stay fp32
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_a_stage_sends_in_the_wire_dtype_and_computes_in_float32(wire_dtype):
    losses, first, last = train({"wire_dtype": wire_dtype}, 12)
    assert all(p.dtype == torch.float32 for p in last.module.parameters())
    assert losses[-1] < losses[0] - 1.0, losses
    hidden = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    sent = last.evaluate(hidden.to(getattr(torch, wire_dtype)))  # a validation pass of a middle stage's input
    assert sent.dtype == getattr(torch, wire_dtype)


def test_float16_on_the_wire_saturates_instead_of_overflowing():
    worker = StageWorker(MODEL, pipeline(wire_dtype="float16"), 0, seed=1)
    sent = worker._to_wire(torch.tensor([1e6, -1e6, 3.0]))
    assert sent.dtype == torch.float16 and torch.isfinite(sent).all() and float(sent[2]) == 3.0


def test_a_verifier_asked_for_a_gpu_it_lacks_says_what_to_do(no_cuda):
    from sentinel_node.config import load_config
    from sentinel_node.roles.common import JoinOptions, NodeError
    from sentinel_node.roles.verifier import VerifierOptions, run_verifier

    with pytest.raises(NodeError, match="--device cuda: no CUDA device is visible; pass --device cpu"):
        run_verifier(JoinOptions(config=load_config()), lambda *_: None, settings=VerifierOptions(device="cuda"))


def test_gpu_check_script_exits_cleanly_without_a_gpu(no_cuda, capsys):
    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([]) == 0
    assert "no GPU present" in capsys.readouterr().out
