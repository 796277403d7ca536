"""``sentinel-node bench verifier``: what one check costs against the physical limits of a boundary.

For each microbatch shape (the tiny preset's up to width 4096) and both directions, a :class:`BoundaryMonitor`
past its warm-up checks honest-looking tensors; reported per shape: milliseconds per check (wall and CPU time),
MiB/s, the ratio to one memory copy of the same tensor on the same device (a check must read the tensor at least
once: that copy is the floor), the tensor's transfer time at 100 Mbit/s and 1 Gbit/s, and the time of each stage
of the profile, so the next slow statistic is visible.

The tensors are synthetic, with the structure of real boundary tensors and none of the cost of a real model at
width 4096: a per-channel offset (activations only), a rank-8 component with geometrically decaying singular
values, noise, log-normal token scales, and (gradients) one token in a hundred carrying ten times the rest, so
that row clipping has work to do. Timing does not depend on the values beyond that; detection is measured by
``bench detection``, and the accuracy of the randomized spectral estimate on a real model's tensors by
:func:`spectral_accuracy` (``--accuracy``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from sentinel_node.config import Config
from sentinel_node.pipeline.device import resolve_device
from sentinel_node.verification import BoundaryMonitor, Profiler

SHAPES: tuple[tuple[int, int, int], ...] = (
    (8, 64, 128),
    (8, 256, 512),
    (8, 512, 1024),
    (4, 1024, 2048),
    (2, 1024, 4096),
)
DIRECTIONS = ("activation", "gradient")
LINKS_BITS_PER_S = {"100mbit": 100e6, "1gbit": 1e9}
GOAL_SHARE_OF_1GBIT = 0.10  # a check takes at most this share of the tensor's transfer time at 1 Gbit/s
GOAL_LINEARITY = 2.0  # the cost per MiB varies by at most this factor from the smallest shape to the largest
REST = "metrics, verdict"  # what a check spends beyond its profile: the replay sketch, distances, thresholds, strikes


@dataclass(frozen=True)
class VerifierBenchSettings:
    shapes: tuple[tuple[int, int, int], ...] = SHAPES
    device: str = "cpu"
    wire_dtype: str = "float32"  # the dtype the tensors arrive in
    repeats: int = 12  # timed checks per shape and direction
    warmup_checks: int = 6  # untimed checks first, past the monitor's warm-up
    threads: int = 1  # torch threads: a verifier node runs with one
    variants: int = 3  # distinct tensors checked in turn
    seed: int = 0


def run_verifier_bench(
    config: Config, settings: VerifierBenchSettings = VerifierBenchSettings(), echo: Callable[[str], None] = print
) -> dict:
    """Times checks at every shape and direction; the report (see :func:`table`)."""
    device = resolve_device(settings.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        rows = []
        for shape in settings.shapes:
            for direction in DIRECTIONS:
                rows.append(_bench_one(config, settings, device, tuple(shape), direction))
                row = rows[-1]
                echo(
                    f"{_shape_name(row['shape'])} {direction:>10}: {row['check_ms']:8.2f} ms per check, "
                    f"{row['mib_per_s']:7.0f} MiB/s, {row['ratio_to_copy']:5.1f}x a copy"
                )
    finally:
        torch.set_num_threads(threads)
    return _report(config, settings, device, rows)


def _bench_one(
    config: Config, settings: VerifierBenchSettings, device: torch.device, shape: tuple[int, int, int], direction: str
) -> dict:
    dtype = getattr(torch, settings.wire_dtype)
    generator = torch.Generator().manual_seed(settings.seed)
    tensors = [synthetic_tensor(shape, direction, generator).to(dtype) for _ in range(settings.variants)]
    monitor_settings = replace(config.verification.monitor_settings(direction, config.swarm.seed), warmup=4)
    monitor = BoundaryMonitor(monitor_settings, shape[-1], expected_shape=shape, dtype=dtype, device=device)
    for index in range(monitor_settings.warmup + settings.warmup_checks):
        monitor.check(tensors[index % len(tensors)], "bench")

    clock = Timer(device, settings.threads)
    source = tensors[0].to(device)
    target = torch.empty_like(source)
    target.copy_(source)
    checks, walls, copies, flagged = [], [], [], 0
    for index in range(settings.repeats):
        # a copy next to each check: both see the same load, and the ratio is taken side by side
        copies.append(clock.time(lambda: target.copy_(source))[0])
        wall = time.perf_counter()
        elapsed, verdict = clock.time(lambda i=index: monitor.check(tensors[i % len(tensors)], "bench"))
        walls.append(time.perf_counter() - wall)
        checks.append(elapsed)
        flagged += int(verdict.flagged)
    stages = _stage_times(monitor.profiler, tensors, settings.repeats, clock)

    check_ms, copy_ms = 1000 * statistics.median(checks), 1000 * statistics.median(copies)
    nbytes = tensors[0].numel() * tensors[0].element_size()
    mib = nbytes / 2**20
    stages[REST] = max(check_ms - sum(stages.values()), 0.0)
    transfer = {link: 1000 * 8 * nbytes / bits for link, bits in LINKS_BITS_PER_S.items()}
    row = {
        "shape": list(shape),
        "direction": direction,
        "dtype": settings.wire_dtype,
        "mib": mib,
        "check_ms": check_ms,
        "check_wall_ms": 1000 * statistics.median(walls),
        "ms_per_mib": check_ms / mib,
        "mib_per_s": mib / (check_ms / 1000),
        "copy_ms": copy_ms,
        "ratio_to_copy": check_ms / copy_ms,
        "transfer_ms": transfer,
        "share_of_1gbit": check_ms / transfer["1gbit"],
        "stages_ms": stages,
        "flagged": flagged,
        "checks": settings.repeats,
    }
    if device.type == "cuda":
        host = tensors[0]
        row["host_to_device_ms"] = 1000 * statistics.median(
            clock.time(lambda: target.copy_(host))[0] for _ in range(settings.repeats)
        )
    return row


class Timer:
    """Times a call: in CPU time on a CPU (the machine's load barely moves it; a check runs in this thread when
    torch has one), in wall time with the device synchronized on a GPU."""

    def __init__(self, device: torch.device, threads: int) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.kind = "wall" if self.cuda else "cpu"
        self._now = time.perf_counter if self.cuda else time.thread_time if threads == 1 else time.process_time

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return self._now()

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        started = self.now()
        result = fn()
        return self.now() - started, result


def synthetic_tensor(shape: Sequence[int], direction: str, generator: torch.Generator) -> torch.Tensor:
    """A float32 (batch, tokens, hidden) tensor with the structure of an honest boundary tensor (module docstring)."""
    batch, tokens, hidden = shape
    n, rank = batch * tokens, min(8, hidden)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator)

    strengths = 2.0 * 0.6 ** torch.arange(rank, dtype=torch.float32)
    low_rank = (randn(n, rank) * strengths) @ (randn(rank, hidden) / math.sqrt(hidden)) * math.sqrt(hidden)
    values = low_rank + randn(n, hidden)
    token_scale = (0.3 * randn(n, 1)).exp()
    if direction == "activation":
        values = values + 0.5 * randn(hidden)
    else:
        outliers = torch.rand(n, 1, generator=generator) < 0.01
        token_scale = torch.where(outliers, 10 * token_scale, token_scale) * 1e-3
    return (values * token_scale).reshape(batch, tokens, hidden)


def _stage_times(profiler: Profiler, tensors: list[torch.Tensor], repeats: int, clock: Timer) -> dict[str, float]:
    """Median milliseconds of each stage of a profile (the scan included), a stage's laps in one check summed."""
    laps: dict[str, list[float]] = {}
    for index in range(repeats):
        stages = _StageClock(clock)
        profiler.profile(profiler.scan(tensors[index % len(tensors)]), stages)
        for stage, ms in stages.laps.items():
            laps.setdefault(stage, []).append(ms)
    return {stage: statistics.median(times) for stage, times in laps.items()}


class _StageClock:
    """Milliseconds per stage of one profile (a stage ticked twice is summed)."""

    def __init__(self, clock: Timer) -> None:
        self.clock, self.laps = clock, {}
        self.last = clock.now()

    def __call__(self, stage: str) -> None:
        now = self.clock.now()
        self.laps[stage] = self.laps.get(stage, 0.0) + 1000 * (now - self.last)
        self.last = now


def _report(config: Config, settings: VerifierBenchSettings, device: torch.device, rows: list[dict]) -> dict:
    linearity = {}
    for direction in DIRECTIONS:
        costs = [row["ms_per_mib"] for row in rows if row["direction"] == direction]
        linearity[direction] = max(costs) / min(costs) if costs else None
    worst_share = max(row["share_of_1gbit"] for row in rows) if rows else None
    verification = config.verification
    return {
        "clock": "wall" if device.type == "cuda" else "cpu",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": settings.threads,
        "wire_dtype": settings.wire_dtype,
        "tensors": "synthetic: channel offsets, rank-8 structure, noise, log-normal token scales, gradient outliers",
        "spectral": {
            "rank": verification.spectral_rank,
            "oversample": verification.spectral_oversample,
            "power_iterations": verification.spectral_power_iterations,
        },
        "repeats": settings.repeats,
        "rows": rows,
        "goal": {"share_of_1gbit": GOAL_SHARE_OF_1GBIT, "linearity": GOAL_LINEARITY},
        "worst_share_of_1gbit": worst_share,
        "linearity": linearity,
        "meets_goal": bool(
            rows
            and worst_share <= GOAL_SHARE_OF_1GBIT
            and all(v is not None and v <= GOAL_LINEARITY for v in linearity.values())
        ),
    }


def _shape_name(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)


STAGE_LEGEND = {
    "scan": "one pass over the rows: row norms, channel sums of squares and absolute values, projections",
    "clip, quantiles": "row clipping corrected on the clipped rows, quantiles of the projections",
    "power iteration": "the range finder's power iterations (two products of the tensor each)",
    "range, energy": "the last product (B = Q^T W A, and the column sums) and B's top energies",
    REST: "the replay sketch (two passes), the distances to the reference, thresholds, peer and shift tests, "
    "strikes, EMA update",
}


def table(report: dict) -> str:
    """The report as readable tables: one line per shape and direction, then the stages of each check."""
    clock = "CPU" if report["clock"] == "cpu" else "wall"
    header = (
        f"{'shape':<12} {'direction':<10} {'MiB':>6} {clock + ' ms':>8} {'wall ms':>8} {'MiB/s':>6} {'x copy':>6} "
        f"{'1Gb/s ms':>8} {'100Mb/s ms':>10} {'% of 1Gb/s':>10}"
    )
    lines = [
        f"device {report['device']} ({report['device_name']}), {report['threads']} thread(s), wire dtype "
        f"{report['wire_dtype']}, spectral rank {report['spectral']['rank']} + {report['spectral']['oversample']}, "
        f"{report['spectral']['power_iterations']} power iteration(s); medians of {report['repeats']} checks "
        f"in {clock} time",
        header,
    ]
    for row in report["rows"]:
        lines.append(
            f"{_shape_name(row['shape']):<12} {row['direction']:<10} {row['mib']:>6.2f} {row['check_ms']:>8.2f} "
            f"{row['check_wall_ms']:>8.2f} {row['mib_per_s']:>6.0f} {row['ratio_to_copy']:>6.1f} "
            f"{row['transfer_ms']['1gbit']:>8.1f} {row['transfer_ms']['100mbit']:>10.1f} "
            f"{100 * row['share_of_1gbit']:>9.1f}%"
        )
    stages = list(dict.fromkeys(stage for row in report["rows"] for stage in row["stages_ms"]))
    lines += ["", f"{clock} ms per stage of a check:"]
    lines.append(f"{'shape':<12} {'direction':<10} " + " ".join(f"{s:>16}" for s in stages))
    for row in report["rows"]:
        cells = " ".join(f"{row['stages_ms'].get(stage, 0.0):>16.2f}" for stage in stages)
        lines.append(f"{_shape_name(row['shape']):<12} {row['direction']:<10} {cells}")
    lines += [""] + [f"  {stage}: {STAGE_LEGEND.get(stage, '')}" for stage in stages]
    linearity = ", ".join(f"{d} {v:.2f}x" for d, v in report["linearity"].items() if v is not None)
    lines.append(
        f"goal: a check <= {100 * GOAL_SHARE_OF_1GBIT:.0f}% of the 1 Gbit/s transfer (worst "
        f"{100 * report['worst_share_of_1gbit']:.1f}%), cost per MiB within {GOAL_LINEARITY:g}x across shapes "
        f"({linearity}): {'met' if report['meets_goal'] else 'NOT met'}"
    )
    return "\n".join(lines)


# --- accuracy of the randomized spectral share ----------------------------------------------------------------------


def exact_spectral_share(tensor: torch.Tensor, rank: int, row_clip: float) -> float:
    """The share of the clipped rows' energy in their top `rank` singular values, from all of them (float64)."""
    rows = tensor.detach().reshape(-1, tensor.shape[-1]).double()
    norms = rows.norm(dim=1, keepdim=True)
    rows = rows * (row_clip * norms.median() / norms.clamp_min(1e-300)).clamp(max=1.0)
    energy = torch.linalg.svdvals(rows).square()
    return float(energy[:rank].sum() / energy.sum())


def spectral_accuracy(config: Config, steps: int = 120, keep: int = 60, seeds: int = 10) -> dict:
    """How the randomized spectral share compares with the exact one on a real model's honest tensors.

    Trains the config's model, cut in two stages, on the embedded corpus for `steps` AdamW steps and keeps the
    boundary's activations and gradients of the last `keep`. Per direction: the honest spread (std over the stream)
    of the exact share, the estimate's mean error against it, and its std over `seeds` swarm seeds (each seed a
    different set of test vectors), averaged over the stream; the ratio of the last to the first is what the
    estimate adds to the statistic's own noise.
    """
    streams = honest_streams(config, steps, keep)
    verification = config.verification
    report = {"steps": steps, "tensors": keep, "seeds": seeds, "shape": list(streams["activation"][0].shape)}
    for direction, stream in streams.items():
        exact = [exact_spectral_share(t, verification.spectral_rank, verification.row_clip) for t in stream]
        errors, spreads = [], []
        profilers = [
            Profiler(
                stream[0].shape[-1],
                verification.n_projections,
                verification.n_quantiles,
                verification.spectral_rank,
                seed,
                verification.row_clip,
                oversample=verification.spectral_oversample,
                power_iterations=verification.spectral_power_iterations,
            )
            for seed in range(seeds)
        ]
        for tensor, truth in zip(stream, exact, strict=True):
            estimates = [float(profiler(tensor).spectral_share) for profiler in profilers]
            errors.append(statistics.mean(estimates) - truth)
            spreads.append(statistics.stdev(estimates) if seeds > 1 else 0.0)
        honest_std = statistics.stdev(exact)
        report[direction] = {
            "exact_mean": statistics.mean(exact),
            "honest_std": honest_std,
            "mean_error": statistics.mean(errors),
            "max_abs_error": max(abs(e) for e in errors),
            "std_over_seeds": statistics.mean(spreads),
            "seed_std_over_honest_std": statistics.mean(spreads) / honest_std if honest_std else None,
        }
    return report


def honest_streams(config: Config, steps: int, keep: int) -> dict[str, list[torch.Tensor]]:
    """The boundary tensors of the config's model cut in two, training on the embedded corpus (the last `keep`)."""
    from sentinel_node.model import build_stage, load_corpus
    from sentinel_node.model.corpus import sample_batch

    torch.manual_seed(config.swarm.seed)
    model, pipe = config.model, config.pipeline
    stages = (build_stage(model, 0, 2, config.swarm.seed), build_stage(model, 1, 2, config.swarm.seed))
    optimizer = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=pipe.lr, weight_decay=0.01)
    corpus = load_corpus(max_bytes=2**21)
    rng = np.random.default_rng(config.swarm.seed)
    streams: dict[str, list[torch.Tensor]] = {"activation": [], "gradient": []}
    first, last = stages
    for step in range(steps):
        optimizer.param_groups[0]["lr"] = pipe.lr * min(1.0, (step + 1) / max(pipe.warmup_steps, 1))
        inputs, targets = sample_batch(corpus.train, pipe.microbatch_size, pipe.seq_len, rng)
        hidden = first(inputs)
        received = hidden.detach().requires_grad_(True)
        last.loss(last(received), targets).backward()
        hidden.backward(received.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= steps - keep:
            streams["activation"].append(hidden.detach().clone())
            streams["gradient"].append(received.grad.detach().clone())
    return streams


def accuracy_table(report: dict) -> str:
    lines = [
        f"randomized spectral share vs exact: {report['tensors']} honest tensors {tuple(report['shape'])} after "
        f"{report['steps'] - report['tensors']} steps, {report['seeds']} seeds",
        f"{'direction':<10} {'exact mean':>10} {'honest std':>10} {'mean err':>9} {'max |err|':>9} "
        f"{'seed std':>9} {'seed/honest':>11}",
    ]
    for direction in DIRECTIONS:
        r = report[direction]
        lines.append(
            f"{direction:<10} {r['exact_mean']:>10.4f} {r['honest_std']:>10.4f} {r['mean_error']:>+9.4f} "
            f"{r['max_abs_error']:>9.4f} {r['std_over_seeds']:>9.4f} {r['seed_std_over_honest_std']:>11.3f}"
        )
    return "\n".join(lines)
