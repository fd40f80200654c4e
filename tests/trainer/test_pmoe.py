"""trainer.pmoe: top-l routing, batch invariance, the digits-patches data, training (paper 003)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import TrainerError
from trainer.pmoe import (
    PatchCNN,
    PatchDataset,
    PatchLayoutError,
    PatchMoE,
    PMoEConfigError,
    TrainSettings,
    accuracy,
    digits_patches,
    discriminative_in_top,
    image_to_patches,
    joint_pmoe,
    largest_gate_hits,
    patch_cnn,
    patches_to_image,
    predict_logits,
    separate_pmoe,
    top_l_patches,
    train_model,
    train_router_linear,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def data() -> PatchDataset:
    return digits_patches(num_train=200, num_test=200, seed=3)


def _brute_top_l(row: list[float], count: int) -> list[int]:
    return sorted(range(len(row)), key=lambda j: (-row[j], j))[:count]


@pytest.mark.parametrize("count", [1, 2, 5, 16])
def test_top_l_equals_a_per_sample_sort_with_ties_to_the_lowest_index(count: int) -> None:
    generator = torch.Generator().manual_seed(count)
    # Integer scores in a small range: most rows have many ties.
    scores = torch.randint(-3, 4, (40, 3, 16), generator=generator).float()
    picked = top_l_patches(scores, count)
    for b in range(scores.shape[0]):
        for s in range(scores.shape[1]):
            assert picked[b, s].tolist() == _brute_top_l(scores[b, s].tolist(), count)


def test_all_equal_scores_pick_the_first_l_patches() -> None:
    assert top_l_patches(torch.zeros(2, 1, 16), 4).tolist() == [[[0, 1, 2, 3]], [[0, 1, 2, 3]]]


def test_route_picks_each_experts_top_l_and_gates_softmax_over_them() -> None:
    model = joint_pmoe(num_patches=16, patch_dim=64, seed=1)
    with torch.no_grad():
        model.router.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(2))
    x = torch.rand(10, 16, 64, generator=torch.Generator().manual_seed(3))
    routing = model.route(x)
    assert routing.indices.shape == (10, 8, 6) and routing.gates.shape == (10, 8, 6)
    x64, w64 = x.double(), model.router.detach().double()
    for b in range(10):
        for s in range(8):
            values = (x64[b] @ w64[s]).tolist()
            chosen = _brute_top_l(values, 6)
            assert routing.indices[b, s].tolist() == chosen
            chosen_values = torch.tensor([values[j] for j in chosen], dtype=torch.float64)
            expected = torch.softmax(chosen_values, dim=0)
            torch.testing.assert_close(routing.gates[b, s].double(), expected, atol=1e-5, rtol=0)


def test_separate_gates_are_ones_and_the_output_is_eq_1_recomputed_by_hand() -> None:
    model = separate_pmoe(num_patches=16, patch_dim=64, seed=4)
    x = torch.rand(3, 16, 64, generator=torch.Generator().manual_seed(5))
    routing = model.route(x)
    assert torch.equal(routing.gates, torch.ones(3, 2, 2))
    w, a = model.expert_weight.detach().double(), model.output_weight.double()
    for b in range(3):
        f = 0.0
        for s in range(2):
            for j in routing.indices[b, s].tolist():
                f += float((torch.relu(w[s] @ x[b, j].double()) * a[s, :, 0]).sum()) / 16
        logits = model(x[b : b + 1])[0]
        assert logits[0].item() == 0.0
        assert logits[1].item() == pytest.approx(f, abs=1e-5)


@pytest.mark.parametrize("kind", ["separate", "joint", "cnn"])
def test_a_samples_output_is_bitwise_the_same_alone_and_in_any_batch(kind: str) -> None:
    builders = {"separate": separate_pmoe, "joint": joint_pmoe}
    model: PatchMoE | PatchCNN = (
        patch_cnn(num_patches=16, patch_dim=64, seed=6)
        if kind == "cnn"
        else builders[kind](num_patches=16, patch_dim=64, seed=6)
    )
    x = torch.rand(300, 16, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        together = model(x)
        shuffled = torch.randperm(300, generator=torch.Generator().manual_seed(8))
        in_other_order = model(x[shuffled])
        for i in [0, 1, 77, 299]:
            alone = model(x[i : i + 1])
            assert torch.equal(alone[0], together[i])
            assert torch.equal(in_other_order[(shuffled == i).nonzero().item()], together[i])
        if isinstance(model, PatchMoE):
            full = model.route(x)
            one = model.route(x[77:78])
            assert torch.equal(one.indices[0], full.indices[77])
            assert torch.equal(one.gates[0], full.gates[77])


def test_flat_rows_equal_patch_arrays_and_a_wrong_shape_names_the_expected_one() -> None:
    model = joint_pmoe(num_patches=16, patch_dim=64, seed=0)
    x = torch.rand(4, 16, 64)
    with torch.no_grad():
        assert torch.equal(model(x.reshape(4, 1024)), model(x))
    with pytest.raises(PatchLayoutError) as caught:
        model(torch.rand(4, 16, 63))
    assert caught.value.expected == (16, 64) and caught.value.got == (4, 16, 63)
    assert isinstance(caught.value, TrainerError)


def test_the_dataset_has_exactly_one_discriminative_patch_and_no_shared_source(
    data: PatchDataset,
) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    target = np.asarray(digits.target)
    for x, y, pos, src in [
        (data.x_train, data.y_train, data.position_train, data.source_train),
        (data.x_test, data.y_test, data.position_test, data.source_test),
    ]:
        assert x.shape == (200, 16, 64)
        is_discriminative = np.isin(target[src], [0, 1])
        assert (is_discriminative.sum(axis=1) == 1).all()
        assert (is_discriminative.argmax(axis=1) == pos).all()
        assert (target[src[np.arange(len(y)), pos]] == y).all()  # class 1 is digit "1"
        assert np.isin(target[src[~is_discriminative]], range(2, 10)).all()
        np.testing.assert_array_equal(x, digits.data[src] / 16.0)
        assert sorted(np.bincount(y).tolist()) == [100, 100]
        assert len(set(pos.tolist())) > 8  # positions vary
    shared = set(data.source_train.ravel()) & set(data.source_test.ravel())
    assert shared == set()


def test_images_and_patches_round_trip_in_grid_order(data: PatchDataset) -> None:
    patches = data.x_test[:5]
    images = patches_to_image(patches, (4, 4), (8, 8))
    assert images.shape == (5, 32, 32, 1)
    # Patch 6 sits in grid row 1, column 2.
    np.testing.assert_array_equal(images[:, 8:16, 16:24, 0], patches[:, 6].reshape(5, 8, 8))
    np.testing.assert_array_equal(image_to_patches(images, (8, 8)), patches)


def test_separate_router_training_follows_eq_6_in_closed_form(data: PatchDataset) -> None:
    # The linear loss's gradient does not depend on w, so after E epochs of equal batches
    # w_a = w_a(0) + lr·E/B · Σ_i y_i Σ_j x_i^(j) (y = +1 for class a), and w_b the opposite.
    model = separate_pmoe(num_patches=16, patch_dim=64, seed=9)
    start = model.router.detach().clone()
    x, y = data.x_train[:40], data.y_train[:40]
    settings = TrainSettings(lr=0.2, batch_size=20, router_epochs=3)
    train_router_linear(model, x, y, settings)
    signs = np.where(y == 0, 1.0, -1.0)
    step = 0.2 * 3 / 20 * (signs[:, None] * x.sum(axis=1)).sum(axis=0)
    torch.testing.assert_close(model.router[0].detach(), start[0] + torch.tensor(step).float())
    torch.testing.assert_close(model.router[1].detach(), start[1] - torch.tensor(step).float())


@pytest.mark.parametrize("mode", ["separate", "joint", "cnn"])
def test_a_short_training_run_reduces_the_loss(data: PatchDataset, mode: str) -> None:
    builders = {"separate": separate_pmoe, "joint": joint_pmoe, "cnn": patch_cnn}
    model = builders[mode](num_patches=16, patch_dim=64, seed=0)
    before = torch.nn.functional.cross_entropy(
        predict_logits(model, data.x_train), torch.from_numpy(data.y_train)
    ).item()
    history = train_model(
        model, data.x_train, data.y_train, mode, TrainSettings(epochs=40, router_epochs=5)
    )
    assert len(history.losses) == 40
    # Joint training starts slowly (routers at N(0, 1e-8), experts at N(0, 1e-4)): 5% is
    # what 40 epochs on 200 samples reliably give it; the others fall much further.
    assert history.losses[-1] < 0.95 * before
    assert accuracy(model, data.x_test, data.y_test) > 0.65
    if mode == "separate":
        assert history.router_losses[-1] < history.router_losses[0]
        # The linear-loss router already ranks most discriminative patches first (Fig. 8).
        top = discriminative_in_top(
            model, data.x_test, data.y_test, data.position_test, [4]
        )
        assert top[4] > 0.6


def test_joint_router_metrics_name_one_expert_per_class(data: PatchDataset) -> None:
    model = joint_pmoe(num_patches=16, patch_dim=64, seed=0)
    train_model(model, data.x_train, data.y_train, "joint", TrainSettings(epochs=3))
    hits = largest_gate_hits(
        model,
        (data.x_train, data.y_train, data.position_train),
        (data.x_test, data.y_test, data.position_test),
    )
    assert [hit.label for hit in hits] == [0, 1]
    assert all(0 <= hit.expert < 8 and 0.0 <= hit.fraction <= 1.0 for hit in hits)
    assert sum(hit.samples for hit in hits) == 200


def test_the_four_class_variant_trains_and_outputs_four_classes() -> None:
    data = digits_patches(num_train=200, num_test=200, discriminative=(0, 1, 2, 3), seed=1)
    assert data.classes == ("0", "1", "2", "3") and data.name == "digits-patches-4class"
    from sklearn.datasets import load_digits

    target = np.asarray(load_digits().target)
    assert np.isin(target[data.source_train], [0, 1, 2, 3]).sum(axis=1).tolist() == [1] * 200
    for mode in ("separate", "joint"):
        builder = separate_pmoe if mode == "separate" else joint_pmoe
        model = builder(num_patches=16, patch_dim=64, num_classes=4, seed=0)
        assert model.num_experts == (4 if mode == "separate" else 8)
        history = train_model(model, data.x_train, data.y_train, mode, TrainSettings(epochs=40))
        assert history.losses[-1] < history.losses[0]
        logits = predict_logits(model, data.x_test)
        assert logits.shape == (200, 4)
        assert set(logits.argmax(dim=1).tolist()) == {0, 1, 2, 3}
        assert accuracy(model, data.x_test, data.y_test) > 0.4  # chance is 0.25


def test_options_out_of_range_are_refused_by_name() -> None:
    with pytest.raises(PMoEConfigError) as caught:
        PatchMoE(num_patches=16, patch_dim=64, num_experts=2, patches_per_expert=17, hidden=4)
    assert caught.value.option == "patches_per_expert"
    with pytest.raises(PMoEConfigError) as caught:
        separate_pmoe(num_patches=16, patch_dim=64, num_classes=3)
    assert caught.value.option == "num_classes"
    with pytest.raises(PMoEConfigError) as caught:
        digits_patches(discriminative=(0, 1), irrelevant=(1, 2))
    assert caught.value.option == "irrelevant"
