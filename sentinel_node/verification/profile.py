"""Step 1 of SENTINEL: reduce a boundary tensor to a profile that does not depend on which tokens it carries."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Profile:
    """Statistics of a (batch, tokens, hidden) tensor over its batch x tokens rows.

    All but `log_rms` are taken after dividing the tensor by its own RMS: the shape of a tensor tells an attack
    from honest work, while its overall magnitude swings with the loss of the text it carries (one metric watches
    that alone).
    """

    mean: torch.Tensor  # (hidden,) per-channel mean
    absmean: torch.Tensor  # (hidden,) per-channel mean absolute value
    rms: torch.Tensor  # (hidden,) per-channel root mean square
    quantiles: torch.Tensor  # (projections, levels) quantiles of the rows projected on fixed random directions
    spectral_share: torch.Tensor  # () share of the rows' energy in their top singular values
    log_rms: torch.Tensor  # () log of the whole tensor's root mean square

    def blend(self, other: Profile, beta: float) -> Profile:
        """beta * self + (1 - beta) * other, field by field (the EMA update)."""
        return Profile(
            *(beta * mine + (1 - beta) * theirs for mine, theirs in zip(self.fields(), other.fields(), strict=True))
        )

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.mean, self.absmean, self.rms, self.quantiles, self.spectral_share, self.log_rms


class Profiler:
    """Computes profiles with projection directions seeded by the swarm, so every verifier uses the same ones."""

    def __init__(
        self, hidden_size: int, n_projections: int, n_quantiles: int, spectral_rank: int, seed: int, row_clip: float
    ):
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(hidden_size, n_projections, generator=generator, dtype=torch.float64)
        self.directions = (directions / directions.norm(dim=0, keepdim=True)).float()
        # the extreme tails are left out: they are a handful of tokens and move with the text, not the sender
        self.levels = torch.linspace(0.02, 0.98, n_quantiles)
        self.spectral_rank = spectral_rank
        self.row_clip = row_clip

    def __call__(self, tensor: torch.Tensor) -> Profile:
        rows = tensor.detach().reshape(-1, tensor.shape[-1]).float()
        # a few tokens of surprising text carry gradients 10x the rest; clipped, they no longer swing the profile,
        # while an attack, which touches every token, shows through unchanged
        norms = rows.norm(dim=1, keepdim=True)
        cap = self.row_clip * norms.median().clamp_min(1e-30)
        rows = rows * (cap / norms.clamp_min(1e-30)).clamp(max=1.0)
        rms = rows.square().mean().sqrt()
        rows = rows / rms.clamp_min(1e-30)
        projected = rows @ self.directions
        quantiles = torch.quantile(projected, self.levels, dim=0).T.contiguous()
        # eigenvalues of the (hidden x hidden) Gram matrix are the squared singular values, at a fraction of an SVD
        energy = torch.linalg.eigvalsh(rows.T.double() @ rows.double()).clamp_min(0)
        top = energy[-self.spectral_rank :].sum()
        share = (top / energy.sum().clamp_min(1e-30)).float()
        return Profile(
            mean=rows.mean(0),
            absmean=rows.abs().mean(0),
            rms=rows.square().mean(0).sqrt(),
            quantiles=quantiles,
            spectral_share=share,
            log_rms=rms.clamp_min(1e-30).log(),
        )
