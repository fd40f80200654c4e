"""Bad inputs give a clear RouterInputError subclass, never a wrong answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from router import (
    BadMode,
    BadTopK,
    BruteForceRouter,
    DimensionMismatch,
    EmptyBatch,
    InputOutOfRange,
    NonFiniteInput,
    PrototypeTree,
    RouterError,
    RouterInputError,
)

pytestmark = pytest.mark.unit

PROTOS = torch.rand(20, 3, generator=torch.Generator().manual_seed(0))
ROUTERS = [PrototypeTree.build(PROTOS, branching=3), BruteForceRouter(PROTOS)]


@pytest.mark.parametrize("router", ROUTERS, ids=["tree", "brute"])
@pytest.mark.parametrize("mode", ["tree", "exact"])
def test_bad_batches(router: PrototypeTree, mode: str) -> None:
    with pytest.raises(DimensionMismatch) as dim:
        router.route(torch.zeros(4, 2), mode=mode)  # type: ignore[arg-type]
    assert (dim.value.expected, dim.value.got) == (3, (4, 2))
    with pytest.raises(DimensionMismatch):
        router.route(torch.zeros(3), mode=mode)  # type: ignore[arg-type]
    with pytest.raises(DimensionMismatch):
        router.route(np.zeros((2, 2, 3)), mode=mode)  # type: ignore[arg-type]
    with pytest.raises(EmptyBatch):
        router.route(torch.zeros(0, 3), mode=mode)  # type: ignore[arg-type]
    bad = np.zeros((5, 3))
    bad[1, 2] = np.nan
    bad[4, 0] = -np.inf
    with pytest.raises(NonFiniteInput) as nf:
        router.route(bad, mode=mode)  # type: ignore[arg-type]
    assert nf.value.rows == [1, 4]
    with pytest.raises(InputOutOfRange):
        router.route(np.full((1, 3), 1e20), mode=mode)  # type: ignore[arg-type]
    with pytest.raises(RouterInputError):
        router.route(np.zeros((1, 3), dtype=np.complex64), mode=mode)  # type: ignore[arg-type]
    with pytest.raises(RouterInputError):
        router.route([[0.0, 0.0, 0.0]], mode=mode)  # type: ignore[arg-type]


@pytest.mark.parametrize("router", ROUTERS, ids=["tree", "brute"])
@pytest.mark.parametrize("top_k", [0, -1, 21, 1.0, True, "2", None])
def test_bad_top_k(router: PrototypeTree, top_k: object) -> None:
    with pytest.raises(BadTopK) as err:
        router.route(torch.zeros(2, 3), top_k=top_k)  # type: ignore[arg-type]
    assert err.value.num_prototypes == 20


@pytest.mark.parametrize("router", ROUTERS, ids=["tree", "brute"])
@pytest.mark.parametrize("mode", ["Tree", "", None, "approx", 1])
def test_bad_mode(router: PrototypeTree, mode: object) -> None:
    with pytest.raises(BadMode) as err:
        router.route(torch.zeros(2, 3), mode=mode)  # type: ignore[arg-type]
    assert err.value.mode == mode
    assert isinstance(err.value, RouterError)


def test_good_edges_still_route() -> None:
    tree = ROUTERS[0]
    r = tree.route(np.zeros((1, 3), dtype=np.int64), top_k=np.int64(20))  # type: ignore[arg-type]
    assert sorted(r.experts[0].tolist()) == list(range(20))
    assert tree.route(torch.full((1, 3), 1e14)).experts.shape == (1, 1)
