"""Step 3 of SENTINEL: distances between a tensor's profile and the EMA baseline's.

Each distance is scale-free (normalized by the baseline), so one threshold rule serves every boundary and both
directions, and a slow change of scale during training does not look like an attack.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sentinel_node.verification.profile import Profile

_EPS = 1e-12


def l1_distance(profile: Profile, reference: Profile) -> float:
    """Mean absolute difference of the per-channel means, relative to the baseline's mean magnitude."""
    scale = reference.absmean.mean() + _EPS
    return float((profile.mean - reference.mean).abs().mean() / scale)


def l2_distance(profile: Profile, reference: Profile) -> float:
    """Euclidean distance of the (mean, mean-absolute) vectors, relative to the baseline's norm.

    Mean-absolute rather than RMS: a few tokens with outsized gradients swing an honest tensor's RMS by 10x.
    """
    mine = torch.cat([profile.mean, profile.absmean])
    ref = torch.cat([reference.mean, reference.absmean])
    return float((mine - ref).norm() / (ref.norm() + _EPS))


def scale_shift(profile: Profile, reference: Profile) -> float:
    """Mean over channels of |log| of the ratio of mean-absolute values: zeros, noise of one global scale, and
    rescaling all move it, while honest channel scales are stable from one microbatch to the next.
    """
    eps = 1e-3 * reference.absmean.mean() + _EPS
    return float(((profile.absmean + eps) / (reference.absmean + eps)).log().abs().mean())


def sign_flip_ratio(profile: Profile, reference: Profile) -> float:
    """Share of channels whose mean has the opposite sign of the baseline's, each weighted by how far the
    baseline's mean stands from zero in units of its spread (a channel centred on zero flips by chance).
    """
    std = (reference.rms.square() - reference.mean.square()).clamp_min(0).sqrt()
    weight = reference.mean.abs() / (std + _EPS)
    flipped = (torch.sign(profile.mean) * torch.sign(reference.mean) < 0).float()
    return float((weight * flipped).sum() / (weight.sum() + _EPS))


def sliced_wasserstein(profile: Profile, reference: Profile) -> float:
    """Mean over projections of the 1-D Wasserstein distance between quantile functions, relative to their spread."""
    spread = (reference.quantiles[:, -1] - reference.quantiles[:, 0]).mean() + _EPS
    return float((profile.quantiles - reference.quantiles).abs().mean() / spread)


def spectral_shift(profile: Profile, reference: Profile) -> float:
    """Relative loss of the share of energy in the top singular values: noise and random signs flatten spectra.

    Signed: a tensor that concentrates more than the reference (honest tensors often do: a few tokens dominate)
    scores below zero, and attacks that destroy structure never do. Only the high side is ever over the fence (its
    floor is positive), but the low side stays in the fence's window: clamped at zero, the many honest rises made
    the window mostly zeros, its quartiles zero, and the fence fell onto its floor, where honest noise crossed it
    (a stage of one replica was banned within ten steps; docs/decisions.md).
    """
    drop = reference.spectral_share - profile.spectral_share
    return float(drop / (reference.spectral_share + _EPS))


def norm_shift(profile: Profile, reference: Profile) -> float:
    """|log| of the ratio of the tensor's RMS to the baseline's: zeros, rescaling and explosions."""
    return float((profile.log_rms - reference.log_rms).abs())


def opposed_rows(profile: Profile, reference: Profile) -> float:
    """Rise of the share of rows (tokens) that point against the tensor's own mean row, over the reference's.

    A residual stream's rows share a direction, so an honest activation has next to none pointing against it;
    negating some tokens (a content-aware corruption of the rows a backdoor would pick) leaves every per-channel
    statistic near honest but adds exactly their share here. Signed, like `spectral_shift`: only a rise is ever
    over the fence. Activations only: gradients' rows share no direction (an honest share near one half).
    """
    return float(profile.opposed - reference.opposed)


METRICS: dict[str, Callable[[Profile, Profile], float]] = {
    "l1": l1_distance,
    "l2": l2_distance,
    "norm": norm_shift,
    "scale": scale_shift,
    "sign_flip": sign_flip_ratio,
    "wasserstein": sliced_wasserstein,
    "spectral": spectral_shift,
    "opposed": opposed_rows,
}
# judged by their fences but not ranked against peers: most honest scores tie at zero, and ranks of ties say nothing
FENCE_ONLY = ("opposed",)
# statistics of the rows' shared direction, which only activations have (docs/decisions.md)
ACTIVATION_ONLY = ("opposed",)
# never blatant: honest scores are zeros with rare content-driven spikes the fence cannot learn (an honest replica's
# share at a deep boundary 5.3 times over its fence: docs/decisions.md), so a crossing weighs one strike however far
SPIKY = ("opposed",)
