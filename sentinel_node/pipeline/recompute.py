"""What an auditor replica recomputes, and with which parameters (see :mod:`sentinel_node.verification.audit`).

A replica keeps the stage's *reference parameters*: a copy of what it held right after each of its last averaging
rounds (before the first, the shared initialisation). An audit recomputes forward and the input gradient with
them, through ``torch.func.functional_call``: the replica's own parameters, their gradients and its pending
microbatches are never touched, so an audit can run between any two training computations.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call

from sentinel_node.verification.audit import Work


@dataclass(frozen=True)
class ReferenceVersion:
    """One version of a stage's reference parameters.

    ``round_step``: the global step after which the averaging round took its snapshot (-1: the initialisation);
    ``applies_from``: the first global step this replica computed with it; ``digest``: SHA-256 of the parameters
    (hex, 16 characters; the replicas of a round over the network hold the same average up to rounding, so their
    digests differ while their recomputations agree within the exact tolerance: versions match by round);
    ``members``: the replicas that averaged in the round (None: every replica that started from the
    initialisation).
    """

    round_step: int
    applies_from: int
    digest: str
    members: tuple[str, ...] | None

    def includes(self, peer: str) -> bool:
        return self.members is None or peer in self.members


def parameters_digest(params: Sequence[torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for param in params:
        data = param.detach().cpu().contiguous()
        hasher.update(f"{data.dtype}:{tuple(data.shape)}:".encode())
        hasher.update(data.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]


class NoReference(LookupError):
    """This replica holds no reference parameters fresh enough for the step asked about."""


class ReferenceParameters:
    """The last ``keep`` versions of a module's reference parameters."""

    def __init__(self, module: torch.nn.Module, keep: int = 2) -> None:
        self.names = [name for name, param in module.named_parameters() if param.requires_grad]
        self._versions: deque[tuple[ReferenceVersion, dict[str, torch.Tensor], int]] = deque(maxlen=keep)

    @torch.no_grad()
    def set(
        self,
        params: Sequence[torch.Tensor],
        round_step: int,
        applies_from: int,
        members: Sequence[str] | None,
        steps_at: int = 0,
    ) -> ReferenceVersion:
        """Keeps a copy of ``params`` (the module's trainable parameters, in order) as a new version; ``steps_at``:
        how many optimizer steps the replica had applied when the round took its snapshot."""
        if len(params) != len(self.names):
            raise ValueError(f"expected {len(self.names)} parameter tensors, got {len(params)}")
        copies = [p.detach().clone() for p in params]
        version = ReferenceVersion(
            round_step, applies_from, parameters_digest(copies), None if members is None else tuple(sorted(members))
        )
        self._versions.append((version, dict(zip(self.names, copies, strict=True)), steps_at))
        return version

    def clear(self) -> None:
        """Forgets every version (a replica whose parameters came from elsewhere: a checkpoint, another replica)."""
        self._versions.clear()

    @property
    def latest(self) -> ReferenceVersion | None:
        return self._versions[-1][0] if self._versions else None

    @property
    def period(self) -> int | None:
        """Steps between the last two rounds kept (None before there are two): how often this replica actually
        averages, which is less often than it is due to when a round takes longer than the steps between them."""
        if len(self._versions) < 2:
            return None
        return self._versions[-1][0].round_step - self._versions[-2][0].round_step

    def for_step(self, step: int, max_age: int) -> tuple[ReferenceVersion, dict[str, torch.Tensor], int]:
        """The version this replica computed step ``step`` with, its parameters and the replica's step count at its
        snapshot; NoReference when there is none, or when it was taken more than ``max_age`` steps before."""
        for version, params, steps_at in reversed(self._versions):
            if version.applies_from <= step:
                if step - version.round_step > max_age:
                    raise NoReference(
                        f"the reference parameters from step {version.round_step} are too old for step {step}"
                    )
                return version, params, steps_at
        raise NoReference(f"no reference parameters for step {step}")


def recompute(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    inputs: torch.Tensor,
    grad_output: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
) -> Work:
    """The stage's output and input gradient for ``inputs`` with ``params`` in place of the module's own: stage 0
    returns its output only; a middle stage both (given ``grad_output``; without one, its output only: the forward
    half of a microbatch the loss gate held back); the last stage the gradient of the loss on ``targets`` for its
    input. Stage 0 also returns its token embeddings, what its layers add to. Returned tensors are float32 on the
    CPU."""
    device = next(iter(params.values())).device
    inputs = inputs.to(device)
    first, last = getattr(module, "is_first", False), getattr(module, "is_last", False)
    with torch.enable_grad(), autocast or contextlib.nullcontext():
        if first:
            with torch.no_grad():
                output = functional_call(module, params, (inputs,))
                embedding = functional_call(module.embed, _within(params, "embed."), (inputs,))
            return Work(output=output.detach().float().cpu(), embedding=embedding.detach().float().cpu())
        inputs = inputs.detach().float().requires_grad_(True)
        output = functional_call(module, params, (inputs,))
        if last:
            if targets is None:
                raise ValueError("the last stage recomputes from targets")
            loss = module.loss(output, targets.to(device))
            (grad,) = torch.autograd.grad(loss, inputs)
            return Work(grad_input=grad.detach().float().cpu())
        if grad_output is None:  # a microbatch held back before its backward pass: its output is all there is
            return Work(output=output.detach().float().cpu())
        (grad,) = torch.autograd.grad(output, inputs, grad_output.to(device=device, dtype=output.dtype))
        return Work(output=output.detach().float().cpu(), grad_input=grad.detach().float().cpu())


def _within(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix) :]: value for name, value in params.items() if name.startswith(prefix)}
