"""Models, Voronoi losses and least-squares fits for seed 002's Theorems 1-5.

Paper: ../shared/papers/002_c2e0fbadc97d5f72.txt. Five regression models, each a true mixture
with k* = 2 atoms (the second with its gate fixed to zero, assumption (A.3)) fitted with
k = 3 components (the first true atom over-specified by two):

    kind          model                                                  theorem  rate
    sigmoid       softmax(w'x + b) gate, experts sigmoid(a'x/|x| + c)    Thm 1    polynomial
    linear        softmax(w'x + b) gate, experts a'x + c                 Thm 2    slower
    temp_linear   softmax((w'x + b)/tau), tau learned, sigmoid experts   Thm 3    slower
    temp_tanh     softmax((tanh(w'x) + b)/tau), tau learned, sigmoid     Thm 4    polynomial
    hier          two-level softmax gate (k1 = 2 groups known, 2 true /  Thm 5    polynomial
                  3 fitted experts per group), sigmoid experts

Experts take the normalised input x/|x| as the paper's example of a strongly identifiable
expert: sigmoid(a'x + c) on the raw input obeys the same PDE as a linear expert
(x * dE/dc = dE/da), so the normalisation is what makes it strongly identifiable.

`fit_one` is a plain function (no Ray): the benchmark runs it as Ray tasks, tests call it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

__all__ = [
    "KINDS",
    "PREDICTED",
    "THEOREM",
    "Params",
    "BOUNDS",
    "assemble",
    "fit_one",
    "regression",
    "sample",
    "start_near",
    "to_free",
    "true_params",
    "voronoi_loss",
]

Params = dict[str, torch.Tensor]

KINDS = ("sigmoid", "linear", "temp_linear", "temp_tanh", "hier")
THEOREM = {
    "sigmoid": "Thm 1", "linear": "Thm 2", "temp_linear": "Thm 3",
    "temp_tanh": "Thm 4", "hier": "Thm 5",
}
# What the theorem says about the Voronoi loss of the least-squares estimate.
PREDICTED = {
    "sigmoid": "polynomial", "linear": "slower", "temp_linear": "slower",
    "temp_tanh": "polynomial", "hier": "polynomial",
}
DIM = 2
NOISE_SD = 0.1
FITTED = 3  # components per mixture (k); the hierarchical model has 3 per group
# Fitted component i starts near (and is compared with) true atom OVERFIT_MAP[i].
OVERFIT_MAP = (0, 0, 1)

_F64 = torch.float64


def _t(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=_F64)


def true_params(kind: str) -> Params:
    """The true mixing measure G*, full form (the zero gate included, last atom)."""
    if kind == "hier":
        return {
            "beta1": _t([0.3, 0.0]),
            "w1": _t([[2.0, -1.0], [0.0, 0.0]]),
            "nu": _t([[0.2, 0.0], [-0.2, 0.0]]),
            "kappa": _t([[[-1.0, 2.0], [0.0, 0.0]], [[1.5, 1.0], [0.0, 0.0]]]),
            "eta": _t([[[2.0, 1.0, 0.5], [-1.5, 2.0, -0.5]],
                       [[1.0, -2.0, 0.0], [-2.0, -1.0, 1.0]]]),
        }
    eta = [[1.0, -1.0, 0.5], [-0.5, 1.5, -0.5]] if kind == "linear" else [
        [2.0, 1.0, 0.5], [-1.5, 2.0, -0.5]]
    params = {"beta": _t([0.5, 0.0]), "w": _t([[2.0, -1.0], [0.0, 0.0]]), "eta": _t(eta)}
    if kind in ("temp_linear", "temp_tanh"):
        params["tau"] = _t(0.5)
    return params


def _experts(kind: str, eta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Expert outputs, shape [n, *eta.shape[:-1]]; eta[..., :DIM] = a, eta[..., DIM] = c."""
    a, c = eta[..., :DIM], eta[..., DIM]
    if kind == "linear":
        return torch.einsum("nd,...d->n...", x, a) + c
    u = x / x.norm(dim=1, keepdim=True)
    return torch.sigmoid(torch.einsum("nd,...d->n...", u, a) + c)


def regression(kind: str, params: Params, x: torch.Tensor) -> torch.Tensor:
    """The mixture's regression function f_G(x), shape [n]."""
    if kind == "hier":
        g1 = torch.softmax(x @ params["w1"].T + params["beta1"], dim=1)
        g2 = torch.softmax(torch.einsum("nd,ijd->nij", x, params["kappa"]) + params["nu"], dim=2)
        return (g1 * (g2 * _experts(kind, params["eta"], x)).sum(2)).sum(1)
    score = x @ params["w"].T
    if kind == "temp_tanh":
        score = torch.tanh(score)
    logits = score + params["beta"]
    if "tau" in params:
        logits = logits / params["tau"]
    return (torch.softmax(logits, dim=1) * _experts(kind, params["eta"], x)).sum(1)


def sample(
    kind: str, n: int, generator: torch.Generator, noise_sd: float = NOISE_SD
) -> tuple[torch.Tensor, torch.Tensor]:
    """n draws of x ~ Uniform([-1, 1]^2), y = f_G*(x) + N(0, noise_sd^2)."""
    x = 2.0 * torch.rand(n, DIM, generator=generator, dtype=_F64) - 1.0
    noise = noise_sd * torch.randn(n, generator=generator, dtype=_F64)
    return x, regression(kind, true_params(kind), x) + noise


# The compact parameter space Theta of assumption (A.1): each coordinate within +-bound.
# Without it an over-specified component can take a vanishing gate mass and a saturated
# expert far from every true atom, fitting noise; the theorems assume Theta compact.
BOUNDS = {
    "beta": 3.0, "w": 5.0, "eta": 5.0, "log_tau": 3.0,
    "beta1": 3.0, "w1": 5.0, "nu": 3.0, "kappa": 5.0,
}


def to_free(values: Params) -> Params:
    """Unconstrained coordinates phi of parameters inside Theta: value = bound * tanh(phi)."""
    return {k: torch.atanh(v / BOUNDS[k]) for k, v in values.items()}


def assemble(kind: str, free: Params) -> Params:
    """Full parameters from the free ones: map phi into Theta and pin the last gate of each
    softmax to zero.

    Pinning removes the softmax's translation invariance, which would otherwise leave the
    Hessian singular in one direction at every point and make the Voronoi loss (not
    translation invariant) depend on where the optimiser drifted.
    """
    v = {k: BOUNDS[k] * torch.tanh(phi) for k, phi in free.items()}
    if kind == "hier":
        k1 = v["eta"].shape[0]
        return {
            "beta1": torch.cat([v["beta1"], torch.zeros(1, dtype=_F64)]),
            "w1": torch.cat([v["w1"], torch.zeros(1, DIM, dtype=_F64)]),
            "nu": torch.cat([v["nu"], torch.zeros(k1, 1, dtype=_F64)], dim=1),
            "kappa": torch.cat([v["kappa"], torch.zeros(k1, 1, DIM, dtype=_F64)], dim=1),
            "eta": v["eta"],
        }
    full = {
        "beta": torch.cat([v["beta"], torch.zeros(1, dtype=_F64)]),
        "w": torch.cat([v["w"], torch.zeros(1, DIM, dtype=_F64)]),
        "eta": v["eta"],
    }
    if "log_tau" in v:
        full["tau"] = v["log_tau"].exp()
    return full


def start_near(kind: str, generator: torch.Generator, scale: float = 0.1) -> Params:
    """Free parameter values (not phi) of a k = 3 fit: each true coordinate plus N(0, scale^2).

    The first true atom is split in two: both copies start from it (independently
    perturbed, which breaks their symmetry) with half its gate mass each.
    """
    truth = true_params(kind)

    def near(value: torch.Tensor) -> torch.Tensor:
        return value + scale * torch.randn(value.shape, generator=generator, dtype=_F64)

    idx = torch.tensor(OVERFIT_MAP)
    halve = torch.tensor([math.log(2.0), math.log(2.0), 0.0], dtype=_F64)
    if kind == "hier":
        return {
            "beta1": near(truth["beta1"][:1]),
            "w1": near(truth["w1"][:1]),
            "nu": near((truth["nu"][:, idx] - halve)[:, :2]),
            "kappa": near(truth["kappa"][:, idx][:, :2]),
            "eta": near(truth["eta"][:, idx]),
        }
    # With a temperature the masses are exp(beta / tau): halve them with beta - tau log 2.
    beta = truth["beta"][idx] - halve * truth.get("tau", torch.ones((), dtype=_F64))
    free = {"beta": near(beta[:2]), "w": near(truth["w"][idx][:2]), "eta": near(truth["eta"][idx])}
    if "tau" in truth:
        free["log_tau"] = near(truth["tau"].log())
    return free


def _cells(theta: torch.Tensor, theta_true: torch.Tensor) -> list[list[int]]:
    """Voronoi cells A_j (eq. 5): fitted atom i joins the nearest true atom (ties: lowest j)."""
    nearest = torch.cdist(theta, theta_true).argmin(dim=1).tolist()
    return [[i for i, j in enumerate(nearest) if j == jt] for jt in range(theta_true.shape[0])]


def _cell_loss(
    mass: torch.Tensor, mass_true: torch.Tensor, parts: list[torch.Tensor],
    parts_true: list[torch.Tensor], theta_dims: int,
) -> float:
    """The Voronoi loss of one flat mixture (eq. 6; eq. 18 with tau among `parts`).

    mass: [k] fitted masses exp(beta_i) (or exp(beta_i / tau)); parts: per-parameter blocks
    [k, *] whose norms are summed (exact cells) or whose squared norms are (over-specified
    cells). The first theta_dims columns of the concatenated parts define the cells.
    """
    theta = torch.cat(parts, dim=1)
    theta_true = torch.cat(parts_true, dim=1)
    loss = 0.0
    for j, cell in enumerate(_cells(theta[:, :theta_dims], theta_true[:, :theta_dims])):
        loss += abs(float(mass[cell].sum()) - float(mass_true[j]))
        power = 1 if len(cell) == 1 else 2
        for i in cell:
            dist = sum(float((p[i] - q[j]).norm()) ** power for p, q in zip(parts, parts_true,
                                                                             strict=True))
            loss += float(mass[i]) * dist
    return loss


def voronoi_loss(kind: str, fitted: Params, truth: Params | None = None) -> float:
    """The paper's Voronoi loss between a fitted (full) mixture and the truth.

    sigmoid, linear: L1 (eq. 6) with eta = (a, c); temp_*: L4 (eq. 18), masses
    exp(beta / tau) and |tau - tau*| beside the other distances (the shared tau does not
    move the cells); hier: L5 (eq. 25), first-level cells by w, second-level by (kappa, eta).
    """
    truth = true_params(kind) if truth is None else truth
    if kind != "hier":
        parts = [fitted["w"], fitted["eta"]]
        parts_true = [truth["w"], truth["eta"]]
        mass, mass_true = fitted["beta"].exp(), truth["beta"].exp()
        if "tau" in truth:
            mass, mass_true = (fitted["beta"] / fitted["tau"]).exp(), (
                truth["beta"] / truth["tau"]).exp()
            parts.append(fitted["tau"].expand(fitted["w"].shape[0], 1))
            parts_true.append(truth["tau"].expand(truth["w"].shape[0], 1))
        return _cell_loss(mass, mass_true, parts, parts_true, 2 * DIM + 1)
    loss = 0.0
    mass1, mass1_true = fitted["beta1"].exp(), truth["beta1"].exp()
    for j1, cell1 in enumerate(_cells(fitted["w1"], truth["w1"])):
        loss += abs(float(mass1[cell1].sum()) - float(mass1_true[j1]))
        for i1 in cell1:
            inner = _cell_loss(
                fitted["nu"][i1].exp(), truth["nu"][j1].exp(),
                [fitted["kappa"][i1], fitted["eta"][i1]], [truth["kappa"][j1], truth["eta"][j1]],
                2 * DIM + 1,
            )
            loss += float(mass1[i1]) * (float((fitted["w1"][i1] - truth["w1"][j1]).norm()) + inner)
    return loss


def _objective(kind: str, free: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (y - regression(kind, assemble(kind, free), x)).square().mean()


def fit_one(
    kind: str, n: int, seed: int, replicate: int, *, start_scale: float = 0.1,
    max_iter: int = 2000, grad_tol: float = 1e-8,
) -> dict[str, Any]:
    """Draw n points from kind's true mixture, fit k = 3 by least squares, score the fit.

    Full-batch L-BFGS with a strong-Wolfe line search in float64 from a start near the
    truth; it runs in chunks until the largest gradient entry of the mean squared error is
    below grad_tol or max_iter iterations are spent. A fit is `failed` when its objective
    is not finite, it did not reach grad_tol, or it ends above the objective of the true
    parameters (a feasible point, so the least-squares estimate can only be at or below it).
    Failed fits are scored like the others; callers must keep them.
    """
    start = time.perf_counter()
    state = np.random.SeedSequence([seed, KINDS.index(kind), n, replicate]).generate_state(1)
    gen = torch.Generator().manual_seed(int(state[0]))
    x, y = sample(kind, n, gen)
    start_values = to_free(start_near(kind, gen, start_scale))
    free = {k: v.requires_grad_(True) for k, v in start_values.items()}
    opt = torch.optim.LBFGS(
        list(free.values()), lr=1.0, max_iter=200, history_size=50,
        tolerance_grad=grad_tol, tolerance_change=1e-16, line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = _objective(kind, free, x, y)
        value.backward()  # type: ignore[no-untyped-call]
        return value

    iterations, grad_max, previous = 0, math.inf, math.inf
    while iterations < max_iter:
        opt.step(closure)  # type: ignore[no-untyped-call]
        iterations = int(opt.state[opt._params[0]]["n_iter"])
        value = float(closure().detach())
        grad_max = max(float(p.grad.abs().max()) for p in free.values() if p.grad is not None)
        if not math.isfinite(value) or grad_max <= grad_tol or value >= previous:
            break
        previous = value
    with torch.no_grad():
        fitted = assemble(kind, {k: v.detach() for k, v in free.items()})
        objective = float(_objective(kind, {k: v.detach() for k, v in free.items()}, x, y))
        truth = true_params(kind)
        objective_truth = float(0.5 * (y - regression(kind, truth, x)).square().mean())
        x_eval = 2.0 * torch.rand(20_000, DIM, generator=torch.Generator().manual_seed(7),
                                  dtype=_F64) - 1.0
        reg_error = float((regression(kind, fitted, x_eval) - regression(kind, truth, x_eval))
                          .square().mean().sqrt())
    reasons = []
    if not math.isfinite(objective):
        reasons.append("non-finite objective")
    if not grad_max <= grad_tol:
        reasons.append(f"gradient {grad_max:.1e} > {grad_tol:.0e}")
    # Relative slack for float64 rounding of a sum of n squares.
    if objective > objective_truth * (1 + 1e-12):
        reasons.append("objective above the truth's")
    return {
        "kind": kind, "n": n, "seed": seed, "replicate": replicate,
        "voronoi_loss": voronoi_loss(kind, fitted, truth) if math.isfinite(objective) else math.inf,
        "regression_rmse": reg_error, "objective": objective, "objective_truth": objective_truth,
        "iterations": iterations, "grad_max": grad_max, "failed": bool(reasons),
        "reason": "; ".join(reasons), "seconds": time.perf_counter() - start,
        "fitted": {k: v.tolist() for k, v in fitted.items()},
    }
