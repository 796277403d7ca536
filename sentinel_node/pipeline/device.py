"""Where a stage computes and how: the device, the optimizer and the mixed-precision mode.

Each choice is a plain function of its inputs (a device, the pipeline config, what this machine offers), so the
GPU decisions can be tested on a machine without one.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from hivemind.utils.logging import get_logger

if TYPE_CHECKING:
    from sentinel_node.config import PipelineConfig

logger = get_logger(__name__)

MixedPrecision = Literal["auto", "bf16", "off"]

TORCH_ADAMW = "torch.AdamW"
BNB_ADAMW8BIT = "bitsandbytes.AdamW8bit"

_NO_CUDA_HINT = "pass --device cpu or run the image with --gpus all"


class DeviceError(ValueError):
    """A requested device or precision is not available here; the message says what to do instead."""


def resolve_device(requested: str | torch.device | None) -> torch.device:
    """The device a stage runs on: None or "auto" -> CUDA when one is visible, else the CPU.

    An explicit CUDA device that this machine does not have raises :class:`DeviceError` rather than failing later
    inside the first forward pass.
    """
    if is_auto(requested):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested.strip() if isinstance(requested, str) else requested)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"unknown device {requested!r} ({e}); pass --device auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {requested}: no CUDA device is visible; {_NO_CUDA_HINT}")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(
                f"--device {requested}: this machine shows {count} CUDA device(s) (0..{count - 1}); "
                "pass --device cuda:0 or set CUDA_VISIBLE_DEVICES"
            )
    return device


def is_auto(requested: str | torch.device | None) -> bool:
    """Whether `requested` leaves the choice to :func:`resolve_device` (None or "auto", any case)."""
    return requested is None or (isinstance(requested, str) and requested.strip().lower() == "auto")


def cpu_fallback_message(compute: str) -> str:
    """What a stage logs when ``--device auto`` found no CUDA device: why, how it computes instead (`compute`, e.g.
    "fp32, torch.AdamW") and how to get the GPU.

    Two causes look alike from outside: a CPU-only torch build, and a CUDA build that sees no GPU (in a container:
    no ``--gpus all``, or no NVIDIA Container Toolkit on the host). The message names which one it is.
    """
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
        fix = "install torch's CUDA build or use the sentinel-node:cuda image"
    else:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
        fix = "run the container with --gpus all (the NVIDIA Container Toolkit on the host) or check nvidia-smi"
    return (
        f"--device auto: {why}; computing on the CPU ({compute}). For the GPU, {fix}; --device cpu makes it explicit"
    )


def make_optimizer(
    params: Iterable[torch.nn.Parameter], pipeline: PipelineConfig, device: torch.device
) -> tuple[torch.optim.Optimizer, str]:
    """The stage's optimizer and its name: bitsandbytes' 8-bit AdamW on CUDA when it imports, else torch AdamW.

    8-bit states cut the optimizer's memory by ~75%, which decides whether a stage fits a home GPU; bitsandbytes'
    kernels need CUDA, so the CPU always gets torch AdamW. A GPU without bitsandbytes still trains, with a warning.
    """
    params = list(params)
    if torch.device(device).type == "cuda":
        try:
            bnb = importlib.import_module("bitsandbytes")
        except Exception as e:  # a broken CUDA install raises more than ImportError
            logger.warning(
                f"bitsandbytes is unavailable ({type(e).__name__}: {e}); using torch AdamW with 32-bit states on "
                "CUDA, which needs ~4x the optimizer memory (install the gpu extra: pip install 'sentinel-node[gpu]')"
            )
        else:
            optimizer = bnb.optim.AdamW8bit(params, lr=pipeline.lr, weight_decay=pipeline.weight_decay)
            return optimizer, BNB_ADAMW8BIT
    return torch.optim.AdamW(params, lr=pipeline.lr, weight_decay=pipeline.weight_decay), TORCH_ADAMW


@dataclass(frozen=True)
class Precision:
    """How a stage computes: `autocast` is the dtype of forward/backward under autocast, None for plain fp32."""

    autocast: torch.dtype | None

    @property
    def enabled(self) -> bool:
        return self.autocast is not None

    @property
    def name(self) -> str:
        return "fp32" if self.autocast is None else str(self.autocast).removeprefix("torch.")


def choose_precision(device_type: str, mode: MixedPrecision = "auto", cuda_bf16: bool | None = None) -> Precision:
    """The compute precision for a device type ("cuda", "cpu", ...) and the config's `pipeline.mixed_precision`.

    "auto": bf16 autocast on a GPU that supports bf16, fp32 elsewhere (bf16 on a CPU is slower than fp32 there).
    "bf16": bf16 autocast wherever it runs (the CPU included, which makes the path testable); a GPU without bf16
    raises :class:`DeviceError`. "off": fp32. `cuda_bf16` overrides the query of this machine's GPU (for tests).
    """
    if mode == "off":
        return Precision(None)
    if mode not in ("auto", "bf16"):
        raise DeviceError(f"pipeline.mixed_precision={mode!r}: expected auto, bf16 or off")
    if device_type == "cuda":
        supported = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        if supported:
            return Precision(torch.bfloat16)
        if mode == "bf16":
            raise DeviceError(
                "pipeline.mixed_precision=bf16 but this GPU does not support bfloat16 (it needs compute capability "
                "8.0+, e.g. an RTX 30xx or newer); set pipeline.mixed_precision to auto or off"
            )
        return Precision(None)
    if mode == "auto":
        return Precision(None)
    if device_type == "cpu":
        return Precision(torch.bfloat16)
    raise DeviceError(f"pipeline.mixed_precision=bf16 is not supported on {device_type}; set it to auto or off")


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now (a GPU's free memory, the CPU's available RAM), None where unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        with contextlib.suppress(ValueError, OSError, AttributeError):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def will_use_8bit(device: torch.device) -> bool:
    """Whether :func:`make_optimizer` would pick bitsandbytes' 8-bit AdamW here (without importing it)."""
    return device.type == "cuda" and importlib.util.find_spec("bitsandbytes") is not None
