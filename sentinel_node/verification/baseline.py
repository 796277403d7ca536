"""Step 2 of SENTINEL: the momentum (EMA) baseline, and the clean replacement built from it."""

from __future__ import annotations

import torch

from sentinel_node.verification.profile import Profile


class EmaBaseline:
    """An exponential moving average of profiles: accepted ones, and where it is the reference (fewer than three
    senders) moderately flagged ones too; never a blatant one (see the monitor)."""

    def __init__(self, beta: float):
        self.beta = beta
        self.reference: Profile | None = None
        self.updates = 0

    def update(self, profile: Profile) -> None:
        self.reference = profile if self.reference is None else self.reference.blend(profile, self.beta)
        self.updates += 1

    def replacement(self, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        """A tensor of `shape` whose channels have the baseline's mean and spread (the "clean bowl").

        The profile's channel statistics are of the tensor divided by its RMS; `log_rms` brings back its magnitude.
        """
        if self.reference is None:
            return torch.zeros(shape, dtype=dtype)
        mean, rms = self.reference.mean, self.reference.rms
        std = (rms.square() - mean.square()).clamp_min(0).sqrt()
        noise = torch.randn(shape, generator=generator)
        return ((mean + std * noise) * self.reference.log_rms.exp()).to(dtype)
