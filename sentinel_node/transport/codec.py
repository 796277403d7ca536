"""Tensors to and from hivemind's wire form (``runtime_pb2.Tensor``), checked before anything is allocated.

Every header field of an incoming tensor comes from a peer that may be hostile: the compression, dtype and shape
are checked against allow-lists and the size limit, and the buffer length against what they imply, before a
single element is decoded. Every failure is a :class:`MalformedTensorError` naming the tensor and the problem.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType
from hivemind.proto.runtime_pb2 import Tensor as WireTensor

from sentinel_node.transport.errors import MalformedTensorError

COMPRESSIONS: dict[str, int] = {
    "none": CompressionType.NONE,
    "float16": CompressionType.FLOAT16,
    "blockwise_8bit": CompressionType.BLOCKWISE_8BIT,
}
_COMPRESSION_NAMES = {code: name for name, code in COMPRESSIONS.items()}
ALLOWED_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}
_FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})

# hivemind's BLOCKWISE_8BIT layout: int64 n_absmax, int64 n_code, float32 absmax[n_absmax], float32 code[n_code],
# uint8 indices[numel], one absmax per block of 4096 values.
BLOCKWISE_BLOCK = 4096
BLOCKWISE_CODE_LEN = 256
# Below one block, 8-bit costs more than it saves (a 1 KiB codebook) and would blur scalars such as a loss.
BLOCKWISE_MIN_NUMEL = BLOCKWISE_BLOCK


@dataclass(frozen=True)
class TensorLimits:
    """What this node accepts from the network, per message."""

    max_tensor_mib: float = 64.0
    max_tensors: int = 16
    max_ndim: int = 8

    @property
    def max_tensor_bytes(self) -> int:
        return int(self.max_tensor_mib * 2**20)


@dataclass(frozen=True)
class TensorSpec:
    """An expected tensor: its dtype and shape, with None for a dimension that may be anything."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype


@functools.cache
def bitsandbytes_problem() -> str | None:
    """Why bitsandbytes cannot quantize here, or None when it can (imported once, on first use)."""
    try:
        importlib.import_module("bitsandbytes.functional")
    except Exception as e:  # an ImportError, or a broken install failing in its own import code
        return f"{type(e).__name__}: {e}"
    return None


def resolve_compression(name: str) -> int:
    """The ``CompressionType`` for a config name; a ValueError at config time if it cannot work on this node."""
    if name not in COMPRESSIONS:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(COMPRESSIONS)}")
    if name == "blockwise_8bit" and (problem := bitsandbytes_problem()) is not None:
        raise ValueError(
            "compression 'blockwise_8bit' quantizes with bitsandbytes, which cannot be imported here "
            f"({problem}); install it (pip install 'sentinel-node[gpu]') or set pipeline.compression to 'float16'"
        )
    return COMPRESSIONS[name]


def serialize_tensors(tensors: Sequence[torch.Tensor], compression: int, limits: TensorLimits) -> list[WireTensor]:
    """Wire form of ``tensors``; a tensor this node would itself refuse to receive is a MalformedTensorError."""
    if len(tensors) > limits.max_tensors:
        raise MalformedTensorError(f"{len(tensors)} tensors in one message, over the limit of {limits.max_tensors}")
    protos = []
    for index, tensor in enumerate(tensors):
        tensor = tensor.detach().cpu().contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in ALLOWED_DTYPES:
            raise MalformedTensorError(f"tensor {index}: dtype {dtype} cannot be sent (allowed: {_allowed()})")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > limits.max_tensor_bytes or tensor.dim() > limits.max_ndim:
            raise MalformedTensorError(
                f"tensor {index}: shape {tuple(tensor.shape)} ({nbytes / 2**20:.1f} MiB) exceeds this node's limits "
                f"({limits.max_tensor_mib:g} MiB, {limits.max_ndim} dimensions)"
            )
        protos.append(_serialize(tensor, _compression_for(tensor, dtype, compression)))
    return protos


def _serialize(tensor: torch.Tensor, compression: int) -> WireTensor:
    if compression == CompressionType.NONE and tensor.dtype == torch.bfloat16:
        # hivemind widens bfloat16 to float32 on the wire unless USE_LEGACY_BFLOAT16=0 is set before it is first
        # imported (a process-wide switch a library cannot rely on): bfloat16 goes as its own 2 bytes, which
        # hivemind's own decoder reads back
        return WireTensor(
            compression=CompressionType.NONE,
            buffer=tensor.view(torch.int16).numpy().tobytes(),
            size=tensor.shape,
            dtype="bfloat16",
        )
    return serialize_torch_tensor(tensor, compression)


def _compression_for(tensor: torch.Tensor, dtype: str, compression: int) -> int:
    # Lossy compression is for floating-point payloads only: token ids and tiny tensors go as they are.
    if dtype not in _FLOAT_DTYPES or tensor.numel() == 0:
        return CompressionType.NONE
    if compression == CompressionType.FLOAT16:
        return CompressionType.FLOAT16 if dtype == "float32" else CompressionType.NONE
    if compression == CompressionType.BLOCKWISE_8BIT:
        return CompressionType.BLOCKWISE_8BIT if tensor.numel() >= BLOCKWISE_MIN_NUMEL else CompressionType.NONE
    return CompressionType.NONE


def check_header(index: int, proto: WireTensor, limits: TensorLimits) -> int:
    """Checks compression, dtype and declared shape; returns the largest buffer the header allows, in bytes."""
    if proto.compression not in _COMPRESSION_NAMES:
        raise MalformedTensorError(
            f"tensor {index}: compression {_name_of(proto.compression)} is not accepted (allowed: "
            f"{', '.join(COMPRESSIONS)})"
        )
    dtype = proto.dtype
    if dtype not in ALLOWED_DTYPES:
        raise MalformedTensorError(f"tensor {index}: dtype {dtype[:40]!r} is not accepted (allowed: {_allowed()})")
    if proto.compression != CompressionType.NONE and dtype not in _FLOAT_DTYPES:
        raise MalformedTensorError(f"tensor {index}: {dtype} cannot be {_COMPRESSION_NAMES[proto.compression]}")
    if proto.compression == CompressionType.FLOAT16 and dtype == "bfloat16":
        raise MalformedTensorError(f"tensor {index}: bfloat16 cannot be float16-compressed")
    shape = tuple(proto.size)
    if len(shape) > limits.max_ndim:
        raise MalformedTensorError(f"tensor {index}: {len(shape)} dimensions, over the limit of {limits.max_ndim}")
    # Every dimension must fit the limit on its own: an empty tensor (a 0 in its shape) declares 0 bytes whatever its
    # other dimensions, and torch refuses shapes whose product overflows 64 bits (RuntimeError; found by fuzzing).
    if shape and max(shape) * ALLOWED_DTYPES[dtype] > limits.max_tensor_bytes:
        raise MalformedTensorError(
            f"tensor {index}: dimension {max(shape)} of shape {shape} is over the {limits.max_tensor_mib:g} MiB limit"
        )
    declared = math.prod(shape) * ALLOWED_DTYPES[dtype]
    if declared > limits.max_tensor_bytes:
        raise MalformedTensorError(
            f"tensor {index}: declared shape {shape} is {declared / 2**20:.0f} MiB, "
            f"over the {limits.max_tensor_mib:g} MiB limit"
        )
    return max(_wire_sizes(proto))


def _wire_sizes(proto: WireTensor) -> tuple[int, ...]:
    numel = math.prod(proto.size)
    if proto.compression == CompressionType.FLOAT16:
        return (numel * 2,)
    if proto.compression == CompressionType.BLOCKWISE_8BIT:
        return (16 + 4 * math.ceil(numel / BLOCKWISE_BLOCK) + 4 * BLOCKWISE_CODE_LEN + numel,)
    return (numel * ALLOWED_DTYPES[proto.dtype],)  # bfloat16 too: 2 bytes, as serialize_tensors sends it


def deserialize_tensors(protos: Sequence[WireTensor], limits: TensorLimits) -> list[torch.Tensor]:
    """Decodes whole (already re-assembled) wire tensors after checking each; never requires grad."""
    if len(protos) > limits.max_tensors:
        raise MalformedTensorError(f"{len(protos)} tensors in one message, over the limit of {limits.max_tensors}")
    tensors = []
    for index, proto in enumerate(protos):
        check_header(index, proto, limits)
        if len(proto.buffer) not in _wire_sizes(proto):
            raise MalformedTensorError(
                f"tensor {index}: buffer of {len(proto.buffer)} bytes does not match shape {tuple(proto.size)}, "
                f"{proto.dtype}, {_COMPRESSION_NAMES[proto.compression]} (expected "
                f"{' or '.join(map(str, _wire_sizes(proto)))})"
            )
        tensors.append(_decode(index, proto))
    return tensors


def _decode(index: int, proto: WireTensor) -> torch.Tensor:
    if proto.compression == CompressionType.BLOCKWISE_8BIT:
        return _dequantize_blockwise(index, proto)
    proto.requires_grad = False  # a peer must not decide whether our tensors join an autograd graph
    tensor = deserialize_torch_tensor(proto)
    if proto.compression == CompressionType.FLOAT16 and proto.dtype == "float16":
        tensor = tensor.clone()  # a view of the read-only message buffer otherwise
    return tensor


def _dequantize_blockwise(index: int, proto: WireTensor) -> torch.Tensor:
    # hivemind's own extract fails under numpy 2 (int() of a 1-element array) and needs bitsandbytes; the format
    # is simple enough to read in torch, which lets nodes without bitsandbytes receive 8-bit tensors.
    buffer, shape = proto.buffer, tuple(proto.size)
    numel = math.prod(shape)
    n_absmax, n_code = (int(v) for v in np.frombuffer(buffer, dtype=np.int64, count=2))
    if n_absmax != math.ceil(numel / BLOCKWISE_BLOCK) or n_code != BLOCKWISE_CODE_LEN:
        raise MalformedTensorError(
            f"tensor {index}: blockwise header ({n_absmax} scales, {n_code} codes) does not fit shape {shape}"
        )
    absmax = torch.from_numpy(np.frombuffer(buffer, dtype=np.float32, count=n_absmax, offset=16).copy())
    code = torch.from_numpy(np.frombuffer(buffer, dtype=np.float32, count=n_code, offset=16 + 4 * n_absmax).copy())
    offset = 16 + 4 * (n_absmax + n_code)
    indices = torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8, count=numel, offset=offset).astype(np.int64))
    values = code[indices] * absmax.repeat_interleave(BLOCKWISE_BLOCK)[:numel]
    return values.reshape(shape).to(getattr(torch, proto.dtype))


def check_tensors(
    tensors: Sequence[torch.Tensor], expect: Sequence[TensorSpec] | None = None, require_finite: bool = False
) -> None:
    """Raises MalformedTensorError unless ``tensors`` match ``expect`` (count, dtype, shape) and are finite."""
    if expect is not None:
        if len(tensors) != len(expect):
            raise MalformedTensorError(f"expected {len(expect)} tensors, got {len(tensors)}")
        for index, (tensor, spec) in enumerate(zip(tensors, expect, strict=True)):
            if tensor.dtype != spec.dtype:
                raise MalformedTensorError(f"tensor {index}: dtype {tensor.dtype}, expected {spec.dtype}")
            shape = tuple(tensor.shape)
            fits = len(shape) == len(spec.shape) and all(
                w in (None, s) for s, w in zip(shape, spec.shape, strict=False)
            )
            if not fits:
                wanted = "(" + ", ".join("*" if w is None else str(w) for w in spec.shape) + ")"
                raise MalformedTensorError(f"tensor {index}: shape {shape}, expected {wanted}")
    if require_finite:
        for index, tensor in enumerate(tensors):
            if tensor.is_floating_point() and not (finite := torch.isfinite(tensor)).all():
                bad = int((~finite).sum())
                raise MalformedTensorError(f"tensor {index}: {bad} of {tensor.numel()} values are NaN or infinite")


def _allowed() -> str:
    return ", ".join(ALLOWED_DTYPES)


def _name_of(code: int) -> str:
    try:
        return CompressionType.Name(code).lower()
    except ValueError:
        return f"code {code}"
