"""BruteForceRouter and the blocked search: exact float64 answers at matmul speed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from router_testdata import make_prototypes, make_queries, numpy_knn

from router import BruteForceRouter, PrototypeTree
from router._bruteforce import BlockedSearch, RowArgmin, score_buffer

pytestmark = pytest.mark.unit


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 120),
    n=st.integers(1, 6),
    top_k=st.integers(1, 6),
    kind=st.sampled_from(["uniform", "clustered", "lowdim", "duplicates"]),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 1e-4, 1e4]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_blocked_search_matches_numpy(
    k: int, n: int, top_k: int, kind: str, seed: int, scale: float, dtype: torch.dtype
) -> None:
    rng = np.random.default_rng(seed)
    p = (make_prototypes(kind, k, n, rng) * scale + scale).astype(np.float32)
    x = make_queries(p, 15, rng)
    kk = min(top_k, k)
    idx, d2 = BlockedSearch(torch.from_numpy(p), dtype=dtype).knn(torch.from_numpy(x), kk)
    want_idx, want_d2 = numpy_knn(x, p, kk)
    assert idx.numpy().tolist() == want_idx.tolist()
    np.testing.assert_allclose(d2.numpy(), want_d2, rtol=1e-12, atol=0)


def test_router_interface_and_costs() -> None:
    rng = np.random.default_rng(0)
    p = make_prototypes("clustered", 500, 4, rng)
    x = make_queries(p, 30, rng)
    ref = BruteForceRouter(p, temperature=0.5)
    r = ref.route(x, mode="exact", top_k=3)
    want_idx, want_d2 = numpy_knn(x, p, 3)
    assert r.experts.numpy().tolist() == want_idx.tolist()
    assert r.distance_evals.tolist() == [500] * len(x)
    np.testing.assert_allclose(r.weights.sum(dim=1).numpy(), 1.0, rtol=1e-6)
    tree = PrototypeTree.build(p, branching=4, temperature=0.5)
    t = tree.route(x, top_k=3)
    assert torch.equal(t.experts, r.experts)
    assert torch.allclose(t.weights, r.weights)
    assert torch.equal(ref.route(x).experts, tree.route(x, mode="exact").experts)


def test_many_blocks() -> None:
    # More rows than one block holds, so blocking must not reorder or drop rows.
    rng = np.random.default_rng(0)
    p = make_prototypes("uniform", 5000, 2, rng)
    x = rng.random((1000, 2))
    idx, _ = BlockedSearch(torch.from_numpy(p)).knn(torch.from_numpy(x), 1)
    assert idx[:, 0].tolist() == numpy_knn(x, p)[0][:, 0].tolist()


@pytest.mark.parametrize("width", [1, 7, 255, 256, 1000, 4099, 100_000])
def test_row_argmin_finds_each_rows_minimum(width: int) -> None:
    rng = np.random.default_rng(width)
    padded = RowArgmin.padded(width)
    scores = torch.full((9, padded), float("inf"))
    # Few distinct values, so most rows have tied minima in several strips.
    scores[:, :width] = torch.from_numpy(rng.integers(0, 50, (9, width)).astype(np.float32))
    scores[3, width - 1] = -1.0  # the last real column, next to the padding
    scores[4, 0] = -1.0
    col = RowArgmin(padded)(scores)
    assert col.shape == (9, 1)
    assert bool((col < width).all())
    assert torch.equal(scores.gather(1, col), scores.amin(dim=1, keepdim=True))
    assert col[3, 0] == width - 1 and col[4, 0] == 0


@pytest.mark.parametrize("width", [1, 7, 255, 256, 1000, 4099])
def test_row_argmin_reports_the_runner_up(width: int) -> None:
    rng = np.random.default_rng(width)
    padded = RowArgmin.padded(width)
    scores = torch.full((12, padded), float("inf"))
    # Few distinct values: minima tie often, within one strip's column and across columns.
    scores[:, :width] = torch.from_numpy(rng.integers(0, 30, (12, width)).astype(np.float32))
    if width > 1:
        scores[5, :2] = -2.0  # a tied minimum in neighbouring columns
        scores[6, 0], scores[6, width - 1] = -2.0, -1.0
    strip = RowArgmin(padded).strip
    if padded > strip:
        # The runner-up in the winner's own column-in-strip, one strip further on.
        scores[7, 3], scores[7, 3 + strip] = -3.0, -2.5
    col, best, runner_up = RowArgmin(padded).with_runner_up(scores.clone())
    ordered = scores.sort(dim=1).values
    assert torch.equal(best, ordered[:, 0])
    assert torch.equal(runner_up, ordered[:, 1]) if width > 1 else bool(runner_up.isinf().all())
    assert torch.equal(scores.gather(1, col).squeeze(1), best)


@pytest.mark.parametrize("width", [1000, 1024, 2048, 300])
def test_score_buffer_is_a_dense_matrix_to_addmm(width: int) -> None:
    a, b, bias = torch.rand(5, 3), torch.rand(3, width), torch.rand(width)
    out = score_buffer(5, width, torch.float32)
    torch.addmm(bias[None, :], a, b, alpha=-2.0, out=out)
    assert out.shape == (5, width)
    torch.testing.assert_close(out, bias[None, :] - 2.0 * a @ b)
    # A row stride of a whole KiB would alias cache sets; the buffer never has one.
    assert (out.stride(0) * 4) % 1024 != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_duplicated_prototypes_answer_the_lowest_index(dtype: torch.dtype) -> None:
    # Every prototype twice, shuffled: the nearest is the first copy, while top-2 still
    # counts both copies (k = 1 scans the distinct rows only, k > 1 every row).
    rng = np.random.default_rng(4)
    half = make_prototypes("uniform", 300, 2, rng)
    p = np.concatenate([half, half])[rng.permutation(600)]
    x = make_queries(p, 200, rng)
    search = BlockedSearch(torch.from_numpy(p), dtype=dtype)
    want_idx, want_d2 = numpy_knn(x, p, 2)
    idx, d2 = search.knn(torch.from_numpy(x), 1)
    assert idx[:, 0].tolist() == want_idx[:, 0].tolist()
    np.testing.assert_allclose(d2[:, 0].numpy(), want_d2[:, 0], rtol=1e-12, atol=0)
    idx2, _ = search.knn(torch.from_numpy(x), 2)
    assert idx2.numpy().tolist() == want_idx.tolist()


def test_row_argmin_refuses_an_unpadded_width() -> None:
    with pytest.raises(ValueError, match="pad"):
        RowArgmin(257)


@settings(max_examples=15, deadline=None)
@given(
    k=st.integers(256, 3000),
    n=st.integers(1, 8),
    top_k=st.sampled_from([1, 1, 3]),
    kind=st.sampled_from(["uniform", "clustered", "lowdim", "duplicates"]),
    seed=st.integers(0, 2**16),
)
def test_two_level_scan_matches_numpy(k: int, n: int, top_k: int, kind: str, seed: int) -> None:
    # K >= 256 takes the two-level argmin and +inf padding columns.
    rng = np.random.default_rng(seed)
    p = make_prototypes(kind, k, n, rng).astype(np.float32)
    x = make_queries(p, 40, rng)
    idx, d2 = BlockedSearch(torch.from_numpy(p)).knn(torch.from_numpy(x), top_k)
    want_idx, want_d2 = numpy_knn(x, p, top_k)
    assert idx.numpy().tolist() == want_idx.tolist()
    np.testing.assert_allclose(d2.numpy(), want_d2, rtol=1e-12, atol=0)
