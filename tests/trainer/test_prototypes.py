from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainer import MixtureOfSmallNetworks, kmeans_prototypes, learned_prototypes, make_loss

pytestmark = pytest.mark.unit


def test_kmeans_finds_well_separated_cluster_centres() -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [5.0, 5.0], [-5.0, 5.0]])
    x = np.concatenate([c + 0.05 * rng.standard_normal((50, 2)) for c in centres])
    found = kmeans_prototypes(x.astype(np.float32), 3, seed=0).numpy()
    assert found.shape == (3, 2) and found.dtype == np.float32
    for c in centres:
        assert np.min(np.linalg.norm(found - c, axis=1)) < 0.05


def test_gate_is_softmax_of_negative_euclidean_distance() -> None:
    protos = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    mixture = MixtureOfSmallNetworks(protos, [nn.Linear(2, 1) for _ in range(3)])
    x = torch.tensor([[0.5, 0.5], [3.0, -1.0]])
    d = np.linalg.norm(x.numpy()[:, None, :] - protos.numpy()[None], axis=2)
    expected = np.exp(-d) / np.exp(-d).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(mixture.gate(x).detach().numpy(), expected, rtol=1e-5)


def test_output_is_gate_weighted_sum_of_networks() -> None:
    nets = [nn.Linear(1, 1) for _ in range(2)]
    with torch.no_grad():
        for i, net in enumerate(nets):
            net.weight.zero_()
            net.bias.fill_(float(i * 10))
    mixture = MixtureOfSmallNetworks(torch.tensor([[0.0], [1.0]]), nets)
    x = torch.tensor([[0.25]])
    w = mixture.gate(x)
    torch.testing.assert_close(mixture(x), w[:, 1:2] * 10.0)


def test_learned_prototypes_start_in_bounds_and_lower_the_mixture_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(400, 1, generator=gen) * 4 - 2
    y = torch.where(x < 0, torch.full_like(x, -1.0), torch.full_like(x, 1.0))
    torch.manual_seed(0)  # the layers' own initialisation draws from the global generator
    nets = [nn.Sequential(nn.Linear(1, 8), nn.PReLU(), nn.Linear(8, 1)) for _ in range(2)]
    before = MixtureOfSmallNetworks(torch.zeros(2, 1), nets)
    protos = learned_prototypes(
        x, y, nets, loss_fn=make_loss("mse", y), epochs=30, lr=1e-2, prototype_lr=1e-2,
        batch_size=32, generator=gen,
    )
    assert protos.shape == (2, 1)
    # Projected into the data's bounding box after every step, so no expert is left empty.
    assert (protos >= x.min()).all() and (protos <= x.max()).all()
    trained = MixtureOfSmallNetworks(protos, nets)
    with torch.no_grad():
        loss_before = float(nn.functional.mse_loss(before(x), y))
        loss_after = float(nn.functional.mse_loss(trained(x), y))
    # The networks passed in are the ones trained (in place).
    assert loss_after < 0.2 * loss_before
