"""Paper 001 (On the Modularity of Hypernetworks): hypernetwork vs embedding, Fig. 1, 3 and 7.

(a) `hyper-synthetic` (Fig. 1): y = <x, h(I)>, x, I ~ N(0, 1) in R^16, h: 16 → 32 → 32 → 16
sigmoid MLP with softmax on top, He-uniform weights; logits scaled by 10 (at the paper's scale
1, h(I) is almost uniform and ~99% of Var(y) is a function of x alone; scale 10 leaves 20-30%
to the condition; chosen from the data, before any model was trained on it). 10,000 training
and 2,000 test triples per seed. g: 16 → 10 → 1 (ReLU, no bias, |θ| = 170); q: [e(I), x] →
10 → 1 with E = 170 (10·d + 10) in the depth sweep, E swept at depth 4. Test MSE.
(b) `rotate-digits` (Fig. 3, 7): x the 8×8 digit rotated by a uniform angle, I the upright
digit, 12 classes of 30°; g: 64 → 10 → 12 (|θ| = 760), q: [e(I), x] → 10 → 12 with
E = 650; 8 rotations per image, images split 75/25 before rotating. Test error rate.
f and e: ReLU MLPs of width 100 with `depth` hidden 100×100 layers (the authors' loop variable;
depth + 2 linear layers), default PyTorch init, plain SGD, batch 64 (authors' code). Learning
rate 0.1 (synthetic), 0.01 (rotation); Fig. 7's sweep uses the authors' grid 1e-4·10^(j/4) at
depth 4. Each seed draws its own data and initialisations. Every run is a Ray task.

    python benchmarks/seed001_hyper.py --quick    # 10 epochs, 3 seeds, depths 2,4,6,8 (~6 min)
    python benchmarks/seed001_hyper.py            # 30 epochs, lr grid j = 2..9 (~20 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _jobs import gather_rows  # this folder, first on sys.path when run as a script
from _paths import shown

HERE = Path(__file__).resolve().parent
SYNTH_LOGIT_SCALE = 10.0
LR = {"synthetic": 0.1, "rotation": 0.01}
PAPER = {
    "fig1a": "hypernetwork MSE below the embedding's from 3 layers on and falling with depth; "
             "embedding flat in depth",
    "fig1b": "embedding MSE does not improve with E; above the hypernetwork's",
    "fig3": "MNIST/CIFAR rotation: hypernetwork error far below the embedding's at every depth "
            "and falling with depth; the embedding's does not",
    "fig7": "hypernetwork below the embedding at every learning rate with non-trivial error",
}


@dataclass(frozen=True)
class Plan:
    seeds: int
    epochs: int
    depths: list[int]
    embedding_dims: list[int]
    lr_steps: list[int]


PLANS = {
    "quick": Plan(seeds=3, epochs=10, depths=[2, 4, 6, 8], embedding_dims=[16, 64, 170, 640],
                  lr_steps=[3, 5, 7, 9]),
    "full": Plan(seeds=3, epochs=30, depths=[2, 4, 6, 8], embedding_dims=[16, 64, 170, 640, 2048],
                 lr_steps=[2, 3, 4, 5, 6, 7, 8, 9]),
    # Does a deeper f fall behind only for lack of training? The depth sweeps at 3x the epochs.
    "depth30": Plan(seeds=3, epochs=30, depths=[2, 4, 6, 8], embedding_dims=[], lr_steps=[]),
}


def paper_lr(step: int) -> float:
    return 1e-4 * 10 ** (step / 4)


def run_one(task: str, model: str, depth: int, seed: int, lr: float, embedding_dim: int | None,
            epochs: int) -> dict[str, Any]:
    """Train one model on seed `seed`'s data; its test error and parameter counts."""
    import torch

    torch.set_num_threads(1)
    from trainer.hyper import (
        EmbeddingModel,
        HyperNetwork,
        PrimarySpec,
        TrainSettings,
        count_parameters,
        evaluate_error,
        hyper_synthetic,
        rotate_digits,
        train_model,
    )

    if task == "synthetic":
        data = hyper_synthetic(input_dim=16, condition_dim=16, hidden=32,
                               logit_scale=SYNTH_LOGIT_SCALE, seed=seed)
    else:
        data = rotate_digits(seed=seed)
    torch.manual_seed(1000 + seed)
    net: Any
    counts: dict[str, int]
    if model == "hyper":
        net = HyperNetwork(data.condition_dim, PrimarySpec(data.input_dim, (10,), data.output_dim),
                           depth)
        counts = {"f": count_parameters(net), "g": net.primary_parameters()}
    else:
        net = EmbeddingModel(data.condition_dim, data.input_dim, data.output_dim, depth,
                             embedding_dim=embedding_dim)
        counts = {"e": count_parameters(net.e), "q": count_parameters(net.q)}
    history = train_model(net, data, TrainSettings(lr=lr, epochs=epochs, seed=seed))
    row: dict[str, Any] = {
        "task": task, "model": model, "depth": depth, "seed": seed, "lr": lr,
        "embedding_dim": getattr(net, "embedding_dim", None), "epochs": epochs,
        "test_error": evaluate_error(net, data), "train_error": evaluate_error(net, data, "train"),
        "diverged": history.diverged, "train_seconds": round(history.seconds, 2), **counts,
    }
    if task == "synthetic":
        x, y = data.x_train, data.y_train
        beta = torch.linalg.lstsq(x, y).solution
        row["x_only_linear_mse"] = float(((data.x_test @ beta - data.y_test) ** 2).mean())
        row["var_y_test"] = float(data.y_test.var())
    return row


def jobs(plan: Plan) -> list[tuple[str, str, int, int, float, int | None, int]]:
    wanted: set[tuple[str, str, int, int, float, int | None, int]] = set()
    for seed in range(plan.seeds):
        for depth in plan.depths:
            for model in ("hyper", "embedding"):
                wanted.add(("synthetic", model, depth, seed, LR["synthetic"], None, plan.epochs))
                wanted.add(("rotation", model, depth, seed, LR["rotation"], None, plan.epochs))
        for dim in plan.embedding_dims:
            wanted.add(("synthetic", "embedding", 4, seed, LR["synthetic"],
                        None if dim == 170 else dim, plan.epochs))
        for step in plan.lr_steps:
            for model in ("hyper", "embedding"):
                wanted.add(("rotation", model, 4, seed, paper_lr(step), None, plan.epochs))
    # Deep and rotation runs first, so that the last task to finish is a short one.
    return sorted(wanted, key=lambda j: (j[0] != "rotation", -j[2], j[3]))


def _stats(values: list[float | None]) -> dict[str, float | None]:
    """Mean and population std over the seeds that have a result."""
    have = [v for v in values if v is not None]
    if not have:
        return {"mean": None, "std": None}
    return {"mean": statistics.fmean(have),
            "std": statistics.pstdev(have) if len(have) > 1 else 0.0}


def _noise(points: list[list[float | None]]) -> float:
    """Seed noise of a curve: the mean over its points of the std across seeds."""
    stds = [_stats(p)["std"] for p in points]
    return statistics.fmean(v for v in stds if v is not None)


def _curve(rows: list[dict[str, Any]], seeds: int, **match: Any) -> list[float | None]:
    """Test errors by seed for the rows matching `match` (None where a run is missing)."""
    by_seed = {r["seed"]: r["test_error"] for r in rows
               if all(r[k] == v for k, v in match.items())}
    return [by_seed.get(s) for s in range(seeds)]


def summarise(rows: list[dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    seeds = range(plan.seeds)
    tasks = {r["task"] for r in rows}
    for task, fig in (("synthetic", "fig1a_synthetic_depth"), ("rotation", "fig3_rotation_depth")):
        if task not in tasks:
            continue
        lr = LR[task]
        err = {m: {d: _curve(rows, plan.seeds, task=task, model=m, depth=d, lr=lr,
                             embedding_dim=170 if task == "synthetic" and m == "embedding"
                             else (650 if m == "embedding" else None))
                   for d in plan.depths} for m in ("hyper", "embedding")}
        from_depth = 3 if task == "synthetic" else 0
        wins = [all((err["hyper"][d][s] or 0) < (err["embedding"][d][s] or 0)
                    for d in plan.depths if d >= from_depth) for s in seeds]
        first, last = plan.depths[0], plan.depths[-1]
        hyper_falls = [(err["hyper"][last][s] or 0) < (err["hyper"][first][s] or 0) for s in seeds]
        emb_first = [err["embedding"][first][s] or 0.0 for s in seeds]
        emb_last = [err["embedding"][last][s] or 0.0 for s in seeds]
        noise = _noise([err["embedding"][d] for d in plan.depths])
        emb_gain = statistics.fmean(emb_first) - statistics.fmean(emb_last)
        figure: dict[str, Any] = {
            "figure": fig, "metric": "test MSE" if task == "synthetic" else "test error rate",
            "lr": lr, "epochs": plan.epochs, "depths": plan.depths,
            "hyper": {d: _stats(err["hyper"][d]) for d in plan.depths},
            "embedding": {d: _stats(err["embedding"][d])
                          for d in plan.depths},
            "hyper_by_seed": {d: err["hyper"][d] for d in plan.depths},
            "embedding_by_seed": {d: err["embedding"][d] for d in plan.depths},
            f"seeds_hyper_beats_embedding_at_depths_ge_{from_depth}": sum(wins),
            "seeds_hyper_error_falls_first_to_last_depth": sum(hyper_falls),
            "embedding_gain_first_to_last_depth": emb_gain,
            "embedding_seed_noise_mean_std": noise,
            "embedding_improves_beyond_noise": emb_gain > noise,
            "params": {m: {k: v for k, v in next(r for r in rows if r["task"] == task
                                                  and r["model"] == m and r["depth"] == d).items()
                           if k in ("f", "g", "e", "q")}
                       for m in ("hyper", "embedding") for d in [plan.depths[-1]]},
            "paper": PAPER["fig1a" if task == "synthetic" else "fig3"],
        }
        if task == "synthetic":
            figure["x_only_linear_mse"] = _stats([r["x_only_linear_mse"] for r in rows
                                                  if r["task"] == task and r["model"] == "hyper"
                                                  and r["depth"] == first])
        figures.append(figure)

    dims = sorted(plan.embedding_dims)
    if "synthetic" in tasks and dims:
        figures.append(_embedding_dim_figure(rows, plan, dims))
    if "rotation" in tasks and plan.lr_steps:
        figures.append(_lr_figure(rows, plan))
    return figures


def _embedding_dim_figure(rows: list[dict[str, Any]], plan: Plan, dims: list[int]
                          ) -> dict[str, Any]:
    seeds = range(plan.seeds)
    emb = {e: _curve(rows, plan.seeds, task="synthetic", model="embedding", depth=4,
                     lr=LR["synthetic"], embedding_dim=e) for e in dims}
    hyper4 = _curve(rows, plan.seeds, task="synthetic", model="hyper", depth=4, lr=LR["synthetic"])
    noise = _noise([emb[e] for e in dims])
    gain = statistics.fmean(v or 0.0 for v in emb[dims[0]]) - statistics.fmean(
        v or 0.0 for v in emb[dims[-1]])
    return {
        "figure": "fig1b_synthetic_embedding_dim", "metric": "test MSE", "depth": 4,
        "embedding_dims": dims, "embedding": {e: _stats(emb[e]) for e in dims},
        "hyper_depth4": _stats(hyper4),
        "seeds_hyper_beats_every_embedding_dim": sum(
            all((hyper4[s] or 0) < (emb[e][s] or 0) for e in dims) for s in seeds),
        "embedding_gain_smallest_to_largest_dim": gain, "embedding_seed_noise_mean_std": noise,
        "embedding_improves_beyond_noise": gain > noise,
        "q_params_by_dim": {e: (e + 16) * 10 + 10 + 10 + 1 for e in dims},
        "paper": PAPER["fig1b"],
    }


def _lr_figure(rows: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    seeds = range(plan.seeds)
    lrs = [paper_lr(j) for j in plan.lr_steps]
    curves = {m: {lr: _curve(rows, plan.seeds, task="rotation", model=m, depth=4, lr=lr)
                  for lr in lrs} for m in ("hyper", "embedding")}
    chance = 1 - 1 / 12
    nontrivial = [lr for lr in lrs if min(v or 1.0 for m in curves for v in curves[m][lr])
                  < chance - 0.05]
    return {
        "figure": "fig7_rotation_lr", "metric": "test error rate", "depth": 4, "lrs": lrs,
        "hyper": {lr: _stats(curves["hyper"][lr]) for lr in lrs},
        "embedding": {lr: _stats(curves["embedding"][lr]) for lr in lrs},
        "nontrivial_lrs": nontrivial,
        "seeds_hyper_beats_embedding_at_every_nontrivial_lr": sum(
            all((curves["hyper"][lr][s] or 1) < (curves["embedding"][lr][s] or 1)
                for lr in nontrivial) for s in seeds),
        "paper": PAPER["fig7"],
    }


def plot(figures: list[dict[str, Any]], out: Path, tag: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")

    out.mkdir(parents=True, exist_ok=True)
    by = {f["figure"]: f for f in figures}
    written = []

    def band(ax: Any, xs: list[Any], stats: dict[Any, dict[str, float]], label: str) -> None:
        nan = float("nan")
        means = [nan if stats[x]["mean"] is None else stats[x]["mean"] for x in xs]
        stds = [nan if stats[x]["std"] is None else stats[x]["std"] for x in xs]
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=label)

    if "fig1a_synthetic_depth" in by:
        written.append(_plot_synthetic(by, out / f"seed001_fig1_synthetic{tag}.png", band))
    if "fig3_rotation_depth" in by:
        written.append(_plot_rotation(by, out / f"seed001_fig3_fig7_rotation{tag}.png", band))
    return written


def _plot_synthetic(by: dict[str, Any], path: Path, band: Any) -> str:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    a = by["fig1a_synthetic_depth"]
    band(left, a["depths"], a["hyper"], "hypernetwork")
    band(left, a["depths"], a["embedding"], "embedding (E = 170)")
    left.set(xlabel="depth of f / e (hidden layers)", ylabel="test MSE",
             title="synthetic, depth (Fig. 1a)")
    left.legend(fontsize=8)
    b = by.get("fig1b_synthetic_embedding_dim")
    if b is None:
        right.axis("off")
        return _save(fig, path)
    band(right, b["embedding_dims"], b["embedding"], "embedding, depth 4")
    right.axhline(b["hyper_depth4"]["mean"], color="C0", ls="--", label="hypernetwork, depth 4")
    right.set(xscale="log", xlabel="embedding dimension E", title="synthetic, E (Fig. 1b)")
    right.legend(fontsize=8)
    return _save(fig, path)


def _plot_rotation(by: dict[str, Any], path: Path, band: Any) -> str:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    c = by["fig3_rotation_depth"]
    band(left, c["depths"], c["hyper"], "hypernetwork")
    band(left, c["depths"], c["embedding"], "embedding (E = 650)")
    left.set(xlabel="depth of f / e (hidden layers)", ylabel="test error rate",
             title="rotate-digits, depth (Fig. 3)")
    left.legend(fontsize=8)
    d = by.get("fig7_rotation_lr")
    if d is None:
        right.axis("off")
        return _save(fig, path)
    band(right, d["lrs"], d["hyper"], "hypernetwork")
    band(right, d["lrs"], d["embedding"], "embedding")
    right.set(xscale="log", xlabel="learning rate", title="rotate-digits, depth 4 (Fig. 7)")
    right.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return shown(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 epochs, 4 lrs (<= 10 min)")
    parser.add_argument("--plan", choices=sorted(PLANS), default=None,
                        help="a named plan instead of quick/full (depth30: depth sweeps only)")
    parser.add_argument("--task", choices=["synthetic", "rotation"], default=None,
                        help="run only this task's figures")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--raw", type=Path, default=None, help="per-run JSON lines file")
    parser.add_argument("--plots", type=Path, default=HERE / "plots")
    parser.add_argument("--from-raw", type=Path, default=None,
                        help="summarise and plot an earlier --raw file instead of training")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    name = args.plan or ("quick" if args.quick else "full")
    plan = PLANS[name]
    import ray

    started = time.perf_counter()
    if args.from_raw:
        rows = [json.loads(line) for line in args.from_raw.read_text().splitlines() if line]
        return _report(rows, plan, name, args, started)
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        remote = ray.remote(num_cpus=1, max_retries=1)(run_one)
        pending = [remote.remote(*job) for job in jobs(plan)
                   if args.task is None or job[0] == args.task]
        rows = gather_rows(pending, raw=args.raw, describe=lambda row: (
            f"{row['task']} {row['model']} depth={row['depth']} seed={row['seed']} "
            f"lr={row['lr']:.2g} E={row['embedding_dim']}: {row['test_error']:.4f}"))
    finally:
        ray.shutdown()
    return _report(rows, plan, name, args, started)


def _report(rows: list[dict[str, Any]], plan: Plan, name: str, args: argparse.Namespace,
            started: float) -> int:
    figures = summarise(rows, plan)
    tag = "" if name == "full" else f"-{name}"
    written = plot(figures, args.plots, tag)
    for figure in figures:
        print(json.dumps({"plan": name, **figure}), flush=True)
    print(json.dumps({"figure": "run", "plan": name, "runs": len(rows), "plots": written,
                      "wall_seconds": round(time.perf_counter() - started, 1),
                      "cpus": args.num_cpus}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
