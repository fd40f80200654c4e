from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer import class_weights, make_loss, predict, train_network

pytestmark = pytest.mark.unit


def test_training_fits_a_linear_map_and_leaves_eval_mode() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(256, 3, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3
    model = nn.Linear(3, 1)
    before = float(nn.functional.mse_loss(predict(model, x), y))
    result = train_network(
        model, x, y, loss_fn=make_loss("mse", y), epochs=60, lr=0.05, batch_size=32,
        generator=gen,
    )
    after = float(nn.functional.mse_loss(predict(model, x), y))
    assert after < 1e-3 < before
    assert result.steps == 60 * 8 and result.epochs == 60
    assert not model.training


def test_on_epoch_sees_every_epoch_loss() -> None:
    seen: list[tuple[int, float]] = []
    x = torch.rand(10, 2)
    train_network(
        nn.Linear(2, 1), x, x[:, :1], loss_fn=make_loss("mse", x), epochs=3, lr=1e-2,
        batch_size=4, on_epoch=lambda e, loss: seen.append((e, loss)),
    )
    assert [e for e, _ in seen] == [0, 1, 2]


def test_empty_cell_trains_nothing() -> None:
    result = train_network(
        nn.Linear(2, 1), torch.zeros(0, 2), torch.zeros(0, 1),
        loss_fn=make_loss("mse", torch.zeros(0)), epochs=5, lr=1e-2, batch_size=4,
    )
    assert result.steps == 0


def test_batchnorm_skips_single_row_batches() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x = torch.rand(5, 2)
    labels = torch.tensor([0, 1, 0, 1, 1])
    # 5 rows in batches of 2: the last batch has one row and would raise in BatchNorm.
    result = train_network(
        model, x, labels, loss_fn=make_loss("ce", labels, 2), epochs=2, lr=1e-2, batch_size=2,
    )
    assert result.steps == 4


def test_class_weights_are_inverse_frequencies_of_the_cell() -> None:
    labels = torch.tensor([0, 0, 0, 2])
    weights = class_weights(labels, 3)
    # n / (classes present · count): 4/(2·3) and 4/(2·1); absent class keeps 1.
    torch.testing.assert_close(weights, torch.tensor([4 / 6, 1.0, 2.0]))


def test_weighted_ce_equals_torch_weighted_cross_entropy() -> None:
    labels = torch.tensor([0, 0, 0, 2])
    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    loss = make_loss("weighted-ce", labels, 3)(logits, labels)
    logp = torch.log_softmax(logits, dim=1)
    w = torch.tensor([4 / 6, 1.0, 2.0])[labels]
    expected = -(w * logp[torch.arange(4), labels]).sum() / w.sum()
    torch.testing.assert_close(loss, expected)


def test_rescaled_output_layer_serves_scale_times_f_plus_shift() -> None:
    from trainer._train import rescale_output, target_scaling

    model = nn.Sequential(nn.Linear(3, 5), nn.PReLU(), nn.Linear(5, 2))
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    before = predict(model, x)
    scale, shift = torch.tensor([2.0, -0.5]), torch.tensor([10.0, 1.0])
    rescale_output(model, scale, shift)
    torch.testing.assert_close(predict(model, x), before * scale + shift)
    y = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    mean, std = target_scaling(y)
    # A constant column keeps std 1 instead of dividing by zero.
    torch.testing.assert_close(mean, torch.tensor([2.0, 5.0]))
    torch.testing.assert_close(std, torch.tensor([1.0, 1.0]))


def test_validation_rows_keep_the_epoch_that_scores_best_on_them() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(64, 2, generator=gen)
    y = x[:, :1] * 3 - x[:, 1:] + 0.1 * torch.randn(64, 1, generator=gen)
    xv, yv = x[48:], y[48:]
    model = nn.Linear(2, 1)
    # A learning rate this high makes Adam's iterates wander, so the best epoch is not the last.
    seen = [float(nn.functional.mse_loss(predict(model, xv), yv))]

    def record(epoch: int, loss: float) -> None:
        with torch.no_grad():
            seen.append(float(nn.functional.mse_loss(model(xv), yv)))
        final_weights.append(model.weight.detach().clone())

    final_weights: list[torch.Tensor] = []
    result = train_network(
        model, x[:48], y[:48], loss_fn=make_loss("mse", y), epochs=30, lr=0.3, batch_size=8,
        generator=gen, on_epoch=record, validation=(xv, yv),
    )
    best = min(range(len(seen)), key=seen.__getitem__)
    assert 0 < best < 30, "the case must have a best epoch before the last"
    assert result.best_epoch == best
    assert result.validation_loss == pytest.approx(seen[best])
    assert float(nn.functional.mse_loss(predict(model, xv), yv)) == pytest.approx(seen[best])
    torch.testing.assert_close(model.weight, final_weights[best - 1])
    assert not model.training


def test_without_validation_rows_the_last_epoch_is_kept() -> None:
    x = torch.rand(16, 2)
    result = train_network(
        nn.Linear(2, 1), x, x[:, :1], loss_fn=make_loss("mse", x), epochs=2, lr=1e-2,
        batch_size=4, validation=(x[:0], x[:0, :1]),
    )
    assert result.best_epoch is None and result.epochs == 2


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_the_foreach_optimizer_computes_the_per_parameter_loops_bits(optimizer: str) -> None:
    # `adam` takes torch's foreach path on CPU too, for speed alone: a build's weights must
    # not change with it.
    from experts_store import ExpertArch, ExpertMLP
    from trainer._train import adam

    arch = ExpertArch(widths=(4, 32, 32, 2), batchnorm=False, activation="prelu")
    models = [ExpertMLP(arch, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    reference_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    optimizers = [
        adam(models[0].parameters(), lr=1e-2, optimizer=optimizer),  # type: ignore[arg-type]
        reference_cls(models[1].parameters(), lr=1e-2, foreach=False),
    ]
    gen = torch.Generator().manual_seed(2)
    for _ in range(25):
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
        for model, opt in zip(models, optimizers, strict=True):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
    first, second = (m.state_dict() for m in models)
    assert all(torch.equal(first[k], second[k]) for k in first)
    start = ExpertMLP(arch, generator=torch.Generator().manual_seed(1)).state_dict()
    assert all(not torch.equal(first[k], start[k]) for k in first)  # every tensor trained
