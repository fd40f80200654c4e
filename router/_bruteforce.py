"""Blocked brute-force k-nearest prototypes that agree exactly with float64 direct differences.

A fast matmul pass (‖x‖² − 2x·p + ‖p‖², in float32 or float64) proposes candidates; every
prototype whose approximate squared distance lies within a rigorous rounding-error margin
of the k-th best is re-measured with float64 direct differences, and the k smallest
(ties to the lowest index) win. The answer is therefore exactly that of a float64
direct-difference scan, at close to matmul speed.
"""

from __future__ import annotations

import numpy as np
import torch

from ._routing import Mode, Routing, check_mode, check_top_k, gate_weights, to_inputs

__all__ = ["BlockedSearch", "BruteForceRouter", "sq_dist_rows"]

# Scores per block: a [rows, K] block near 4 MB stays cache-friendly.
_BLOCK_ELEMENTS = 1 << 20


def sq_dist_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared distances of paired rows, float64 direct differences: the reference metric."""
    diff = a - b
    return (diff * diff).sum(dim=-1)


class BlockedSearch:
    """Exact k-nearest search over fixed prototypes; the float32 or float64 matmul pass."""

    def __init__(self, prototypes: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self.prototypes64 = prototypes.to(torch.float64).contiguous()
        k, n = self.prototypes64.shape
        self.dim = n
        # Centring shrinks the norms in the expansion, so its rounding margin shrinks too.
        self.centre = self.prototypes64.mean(dim=0)
        centred = self.prototypes64 - self.centre
        self.norm2 = (centred * centred).sum(dim=1).to(dtype)
        self.centred_t = centred.to(dtype).t().contiguous()
        self.max_norm = float((centred * centred).sum(dim=1).max().sqrt())
        self.dtype = dtype
        unit = 2.0**-24 if dtype == torch.float32 else 2.0**-53
        # |error| of ‖p‖² − 2x·p <= error_factor * (‖x‖ + R)², R = max ‖p‖ (centred):
        # (‖x‖ + R)² >= 2‖x‖R + ‖x‖² + R² covers the dot product (gamma_n * 2‖x‖R), and the
        # 16u spare covers both norms, the additions and rounding x and p into dtype.
        self.error_factor = (n + 16) * unit

    def knn(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact k nearest of float64 x [B, n]: (indices [B, k] int64, sq dists [B, k] f64)."""
        b = x.shape[0]
        num = self.prototypes64.shape[0]
        out_idx = torch.empty((b, k), dtype=torch.long)
        out_d2 = torch.empty((b, k), dtype=torch.float64)
        rows = max(1, min(b, _BLOCK_ELEMENTS // max(1, num)))
        # One score buffer for all blocks: a fresh multi-MB tensor per block would pay
        # page faults on every block, as much as the matmul itself.
        buffer = torch.empty((rows, num), dtype=self.dtype)
        for lo in range(0, b, rows):
            hi = min(b, lo + rows)
            idx, d2 = self._knn_block(x[lo:hi], k, buffer[: hi - lo])
            out_idx[lo:hi] = idx
            out_d2[lo:hi] = d2
        return out_idx, out_d2

    def _knn_block(
        self, x: torch.Tensor, k: int, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        xc = x - self.centre
        xnorm2 = (xc * xc).sum(dim=1)
        # ‖x‖² is the same for a whole row: rank by ‖p‖² − 2x·p and skip a full-matrix add.
        torch.addmm(
            self.norm2[None, :], xc.to(self.dtype), self.centred_t, alpha=-2.0, out=scores
        )
        margin = 2.0 * self.error_factor * (xnorm2.sqrt() + self.max_norm) ** 2
        if k == 1:
            return self._nearest_block(x, scores, margin)
        kth = scores.topk(k, dim=1, largest=False, sorted=True).values[:, -1]
        limit = self._limit(kth, margin)
        row, col = torch.nonzero(scores <= limit[:, None], as_tuple=True)
        d2 = sq_dist_rows(x[row], self.prototypes64[col])
        return select_k(row, col, d2, x.shape[0], k)

    def _limit(self, best: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
        limit = (best.to(torch.float64) + margin).to(self.dtype)
        # Rounding the limit into dtype may lose up to half an ulp: step one ulp outwards.
        return torch.nextafter(limit, torch.full_like(limit, float("inf")))

    def _nearest_block(
        self, x: torch.Tensor, scores: torch.Tensor, margin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Most rows have one clear winner: the runner-up (one cheap amin after masking the
        # winner) lies beyond the margin. Only the other rows need a full candidate list.
        j = scores.argmin(dim=1, keepdim=True)
        limit = self._limit(scores.gather(1, j).squeeze(1), margin)
        scores.scatter_(1, j, float("inf"))
        close = torch.nonzero(scores.amin(dim=1) <= limit).flatten()
        idx = j.squeeze(1).clone()
        d2 = sq_dist_rows(x, self.prototypes64[idx])
        if close.numel() > 0:
            sub = scores[close]
            sub.scatter_(1, j[close], float("-inf"))  # the winner is a candidate too
            r, col = torch.nonzero(sub <= limit[close, None], as_tuple=True)
            row = close[r]
            cd2 = sq_dist_rows(x[row], self.prototypes64[col])
            best_idx, best_d2 = select_k(row, col, cd2, x.shape[0], 1)
            idx[close] = best_idx[close, 0]
            d2[close] = best_d2[close, 0]
        return idx[:, None], d2[:, None]


def select_k(
    row: torch.Tensor, col: torch.Tensor, d2: torch.Tensor, b: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k smallest (d2, col) per row, lexicographically; every row has >= k candidates."""
    if k == 1:
        best = torch.full((b,), float("inf"), dtype=torch.float64)
        best.scatter_reduce_(0, row, d2, reduce="amin")
        on_min = d2 == best[row]
        idx = torch.full((b,), torch.iinfo(torch.long).max, dtype=torch.long)
        idx.scatter_reduce_(0, row[on_min], col[on_min], reduce="amin")
        return idx[:, None], best[:, None]
    # Stable sorts from the last key to the first give (row, d2, col) order.
    order = torch.argsort(col, stable=True)
    order = order[torch.argsort(d2[order], stable=True)]
    order = order[torch.argsort(row[order], stable=True)]
    row, col, d2 = row[order], col[order], d2[order]
    counts = torch.bincount(row, minlength=b)
    starts = torch.cumsum(counts, 0) - counts
    take = (starts[:, None] + torch.arange(k)[None, :]).reshape(-1)
    return col[take].reshape(b, k), d2[take].reshape(b, k)


class BruteForceRouter:
    """Reference router: the exact float64 nearest prototypes by scanning all of them.

    Same route() interface as PrototypeTree; mode is accepted and ignored (both modes are
    exact here) and every input costs K distance evaluations.
    """

    def __init__(self, prototypes: torch.Tensor | np.ndarray, temperature: float = 1.0) -> None:
        p = torch.as_tensor(prototypes).detach().to("cpu")
        if p.dim() != 2 or p.shape[0] < 1 or p.shape[1] < 1:
            raise ValueError(f"prototypes must be [K >= 1, n >= 1], got {list(p.shape)}")
        self.prototypes = p.to(torch.float32).contiguous()
        self.temperature = float(temperature)
        self._search = BlockedSearch(self.prototypes, dtype=torch.float64)

    @property
    def num_prototypes(self) -> int:
        return int(self.prototypes.shape[0])

    @property
    def dim(self) -> int:
        return int(self.prototypes.shape[1])

    def route(
        self, x: torch.Tensor | np.ndarray, mode: Mode = "tree", top_k: int = 1
    ) -> Routing:
        check_mode(mode)
        k = check_top_k(top_k, self.num_prototypes)
        xs = to_inputs(x, self.dim)
        idx, d2 = self._search.knn(xs, k)
        return Routing(
            experts=idx,
            weights=gate_weights(d2, self.temperature),
            distances=d2.sqrt().to(torch.float32),
            distance_evals=torch.full((xs.shape[0],), self.num_prototypes, dtype=torch.long),
        )
