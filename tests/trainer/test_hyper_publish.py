"""`trainer.hyper.publish_hypernetwork`: what a published hyper store serves is the g trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experts_store import FrozenHyperNetwork, Store
from trainer.hyper import HyperConfigError, HyperNetwork, PrimarySpec, publish_hypernetwork

pytestmark = pytest.mark.unit


def _f(activation: str, bias: bool = False) -> HyperNetwork:
    torch.manual_seed(0)
    primary = PrimarySpec(4, (8, 6), 3, activation=activation, bias=bias)  # type: ignore[arg-type]
    return HyperNetwork(5, primary, depth=1, width=32)


@pytest.mark.parametrize("bias", [False, True])
def test_a_published_relu_primary_serves_what_was_trained(tmp_path: Path, bias: bool) -> None:
    f = _f("relu", bias)
    publish_hypernetwork(tmp_path / "store", f)
    spec = Store.open(tmp_path / "store").manifest.hyper
    assert spec is not None
    net = FrozenHyperNetwork.load(tmp_path / "store" / spec.hypernetwork.file)
    x, condition = torch.randn(50, 4), torch.randn(5)
    with torch.no_grad():
        trained = f(x, condition.expand(50, 5))
    served = net.expert(condition, spec)(x)
    assert torch.allclose(served, trained, atol=1e-6, rtol=0)


def test_a_primary_the_store_cannot_serve_is_refused_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    # An ELU g was published as ReLU and served 0.05 away from the trained outputs.
    with pytest.raises(HyperConfigError) as info:
        publish_hypernetwork(tmp_path / "store", _f("elu"))
    assert info.value.option == "primary.activation" and "'elu'" in str(info.value)
    assert not (tmp_path / "store" / "manifest.json").exists()


def test_a_conditions_table_f_cannot_take_is_refused_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    # A [3, 7] table beside an f of m2 = 5 was published, and every server refused the store.
    with pytest.raises(HyperConfigError) as info:
        publish_hypernetwork(tmp_path / "store", _f("relu"), conditions=torch.randn(3, 7),
                             condition_ids=["a", "b", "c"])
    assert info.value.option == "conditions" and "[3, 7]" in str(info.value)
    assert not (tmp_path / "store" / "manifest.json").exists()
