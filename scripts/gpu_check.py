#!/usr/bin/env python
"""Checks a stage's GPU path on this machine: CUDA, bf16 autocast, bitsandbytes' 8-bit AdamW, checkpoints.

Builds a two-stage pipeline on the GPU through ``StageWorker`` (the code a stage node runs), trains a few steps on
the embedded corpus and prints the device, the optimizer, the compute and wire dtypes, the validation loss before
and after, the time per step and a checkpoint round trip. On a machine without CUDA it says so and exits 0.

    python scripts/gpu_check.py [--steps 30] [--allow-cpu]

Exit status: 0 when everything checked out (or there is no GPU), 1 when a check failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--allow-cpu", action="store_true", help="run the same check on the CPU (tiny model)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(f"no GPU present: torch {torch.__version__} sees no CUDA device; nothing to check")
        return 0
    return run(args.steps, "cuda" if torch.cuda.is_available() else "cpu")


def run(steps: int, device_name: str) -> int:
    import numpy as np
    import torch

    from sentinel_node.config import ModelConfig, PipelineConfig
    from sentinel_node.model import load_corpus
    from sentinel_node.model.corpus import sample_batch, validation_batches
    from sentinel_node.pipeline import StageWorker
    from sentinel_node.pipeline.checkpoint import load_checkpoint, save_checkpoint

    failures: list[str] = []
    on_gpu = device_name == "cuda"
    if on_gpu:
        # big enough that the GPU, not Python, sets the pace; still a few hundred MB
        model = ModelConfig(hidden_size=512, intermediate_size=1376, n_layers=8, n_heads=8, n_kv_heads=8)
        pipe = PipelineConfig(n_stages=2, microbatch_size=16, seq_len=256, warmup_steps=5, lr=1e-3)
    else:
        model = ModelConfig(hidden_size=64, intermediate_size=172, n_layers=2, n_heads=4, n_kv_heads=4)
        pipe = PipelineConfig(n_stages=2, microbatch_size=8, seq_len=64, warmup_steps=5, lr=3e-3)
    torch.manual_seed(0)
    stages = [StageWorker(model, pipe, k, seed=0, device=device_name) for k in range(2)]
    device = stages[0].device
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    print(f"torch {torch.__version__}, device {device}", end="")
    if on_gpu:
        props = torch.cuda.get_device_properties(device)
        print(f": {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}")
        print(f"bf16 supported: {torch.cuda.is_bf16_supported()}")
    else:
        print(" (no GPU: checking the CPU path)")
    try:
        import bitsandbytes

        print(f"bitsandbytes {bitsandbytes.__version__}")
    except Exception as e:  # report, don't fail: the worker falls back to torch AdamW
        print(f"bitsandbytes not usable: {type(e).__name__}: {e}")
    for w in stages:
        n_params = sum(p.numel() for p in w.module.parameters())
        dtypes = sorted({str(p.dtype) for p in w.module.parameters()})
        print(
            f"stage {w.stage}: {n_params / 1e6:.1f}M parameters ({', '.join(dtypes)}), compute {w.precision.name}, "
            f"optimizer {w.optimizer_name} ({type(w.optimizer).__module__}.{type(w.optimizer).__name__})"
        )

    corpus = load_corpus(max_bytes=4 * 2**20)
    val = validation_batches(corpus, 4, pipe.microbatch_size, pipe.seq_len, seed=1)

    def val_loss() -> float:
        losses = []
        with torch.no_grad():
            for i, (x, y) in enumerate(val):
                hidden = stages[0].forward(f"val{i}", x)
                stages[0].discard(f"val{i}")
                logits = stages[1].forward(f"val{i}", hidden)
                stages[1].discard(f"val{i}")
                losses.append(float(stages[1].module.loss(logits, y.to(device))))
        return sum(losses) / len(losses)

    before = val_loss()
    rng = np.random.default_rng(0)
    times, wire = [], set()
    for step in range(steps):
        x, y = sample_batch(corpus.train, pipe.microbatch_size, pipe.seq_len, rng)
        sync()
        start = time.perf_counter()
        hidden = stages[0].forward(f"m{step}", x)
        _, grad = stages[1].forward_backward_loss(f"m{step}", hidden, y)
        stages[0].backward(f"m{step}", grad)
        for w in stages:
            w.step(step)
        sync()
        times.append(time.perf_counter() - start)
        wire |= {str(hidden.dtype), str(grad.dtype)}
    after = val_loss()
    median = statistics.median(times[1:] or times)  # the first step pays for kernels' warm-up
    tokens = pipe.microbatch_size * pipe.seq_len
    print(f"wire dtypes (activations, gradients): {', '.join(sorted(wire))}")
    print(f"validation loss: {before:.4f} before, {after:.4f} after {steps} steps")
    print(f"step time: median {median * 1e3:.1f} ms ({tokens / median:,.0f} tokens/s), first {times[0] * 1e3:.0f} ms")
    if on_gpu:
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB")
    if wire != {"torch.float32"}:
        failures.append(f"tensors on the wire are {wire}, expected float32 only")
    if not (after < before):
        failures.append(f"validation loss did not fall ({before:.4f} -> {after:.4f})")

    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        path = save_checkpoint(stages[1], directory, steps - 1, "gpu-check")
        saved_s = time.perf_counter() - start
        fresh = StageWorker(model, pipe, 1, seed=1, device=device_name)
        start = time.perf_counter()
        restored_step = load_checkpoint(fresh, directory, "gpu-check")
        loaded_s = time.perf_counter() - start
        same = all(
            torch.equal(a, b)
            for a, b in zip(stages[1].module.state_dict().values(), fresh.module.state_dict().values(), strict=True)
        )
        state_keys = sorted({k for s in fresh.optimizer.state.values() for k in s})
        print(
            f"checkpoint: {path.stat().st_size / 2**20:.1f} MiB, save {saved_s:.2f} s, load {loaded_s:.2f} s, "
            f"step {restored_step}, parameters identical: {same}, optimizer state keys: {', '.join(state_keys)}"
        )
        if restored_step != steps - 1 or not same or not fresh.optimizer.state:
            failures.append("checkpoint round trip did not restore the stage")

    for failure in failures:
        print(f"FAILED: {failure}")
    print("gpu check: " + ("failed" if failures else "ok"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
