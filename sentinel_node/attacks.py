"""The attack catalogue: what a malicious stage does to the tensors it sends (docs/architecture.md section 4).

An attack is a function ``attack(tensor, step, state) -> tensor`` of the honest tensor, the global step and the
attacker's own state (a dict kept between calls). It returns the tensor it sends; returning the input object
itself means "not attacked this time". Each works on activations and on gradients. :class:`Attacker` adds a start
step and a probability. Red teams bring their own with ``--attack-file PATH.py:NAME``.

A *stage-level* attack (:class:`StageAttack`, :data:`STAGE_ATTACKS`) changes what the replica does with its own
computation, beyond a function of the tensor: it sees what the tensor was computed from (:class:`StageContext`)
and may refuse its optimizer step. ``stale``, ``skip`` and ``replay`` send tensors whose statistics are honest;
only recomputation audits see them. ``--attack-file PATH.py:NAME`` may name a subclass of :class:`StageAttack`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from sentinel_node.verification.audit import Work

AttackFn = Callable[[torch.Tensor, int, dict], torch.Tensor]
DIRECTIONS = ("activation", "gradient")


class AttackError(ValueError):
    """An attack name, parameter or file is invalid; the message says which and what to do."""


def _generator(state: dict) -> torch.Generator:
    if "generator" not in state:
        state["generator"] = torch.Generator().manual_seed(state.get("seed", 0))
    return state["generator"]


def constant(tensor: torch.Tensor, step: int, state: dict, value: float = 0.0) -> torch.Tensor:
    """Sends a constant (zeros by default) instead of the computed tensor."""
    return torch.full_like(tensor, value)


def random_noise(tensor: torch.Tensor, step: int, state: dict) -> torch.Tensor:
    """Sends Gaussian noise with the honest tensor's mean and standard deviation."""
    noise = torch.randn(tensor.shape, generator=_generator(state), dtype=torch.float32).to(tensor.dtype)
    return tensor.mean() + tensor.std() * noise


def scale(tensor: torch.Tensor, step: int, state: dict, sigma: float = -1.0) -> torch.Tensor:
    """Multiplies the tensor by sigma (-1: inverts its sign)."""
    return tensor * sigma


def sign_flip(tensor: torch.Tensor, step: int, state: dict) -> torch.Tensor:
    """Flips the sign of each element with probability 1/2."""
    signs = torch.randint(0, 2, tensor.shape, generator=_generator(state)).to(tensor.dtype) * 2 - 1
    return tensor * signs


def delay(tensor: torch.Tensor, step: int, state: dict, steps: int = 100) -> torch.Tensor:
    """Sends the tensor it computed `steps` global steps earlier (the oldest it kept, until it has one that old)."""
    history: deque = state.setdefault("history", deque())
    if not history or history[-1][0] != step:
        history.append((step, tensor.detach().clone()))  # one tensor per step bounds the memory to `steps` tensors
    while len(history) > 1 and history[1][0] <= step - steps:
        history.popleft()
    old_step, old = history[0]
    if old_step == step or old.shape != tensor.shape:
        return tensor
    return old.to(tensor.dtype)


def bias(tensor: torch.Tensor, step: int, state: dict, offset: float = 1.0) -> torch.Tensor:
    """Adds a constant offset of `offset` times the tensor's RMS: the same meaning on activations and gradients."""
    return tensor + offset * tensor.float().square().mean().sqrt().to(tensor.dtype)


def invisible_noise(tensor: torch.Tensor, step: int, state: dict, fraction: float = 0.99) -> torch.Tensor:
    """Replaces `fraction` of the signal's energy with noise, keeping the tensor's norm."""
    noise = torch.randn(tensor.shape, generator=_generator(state), dtype=torch.float32).to(tensor.dtype)
    noise = noise * (tensor.norm() / noise.norm().clamp_min(1e-30))
    return (1 - fraction) ** 0.5 * tensor + fraction**0.5 * noise


_BASIC: dict[str, AttackFn] = {
    "constant": constant,
    "random": random_noise,
    "scale": scale,
    "sign_flip": sign_flip,
    "delay": delay,
    "bias": bias,
    "invisible_noise": invisible_noise,
}


def mixed(tensor: torch.Tensor, step: int, state: dict, every: int = 5) -> torch.Tensor:
    """A different basic attack every `every` steps, in a random order of the attacker's own."""
    if "order" not in state:
        names = sorted(_BASIC)
        random.Random(state.get("seed", 0)).shuffle(names)
        state["order"] = names
    name = state["order"][(step // every) % len(state["order"])]
    return _BASIC[name](tensor, step, state.setdefault(f"state_{name}", {"seed": state.get("seed", 0)}))


def adaptive(
    tensor: torch.Tensor, step: int, state: dict, margin: float = 0.9, warmup: int = 20, settings=None
) -> torch.Tensor:
    """An attacker who knows SENTINEL's metrics: it replaces as large a share of the signal with noise of the same
    norm as it can while every metric stays under `margin` times the threshold it estimates from its own honest
    tensors (after `warmup` of them: it sees only its own share of the traffic, so it cannot wait as long as a
    verifier).
    """
    from sentinel_node.verification import BoundaryMonitor

    if "monitor" not in state:
        if settings is None:
            raise AttackError(
                "the adaptive attack needs the swarm's verification settings (the simulator passes them)"
            )
        own = dataclasses.replace(settings, warmup=min(warmup, settings.warmup))
        state["monitor"] = BoundaryMonitor(own, hidden_size=tensor.shape[-1], dtype=tensor.dtype)
    monitor: BoundaryMonitor = state["monitor"]
    reference = monitor.baseline.reference
    if monitor.warming_up or reference is None:
        monitor.check(tensor, "self")  # learn what honest looks like, as the verifier does
        return tensor

    limits = {name: margin * monitor.thresholds[name].threshold() for name in monitor.thresholds}
    noise = torch.randn(tensor.shape, generator=_generator(state), dtype=torch.float32).to(tensor.dtype)
    noise = noise * (tensor.norm() / noise.norm().clamp_min(1e-30))

    def blend(fraction: float) -> torch.Tensor:
        return (1 - fraction) ** 0.5 * tensor + fraction**0.5 * noise

    def passes(fraction: float) -> bool:
        profile = monitor.profiler(blend(fraction))
        scores = {name: metric(profile, reference) for name, metric in monitor.metrics.items()}
        return all(score <= limits[name] for name, score in scores.items())

    low, high = 0.0, 1.0
    for _ in range(8):
        mid = (low + high) / 2
        low, high = (mid, high) if passes(mid) else (low, mid)
    monitor.check(tensor, "self")
    return blend(low) if low > 0 else tensor


# --- families written outside the catalogue the fences were tuned on (`bench detection --suite sweep`): each has
# a strength parameter, and none is in `mixed`


def gaussian_noise(tensor: torch.Tensor, step: int, state: dict, fraction: float = 0.25) -> torch.Tensor:
    """Adds Gaussian noise whose norm is `fraction` of the tensor's (the signal stays; compare `invisible_noise`)."""
    noise = torch.randn(tensor.shape, generator=_generator(state), dtype=torch.float32).to(tensor.dtype)
    return tensor + noise * (fraction * tensor.norm() / noise.norm().clamp_min(1e-30))


def lowrank_noise(tensor: torch.Tensor, step: int, state: dict, fraction: float = 0.5, rank: int = 2) -> torch.Tensor:
    """Adds noise confined to `rank` fixed directions of the hidden space, with `fraction` of the tensor's norm."""
    hidden = tensor.shape[-1]
    if state.get("basis") is None or state["basis"].shape[0] != hidden:
        basis = torch.randn(hidden, rank, generator=_generator(state))
        state["basis"] = torch.linalg.qr(basis).Q
    coefficients = torch.randn(*tensor.shape[:-1], rank, generator=_generator(state))
    noise = (coefficients @ state["basis"].T).to(tensor.dtype)
    return tensor + noise * (fraction * tensor.norm() / noise.norm().clamp_min(1e-30))


def sparse_sign_flip(tensor: torch.Tensor, step: int, state: dict, fraction: float = 0.1) -> torch.Tensor:
    """Flips the sign of a random `fraction` of the elements."""
    flip = torch.rand(tensor.shape, generator=_generator(state)) < fraction
    return torch.where(flip, -tensor, tensor)


def channel_permutation(tensor: torch.Tensor, step: int, state: dict, fraction: float = 1.0) -> torch.Tensor:
    """Permutes a fixed random `fraction` of the hidden channels among themselves (at least two)."""
    hidden = tensor.shape[-1]
    if state.get("permutation") is None or len(state["permutation"]) != hidden:
        generator = _generator(state)
        chosen = torch.randperm(hidden, generator=generator)[: max(2, round(fraction * hidden))]
        permutation = torch.arange(hidden)
        permutation[chosen] = chosen.roll(1)  # a cycle: every chosen channel moves
        state["permutation"] = permutation
    return tensor[..., state["permutation"]]


def drift(tensor: torch.Tensor, step: int, state: dict, speed: float = 0.01) -> torch.Tensor:
    """A bias that grows by `speed` times the tensor's RMS per global step since the attack began (an EMA baseline
    follows it)."""
    first = state.setdefault("first_step", step)
    return bias(tensor, step, state, offset=speed * (step - first + 1))


def replay(tensor: torch.Tensor, step: int, state: dict, lag: int = 1, noise: float = 0.0) -> torch.Tensor:
    """A free-rider: sends the tensor it was given `lag` tensors earlier instead of this one, plus noise of
    relative norm `noise` (it keeps only the last `lag`)."""
    history: deque = state.setdefault("replay", deque(maxlen=lag + 1))
    history.append(tensor.detach().clone())
    if len(history) <= lag or history[0].shape != tensor.shape:
        return tensor
    old = history[0]
    if noise > 0:
        return gaussian_noise(old, step, state, fraction=noise)
    return old.clone()


def intermittent(
    tensor: torch.Tensor, step: int, state: dict, every: int = 10, attack: str = "random"
) -> torch.Tensor:
    """Corrupts one tensor in `every` (of its own, in turn) with the catalogue's `attack`; sends the rest honest."""
    state["count"] = state.get("count", 0) + 1
    if state["count"] % every:
        return tensor
    return _BASIC[attack](tensor, step, state.setdefault(f"state_{attack}", {"seed": state.get("seed", 0)}))


def channel_target(tensor: torch.Tensor, step: int, state: dict, channels: int = 4, factor: float = 0.0):
    """Multiplies the `channels` largest channels (by mean magnitude in this tensor) by `factor`: few channels,
    but the ones carrying the most signal."""
    magnitude = tensor.detach().abs().reshape(-1, tensor.shape[-1]).mean(0)
    top = magnitude.topk(min(channels, tensor.shape[-1])).indices
    scale_by = torch.ones(tensor.shape[-1], dtype=tensor.dtype)
    scale_by[top] = factor
    return tensor * scale_by


def row_corruption(tensor: torch.Tensor, step: int, state: dict, fraction: float = 0.1) -> torch.Tensor:
    """Correlated with the content: negates the rows (tokens) that lie furthest along one fixed direction of the
    hidden space, the `fraction` of tokens a backdoor-minded attacker would pick out."""
    hidden = tensor.shape[-1]
    if state.get("direction") is None or len(state["direction"]) != hidden:
        state["direction"] = torch.randn(hidden, generator=_generator(state))
    rows = tensor.reshape(-1, hidden)
    along = rows.detach().float() @ state["direction"]
    chosen = along >= torch.quantile(along, 1 - fraction)
    return torch.where(chosen[:, None], -rows, rows).reshape(tensor.shape)


def sequence_shuffle(tensor: torch.Tensor, step: int, state: dict, fraction: float = 1.0) -> torch.Tensor:
    """Swaps whole sequences of the microbatch among `fraction` of them: every statistic of the tensor stays honest,
    only which sequence carries which content is wrong."""
    batch = tensor.shape[0]
    chosen = torch.randperm(batch, generator=_generator(state))[: max(2, round(fraction * batch))]
    order = torch.arange(batch)
    order[chosen] = chosen.roll(1)
    return tensor[order]


# --- four more, written after the fences and the sequential tests were settled (the red-team pass of
# docs/decisions.md "Four attacks from outside"): each keeps the tensor's norm, so no size test sees it


def plane_rotation(tensor: torch.Tensor, step: int, state: dict, degrees: float = 90.0, planes: int = 8):
    """Rotates the tensor by `degrees` in `planes` fixed planes, each spanned by two random hidden channels: the
    norm and every channel's spread stay, the directions the next stage reads are turned."""
    hidden = tensor.shape[-1]
    pairs = min(planes, hidden // 2)
    if pairs == 0:
        return tensor
    if state.get("planes") is None or state["planes"][1] != hidden:
        chosen = torch.randperm(hidden, generator=_generator(state))[: 2 * pairs]
        state["planes"] = (chosen.reshape(pairs, 2), hidden)
    channels = state["planes"][0]
    angle = math.radians(degrees)
    out = tensor.clone()
    a, b = tensor[..., channels[:, 0]], tensor[..., channels[:, 1]]
    out[..., channels[:, 0]] = math.cos(angle) * a - math.sin(angle) * b
    out[..., channels[:, 1]] = math.sin(angle) * a + math.cos(angle) * b
    return out


def token_shift(tensor: torch.Tensor, step: int, state: dict, shift: int = 1) -> torch.Tensor:
    """Hands each position the hidden state of the position `shift` before it (cyclically, within its sequence):
    every value is an honest one, at the wrong token. A tensor without a sequence axis is sent unchanged."""
    if tensor.dim() < 3 or shift % tensor.shape[-2] == 0:
        return tensor
    return tensor.roll(shift, dims=-2)


def cross_mix(tensor: torch.Tensor, step: int, state: dict, weight: float = 0.5) -> torch.Tensor:
    """Blends each sequence with the next one of the microbatch, `weight` of the other's, rescaled to the tensor's
    norm: tokens leak between sequences while the size of everything stays honest."""
    if tensor.shape[0] < 2:
        return tensor
    mixed = (1 - weight) * tensor + weight * tensor.roll(1, dims=0)
    return mixed * (tensor.norm() / mixed.norm().clamp_min(1e-30))


def ternary_quantize(tensor: torch.Tensor, step: int, state: dict, threshold: float = 0.7) -> torch.Tensor:
    """A lazy compressor's tensor: every element becomes -1, 0 or +1 (0 where its magnitude is under `threshold`
    times the mean magnitude), times one scale that keeps the tensor's norm."""
    magnitude = tensor.abs()
    ternary = torch.sign(tensor) * (magnitude >= threshold * magnitude.mean())
    return ternary * (tensor.norm() / ternary.norm().clamp_min(1e-30))


# stateful attacks learn from the honest tensors they see before they start or when they hold back
delay.observes_honest = True
adaptive.observes_honest = True
mixed.observes_honest = True
replay.observes_honest = True

FAMILIES: dict[str, AttackFn] = {
    "gaussian_noise": gaussian_noise,
    "lowrank_noise": lowrank_noise,
    "sparse_sign_flip": sparse_sign_flip,
    "channel_permutation": channel_permutation,
    "drift": drift,
    "replay": replay,
    "intermittent": intermittent,
    "channel_target": channel_target,
    "row_corruption": row_corruption,
    "sequence_shuffle": sequence_shuffle,
    "plane_rotation": plane_rotation,
    "token_shift": token_shift,
    "cross_mix": cross_mix,
    "ternary_quantize": ternary_quantize,
}
CATALOGUE: dict[str, AttackFn] = {**_BASIC, "mixed": mixed, "adaptive": adaptive, **FAMILIES}
BASIC_ATTACKS: tuple[str, ...] = tuple(_BASIC)


# --- stage-level attacks -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageContext:
    """What a replica computed a tensor from: its module, the microbatch's inputs (token ids on stage 0, hidden
    states elsewhere), the targets (on the last stage) and, for an input gradient, the output gradient it was given.
    Fields a caller does not know are None."""

    module: torch.nn.Module | None = None
    inputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None


class StageAttack:
    """A stage-level attack: subclass it and override what the replica changes. One instance per red-team replica
    (``seed`` is its own); ``activation`` and ``gradient`` return what to send (the tensor itself: not attacked),
    ``applies_step`` whether to apply the optimizer step of a global step. ``observes_honest``: call the hooks on
    honest tensors too (before the attack starts, and when it holds back), to learn from them."""

    observes_honest = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def activation(self, output: torch.Tensor, step: int, context: StageContext) -> torch.Tensor:
        return output

    def gradient(self, grad_input: torch.Tensor, step: int, context: StageContext) -> torch.Tensor:
        return grad_input

    def applies_step(self, step: int) -> bool:
        return True

    def recomputation(self, work: Work, step: int, context: StageContext) -> Work:
        """What it answers when a verifier asks it, as an auditor, to recompute a microbatch of another replica."""
        return work


class Stale(StageAttack):
    """Never applies its optimizer step: a free rider serving with the parameters averaging last left it, saving the
    step (and its optimizer state) while the others train."""

    def applies_step(self, step: int) -> bool:
        return False


class Skip(StageAttack):
    """Sends what passes through its layers without them: its input as its output and the output gradient as its
    input gradient (stage 0 its token embeddings; the last stage the gradient of its head and norm alone)."""

    def activation(self, output: torch.Tensor, step: int, context: StageContext) -> torch.Tensor:
        if context.inputs is None:
            return output
        if context.inputs.is_floating_point():
            return context.inputs.detach().to(output.dtype).clone()
        embed = getattr(context.module, "embed", None)
        if embed is None:
            return output
        with torch.no_grad():
            return embed(context.inputs.to(output.device)).detach().to(output.dtype)

    def gradient(self, grad_input: torch.Tensor, step: int, context: StageContext) -> torch.Tensor:
        if context.grad_output is not None:
            return context.grad_output.detach().to(grad_input.dtype).clone()
        module = context.module
        if context.inputs is None or context.targets is None or getattr(module, "head", None) is None:
            return grad_input
        with torch.enable_grad():
            hidden = context.inputs.detach().float().requires_grad_(True)
            loss = module.loss(module.head(module.norm(hidden)), context.targets)
            (grad,) = torch.autograd.grad(loss, hidden)
        return grad.detach().to(grad_input.dtype)


class Replay(StageAttack):
    """Answers with a valid tensor of another microbatch: in each direction, the one it computed just before."""

    observes_honest = True

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._previous: dict[str, torch.Tensor] = {}

    def _swap(self, direction: str, tensor: torch.Tensor) -> torch.Tensor:
        previous = self._previous.get(direction)
        self._previous[direction] = tensor.detach().clone()
        return previous if previous is not None and previous.shape == tensor.shape else tensor

    def activation(self, output: torch.Tensor, step: int, context: StageContext) -> torch.Tensor:
        return self._swap("activation", output)

    def gradient(self, grad_input: torch.Tensor, step: int, context: StageContext) -> torch.Tensor:
        return self._swap("gradient", grad_input)


class LyingAuditor(StageAttack):
    """Trains and answers honestly, and lies whenever it audits another replica: it says the stage's layers add the
    opposite of what they add (what would fail an honest claim), trying to get honest replicas banned."""

    def recomputation(self, work: Work, step: int, context: StageContext) -> Work:
        inputs, grad_output = context.inputs, context.grad_output
        output = work.output
        if output is not None:
            base = work.embedding if work.embedding is not None else inputs
            output = 2 * base - output if base is not None and base.is_floating_point() else -output
        grad_input = work.grad_input
        if grad_input is not None:
            grad_input = 2 * grad_output - grad_input if grad_output is not None else -grad_input
        return Work(output=output, grad_input=grad_input, embedding=work.embedding)


STAGE_ATTACKS: dict[str, type[StageAttack]] = {"stale": Stale, "skip": Skip, "replay": Replay, "lie": LyingAuditor}
ATTACK_NAMES: tuple[str, ...] = (*CATALOGUE, *STAGE_ATTACKS)


class StageHook:
    """One direction of a stage attack, in the shape of an attack function (``context`` added)."""

    def __init__(self, attack: StageAttack, direction: str) -> None:
        self.attack, self.direction = attack, direction
        self.observes_honest = attack.observes_honest
        self.__name__ = type(attack).__name__

    def __call__(self, tensor: torch.Tensor, step: int, state: dict, context: StageContext | None = None):
        return getattr(self.attack, self.direction)(tensor, step, context or StageContext())


def make_attack(name: str, **params) -> AttackFn:
    """The catalogue's attack `name` with some parameters fixed, e.g. make_attack("scale", sigma=2.0)."""
    if name not in CATALOGUE:
        raise AttackError(f"unknown attack {name!r}; choose one of {', '.join(CATALOGUE)} or use --attack-file")
    fn = CATALOGUE[name]
    accepted = set(inspect.signature(fn).parameters) - {"tensor", "step", "state"}
    unknown = set(params) - accepted
    if unknown:
        raise AttackError(
            f"attack {name!r} takes no parameter {', '.join(sorted(unknown))}; it takes {sorted(accepted)}"
        )
    if not params:
        return fn
    bound = partial(fn, **params)
    bound.observes_honest = getattr(fn, "observes_honest", False)
    return bound


def load_attack_file(spec: str) -> tuple[str, AttackFn | type[StageAttack]]:
    """Loads `PATH.py:NAME`, a function NAME(tensor, step, state) -> tensor or a :class:`StageAttack` subclass;
    returns (NAME, the function or class)."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise AttackError(f"--attack-file {spec!r} must look like PATH.py:NAME")
    path = Path(path_text)
    if not path.is_file():
        raise AttackError(f"--attack-file: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"sentinel_attack_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise AttackError(f"--attack-file: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the red team's code may fail in any way; say where
        raise AttackError(f"--attack-file: importing {path} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise AttackError(f"--attack-file: {path} defines no {name!r}")
    if isinstance(fn, type):
        if not issubclass(fn, StageAttack):
            raise AttackError(
                f"--attack-file: {path}:{name} is a class but not a sentinel_node.attacks.StageAttack; subclass it, "
                "or name a function (tensor, step, state) -> tensor"
            )
        try:
            fn(0)
        except Exception as e:
            raise AttackError(f"--attack-file: {path}:{name}(seed) failed: {type(e).__name__}: {e}") from None
        return name, fn
    if not callable(fn):
        raise AttackError(f"--attack-file: {path}:{name} is not a function")
    try:
        inspect.signature(fn).bind(torch.zeros(1), 0, {})
    except TypeError:
        raise AttackError(
            f"--attack-file: {path}:{name} must take (tensor, step, state), it takes {inspect.signature(fn)}"
        ) from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return name, fn


@dataclass
class Attacker:
    """An attack with a start step and a probability; `state` is the attacker's own, kept between calls."""

    fn: AttackFn
    start: int = 0
    probability: float = 1.0
    seed: int = 0
    state: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state.setdefault("seed", self.seed)
        self._rng = random.Random(self.seed)

    def __call__(
        self, tensor: torch.Tensor, step: int, context: StageContext | None = None
    ) -> tuple[torch.Tensor, bool]:
        """The tensor to send and whether it differs from the honest one; ``context`` (what the tensor was computed
        from) reaches stage-level attacks only."""
        attacking = step >= self.start and self._rng.random() < self.probability
        if not attacking and not getattr(self.fn, "observes_honest", False):
            return tensor, False
        if isinstance(self.fn, StageHook):
            out = self.fn(tensor, step, self.state, context)
        else:
            out = self.fn(tensor, step, self.state)
        if not attacking:
            return tensor, False
        if not isinstance(out, torch.Tensor):
            raise AttackError(f"attack {getattr(self.fn, '__name__', self.fn)!r} returned {type(out).__name__}")
        return out, out is not tensor

    def applies_step(self, step: int) -> bool:
        """Whether the replica applies global step ``step``'s optimizer step (a stage attack may refuse it)."""
        if not isinstance(self.fn, StageHook) or step < self.start:
            return True
        if self.probability < 1 and random.Random(f"{self.seed}:step:{step}").random() >= self.probability:
            return True
        return self.fn.attack.applies_step(step)


def attack_maker(
    name: str | None = None, file: str | None = None, settings_for: Callable[[str], object] | None = None
) -> tuple[str, Callable[[str], AttackFn]]:
    """(the attack's name, a function giving the attack to run on a direction) for a catalogue attack or a red
    team's ``PATH.py:NAME``; ``settings_for(direction)`` gives the swarm's verification settings, which the
    adaptive attack needs. AttackError for a bad name or file, raised now rather than on the first tensor."""
    if (name is None) == (file is None):
        raise AttackError("give exactly one of --attack NAME and --attack-file PATH.py:NAME")
    if file is not None:
        loaded_name, fn = load_attack_file(file)
        if isinstance(fn, type):
            return loaded_name, _stage_maker(fn)
        return loaded_name, lambda direction: fn
    if name in STAGE_ATTACKS:
        return name, _stage_maker(STAGE_ATTACKS[name])
    make_attack(name)  # an unknown name fails here, with the catalogue listed
    if name == "adaptive":
        if settings_for is None:
            raise AttackError("the adaptive attack needs the swarm's verification settings")
        return name, lambda direction: make_attack(name, settings=settings_for(direction))
    return name, lambda direction: make_attack(name)


def _stage_maker(cls: type[StageAttack]) -> Callable[[str], AttackFn]:
    """A maker for a stage attack: :func:`arm` builds one instance per replica and hooks both directions to it."""

    def make(direction: str, attack: StageAttack | None = None) -> AttackFn:
        return StageHook(attack if attack is not None else cls(), direction)

    make.stage_attack = cls
    return make


def sends(direction: str, stage: int, n_stages: int) -> bool:
    """Whether stage ``stage`` sends tensors in ``direction``: the last stage sends no activation, the first no
    gradient."""
    return not ((direction == "activation" and stage == n_stages - 1) or (direction == "gradient" and stage == 0))


def arm(
    make: Callable[[str], AttackFn],
    target: str,
    stage: int,
    n_stages: int,
    *,
    start: int = 0,
    probability: float = 1.0,
    seed: str = "0",
) -> dict[str, Attacker]:
    """An :class:`Attacker` per direction that ``target`` names ("activation", "gradient" or "both") and stage
    ``stage`` sends, each seeded from ``seed`` and its direction: what a red-team stage replica runs, in the
    simulator and on the network alike."""
    if target not in (*DIRECTIONS, "both"):
        raise AttackError(f"attack target {target!r}: choose activation, gradient or both")
    if not 0 < probability <= 1:
        raise AttackError(f"--attack-probability must be in (0, 1], got {probability}")
    directions = DIRECTIONS if target == "both" else (target,)
    stage_attack = getattr(make, "stage_attack", None)
    shared = stage_attack(zlib.crc32(f"{seed}:stage".encode())) if stage_attack is not None else None
    return {
        direction: Attacker(
            make(direction) if shared is None else make(direction, shared),
            start=start,
            probability=probability,
            seed=zlib.crc32(f"{seed}:{direction}".encode()),
        )
        for direction in directions
        if sends(direction, stage, n_stages)
    }


def lies_in_audits(attackers: dict[str, Attacker]) -> Callable[[Work, int, StageContext], Work] | None:
    """What a red-team replica answers to recompute requests, given the honest recomputation (None: the truth)."""
    hooks = [a.fn for a in attackers.values() if isinstance(a.fn, StageHook)]
    if not hooks:
        return None
    attack, start = hooks[0].attack, min(a.start for a in attackers.values())
    return lambda work, step, context: attack.recomputation(work, step, context) if step >= start else work


def refuses_steps(attackers: dict[str, Attacker]) -> Callable[[int], bool] | None:
    """For :attr:`StageWorker.applies_step`: whether a red-team replica applies each optimizer step (None for a
    replica whose attackers never refuse one)."""
    if not any(isinstance(a.fn, StageHook) for a in attackers.values()):
        return None
    return lambda step: all(a.applies_step(step) for a in attackers.values())
