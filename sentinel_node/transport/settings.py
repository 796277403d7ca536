"""The transport's knobs, checked once when a role starts (not when the first tensor is sent)."""

from __future__ import annotations

from dataclasses import dataclass

from sentinel_node.transport.codec import TensorLimits, resolve_compression

# The daemon's persistent connection caps a whole unary message at 4 MiB; leave room for metadata and framing.
UNARY_MAX_BYTES = 3 * 2**20 + 2**19


@dataclass(frozen=True)
class TransportSettings:
    """How this node sends tensors and what it accepts.

    Build it from ``PipelineConfig``: ``TransportSettings(compression=cfg.compression,
    max_tensor_mib=cfg.max_tensor_mib)``. Construction raises ValueError for a compression this node cannot use.
    """

    compression: str = "none"
    max_tensor_mib: float = 64.0
    max_tensors: int = 16
    # Measured on loopback: streaming already wins at 128 KiB (3.8 vs 5.5 ms) and by 2-3x at 1-2 MiB.
    stream_threshold_bytes: int = 128 * 2**10
    chunk_bytes: int = 256 * 2**10
    hop_margin_s: float = 0.2
    max_call_s: float = 300.0
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        resolve_compression(self.compression)
        if self.max_tensor_mib <= 0 or self.max_tensors < 1:
            raise ValueError("max_tensor_mib must be positive and max_tensors at least 1")
        if not 0 <= self.stream_threshold_bytes <= UNARY_MAX_BYTES:
            raise ValueError(f"stream_threshold_bytes must be between 0 and {UNARY_MAX_BYTES} (the unary cap)")
        if not 2**16 <= self.chunk_bytes <= 2**24:
            raise ValueError("chunk_bytes must be between 64 KiB and 16 MiB")
        if self.hop_margin_s < 0 or self.max_call_s <= self.hop_margin_s or self.drain_timeout_s <= 0:
            raise ValueError("need 0 <= hop_margin_s < max_call_s and a positive drain_timeout_s")

    @property
    def compression_type(self) -> int:
        return resolve_compression(self.compression)

    @property
    def limits(self) -> TensorLimits:
        return TensorLimits(max_tensor_mib=self.max_tensor_mib, max_tensors=self.max_tensors)
