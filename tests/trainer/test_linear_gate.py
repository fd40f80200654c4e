"""The learned linear router (trainer/_linear_gate.py): τ is set or scheduled, never a
parameter, and the trained router's served top-1 is the argmax of its logits."""

from __future__ import annotations

import pytest
import torch

from experts_store import ExpertArch, ExpertMLP
from router import Gate, PrototypeTree, lift_rows, linear_lift, unlift
from trainer import BuildConfig, ConfigError
from trainer._linear_gate import LinearRouterMixture, TemperatureSchedule, learned_linear_router

pytestmark = pytest.mark.unit


def test_the_trained_routers_top1_is_the_argmax_of_its_logits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(400, 2, generator=g) * 2 - 1
    y = (x[:, :1] ** 2 - x[:, 1:]).sin()
    networks = [ExpertMLP(ExpertArch((2, 8, 1), activation="tanh"), generator=g)
                for _ in range(6)]
    w, b = learned_linear_router(
        x, y, networks, loss_fn=torch.nn.functional.mse_loss,
        schedule=TemperatureSchedule(1.0, 0.3), epochs=3, lr=1e-2, router_lr=1e-2,
        batch_size=64, generator=g,
    )
    lifted = linear_lift(w, b)
    assert torch.equal(unlift(lifted)[0], w) and torch.equal(unlift(lifted)[1], b)
    tree = PrototypeTree.build(lifted, branching=2)
    served = tree.gate(lift_rows(x), Gate(top_k=1, mode="exact")).experts[:, 0]
    logits = x.double() @ w.double().T + b.double()
    assert torch.equal(served, logits.argmax(dim=1))


def test_temperature_is_never_a_parameter_and_follows_its_schedule() -> None:
    mixture = LinearRouterMixture(torch.zeros(3, 2), torch.zeros(3),
                                  [ExpertMLP(ExpertArch((2, 1))) for _ in range(3)])
    assert "temperature" not in dict(mixture.named_parameters())
    schedule = TemperatureSchedule(1.0, 0.1)
    taus = [schedule.at(e, 5) for e in range(5)]
    assert taus[0] == 1.0 and taus[-1] == pytest.approx(0.1) and taus == sorted(taus, reverse=True)
    assert TemperatureSchedule(0.5, 0.5).at(3, 5) == 0.5


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"gate_temperature_schedule": (1.0, 0.1)}, "gate_temperature_schedule"),
        ({"gate": "learned-linear", "gate_temperature_schedule": (1.0, 0.0)},
         "gate_temperature_schedule"),
        ({"gate": "learned-linear", "temperature": 0.5, "gate_temperature_schedule": (1.0, 0.1)},
         "gate_temperature_schedule"),
        ({"gate": "learned-linear", "prototypes": "kmeans"}, "prototypes"),
        ({"expert_activation": "swish"}, "expert_activation"),
    ],
)
def test_bad_gate_options_name_the_option(options: dict[str, object], option: str) -> None:
    config = BuildConfig(out="x", dataset="ackley2d", **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        config.validate()
    assert info.value.option == option
