"""Paper 004 (compositional sparsity, Thm 7): dense vs graph-shaped networks vs MoMLPs.

Target: the binary tree on d inputs (d - 1 nodes), h(a, b) = tanh(2ab + a - b) at every node,
x ~ U[-1, 1]^d. Models at a matched total-parameter budget P (each sized to the closest
width; exact counts recorded) and the same training rows N and epochs:

    A  dense deep MLP, 3 hidden layers                     (d -> w -> w -> w -> 1)
    B  dense one-hidden-layer MLP                          (d -> w -> 1)
    C  the known tree graph, one small MLP per node        (2 -> w -> w -> 1 per node, K_v = 1)
    D  the flat MoMLP: Algorithm 2 in-process (eq.-39 prototypes, deepen, one expert per
       cell; trainer's own pieces), K = 8 experts d -> w -> w -> 1
    Dq D whose experts train K x EPOCHS epochs on their N/K rows: as many row passes (and
       gradient steps) each as the other models' networks take over all N (D's experts take
       1/12 of them: at equal epochs D is also a smaller training budget)
    E  the compositional MoMLP: the tree with K_v = 4 experts per node, trained end to end
       (soft gates, internal prototypes refitted, hardened, hard fine-tune)

Adam (lr 3e-3, batch 128, the same epochs for every model; D and E split theirs between
phases), MSE on 4,000 fresh test rows, E and D evaluated hard (one expert per node / row).
Every run is a Ray task (embedded Ray, 2 CPUs). One JSON line per figure; --raw per run.

    python benchmarks/seed004_composition.py --quick   # d = 8, N in {1000, 4000}, 3 seeds
    python benchmarks/seed004_composition.py           # d = 8 and 16, N up to 16000, 2 budgets
    python benchmarks/seed004_composition.py --points 16:8:1000,16:8:4000   # chosen points
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _jobs import gather_rows  # this folder, first on sys.path when run as a script
from _paths import shown

HERE = Path(__file__).resolve().parent
EPOCHS = 60
LR = 3e-3
BATCH = 128
NUM_TEST = 4000
MODELS = ("A", "B", "C", "D", "Dq", "E")
LABELS = {"A": "A dense deep", "B": "B dense 1-hidden", "C": "C tree net",
          "D": "D flat MoMLP", "Dq": "D, K x expert epochs", "E": "E compositional MoMLP"}
FLAT_EXPERTS = 8
NODE_EXPERTS = 4

# (d, node hidden width of E (sets the budget P), N) per plan; every point runs 3 seeds.
PLANS: dict[str, list[tuple[int, int, int]]] = {
    "quick": [(8, 8, 1000), (8, 8, 4000)],
    "full": [(8, 8, 1000), (8, 8, 4000), (8, 8, 16000), (8, 4, 4000),
             (16, 8, 1000), (16, 8, 4000), (16, 8, 16000), (16, 4, 4000)],
}
SEEDS = 3


def tree_target(x: Any) -> Any:
    import torch

    values = list(x.T)
    while len(values) > 1:
        values = [torch.tanh(2 * a * b + a - b) for a, b in zip(values[::2], values[1::2],
                                                                strict=True)]
    return values[0][:, None]


def closest_width(params_of: Any, budget: int) -> int:
    """The width w whose parameter count params_of(w) is closest to budget."""
    best = min(range(1, 4000), key=lambda w: abs(params_of(w) - budget))
    return int(best)


def sized(d: int, node_width: int) -> dict[str, Any]:
    """Architectures of A-E with E's total parameters (prototypes included) as the budget."""
    from experts_store import ExpertArch

    nodes = d - 1

    def arch(widths: tuple[int, ...]) -> int:
        return ExpertArch(widths=widths).num_parameters()

    budget = nodes * NODE_EXPERTS * (arch((2, node_width, node_width, 1)) + 2)
    w_a = closest_width(lambda w: arch((d, w, w, w, 1)), budget)
    w_b = closest_width(lambda w: arch((d, w, 1)), budget)
    w_c = closest_width(lambda w: nodes * arch((2, w, w, 1)), budget)
    w_d = closest_width(lambda w: FLAT_EXPERTS * (arch((d, w, w, 1)) + d), budget)
    return {"budget": budget, "A": w_a, "B": w_b, "C": w_c, "D": w_d, "Dq": w_d, "E": node_width}


def run_one(model: str, d: int, node_width: int, n_train: int, seed: int) -> dict[str, Any]:
    """Train one model on seed `seed`'s data; its hard test MSE and parameter counts."""
    import torch

    from experts_store import ExpertArch, ExpertMLP
    from trainer import train_network
    from trainer.graph import (
        CompositionalMoMLP,
        GraphSpec,
        GraphTraining,
        NodeSpec,
        binary_tree_spec,
        train_end_to_end,
        train_nodewise,
    )

    torch.set_num_threads(1)
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(1000 + seed)
    x_test = torch.rand(NUM_TEST, d, generator=gen) * 2 - 1
    x = torch.rand(n_train, d, generator=gen) * 2 - 1
    y, y_test = tree_target(x), tree_target(x_test)
    widths = sized(d, node_width)
    w = widths[model]
    torch.manual_seed(seed)
    total = active = 0
    if model in ("A", "B"):
        hidden = (w, w, w) if model == "A" else (w,)
        net = ExpertMLP(ExpertArch(widths=(d, *hidden, 1)), generator=gen)
        train_network(net, x, y, loss_fn=torch.nn.functional.mse_loss, epochs=EPOCHS, lr=LR,
                      batch_size=BATCH, generator=gen)
        with torch.no_grad():
            pred = net(x_test)
        total = active = net.num_parameters()
    elif model == "C":
        tree = CompositionalMoMLP(binary_tree_spec(d, experts=1, hidden=(w, w)), d, seed=seed)
        train_end_to_end(tree, x, y, GraphTraining(soft_epochs=EPOCHS, hard_epochs=0, lr=LR,
                                                   batch_size=BATCH, seed=seed))
        with torch.no_grad():
            pred = tree.forward_hard(x_test).outputs
        total = active = tree.total_parameters()
    elif model in ("D", "Dq"):
        node = NodeSpec("flat", tuple(f"x:{i}" for i in range(d)), (d, w, w, 1),
                        experts=FLAT_EXPERTS, branching=4)
        flat = CompositionalMoMLP(GraphSpec((node,), ("flat",)), d, seed=seed)
        expert_epochs = EPOCHS * FLAT_EXPERTS if model == "Dq" else EPOCHS - EPOCHS // 3
        train_nodewise(flat, x, {"flat": y}, GraphTraining(
            prototype_epochs=EPOCHS // 3, expert_epochs=expert_epochs, lr=LR,
            batch_size=BATCH, seed=seed))
        with torch.no_grad():
            pred = flat.forward_hard(x_test).outputs
        total, active = flat.total_parameters(), flat.active_parameters()
    else:
        graph = CompositionalMoMLP(binary_tree_spec(d, experts=NODE_EXPERTS, hidden=(w, w)), d,
                                   seed=seed)
        train_end_to_end(graph, x, y, GraphTraining(
            soft_epochs=EPOCHS // 2, hard_epochs=EPOCHS - EPOCHS // 2, lr=LR,
            batch_size=BATCH, seed=seed))
        with torch.no_grad():
            pred = graph.forward_hard(x_test).outputs
        total, active = graph.total_parameters(), graph.active_parameters()
    mse = float(((pred - y_test) ** 2).mean())
    return {"model": model, "d": d, "node_width": node_width, "budget": widths["budget"],
            "width": w, "train_size": n_train, "seed": seed, "test_mse": mse,
            "target_variance": float(y_test.var()), "params": total, "active_params": active,
            "train_seconds": round(time.perf_counter() - started, 2)}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (d, budget, N): median MSE per model, per-seed wins, and the two gaps."""
    groups: dict[tuple[int, int, int], dict[str, dict[int, dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(dict))
    for row in rows:
        groups[(row["d"], row["node_width"], row["train_size"])][row["model"]][row["seed"]] = row
    figures = []
    for (d, node_width, n), by_model in sorted(groups.items()):
        seeds = sorted(set.intersection(*(set(by_model[m]) for m in MODELS)))
        mse = {m: [by_model[m][s]["test_mse"] for s in seeds] for m in MODELS}
        e_beats_d = sum(mse["E"][i] < mse["D"][i] for i in range(len(seeds)))
        e_beats_dq = sum(mse["E"][i] < mse["Dq"][i] for i in range(len(seeds)))
        c_beats_ab = sum(mse["C"][i] < min(mse["A"][i], mse["B"][i]) for i in range(len(seeds)))
        med = {m: statistics.median(v) for m, v in mse.items()}
        figures.append({
            "figure": "mse", "d": d, "train_size": n, "node_width": node_width,
            "budget": by_model["E"][seeds[0]]["budget"], "seeds": len(seeds),
            "median_test_mse": {m: round(v, 6) for m, v in med.items()},
            "params": {m: by_model[m][seeds[0]]["params"] for m in MODELS},
            "active_params": {m: by_model[m][seeds[0]]["active_params"] for m in MODELS},
            "target_variance": round(by_model["E"][seeds[0]]["target_variance"], 4),
            "E_beats_D_seeds": e_beats_d, "E_beats_Dq_seeds": e_beats_dq,
            "C_beats_A_and_B_seeds": c_beats_ab,
            "gap_D_over_E": round(med["D"] / med["E"], 3),
            "gap_Dq_over_E": round(med["Dq"] / med["E"], 3),
            "gap_bestAB_over_C": round(min(med["A"], med["B"]) / med["C"], 3),
            "median_train_seconds": {m: statistics.median(
                by_model[m][s]["train_seconds"] for s in seeds) for m in MODELS},
        })
    return figures


def plot(figures: list[dict[str, Any]], out: Path, tag: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for d in sorted({f["d"] for f in figures}):
        mine = [f for f in figures if f["d"] == d]
        widest = max(f["node_width"] for f in mine)
        by_n = sorted((f for f in mine if f["node_width"] == widest), key=lambda f: f["train_size"])
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
        for m in MODELS:
            left.plot([f["train_size"] for f in by_n], [f["median_test_mse"][m] for f in by_n],
                      marker="o", label=LABELS[m])
        left.set(xscale="log", yscale="log", xlabel="training samples N",
                 ylabel="test MSE (median of seeds)", title=f"d = {d}, P ~ {by_n[0]['budget']}")
        left.legend(fontsize=7)
        n_mid = sorted({f["train_size"] for f in mine})[len({f["train_size"] for f in mine}) // 2]
        by_p = sorted((f for f in mine if f["train_size"] == n_mid), key=lambda f: f["budget"])
        for m in MODELS:
            right.plot([f["params"][m] for f in by_p], [f["median_test_mse"][m] for f in by_p],
                       marker="o", label=LABELS[m])
        right.set(xscale="log", yscale="log", xlabel="total parameters",
                  title=f"d = {d}, N = {n_mid}")
        fig.tight_layout()
        path = out / f"seed004_d{d}{tag}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(shown(path))  # --plots may lie outside the checkout
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d = 8 only, two sizes (<= 10 min)")
    parser.add_argument("--points", default=None,
                        help="run only these d:node_width:N points, e.g. 16:8:1000,16:8:4000")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--raw", type=Path, default=None, help="per-run JSON lines file")
    parser.add_argument("--plots", type=Path, default=HERE / "plots")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    name = "quick" if args.quick else "full"
    points = PLANS[name]
    if args.points:
        name = "points"
        points = [(int(a), int(b), int(c)) for a, b, c in
                  (p.split(":") for p in args.points.split(","))]
    jobs = [(m, d, w, n, s) for d, w, n in points for s in range(SEEDS) for m in MODELS]
    # Slowest first (E and D on the most rows), so the last task to finish is a short one.
    cost = {"D": 4, "Dq": 24, "E": 4}
    jobs.sort(key=lambda j: -j[3] * j[1] * cost.get(j[0], 1))
    import ray

    started = time.perf_counter()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        remote = ray.remote(num_cpus=1, max_retries=1)(run_one)
        pending = [remote.remote(*job) for job in jobs]
        rows = gather_rows(pending, raw=args.raw, describe=lambda row: (
            f"{row['model']} d={row['d']} N={row['train_size']} P~{row['budget']} "
            f"seed={row['seed']}: mse {row['test_mse']:.5f} ({row['train_seconds']}s)"))
    finally:
        ray.shutdown()
    figures = summarise(rows)
    for figure in figures:
        print(json.dumps({"plan": name, **figure}), flush=True)
    # After the figures are out: a plot that fails loses no training.
    written = plot(figures, args.plots, "" if name == "full" else f"-{name}")
    print(json.dumps({"figure": "run", "plan": name, "runs": len(rows), "plots": written,
                      "wall_seconds": round(time.perf_counter() - started, 1),
                      "cpus": args.num_cpus, "epochs": EPOCHS, "lr": LR, "batch": BATCH}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
