"""What one stage of a model needs: parameters, memory and bandwidth, from the config alone (no tensor is made).

Small pure functions, in the manner of Petals' block selection: a volunteer reads ``sentinel-node plan`` before
joining, and a stage that would not fit its device refuses to start with these numbers in the message.

Memory model of this runtime (:class:`sentinel_node.pipeline.StageWorker`), per stage of P parameters:

- weights: fp32 master weights, 4 bytes each, whatever the compute precision (bf16 runs under autocast);
- gradients: fp32, 4 bytes each (accumulated over a global step's microbatches);
- optimizer state: torch AdamW 8 bytes per parameter (two fp32 moments), bitsandbytes' 8-bit AdamW 2 bytes
  (two 8-bit moments; the blockwise scales add 0.4%);
- activations: a stage keeps each microbatch's autograd graph from its forward until its backward arrives, so
  every stage but the last holds the microbatches in flight (the trainer's ``--inflight``, by default a whole
  step's); the last stage computes loss and backward at once and holds one. Per token and decoder layer the
  graph keeps ``32 H + 8 kv + 16 I`` bytes in fp32 and ``30 H + 4 kv + 8 I`` under bf16 autocast (H hidden, kv
  the key/value width, I intermediate: measured on the CPU with ``torch.autograd.graph.saved_tensors_hooks``
  on transformers' Llama layer, fit residuals under 0.1%); under autocast each microbatch's graph also keeps its
  own bf16 copy of the stage's linear weights (2 bytes per weight, measured within 2%). The last stage keeps
  4 (fp32) or 5 (bf16) bytes per token per vocabulary entry for the loss, and needs about 8 more while the
  loss's backward runs.
- device overhead: the CUDA context and allocator slack, :data:`CUDA_OVERHEAD_GIB` plus :data:`MARGIN` of the
  rest (an assumption, not measured here: no GPU was available).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from sentinel_node.config import Config, ModelConfig

Precision = Literal["bf16", "fp32"]
Optimizer = Literal["adamw8bit", "adamw"]

GIB = 2**30
CUDA_OVERHEAD_GIB = 1.0
MARGIN = 0.10
# common GPU memory sizes, GiB (RTX 3060 Ti/4060: 8, 3060: 12, 4080/A4000: 16, 3090/4090: 24, 5090: 32, A100: 40/80)
GPU_SIZES_GIB = (8, 12, 16, 24, 32, 40, 48, 80, 141)
WIRE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "blockwise_8bit": 1.0 + 4 / 4096}
OPTIMIZER_BYTES = {"adamw8bit": 2.0 * (1 + 4 / 2048), "adamw": 8.0}


def layer_range(n_layers: int, stage: int, n_stages: int) -> range:
    """The global indices of the layers stage `stage` holds; earlier stages take the remainder."""
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is outside 0..{n_stages - 1}")
    if n_layers < n_stages:
        raise ValueError(f"{n_layers} layers cannot fill {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def kv_width(m: ModelConfig) -> int:
    return m.n_kv_heads * (m.hidden_size // m.n_heads)


def layer_linear_params(m: ModelConfig) -> int:
    """Weights of one decoder layer's linear maps: q, k, v, o and the gated MLP (Llama has no biases)."""
    h, kv = m.hidden_size, kv_width(m)
    return 2 * h * h + 2 * h * kv + 3 * h * m.intermediate_size


def layer_params(m: ModelConfig) -> int:
    return layer_linear_params(m) + 2 * m.hidden_size  # and two RMSNorm gains


def model_params(m: ModelConfig) -> int:
    """The whole model as the stages hold it: embedding and head untied (they live on different stages)."""
    return m.n_layers * layer_params(m) + 2 * m.vocab_size * m.hidden_size + m.hidden_size


@dataclass(frozen=True)
class StageParams:
    stage: int
    layers: range
    embedding: int
    decoder: int
    head: int  # final norm and LM head
    linear: int  # of which weights of linear maps (what autocast copies to bf16)

    @property
    def total(self) -> int:
        return self.embedding + self.decoder + self.head


def stage_params(m: ModelConfig, stage: int, n_stages: int) -> StageParams:
    layers = layer_range(m.n_layers, stage, n_stages)
    first, last = stage == 0, stage == n_stages - 1
    embedding = m.vocab_size * m.hidden_size if first else 0
    head = (m.vocab_size * m.hidden_size + m.hidden_size) if last else 0
    linear = len(layers) * layer_linear_params(m) + (m.vocab_size * m.hidden_size if last else 0)
    return StageParams(stage, layers, embedding, len(layers) * layer_params(m), head, linear)


def activation_bytes(m: ModelConfig, params: StageParams, tokens: int, precision: Precision, last: bool) -> float:
    """What one microbatch of ``tokens`` tokens keeps in the stage's graph until its backward."""
    h, kv, i = m.hidden_size, kv_width(m), m.intermediate_size
    if precision == "fp32":
        per_layer, per_vocab, copies = 32 * h + 8 * kv + 16 * i, 4, 0.0
    else:
        per_layer, per_vocab, copies = 30 * h + 4 * kv + 8 * i, 5, 2.0 * params.linear
    total = tokens * len(params.layers) * per_layer + copies
    if last:
        total += tokens * m.vocab_size * per_vocab
    return float(total)


@dataclass(frozen=True)
class StageMemory:
    """Bytes one replica of a stage needs, for one compute precision and optimizer."""

    precision: Precision
    optimizer: Optimizer
    weights: float
    gradients: float
    optimizer_state: float
    activations: float  # all microbatches the stage holds at once
    transient: float  # the loss's backward on the last stage

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.activations + self.transient

    @property
    def device_total(self) -> float:
        """With the CUDA context and allocator slack: what a GPU must have free."""
        return self.total * (1 + MARGIN) + CUDA_OVERHEAD_GIB * GIB


def in_flight(config: Config, stage: int, inflight: int | None = None) -> int:
    """Microbatches whose graphs a stage holds at once: the trainer's in flight, one on the last stage."""
    if stage == config.pipeline.n_stages - 1:
        return 1
    return inflight or config.pipeline.microbatches_per_step


def stage_memory(
    config: Config, stage: int, precision: Precision, optimizer: Optimizer, inflight: int | None = None
) -> StageMemory:
    m, pipe = config.model, config.pipeline
    params = stage_params(m, stage, pipe.n_stages)
    last = stage == pipe.n_stages - 1
    tokens = pipe.microbatch_size * pipe.seq_len
    held = in_flight(config, stage, inflight)
    return StageMemory(
        precision=precision,
        optimizer=optimizer,
        weights=4.0 * params.total,
        gradients=4.0 * params.total,
        optimizer_state=OPTIMIZER_BYTES[optimizer] * params.total,
        activations=held * activation_bytes(m, params, tokens, precision, last),
        transient=8.0 * tokens * m.vocab_size if last else 0.0,
    )


def smallest_gpu(memory: StageMemory, sizes: tuple[int, ...] = GPU_SIZES_GIB) -> int | None:
    """The smallest common GPU (GiB) the stage fits on, None when none does."""
    for size in sizes:
        if memory.device_total <= size * GIB:
            return size
    return None


@dataclass(frozen=True)
class BoundaryTraffic:
    boundary: int  # between stage `boundary` and `boundary + 1`
    activation_bytes: dict[str, float]  # one microbatch, per wire dtype; its gradient has the same size
    verifier_mbit_s: dict[str, float]  # each way (in and out), at the plan's pace


def boundary_traffic(config: Config, boundary: int, step_seconds: float) -> BoundaryTraffic:
    """A verifier receives each microbatch's activation and gradient and sends both on: per direction of its
    link, 2 tensors per microbatch, a whole step's microbatches every ``step_seconds`` (one verifier carrying the
    boundary; more verifiers share it)."""
    pipe = config.pipeline
    elements = pipe.microbatch_size * pipe.seq_len * config.model.hidden_size
    sizes = {dtype: elements * width for dtype, width in WIRE_BYTES.items()}
    rate = pipe.microbatches_per_step / step_seconds
    mbit = {dtype: 2 * size * rate * 8 / 1e6 for dtype, size in sizes.items()}
    return BoundaryTraffic(boundary, sizes, mbit)


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, int]  # first, last (inclusive)
    params: int
    memory: dict[str, StageMemory]  # "bf16+adamw8bit" (a GPU stage), "fp32+adamw" (the CPU, or no bitsandbytes)
    smallest_gpu_gib: int | None  # for bf16 + 8-bit AdamW


@dataclass(frozen=True)
class Plan:
    model_params: int
    tokens_per_microbatch: int
    microbatches_per_step: int
    inflight: int
    step_seconds: float
    stages: list[StagePlan]
    boundaries: list[BoundaryTraffic]

    def as_dict(self) -> dict:
        out = asdict(self)
        for stage, plan in zip(out["stages"], self.stages, strict=True):
            for key, memory in plan.memory.items():
                stage["memory"][key] = {**asdict(memory), "total": memory.total, "device_total": memory.device_total}
        return out


MODES: dict[str, tuple[Precision, Optimizer]] = {
    "bf16+adamw8bit": ("bf16", "adamw8bit"),
    "fp32+adamw": ("fp32", "adamw"),
}


def plan(config: Config, step_seconds: float = 60.0, inflight: int | None = None) -> Plan:
    pipe = config.pipeline
    stages = []
    for k in range(pipe.n_stages):
        params = stage_params(config.model, k, pipe.n_stages)
        memory = {name: stage_memory(config, k, p, o, inflight) for name, (p, o) in MODES.items()}
        stages.append(
            StagePlan(
                k,
                (params.layers.start, params.layers.stop - 1),
                params.total,
                memory,
                smallest_gpu(memory["bf16+adamw8bit"]),
            )
        )
    return Plan(
        model_params=model_params(config.model),
        tokens_per_microbatch=pipe.microbatch_size * pipe.seq_len,
        microbatches_per_step=pipe.microbatches_per_step,
        inflight=inflight or pipe.microbatches_per_step,
        step_seconds=step_seconds,
        stages=stages,
        boundaries=[boundary_traffic(config, b, step_seconds) for b in range(pipe.n_stages - 1)],
    )


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def render(p: Plan) -> str:
    """The plan as Markdown tables (they read in a terminal too)."""
    lines = [
        f"model: {_count(p.model_params)} parameters; microbatch {p.tokens_per_microbatch} tokens, "
        f"{p.microbatches_per_step} per step, {p.inflight} in flight",
        "",
        "| stage | layers | params | weights | grads | AdamW 8-bit | AdamW fp32 | activations bf16 | activations fp32 "
        "| total bf16 + 8-bit | total fp32 + AdamW | smallest GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in p.stages:
        gpu, cpu = s.memory["bf16+adamw8bit"], s.memory["fp32+adamw"]
        fits = f"{s.smallest_gpu_gib} GB" if s.smallest_gpu_gib else "none listed"
        lines.append(
            f"| {s.stage} | {s.layers[0]}-{s.layers[1]} | {_count(s.params)} | {_size(gpu.weights)} | "
            f"{_size(gpu.gradients)} | {_size(gpu.optimizer_state)} | {_size(cpu.optimizer_state)} | "
            f"{_size(gpu.activations + gpu.transient)} | {_size(cpu.activations + cpu.transient)} | "
            f"{_size(gpu.total)} | {_size(cpu.total)} | {fits} |"
        )
    if p.boundaries:
        lines += [
            "",
            "| boundary | activation (= gradient) per microbatch: fp32 / bf16 / fp16 / 8-bit "
            f"| verifier Mbit/s each way at {p.step_seconds:g} s per step: fp32 / bf16 / fp16 / 8-bit |",
            "|---|---|---|",
        ]
        rows = []
        for b in p.boundaries:
            sizes = " / ".join(_size(v) for v in b.activation_bytes.values())
            rates = " / ".join(f"{v:.1f}" for v in b.verifier_mbit_s.values())
            rows.append((f"{b.boundary}\\|{b.boundary + 1}", sizes, rates))
        if len({row[1:] for row in rows}) == 1 and len(rows) > 1:  # the same everywhere: one line says it
            rows = [(f"each of the {len(rows)}", *rows[0][1:])]
        lines += [f"| {name} | {sizes} | {rates} |" for name, sizes, rates in rows]
    lines += [
        "",
        "Smallest GPU: bf16 + 8-bit AdamW, with 10% slack and 1 GiB for the CUDA context. Weights and gradients are "
        "fp32 in both modes.",
    ]
    return "\n".join(lines)


# --- does a stage fit the device it is about to be built on


def fit_problem(
    config: Config, stage: int, precision: Precision, optimizer: Optimizer, free_bytes: float, device: str
) -> str | None:
    """None when stage ``stage`` fits ``free_bytes``; else the message a volunteer reads, with the plan's numbers."""
    memory = stage_memory(config, stage, precision, optimizer)
    needed = memory.device_total if device.startswith("cuda") else memory.total
    if needed <= free_bytes:
        return None
    held = in_flight(config, stage)
    return (
        f"stage {stage} does not fit {device}: it needs about {_size(needed)} ({precision}, {optimizer}: weights "
        f"{_size(memory.weights)}, gradients {_size(memory.gradients)}, optimizer state "
        f"{_size(memory.optimizer_state)}, activations of {held} microbatch(es) of "
        f"{config.pipeline.microbatch_size}x{config.pipeline.seq_len} tokens "
        f"{_size(memory.activations + memory.transient)}"
        + (f", CUDA context and slack {_size(needed - memory.total)}" if needed > memory.total else "")
        + f") and {device} has {_size(free_bytes)} free. `sentinel-node plan --config FILE` shows what each stage "
        "needs: join a stage that fits, or ask the organiser for a config with more stages or smaller microbatches"
    )
