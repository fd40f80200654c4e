"""Blocked brute-force k-nearest prototypes that agree exactly with float64 direct differences.

A fast matmul pass (‖x‖² − 2x·p + ‖p‖², in float32 or float64) proposes candidates; every
prototype whose approximate squared distance lies within a rigorous rounding-error margin
of the k-th best is re-measured with float64 direct differences, and the k smallest
(ties to the lowest index) win. The answer is therefore exactly that of a float64
direct-difference scan, at close to matmul speed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._routing import Mode, Routing, check_mode, check_top_k, gate_weights, to_inputs

__all__ = ["BlockedSearch", "BruteForceRouter", "RowArgmin", "score_buffer", "sq_dist_rows"]

# Scores per block: a [rows, K] block near 4 MB stays cache-friendly.
_BLOCK_ELEMENTS = 1 << 20
# Below this many columns a plain argmin is as fast as the two-level one.
_TWO_LEVEL_MIN = 256
# The strip length is a multiple of this: the strip-wise minimum is then whole SIMD lanes.
_LANES = 16
# A score row stride that is a whole multiple of this many bytes is padded by one cache line.
# With such a stride, the rows of the tile a matmul writes all map onto the same few L1
# sets (4 KiB per way), and each row's write evicts its neighbours': the addmm that fills
# a [1024, 1024] float32 block ran 5-6x slower at n <= 8 than at width 1000 or 1040
# (0.62-0.70 vs 0.10-0.19 ns per score), ~15% slower at n = 16 and up to 2x at n = 128
# (one thread, 2-core EPYC VM), a loss the power-of-two widths RowArgmin pads to (1024,
# 2048) hit exactly. One extra cache line per row restores the fast rate.
_ALIASING_STRIDE_BYTES = 1024
_CACHE_LINE_BYTES = 64


def score_buffer(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, width] matrix whose row stride avoids cache-set aliasing.

    The rows are contiguous, so view() into strips and addmm(out=...) work on it as on
    a dense matrix; only the stride between rows may be a cache line longer than width.
    """
    item = torch.empty((), dtype=dtype).element_size()
    stride = width
    if (width * item) % _ALIASING_STRIDE_BYTES == 0:
        stride += _CACHE_LINE_BYTES // item
    return torch.empty((rows, stride), dtype=dtype)[:, :width]


def sq_dist_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared distances of paired rows, float64 direct differences: the reference metric."""
    diff = a - b
    return (diff * diff).sum(dim=-1)


class RowArgmin:
    """Column of each row's minimum of a [rows, width] matrix, in two cheap passes.

    CPU torch's argmin along a row runs about 13x slower than amin, which is vectorised
    (and min(dim) with its indices, used on the short rows here, about 2.5x faster than
    argmin on a [1024, 32] block).
    Viewing a row as `strips` strips of `strip` columns, an elementwise amin across the
    strips (vectorised) gives each column-in-strip's minimum; an argmin over those
    `strip` values and another over the winner's `strips` values then touch about
    2*sqrt(width) elements per row instead of width. width must equal strips * strip:
    callers pad with +inf columns. Among equal minima the column found is not always the
    lowest; the callers re-check near ties exactly, so only the value matters.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self.strip = _strip(width)
        self.strips = width // self.strip
        if self.strips * self.strip != width:
            raise ValueError(f"width {width} is not strips * strip; pad it with padded()")
        self._offsets = torch.arange(self.strips) * self.strip

    @staticmethod
    def padded(width: int) -> int:
        """The width to pad a row of `width` columns to: whole strips."""
        strip = _strip(width)
        return -(-width // strip) * strip

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """Column index [rows, 1] (int64) of a minimum of each row."""
        if self.strips == 1:
            return scores.min(dim=1, keepdim=True).indices
        rows = scores.shape[0]
        per_column = scores.view(rows, self.strips, self.strip).amin(dim=1)
        column = per_column.min(dim=1, keepdim=True).indices
        candidates = column + self._offsets[None, :]
        strip = scores.gather(1, candidates).min(dim=1, keepdim=True).indices
        return candidates.gather(1, strip)

    def with_runner_up(
        self, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(column [rows, 1] of a minimum, the minimum [rows], the runner-up [rows]).

        The runner-up is the smallest value left once that one element is removed: equal
        to the minimum when it occurs twice. Every other element lies either in the
        winner's column-in-strip (among the `strips` values already gathered) or in another
        column-in-strip, whose minimum the strip-wise pass already holds; so the runner-up
        costs no second pass over the row.
        """
        rows = scores.shape[0]
        per_column = scores.view(rows, self.strips, self.strip).amin(dim=1)
        column = per_column.min(dim=1, keepdim=True).indices
        candidates = column + self._offsets[None, :]
        along = scores.gather(1, candidates)
        best, strip = along.min(dim=1, keepdim=True)
        along.scatter_(1, strip, float("inf"))
        per_column.scatter_(1, column, float("inf"))
        runner_up = torch.minimum(along.amin(dim=1), per_column.amin(dim=1))
        return candidates.gather(1, strip), best.squeeze(1), runner_up


def _strip(width: int) -> int:
    """Strip length for a row of about `width` columns: the whole row below
    _TWO_LEVEL_MIN, else about √width rounded up to whole SIMD lanes."""
    if width < _TWO_LEVEL_MIN:
        return width
    return -(-math.isqrt(width) // _LANES) * _LANES


class _Scan:
    """Rows laid out for the matmul pass: centred, transposed, padded to whole strips."""

    def __init__(
        self,
        rows64: torch.Tensor,
        ids: torch.Tensor | None,
        centre: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        k, n = rows64.shape
        self.rows64 = rows64  # [k, n] float64: the rows candidates are re-measured against
        self.ids = ids  # prototype index of each row (increasing); None: row i is prototype i
        centred = rows64 - centre
        # Padding columns score +inf (norm +inf, coordinates 0), so no scan ever picks them.
        width = RowArgmin.padded(k)
        self.row_argmin = RowArgmin(width)
        self.norm2 = torch.full((width,), float("inf"), dtype=dtype)
        self.norm2[:k] = (centred * centred).sum(dim=1).to(dtype)
        self.centred_t = torch.zeros((n, width), dtype=dtype)
        self.centred_t[:, :k] = centred.to(dtype).t()


def _first_of_each_distinct(p: torch.Tensor) -> torch.Tensor:
    """Increasing indices of the rows of p that repeat no earlier row exactly.

    Rows are keyed by a hash of their bits (copies get equal keys) and stably sorted by
    key, so each copy follows an earlier row of its key; it is dropped only if it equals
    its predecessor bit for bit. A hash collision can at worst keep a copy (correct, a
    little slower); it never drops a row that is not an earlier row's copy. Cheaper than
    torch.unique(dim=0)'s lexicographic sort: 0.2 vs 0.4 s at K = 10^5, n = 128, and
    0.02 vs 0.2 s at n = 16.
    """
    k, n = p.shape
    if k < 2:
        return torch.arange(k)
    bits = p.contiguous().view(torch.int64)
    # A weighted sum of the bits, each folded onto its low half first: a round float's
    # bits (1.0, 0.5, small integers) are zero below the exponent and top mantissa bits,
    # and a bare multiply would keep only those few top bits. Three passes over p; the
    # splitmix64 finaliser then spreads the per-row sum over all 64 bits of the key.
    weights = torch.randint(
        -(1 << 62), 1 << 62, (n,), generator=torch.Generator().manual_seed(0),
        dtype=torch.int64,
    ) | 1
    z = ((bits ^ (bits >> 32)) * weights).sum(dim=1)
    z = (z ^ (z >> 30)) * _MIX_1
    z = (z ^ (z >> 27)) * _MIX_2
    key = z ^ (z >> 31)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    same_key = torch.nonzero(sorted_key[1:] == sorted_key[:-1]).flatten()
    later, earlier = order[same_key + 1], order[same_key]
    copy = (bits[later] == bits[earlier]).all(dim=1)
    keep = torch.ones(k, dtype=torch.bool)
    keep[later[copy]] = False
    return torch.nonzero(keep).flatten()


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 it wraps to."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)


class BlockedSearch:
    """Exact k-nearest search over fixed prototypes; the float32 or float64 matmul pass."""

    def __init__(self, prototypes: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self.prototypes64 = prototypes.to(torch.float64).contiguous()
        k, n = self.prototypes64.shape
        self.dim = n
        # Centring shrinks the norms in the expansion, so its rounding margin shrinks too.
        self.centre = self.prototypes64.mean(dim=0)
        centred = self.prototypes64 - self.centre
        self.max_norm = float((centred * centred).sum(dim=1).max().sqrt())
        self.dtype = dtype
        self._all = _Scan(self.prototypes64, None, self.centre, dtype)
        # The nearest prototype is never a repeat of an earlier row: an exact copy ties
        # with its first occurrence, and ties go to the lowest index. So k = 1 scans the
        # distinct rows only (each standing for its first occurrence). Besides the rows
        # saved, a store of copies no longer makes every query a near tie needing the
        # float64 re-check. k > 1 still scans every row: copies belong in a top-k answer.
        first = _first_of_each_distinct(self.prototypes64)
        self._distinct = (
            self._all if first.numel() == k
            else _Scan(self.prototypes64[first], first, self.centre, dtype)
        )
        unit = 2.0**-24 if dtype == torch.float32 else 2.0**-53
        # |error| of ‖p‖² − 2x·p <= error_factor * (2‖x‖R + R²), R = max ‖p‖ (centred):
        # n·u·2‖x‖R bounds the dot product (gamma_n Σ|x_i p_i| <= gamma_n ‖x‖‖p‖, doubled),
        # the 16u spare on it covers rounding x and p into dtype and the final subtraction,
        # and (n + 16)u·R² (2u needed) rounding ‖p‖² into dtype. ‖x‖² is never added to
        # the scores, so it brings no error.
        self.error_factor = (n + 16) * unit

    def knn(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact k nearest of float64 x [B, n]: (indices [B, k] int64, sq dists [B, k] f64)."""
        scan = self._distinct if k == 1 else self._all
        b = x.shape[0]
        num = scan.norm2.shape[0]
        out_idx = torch.empty((b, k), dtype=torch.long)
        out_d2 = torch.empty((b, k), dtype=torch.float64)
        rows = max(1, min(b, _BLOCK_ELEMENTS // max(1, num)))
        # One score buffer for all blocks: a fresh multi-MB tensor per block would pay
        # page faults on every block, as much as the matmul itself.
        buffer = score_buffer(rows, num, self.dtype)
        for lo in range(0, b, rows):
            hi = min(b, lo + rows)
            idx, d2 = self._knn_block(scan, x[lo:hi], k, buffer[: hi - lo])
            out_idx[lo:hi] = idx
            out_d2[lo:hi] = d2
        if scan.ids is not None:
            out_idx = scan.ids[out_idx]
        return out_idx, out_d2

    def _knn_block(
        self, scan: _Scan, x: torch.Tensor, k: int, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        xc = x - self.centre
        xnorm = torch.linalg.vector_norm(xc, dim=1)  # one pass, where (xc * xc).sum took two
        # ‖x‖² is the same for a whole row: rank by ‖p‖² − 2x·p and skip a full-matrix add.
        torch.addmm(
            scan.norm2[None, :], xc.to(self.dtype), scan.centred_t, alpha=-2.0, out=scores
        )
        r = self.max_norm
        margin = 2.0 * self.error_factor * (2.0 * r * xnorm + r * r)
        if k == 1:
            return self._nearest_block(scan, x, scores, margin)
        kth = scores.topk(k, dim=1, largest=False, sorted=True).values[:, -1]
        limit = self._limit(kth, margin)
        row, col = torch.nonzero(scores <= limit[:, None], as_tuple=True)
        d2 = sq_dist_rows(x[row], scan.rows64[col])
        return select_k(row, col, d2, x.shape[0], k)

    def _limit(self, best: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
        limit = (best.to(torch.float64) + margin).to(self.dtype)
        # Rounding the limit into dtype may lose up to half an ulp: step one ulp outwards.
        return torch.nextafter(limit, torch.full_like(limit, float("inf")))

    def _nearest_block(
        self, scan: _Scan, x: torch.Tensor, scores: torch.Tensor, margin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Most rows have one clear winner: the runner-up (found with the winner, no second
        # pass over the block) lies beyond the margin. Only the close rows (a few percent;
        # up to ~15% on clustered data in 128-D) list every candidate within the margin,
        # the winner included, and re-measure them all in float64: one gather, compare and
        # nonzero over those rows, where a second argmin for a single rival cost several.
        # Indices here are rows of the scan (scan.ids maps them afterwards).
        j, best, runner_up = scan.row_argmin.with_runner_up(scores)
        limit = self._limit(best, margin)
        close = torch.nonzero(runner_up <= limit).flatten()
        idx = j.squeeze(1)
        d2 = sq_dist_rows(x, scan.rows64[idx])
        if close.numel() > 0:
            near = scores.index_select(0, close) <= limit.index_select(0, close)[:, None]
            row, col = torch.nonzero(near, as_tuple=True)
            cd2 = sq_dist_rows(x[close[row]], scan.rows64[col])
            close_idx, close_d2 = select_k(row, col, cd2, close.numel(), 1)
            idx[close] = close_idx[:, 0]
            d2[close] = close_d2[:, 0]
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
