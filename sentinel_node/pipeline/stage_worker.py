"""One replica of one stage: forward and backward of microbatches, gradient accumulation, optimizer steps."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from hivemind.utils.logging import get_logger

from sentinel_node.config import ModelConfig, PipelineConfig
from sentinel_node.model import StageModule, build_stage
from sentinel_node.pipeline.device import (
    DeviceError,
    Precision,
    choose_precision,
    cpu_fallback_message,
    free_memory,
    is_auto,
    make_optimizer,
    resolve_device,
    will_use_8bit,
)
from sentinel_node.pipeline.recompute import ReferenceParameters, ReferenceVersion, recompute
from sentinel_node.verification.audit import Drift, Work, errors_against

logger = get_logger(__name__)

_FLOAT16_MIN, _FLOAT16_MAX = torch.finfo(torch.float16).min, torch.finfo(torch.float16).max


class StageWorker:
    """Holds stage `stage` of the model and its optimizer; keeps each microbatch's graph until its backward.

    A replica steps on the trainer's global step with the mean gradient of the microbatches it served since the
    last step, so replicas that are later averaged each contribute an unbiased update.

    `device` may be "auto" (CUDA when visible) or None (the same). On CUDA the optimizer is bitsandbytes' 8-bit
    AdamW when installed and forward/backward run under bf16 autocast where the GPU supports it
    (`pipeline.mixed_precision`); whatever the compute dtype, the tensors it returns (activations, input
    gradients) are in the swarm's wire dtype (`pipeline.wire_dtype`), so verifiers and peers see one dtype on the
    wire, and the tensors it takes in any float dtype are cast to float32 before they enter the stage. On the CPU:
    fp32 and torch AdamW.
    """

    def __init__(
        self,
        model: ModelConfig,
        pipeline: PipelineConfig,
        stage: int,
        seed: int = 0,
        device: str | torch.device | None = "cpu",
        max_pending: int = 64,
    ):
        self.stage, self.n_stages, self.pipeline = stage, pipeline.n_stages, pipeline
        self.device = resolve_device(device)
        self.precision = choose_precision(self.device.type, pipeline.mixed_precision)
        self.wire_dtype: torch.dtype = getattr(torch, pipeline.wire_dtype)
        check_fits(model, pipeline, stage, self.device, self.precision)
        self.module: StageModule = build_stage(model, stage, pipeline.n_stages, seed, init=model.init_from is None)
        if model.init_from is not None:
            from sentinel_node.config import Config
            from sentinel_node.model.weights import load_pretrained

            load_pretrained(self.module, Config(model=model, pipeline=pipeline), stage, model.init_from)
        self.module.to(self.device)
        self.optimizer, self.optimizer_name = make_optimizer(self.module.parameters(), pipeline, self.device)
        if self.device.type != "cpu":
            logger.info(
                f"stage {stage} on {self.device}: {self.precision.name} compute, optimizer {self.optimizer_name}"
            )
        elif is_auto(device):
            # one line, so a volunteer who forgot --gpus all sees it in `docker logs` (README: Run it in Docker)
            logger.info(f"stage {stage}: {cpu_fallback_message(f'{self.precision.name}, {self.optimizer_name}')}")
        self.max_pending = max_pending
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.accumulated = 0
        self.steps = 0
        # recomputation audits: the parameters every replica of the stage shares (the initialisation, then each
        # averaging round's result), and a red-team replica's refusal to apply its optimizer step
        self.reference = ReferenceParameters(self.module)
        self.set_reference(round_step=-1, applies_from=0, members=None)
        self.applies_step: Callable[[int], bool] | None = None

    @property
    def is_first(self) -> bool:
        return self.module.is_first

    @property
    def is_last(self) -> bool:
        return self.module.is_last

    def forward(self, microbatch: str, inputs: torch.Tensor) -> torch.Tensor:
        """The stage's output for `inputs`; the graph is kept for `backward(microbatch, ...)`."""
        if len(self._pending) >= self.max_pending:
            raise RuntimeError(f"stage {self.stage} holds {self.max_pending} microbatches awaiting backward")
        inputs = self._from_wire(inputs)
        if not self.is_first:
            inputs = inputs.detach().requires_grad_(True)
        with self._autocast():
            output = self.module(inputs)
        self._pending[microbatch] = (inputs, output)
        return self._to_wire(output)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor) -> torch.Tensor:
        """The stage's output for a validation pass (no graph kept), in the wire dtype like a training output."""
        with self._autocast():
            return self._to_wire(self.module(self._from_wire(inputs)))

    @torch.no_grad()
    def evaluate_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Last stage: the loss of a validation pass."""
        with self._autocast():
            return float(self.module.loss(self.module(self._from_wire(inputs)), targets.to(self.device)))

    def _from_wire(self, inputs: torch.Tensor) -> torch.Tensor:
        # token ids stay as they are; hidden states arrive in the wire dtype and the stage computes from float32
        if self.is_first:
            return inputs.to(self.device)
        return inputs.to(self.device, torch.float32)

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().float()
        if self.wire_dtype == torch.float16:  # an honest outlier past fp16's range must not arrive as infinity
            tensor = tensor.clamp(_FLOAT16_MIN, _FLOAT16_MAX)
        return tensor.to(self.wire_dtype)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.precision.enabled:
            return contextlib.nullcontext()  # fp32: no autocast machinery at all, as before mixed precision
        return torch.autocast(device_type=self.device.type, dtype=self.precision.autocast)

    def forward_backward_loss(
        self, microbatch: str, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[float, torch.Tensor | None]:
        """Last stage: the loss and the gradient for the stage's input; accumulates this stage's gradients."""
        loss = self.forward_loss(microbatch, inputs, targets)
        return loss, self.backward_loss(microbatch)

    def forward_loss(self, microbatch: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Last stage: the loss of a microbatch, its graph kept for `backward_loss` (or `discard`: a microbatch
        held back by the trainer's loss gate teaches no stage anything)."""
        self.forward(microbatch, inputs)
        inputs, logits = self._pending.pop(microbatch)
        loss = self.module.loss(logits, targets.to(self.device))
        self._pending[microbatch] = (inputs, loss)
        return float(loss.detach())

    def backward_loss(self, microbatch: str) -> torch.Tensor | None:
        """Last stage: backpropagates the loss `forward_loss` kept; the gradient for the stage's input (None on a
        stage that is also the first)."""
        inputs, loss = self._pending.pop(microbatch)
        loss.backward()
        self.accumulated += 1
        return self._to_wire(inputs.grad) if inputs.grad is not None else None

    def backward(self, microbatch: str, grad_output: torch.Tensor) -> torch.Tensor | None:
        """Accumulates gradients for `microbatch`; returns the gradient for the stage's input (None on stage 0).
        LookupError when its forward was discarded meanwhile (its call was cancelled)."""
        if microbatch not in self._pending:
            raise LookupError(f"microbatch {microbatch} has no forward pass awaiting backward (it was discarded)")
        inputs, output = self._pending.pop(microbatch)
        output.backward(grad_output.to(device=self.device, dtype=output.dtype))
        self.accumulated += 1
        return None if self.is_first else self._to_wire(inputs.grad)

    def discard(self, microbatch: str) -> None:
        """Forgets a microbatch whose gradient will never come (dropped, failed, or its output was replaced)."""
        self._pending.pop(microbatch, None)

    def learning_rate(self, step: int) -> float:
        warmup = self.pipeline.warmup_steps
        return self.pipeline.lr * min(1.0, (step + 1) / warmup) if warmup else self.pipeline.lr

    def step(self, global_step: int) -> bool:
        """Applies the mean of the accumulated gradients; False when this replica served nothing since the last."""
        if self.accumulated == 0:
            return False
        if self.applies_step is not None and not self.applies_step(global_step):
            self.optimizer.zero_grad(set_to_none=True)  # a frozen red-team replica: it computed, it never learns
            self.accumulated = 0
            return False
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad /= self.accumulated
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.pipeline.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(global_step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.accumulated = 0
        self.steps += 1
        return True

    # --- recomputation audits

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def set_reference(
        self,
        round_step: int,
        applies_from: int,
        members: Sequence[str] | None,
        params: Sequence[torch.Tensor] = (),
        steps_at: int | None = None,
    ) -> ReferenceVersion:
        """Keeps ``params`` (default: the module's current parameters) as the reference of the averaging round that
        took its snapshot after step ``round_step``; this replica computes step ``applies_from`` on with it.
        ``steps_at``: its own step count at the snapshot (default: now)."""
        steps_at = self.steps if steps_at is None else steps_at
        return self.reference.set(list(params) or self.trainable(), round_step, applies_from, members, steps_at)

    def recompute(
        self,
        step: int,
        inputs: torch.Tensor,
        grad_output: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        max_age: int | None = None,
    ) -> tuple[Work, ReferenceVersion, Drift]:
        """The stage's work on a microbatch of global step ``step``, recomputed with the reference parameters this
        replica held for that step (under the same autocast as training), and how far its own parameters have
        carried it from there on the same microbatch (its :class:`Drift`); its parameters, their gradients and its
        pending microbatches are untouched. NoReference when it holds none younger than ``max_age`` steps
        (default: two averaging periods, as a round's result may be merged a step or more late; periods as this
        replica actually averages, up to four times ``average_every``: where steps come faster than a round
        completes, as on loopback, rounds are every 10 to 15 steps rather than 5, and a fixed two periods left
        every audit of a loss gate test without a reference)."""
        every = self.pipeline.average_every
        age = 2 * min(max(every, self.reference.period or every), 4 * every) if max_age is None else max_age
        version, params, steps_at = self.reference.for_step(step, age)
        autocast = self._autocast
        work = recompute(self.module, params, inputs, grad_output, targets, autocast=autocast())
        steps = self.steps - steps_at
        if steps <= 0:
            return work, version, Drift()
        own = {name: p.detach() for name, p in self.module.named_parameters() if p.requires_grad}
        current = recompute(self.module, own, inputs, grad_output, targets, autocast=autocast())
        if self.is_first:
            errors = errors_against(current, work, Work(output=work.embedding), residual=False)
        else:
            passthrough = Work(output=None if self.is_last else inputs, grad_input=grad_output)
            errors = errors_against(current, work, passthrough, residual=True)
        return work, version, Drift(steps, errors)


def check_fits(
    model: ModelConfig, pipeline: PipelineConfig, stage: int, device: torch.device, precision: Precision
) -> None:
    """DeviceError, before anything is allocated, when the stage would not fit the device's free memory."""
    from sentinel_node.config import Config
    from sentinel_node.model.plan import fit_problem

    free = free_memory(device)
    if free is None:
        return
    config = Config(model=model, pipeline=pipeline)
    optimizer = "adamw8bit" if will_use_8bit(device) else "adamw"
    problem = fit_problem(config, stage, "bf16" if precision.enabled else "fp32", optimizer, free, str(device))
    if problem is not None:
        raise DeviceError(problem)
