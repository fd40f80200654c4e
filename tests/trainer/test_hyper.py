"""trainer.hyper: θ layout, generate + primary forward, batch invariance, datasets, training."""

from __future__ import annotations

import pytest
import torch

from trainer import TrainerError
from trainer.hyper import (
    ROTATION_CLASSES,
    EmbeddingModel,
    HyperConfigError,
    HyperNetwork,
    PrimarySpec,
    ThetaLayoutError,
    TrainSettings,
    angle_to_class,
    count_parameters,
    evaluate_error,
    generate,
    hyper_synthetic,
    paper_embedding_dim,
    primary_forward,
    primary_forward_stacked,
    rotate_digits,
    rotate_images,
    stack_thetas,
    train_model,
)

pytestmark = pytest.mark.unit


def _hand_forward(x: torch.Tensor, theta: dict[str, torch.Tensor], bias: bool) -> torch.Tensor:
    """g written out with nn.functional, layer by layer, as an independent reference."""
    hidden = x.double() @ theta["layers.0.weight"].double().T
    if bias:
        hidden = hidden + theta["layers.0.bias"].double()
    hidden = torch.relu(hidden)
    out = hidden @ theta["layers.1.weight"].double().T
    if bias:
        out = out + theta["layers.1.bias"].double()
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_generate_then_primary_forward_equals_hand_written_g(bias: bool) -> None:
    torch.manual_seed(0)
    spec = PrimarySpec(input_dim=7, hidden_dims=(10,), output_dim=3, bias=bias)
    f = HyperNetwork(condition_dim=5, primary=spec, depth=2)
    condition, x = torch.randn(5), torch.randn(9, 7)
    theta = generate(f, condition)
    assert {k: tuple(v.shape) for k, v in theta.items()} == {
        "layers.0.weight": (10, 7), "layers.1.weight": (3, 10),
        **({"layers.0.bias": (10,), "layers.1.bias": (3,)} if bias else {}),
    }
    expected = _hand_forward(x, theta, bias)
    torch.testing.assert_close(primary_forward(x, theta, spec).double(), expected,
                               rtol=1e-5, atol=1e-6)
    # The training path f(x, I) computes the same function of (x, I).
    with torch.no_grad():
        direct = f(x, condition.expand(9, 5))
    torch.testing.assert_close(direct.double(), expected, rtol=1e-5, atol=1e-6)


def test_generated_tensors_are_the_layout_slices_of_f_output() -> None:
    torch.manual_seed(1)
    f = HyperNetwork(4, PrimarySpec(6, (10,), 12), depth=1)
    condition = torch.randn(4)
    flat = f.f(condition).detach()
    theta = generate(f, condition)
    for slot in f.layout.slots:
        assert torch.equal(theta[slot.name].flatten(), flat[slot.offset : slot.end])
    assert torch.equal(f.layout.join(theta), flat)


@pytest.mark.parametrize(
    "spec",
    [PrimarySpec(64, (10,), 12), PrimarySpec(3, (10, 7), 2, bias=True), PrimarySpec(1, (), 1)],
)
def test_layout_covers_f_output_without_gaps_or_overlaps(spec: PrimarySpec) -> None:
    layout = spec.layout()
    covered = torch.zeros(layout.size, dtype=torch.long)
    for slot in layout.slots:
        covered[slot.offset : slot.end] += 1
    assert bool((covered == 1).all())
    widths = spec.widths
    pairs = zip(widths, widths[1:], strict=False)
    expected = sum(a * b + (b if spec.bias else 0) for a, b in pairs)
    assert layout.size == expected
    f = HyperNetwork(2, spec, depth=0)
    assert f.f[-1].out_features == layout.size
    assert len(set(layout.names)) == len(layout.slots)


def test_paper_rotation_layout_is_d_times_10_plus_10_times_12() -> None:
    layout = PrimarySpec(64, (10,), 12).layout()
    assert [(s.name, s.shape, s.offset) for s in layout.slots] == [
        ("layers.0.weight", (10, 64), 0), ("layers.1.weight", (12, 10), 640)]
    assert layout.size == 760


@pytest.mark.parametrize(
    "spec", [PrimarySpec(64, (10,), 12), PrimarySpec(16, (10,), 1), PrimarySpec(5, (7,), 3,
                                                                              bias=True)]
)
def test_a_row_output_does_not_depend_on_other_conditions_in_its_batch(
    spec: PrimarySpec,
) -> None:
    torch.manual_seed(2)
    d = spec.input_dim
    f = HyperNetwork(64, spec, depth=2)
    conditions = torch.randn(6, 64)
    thetas = [generate(f, c) for c in conditions]
    x = torch.randn(300, d)
    index = torch.randint(0, 6, (300,))
    together = primary_forward_stacked(x, stack_thetas(thetas), index, spec)
    # Alone: each row with only its own θ, in batches of one row and of its own condition.
    for k in range(6):
        rows = (index == k).nonzero().flatten()
        own = primary_forward(x[rows], thetas[k], spec)
        assert torch.equal(together[rows], own)
        for r in rows[:5].tolist():
            assert torch.equal(together[r], primary_forward(x[r : r + 1], thetas[k], spec)[0])
    # Reordered, and with a different set of other conditions stacked beside it.
    perm = torch.randperm(300)
    assert torch.equal(primary_forward_stacked(x[perm], stack_thetas(thetas), index[perm],
                                               spec), together[perm])
    others = stack_thetas([thetas[3], generate(f, torch.randn(64)), thetas[0]])
    keep = (index == 0) | (index == 3)
    remap = torch.where(index[keep] == 0, 2, 0)
    assert torch.equal(primary_forward_stacked(x[keep], others, remap, spec), together[keep])
    # generate over a stack of conditions equals generating one by one.
    batched = generate(f, conditions)
    for k in range(6):
        for name, tensor in batched.items():
            torch.testing.assert_close(tensor[k], thetas[k][name], rtol=1e-6, atol=1e-7)


def test_wrong_shapes_are_refused_with_the_tensor_name() -> None:
    spec = PrimarySpec(4, (10,), 2)
    f = HyperNetwork(3, spec, depth=0)
    theta = generate(f, torch.randn(3))
    with pytest.raises(ThetaLayoutError) as info:
        primary_forward(torch.randn(2, 5), theta, spec)
    assert info.value.name == "x"
    bad = dict(theta, **{"layers.1.weight": torch.zeros(3, 10)})
    with pytest.raises(ThetaLayoutError) as info:
        primary_forward(torch.randn(2, 4), bad, spec)
    assert info.value.name == "layers.1.weight" and info.value.expected == (2, 10)
    with pytest.raises(ThetaLayoutError) as info:
        f(torch.randn(2, 4), torch.randn(2, 4))
    assert info.value.name == "condition"
    assert isinstance(info.value, TrainerError)
    with pytest.raises(HyperConfigError):
        PrimarySpec(0, (10,), 1)


def test_parameter_counts_match_the_paper_architecture() -> None:
    f = HyperNetwork(64, PrimarySpec(64, (10,), 12), depth=4)
    assert f.primary_parameters() == 760
    assert count_parameters(f) == (64 * 100 + 100) + 4 * (100 * 100 + 100) + (100 * 760 + 760)
    q = EmbeddingModel(64, 64, 12, depth=4)
    assert q.embedding_dim == paper_embedding_dim(64) == 650
    assert count_parameters(q.q) == (650 + 64) * 10 + 10 + 10 * 12 + 12


def test_rotate_digits_shapes_and_labels() -> None:
    data = rotate_digits(rotations_per_image=2, seed=0)
    assert data.x_train.shape == data.condition_train.shape
    assert data.x_train.shape[1] == 64 == data.condition_dim
    assert data.x_train.shape[0] + data.x_test.shape[0] == 2 * 1797
    assert data.y_train.dtype == torch.long and data.output_dim == ROTATION_CLASSES
    labels = torch.cat([data.y_train, data.y_test])
    assert int(labels.min()) == 0 and int(labels.max()) == ROTATION_CLASSES - 1
    assert len(torch.unique(labels)) == ROTATION_CLASSES
    # Each upright image appears rotations_per_image times in a row; test images are unseen.
    assert torch.equal(data.condition_train[0], data.condition_train[1])
    train_set = {tuple(row.tolist()) for row in data.condition_train[::2]}
    assert not any(tuple(row.tolist()) in train_set for row in data.condition_test[::2])


def test_angle_classes_are_the_circularly_nearest_multiple_of_30() -> None:
    degrees = torch.tensor([0.0, 14.9, 15.1, 44.0, 181.0, 344.9, 345.1, 359.9])
    assert angle_to_class(degrees).tolist() == [0, 0, 1, 1, 6, 11, 0, 0]


def test_rotate_images_matches_rot90_and_identity() -> None:
    images = torch.rand(3, 8, 8)
    turned = rotate_images(images, torch.tensor([0.0, 90.0, 180.0]))
    torch.testing.assert_close(turned[0], images[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(turned[1], torch.rot90(images[1], 1, (0, 1)), rtol=0, atol=1e-5)
    torch.testing.assert_close(turned[2], torch.rot90(images[2], 2, (0, 1)), rtol=0, atol=1e-5)


def test_hyper_synthetic_target_is_x_dot_softmax() -> None:
    data = hyper_synthetic(num_train=50, num_test=10, input_dim=5, condition_dim=3, seed=1)
    assert data.y_train.shape == (50, 1) and data.x_test.shape == (10, 5)
    # <x, h> with h on the simplex lies between min(x) and max(x).
    x, y = data.x_train, data.y_train[:, 0]
    assert bool((y <= x.max(1).values + 1e-6).all() and (y >= x.min(1).values - 1e-6).all())
    again = hyper_synthetic(num_train=50, num_test=10, input_dim=5, condition_dim=3, seed=1)
    assert torch.equal(again.y_train, data.y_train)


@pytest.mark.parametrize("kind", ["hyper", "embedding"])
def test_a_short_training_run_reduces_the_loss(kind: str) -> None:
    torch.manual_seed(0)
    data = hyper_synthetic(num_train=512, num_test=128, input_dim=4, condition_dim=4,
                           hidden=8, logit_scale=5.0, seed=0)
    model: torch.nn.Module
    if kind == "hyper":
        model = HyperNetwork(4, PrimarySpec(4, (10,), 1), depth=1, width=32)
    else:
        model = EmbeddingModel(4, 4, 1, depth=1, width=32)
    before = evaluate_error(model, data, "train")
    history = train_model(model, data, TrainSettings(lr=0.05, epochs=5, batch_size=32))
    assert not history.diverged and len(history.losses) == 5
    assert history.losses[-1] < 0.5 * history.losses[0]
    assert evaluate_error(model, data, "train") < 0.5 * before
