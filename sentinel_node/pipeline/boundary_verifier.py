"""A verifier's checking side: one monitor per (boundary, direction) it serves and one strike ledger for all."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from sentinel_node.config import VerificationConfig
from sentinel_node.verification import BoundaryMonitor, SenderStrikes, Verdict, VerdictKind
from sentinel_node.verification.excess import LossGate
from sentinel_node.verification.passage import Given

# senders remembered per monitor, to tell when every one of them has left
MAX_SENDERS = 64


class BoundaryVerifier:
    """Checks activations going forward and gradients coming back across the boundaries it serves.

    Boundary k sits between stage k and stage k + 1: activations there are sent by stage k replicas, gradients by
    stage k + 1 replicas. With `enabled=False` it is a plain relay (for overhead measurements and undefended runs).
    `dtype` is the swarm's wire dtype (`pipeline.wire_dtype`); `device` where the statistics are computed.
    `private_seed` seeds what it keeps from the stages it judges (the coherence test's projection); None, as on the
    network, draws it from the OS (the simulator passes one, to be reproducible).

    The verifier of the last boundary also keeps the loss gate (`gate`, :mod:`sentinel_node.verification.excess`)
    when `gate_boundary` is among its boundaries: it names the last stage the loss above which a microbatch's update
    is held back (never, with `loss_gate` 0), and the loss each microbatch's text predicts.
    """

    def __init__(
        self,
        config: VerificationConfig,
        boundaries: Iterable[int],
        hidden_size: int,
        expected_shape: tuple[int, ...] | None,
        seed: int,
        enabled: bool = True,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        gate_boundary: int | None = None,
        vocab: int | None = None,
        private_seed: int | None = None,
    ):
        self.enabled = enabled
        self.ledger = SenderStrikes(
            config.strike_limit,
            config.forgive_after,
            config.blatant_limit,
            config.blatant_forgive_after,
            config.max_senders,
            config.probation,
            config.forgive_steps,
            config.repeat_within,
        )

        def monitor(boundary: int, direction: str) -> BoundaryMonitor:
            settings = config.monitor_settings(direction, seed, boundary)
            return BoundaryMonitor(
                dataclasses.replace(settings, private_seed=private_seed),
                hidden_size=hidden_size,
                expected_shape=expected_shape,
                dtype=dtype,
                ledger=self.ledger,
                device=device,
            )

        self._monitor = monitor
        self.monitors: dict[tuple[int, str], BoundaryMonitor] = {
            (boundary, direction): monitor(boundary, direction)
            for boundary in boundaries
            for direction in ("activation", "gradient")
        }
        # the senders each monitor learned from lately (at most MAX_SENDERS, the latest kept)
        self.senders: dict[tuple[int, str], dict[str, None]] = {key: {} for key in self.monitors}
        # with loss_gate 0 it holds nothing back, and still predicts each microbatch's loss for the loss evidence
        gated = gate_boundary is not None and gate_boundary in self.boundaries and vocab is not None
        self._gate = LossGate(vocab, config.gate_settings()) if gated else None

    @property
    def gate(self) -> LossGate | None:
        """The loss gate, where this verifier keeps one and checks (a plain relay gates nothing)."""
        return self._gate if self.enabled else None

    @property
    def boundaries(self) -> list[int]:
        return sorted({boundary for boundary, _ in self.monitors})

    def check(
        self,
        boundary: int,
        direction: str,
        tensor: torch.Tensor,
        sender: str,
        tainted: bool,
        content: int | None = None,
        step: int | None = None,
        given: Given | None = None,
    ) -> Verdict:
        """`content` names the microbatch's tokens (a hash of its targets): two tensors of the same content may be
        near-copies of each other (a retried microbatch, duplicate computation), of different content never. `step`
        is the global step as this verifier knows it (the swarm's estimate, never the sender's word): statistical
        flags of one step give a sender one strike at most. `given`, for a gradient: the output gradient its sender
        was given (rows of it), which the input gradient must follow through the residual stream."""
        monitor = self.monitors.get((boundary, direction))
        if monitor is None:
            raise KeyError(f"this verifier does not serve boundary {boundary} ({direction})")
        if not self.enabled:
            return Verdict(VerdictKind.SKIPPED, tensor)
        seen = self.senders[(boundary, direction)]
        seen.pop(sender, None)
        seen[sender] = None
        while len(seen) > MAX_SENDERS:
            seen.pop(next(iter(seen)))
        return monitor.check(tensor, sender, tainted=tainted, content=content, step=step, given=given)

    def restart_if_replaced(self, boundary: int, direction: str, live: set[str]) -> bool:
        """Starts the monitor of (``boundary``, ``direction``) afresh (a new warm-up) when none of the senders it
        learned from is among the ``live`` replicas of the sending stage and another is: the stage is served by a
        replica that took over without its state (its last replica died, and one came to cover it with fresh
        weights), whose tensors no baseline of the old ones describes. Strikes and bans are kept."""
        key = (boundary, direction)
        seen = self.senders.get(key)
        if not seen or not live or set(seen) & live:
            return False
        self.monitors[key] = self._monitor(boundary, direction)
        self.senders[key] = {}
        return True

    def suspicious(self, sender: str, boundary: int, direction: str, share: float) -> bool:
        """Whether ``sender``'s evidence in the peer, coherence or drift test of (``boundary``, ``direction``) has
        reached ``share`` of its limit: it has been consistently unlike its peers lately, short of an alarm. Worth a
        recomputation, never a strike (an honest sender whose replica drifted from its peers passes its audits)."""
        monitor = self.monitors.get((boundary, direction))
        if monitor is None or share <= 0:
            return False
        if monitor.peers.enabled and monitor.peers.evidence(sender) >= share * monitor.peers.limit:
            return True
        return any(
            test.enabled and test.evidence(sender) >= share * test.limit for test in (monitor.coherence, monitor.drift)
        )

    def is_banned(self, sender: str) -> bool:
        return self.ledger.is_banned(sender)
