"""Step 1 of SENTINEL: reduce a boundary tensor to a profile that does not depend on which tokens it carries.

Every statistic costs time linear in the tensor's size, and the tensor is never copied whole: a verifier must keep
up with the network at real widths. One pass over the rows, a slice at a time so that each slice is read from
memory once, takes the row norms, the per-channel sums of squares and of absolute values (float32 whatever the
wire dtype), and the rows' projections on the fixed random directions. The few rows that clipping shrinks are
corrected for on their own. The share of energy in the top singular values comes from a randomized range finder
(Halko, Martinsson and Tropp 2011) whose test vectors are the first ``spectral_rank + oversample`` of those same
directions: the projections are its first sketch, and a few more (rows x hidden) x (hidden x l) products give the
top energies, instead of a hidden x hidden Gram matrix and its eigendecomposition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

Clock = Callable[[str], None]  # called after each stage of a profile with the stage's name (benchmarks time them)

# a row counts as opposed to its tensor's mean row below this cosine: honest rows that merely point elsewhere (the
# first stage's output carries token-specific directions, at cosines down to -0.3) are not, negated ones (about -0.9)
# are (docs/decisions.md, "Rows against the boundary's mean direction")
OPPOSED_COSINE = -0.5

# rows are scanned in slices of about this many bytes of float32, which stay in a core's cache between the
# statistics taken of them (on a GPU the whole tensor is one slice)
_SLICE_BYTES = 2**20


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
    opposed: torch.Tensor  # () share of the rows pointing against the tensor's own mean row (`OPPOSED_COSINE`)
    log_rms: torch.Tensor  # () log of the whole tensor's root mean square

    def blend(self, other: Profile, beta: float) -> Profile:
        """beta * self + (1 - beta) * other, field by field (the EMA update)."""
        return Profile(
            *(torch.lerp(theirs, mine, beta) for mine, theirs in zip(self.fields(), other.fields(), strict=True))
        )

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.mean, self.absmean, self.rms, self.quantiles, self.spectral_share, self.opposed, self.log_rms


@dataclass(frozen=True)
class Scan:
    """The first pass over a tensor's (rows, hidden) values, on the profiler's device.

    `finite` is exact: a NaN or an infinity makes its row's sum of squares non-finite, and only when one is (which
    a finite row can also reach by overflow) are the values themselves looked at.
    """

    values: torch.Tensor  # (rows, hidden) as received (its wire dtype)
    row_squares: torch.Tensor  # (rows,) squared Euclidean norm of each row
    column_squares: torch.Tensor  # (hidden,) sum over rows of the squared values
    column_absolutes: torch.Tensor  # (hidden,) sum over rows of the absolute values
    products: torch.Tensor  # (rows, probes) the rows times the profiler's probes
    finite: bool


class Profiler:
    """Computes profiles with random directions seeded by the swarm, so every verifier computes the same numbers.

    The directions are drawn from a generator seeded with `seed`, on the CPU in float64, and only then moved to
    `device`: the estimate depends neither on global RNG state nor on where it runs. When the range finder needs
    more test vectors than there are directions, the extra ones are drawn after them from the same generator.
    """

    def __init__(
        self,
        hidden_size: int,
        n_projections: int,
        n_quantiles: int,
        spectral_rank: int,
        seed: int,
        row_clip: float,
        *,
        oversample: int = 8,
        power_iterations: int = 1,
        device: str | torch.device = "cpu",
    ):
        if power_iterations < 0 or oversample < 0:
            raise ValueError(f"power_iterations ({power_iterations}) and oversample ({oversample}) must be >= 0")
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(seed)
        probes = torch.randn(hidden_size, n_projections, generator=generator, dtype=torch.float64)
        self.sketch_width = min(spectral_rank + oversample, hidden_size)
        if self.sketch_width > n_projections:
            extra = self.sketch_width - n_projections
            probes = torch.cat([probes, torch.randn(hidden_size, extra, generator=generator, dtype=torch.float64)], 1)
        # unit columns: the projections are distances along directions; the range finder only needs their span
        self.probes = (probes / probes.norm(dim=0, keepdim=True)).float().to(self.device)
        self.n_projections = n_projections
        # the extreme tails are left out: they are a handful of tokens and move with the text, not the sender
        self.levels = torch.linspace(0.02, 0.98, n_quantiles, device=self.device)
        self.spectral_rank = spectral_rank
        self.power_iterations = power_iterations
        self.passes = 1 + 2 * power_iterations  # products of the tensor after the scan
        self.row_clip = row_clip
        self.slice_rows = max(1, _SLICE_BYTES // (4 * hidden_size)) if self.device.type == "cpu" else None

    @property
    def directions(self) -> torch.Tensor:
        """(hidden, projections) unit directions of the sliced Wasserstein distance."""
        return self.probes[:, : self.n_projections]

    def __call__(self, tensor: torch.Tensor) -> Profile:
        return self.profile(self.scan(tensor))

    def scan(self, tensor: torch.Tensor) -> Scan:
        """The first pass over `tensor` (any float dtype, any device): everything but the range finder's products."""
        values = tensor.detach().reshape(-1, tensor.shape[-1]).to(self.device)
        n, hidden = values.shape
        row_squares = torch.empty(n, device=self.device)
        products = torch.empty(n, self.probes.shape[1], device=self.device)
        column_squares = torch.zeros(hidden, device=self.device)
        column_absolutes = torch.zeros(hidden, device=self.device)
        step = self.slice_rows or n
        scratch = torch.empty(min(step, n), hidden, device=self.device)
        for start in range(0, n, step):
            rows = _float32(values[start : start + step])
            buffer = scratch[: rows.shape[0]]
            torch.mul(rows, rows, out=buffer)
            torch.sum(buffer, dim=1, out=row_squares[start : start + step])
            column_squares += buffer.sum(0)
            torch.abs(rows, out=buffer)
            column_absolutes += buffer.sum(0)
            torch.mm(rows, self.probes, out=products[start : start + step])
        finite = bool(torch.isfinite(row_squares).all()) or bool(torch.isfinite(values).all())
        return Scan(values, row_squares, column_squares, column_absolutes, products, finite)

    def profile(self, scan: Scan, clock: Clock | None = None) -> Profile:
        """The profile of a finite scan, on the CPU whatever the device. `clock(stage)` follows each stage."""
        tick = clock or _no_clock
        tick("scan")
        values = scan.values
        n = values.shape[0]
        # a few tokens of surprising text carry gradients 10x the rest; clipped, they no longer swing the profile,
        # while an attack, which touches every token, shows through unchanged. Row i counts scaled by weights[i]
        # in every statistic; only the clipped rows are ever gathered.
        norms = scan.row_squares.sqrt()
        cap = self.row_clip * norms.median().clamp_min(1e-30)
        weights = (cap / norms.clamp_min(1e-30)).clamp(max=1.0)
        total = (weights.square() * scan.row_squares).sum()  # squared Frobenius norm of the clipped rows
        rms = (total / values.numel()).sqrt()
        scale = 1.0 / rms.clamp_min(1e-30)
        absolutes, squares = scan.column_absolutes, scan.column_squares
        clipped = torch.nonzero(weights < 1.0).squeeze(1)
        if clipped.numel():
            few, shrink = _float32(values[clipped]), weights[clipped, None]
            absolutes = absolutes + ((shrink - 1) * few.abs()).sum(0)
            squares = squares + ((shrink.square() - 1) * few.square()).sum(0)
        products = scan.products * weights[:, None]
        projected = products[:, : self.n_projections] * scale
        quantiles = _quantiles(projected, self.levels)
        tick("clip, quantiles")

        top, sums, along = self._top_energy(values, weights, products[:, : self.sketch_width], tick)
        fields = (
            sums * (scale / n),
            absolutes * (scale / n),
            (squares / n).sqrt() * scale,
            quantiles,
            top / total.clamp_min(1e-30),
            (along < OPPOSED_COSINE * norms * sums.norm()).float().mean(),
            rms.clamp_min(1e-30).log(),
        )
        return Profile(*(f.cpu() for f in fields)) if self.device.type != "cpu" else Profile(*fields)

    def _top_energy(
        self, values: torch.Tensor, weights: torch.Tensor, sketch: torch.Tensor, tick: Clock
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The energy of the clipped rows W A in their top `spectral_rank` singular directions, and (for free, in
        the first product) the column sums of W A, and (one more column of the second) the rows' dot products with
        those sums: residual streams share a direction, and a row that points against it is rare in honest work
        (the `opposed` share; docs/decisions.md, "Rows against the boundary's mean direction").

        The range finder alternates sides from the scan's sketch W A Omega: B = Q^T W A with Q an orthonormal
        basis of the sketch, then W A Z with Z one of B's row space, and so on, `self.passes` products in all
        (1: Halko et al.'s plain range finder; 3: one power iteration). The top energies are those of the last
        product: the rows' energy in the subspace it was projected on.
        """
        weights = weights[:, None]
        column_sums = along = None
        product = sketch
        for index in range(self.passes):
            if index % 2 == 0:  # left: Q^T W A, (l, hidden)
                left = weights * _orthonormal(product)
                if column_sums is None:
                    left = torch.cat([left, weights], dim=1)
                product = self._left(values, left)
                if column_sums is None:
                    product, column_sums = product[:-1], product[-1]
            else:  # right: W A Z, (rows, l); the first also takes A times the column sums (signs: W is positive)
                right = _orthonormal(product.T)
                if along is None:
                    right = torch.cat([right, column_sums[:, None]], dim=1)
                product = self._right(values, right)
                if along is None:
                    product, along = product[:, :-1], product[:, -1]
                product = weights * product
            if index < self.passes - 1:
                tick("power iteration")
        if along is None:  # no power iteration: one product of its own
            along = self._right(values, column_sums[:, None])[:, 0]
        gram = product @ product.T if self.passes % 2 else product.T @ product
        energies = torch.linalg.eigvalsh(gram).clamp_min(0)
        tick("range, energy")
        return energies[-self.spectral_rank :].sum(), column_sums, along

    def _left(self, values: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """left^T @ values in float32, (k, hidden); slice by slice when the values need a cast."""
        if values.dtype == torch.float32:
            return left.T @ values
        step = self.slice_rows or values.shape[0]
        out = torch.zeros(left.shape[1], values.shape[1], device=values.device)
        for start in range(0, values.shape[0], step):
            out.addmm_(left[start : start + step].T, _float32(values[start : start + step]))
        return out

    def _right(self, values: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """values @ right in float32, (rows, k); slice by slice when the values need a cast."""
        if values.dtype == torch.float32:
            return values @ right
        step = self.slice_rows or values.shape[0]
        return torch.cat([_float32(values[s : s + step]) @ right for s in range(0, values.shape[0], step)])


def _quantiles(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """(columns, levels) quantiles of each column of `values` (rows, columns), interpolated linearly between order
    statistics as torch.quantile does. On the CPU numpy's vectorized sort is an order of magnitude faster than
    torch's (measured: 16 x 8192 values in 0.7 ms against 11 ms)."""
    columns = values.T.contiguous()
    n = columns.shape[1]
    if columns.device.type == "cpu":
        ordered = torch.from_numpy(np.sort(columns.numpy(), axis=1))
    else:
        ordered = torch.sort(columns, dim=1).values
    position = levels * (n - 1)
    low = position.floor().long()
    high = (low + 1).clamp(max=n - 1)
    return torch.lerp(ordered[:, low], ordered[:, high], position - low)


def _float32(values: torch.Tensor) -> torch.Tensor:
    return values if values.dtype == torch.float32 else values.float()


def _orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(matrix, mode="reduced").Q


def _no_clock(_: str) -> None:
    return None
