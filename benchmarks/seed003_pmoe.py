"""Paper 003 (pMoE), Sec. 5.1, on scikit-learn digits: CNN vs separate and joint patch-level MoE.

Data: `digits-patches` (4x4 grids of 8x8 digits, n = 16, d = 64; one "1" or "0" patch at a
random position, 15 patches of digits 2-9; source images split before composing), 1,000 test
samples per seed; each seed composes its own data and initialises its own models.
Models and settings (paper + authors' code): CNN of 40 neurons; separate pMoE k = 2, l = 2,
20 neurons per expert, routers 100 epochs of eq. 6 then experts 150 epochs; joint pMoE k = 8,
l = 6, 5 neurons per expert, 150 epochs; SGD lr 0.2, batch 20; final-epoch test accuracy.

Figures (one JSON line each): Fig. 4 accuracy vs train size and the size each model needs for
95% (paper: pMoE needs 60% of the CNN's); Fig. 5 separate pMoE's success (>= 95% test
accuracy) over l x train size; Fig. 8 the separate router's discriminative patch in its top-q;
Fig. 9 the joint router's largest gate on it at one expert; Table 1 expert compute l/n of the
CNN's; a 4-class variant (digits 0-3 discriminative, 4-9 irrelevant).
Every training run is a Ray task (embedded Ray, 2 CPUs); per-run lines go to --raw.

    python benchmarks/seed003_pmoe.py --quick       # <= 10 min on 2 cores: fewer sizes and seeds
    python benchmarks/seed003_pmoe.py               # 10 sizes x 5 seeds; l sweep x 3 (~30 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _jobs import gather_rows  # this folder, first on sys.path when run as a script
from _paths import shown

HERE = Path(__file__).resolve().parent
PAPER = {
    "fig4_ratio_for_95": 0.6,
    "fig8_top4_at_300": 0.95,
    "fig9_at_300": {"class 1 (digit 1)": 0.95, "class 2 (digit 0)": 0.92},
}
TARGET = 0.95


@dataclass(frozen=True)
class Plan:
    sizes: list[int]
    seeds: int
    l_values: list[int]
    l_sizes: list[int]
    l_seeds: int
    four_class_sizes: list[int]
    four_class_seeds: int
    num_test: int = 1000


PLANS = {
    "full": Plan(
        sizes=[100, 200, 300, 400, 500, 600, 700, 800, 900, 1000],
        seeds=5,
        l_values=[1, 2, 4, 8, 16],
        l_sizes=[100, 200, 400, 700, 1000],
        l_seeds=3,
        four_class_sizes=[200, 600, 1000],
        four_class_seeds=2,
    ),
    "quick": Plan(
        sizes=[100, 300, 600, 1000],
        seeds=2,
        l_values=[1, 2, 4, 8, 16],
        l_sizes=[100, 300, 1000],
        l_seeds=1,
        four_class_sizes=[300, 1000],
        four_class_seeds=1,
    ),
}


def run_one(
    model: str, size: int, seed: int, per_expert: int, classes: int, num_test: int
) -> dict[str, Any]:
    """Train one model on the first `size` samples of seed `seed`'s data; figures for the run."""
    import torch

    torch.set_num_threads(1)
    from trainer.pmoe import (
        TrainSettings,
        accuracy,
        digits_patches,
        discriminative_in_top,
        joint_pmoe,
        largest_gate_hits,
        patch_cnn,
        predict_logits,
        separate_pmoe,
        train_model,
    )

    discriminative = (0, 1) if classes == 2 else tuple(range(classes))
    data = digits_patches(
        num_train=max(size, 1000), num_test=num_test, discriminative=discriminative, seed=seed
    ).subset(size)
    shape = {"num_patches": data.num_patches, "patch_dim": data.patch_dim, "num_classes": classes}
    if model == "cnn":
        net: Any = patch_cnn(**shape, seed=seed)
    elif model == "separate":
        net = separate_pmoe(**shape, patches_per_expert=per_expert, seed=seed)
    else:
        net = joint_pmoe(**shape, patches_per_expert=per_expert, seed=seed)
    history = train_model(net, data.x_train, data.y_train, model, TrainSettings(seed=seed))
    start = time.perf_counter()
    predict_logits(net, data.x_test)
    inference_s = time.perf_counter() - start
    row: dict[str, Any] = {
        "model": model, "train_size": size, "seed": seed, "l": per_expert, "classes": classes,
        "test_accuracy": accuracy(net, data.x_test, data.y_test),
        "train_accuracy": accuracy(net, data.x_train, data.y_train),
        "final_train_loss": history.losses[-1],
        "train_seconds": round(history.seconds, 2),
        "test_inference_seconds": round(inference_s, 4),
    }
    if model == "cnn":
        row["expert_macs_per_sample"] = net.expert_macs_per_sample()
    else:
        row["expert_macs_per_sample"] = net.expert_macs_per_sample()
        row["router_macs_per_sample"] = net.router_macs_per_sample()
        indices = net.route(torch.from_numpy(data.x_test)).indices
        row["patches_per_expert_measured"] = int(indices.shape[-1])
    if model == "separate":
        top = discriminative_in_top(
            net, data.x_test, data.y_test, data.position_test, list(range(1, 7))
        )
        row["router_top_q"] = {str(q): v for q, v in top.items()}
    if model == "joint":
        hits = largest_gate_hits(
            net,
            (data.x_train, data.y_train, data.position_train),
            (data.x_test, data.y_test, data.position_test),
        )
        row["largest_gate"] = [
            {"class": h.label, "digit": data.classes[h.label], "expert": h.expert,
             "fraction": h.fraction} for h in hits
        ]
    return row


def samples_for(sizes: list[int], means: list[float], target: float = TARGET) -> dict[str, Any]:
    """Smallest size whose mean accuracy reaches `target`, on the grid and interpolated."""
    for i, (size, mean) in enumerate(zip(sizes, means, strict=True)):
        if mean >= target:
            if i == 0:
                return {"grid": size, "interpolated": size, "at_or_below_smallest": True}
            lo, hi, m_lo = sizes[i - 1], size, means[i - 1]
            interpolated = lo + (hi - lo) * (target - m_lo) / (mean - m_lo)
            return {"grid": size, "interpolated": round(interpolated, 1),
                    "at_or_below_smallest": False}
    return {"grid": None, "interpolated": None, "best_mean": max(means)}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(rows: list[dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    main = [r for r in rows if r["classes"] == 2 and r["l"] == {"cnn": 16, "separate": 2,
                                                                  "joint": 6}[r["model"]]]
    by: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in main:
        by[(r["model"], r["train_size"])].append(r)
    curves: dict[str, dict[str, Any]] = {}
    for model in ("cnn", "separate", "joint"):
        stats = [_mean_sd([r["test_accuracy"] for r in by[(model, n)]]) for n in plan.sizes]
        curve = {"train_sizes": plan.sizes, "mean": [round(m, 4) for m, _ in stats],
                 "sd": [round(s, 4) for _, s in stats],
                 "runs": [len(by[(model, n)]) for n in plan.sizes]}
        curve["samples_for_95"] = samples_for(plan.sizes, curve["mean"])
        curves[model] = curve
    need = {m: curves[m]["samples_for_95"]["interpolated"] for m in curves}
    ratios = {m: (round(need[m] / need["cnn"], 3) if need[m] and need["cnn"] else None)
              for m in ("separate", "joint")}
    # Where the CNN never reaches 95% on the grid, its need is above the largest size: the
    # ratio is then only bounded from above.
    bounds = {m: (round(need[m] / plan.sizes[-1], 3) if need[m] and not need["cnn"] else None)
              for m in ("separate", "joint")}
    met = all((r is not None and r <= 0.6) or (b is not None and b <= 0.6)
              for r, b in zip(ratios.values(), bounds.values(), strict=True))
    figures.append({"figure": "fig4_test_accuracy", "curves": curves,
                    "ratio_to_cnn_for_95": ratios, "ratio_below_if_cnn_short": bounds,
                    "goal": "<= 0.6", "met": met,
                    "paper": {"ratio_for_95": PAPER["fig4_ratio_for_95"]}})

    sweep: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in rows:
        if (r["model"] == "separate" and r["classes"] == 2 and r["train_size"] in plan.l_sizes
                and r["seed"] < plan.l_seeds):
            sweep[(r["l"], r["train_size"])].append(r["test_accuracy"])
    success = [[round(statistics.fmean(a >= TARGET for a in sweep[(k, n)]), 2)
                if sweep[(k, n)] else None for n in plan.l_sizes] for k in plan.l_values]
    means = [[round(statistics.fmean(sweep[(k, n)]), 4) if sweep[(k, n)] else None
              for n in plan.l_sizes] for k in plan.l_values]
    need_l = {str(k): samples_for(plan.l_sizes, [m if m is not None else 0.0 for m in row])
              for k, row in zip(plan.l_values, means, strict=True)}
    figures.append({"figure": "fig5_l_sweep_separate", "l": plan.l_values,
                    "train_sizes": plan.l_sizes, "success_fraction": success,
                    "mean_accuracy": means, "samples_for_95": need_l,
                    "success": f"test accuracy >= {TARGET}"})

    top: dict[str, list[float]] = {}
    for q in ("1", "2", "4", "6"):
        top[q] = [round(statistics.fmean(r["router_top_q"][q] for r in by[("separate", n)]), 4)
                  for n in plan.sizes]
    at300 = top["4"][plan.sizes.index(300)] if 300 in plan.sizes else None
    figures.append({"figure": "fig8_separate_router_top_q", "train_sizes": plan.sizes,
                    "fraction_in_top_q": top, "top4_at_300": at300,
                    "paper": {"top4_at_300": PAPER["fig8_top4_at_300"]}})

    gate: dict[str, list[float]] = {}
    for digit in ("1", "0"):
        gate[f"digit {digit}"] = [round(statistics.fmean(
            g["fraction"] for r in by[("joint", n)] for g in r["largest_gate"]
            if g["digit"] == digit), 4) for n in plan.sizes]
    i300 = plan.sizes.index(300) if 300 in plan.sizes else None
    figures.append({"figure": "fig9_joint_router_largest_gate", "train_sizes": plan.sizes,
                    "fraction": gate,
                    "at_300": None if i300 is None else {k: v[i300] for k, v in gate.items()},
                    "paper": {"at_300": PAPER["fig9_at_300"]}})

    compute: dict[str, Any] = {}
    cnn_macs = next(r["expert_macs_per_sample"] for r in main if r["model"] == "cnn")
    for model in ("separate", "joint"):
        r = next(r for r in main if r["model"] == model)
        compute[model] = {"expert_macs": r["expert_macs_per_sample"], "cnn_macs": cnn_macs,
                          "ratio": round(r["expert_macs_per_sample"] / cnn_macs, 4),
                          "l_over_n": round(r["l"] / 16, 4),
                          "router_macs": r["router_macs_per_sample"],
                          "patches_per_expert_measured": r["patches_per_expert_measured"]}
    infer = {m: round(statistics.median(r["test_inference_seconds"] for r in main
                                        if r["model"] == m), 4) for m in ("cnn", "separate",
                                                                           "joint")}
    train = {m: round(statistics.fmean(r["train_seconds"] for r in by[(m, plan.sizes[-1])]), 2)
             for m in ("cnn", "separate", "joint")}
    figures.append({"figure": "table1_compute", "per_sample": compute,
                    "test_inference_seconds_1000_median": infer,
                    f"train_seconds_at_{plan.sizes[-1]}": train,
                    "paper": "expert compute O(Bmld) vs CNN O(Bmnd): l/n"})

    four = [r for r in rows if r["classes"] == 4]
    if four:
        curves4 = {}
        for model in ("cnn", "separate", "joint"):
            stats = [_mean_sd([r["test_accuracy"] for r in four if r["model"] == model
                               and r["train_size"] == n]) for n in plan.four_class_sizes]
            curves4[model] = {"mean": [round(m, 4) for m, _ in stats],
                              "sd": [round(s, 4) for _, s in stats]}
        figures.append({"figure": "four_class_test_accuracy",
                        "train_sizes": plan.four_class_sizes, "curves": curves4,
                        "seeds": plan.four_class_seeds, "chance": 0.25})
    return figures


def plot(figures: list[dict[str, Any]], out: Path, tag: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    found = {f["figure"]: f for f in figures}
    written = []
    fig4 = found["fig4_test_accuracy"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for model, label in (("cnn", "CNN (40)"), ("separate", "pMoE separate k=2 l=2"),
                         ("joint", "pMoE joint k=8 l=6")):
        c = fig4["curves"][model]
        ax.errorbar(c["train_sizes"], c["mean"], c["sd"], marker="o", capsize=3, label=label)
    ax.axhline(TARGET, color="k", ls=":", lw=1)
    ax.set(xlabel="training samples N", ylabel="test accuracy", title="digits-patches (Fig. 4)")
    ax.legend(fontsize=8)
    written.append(_save(fig, out / f"seed003_fig4_accuracy{tag}.png"))

    fig5 = found["fig5_l_sweep_separate"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    grid = [[v if v is not None else float("nan") for v in row] for row in fig5["success_fraction"]]
    image = ax.imshow(grid, cmap="gray", vmin=0, vmax=1, origin="lower", aspect="auto")
    ax.set_xticks(range(len(fig5["train_sizes"])), fig5["train_sizes"])
    ax.set_yticks(range(len(fig5["l"])), fig5["l"])
    ax.set(xlabel="training samples N", ylabel="l", title="separate pMoE: P(acc >= 95%) (Fig. 5)")
    fig.colorbar(image, ax=ax)
    written.append(_save(fig, out / f"seed003_fig5_l_sweep{tag}.png"))

    fig8, fig9 = found["fig8_separate_router_top_q"], found["fig9_joint_router_largest_gate"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for q, values in fig8["fraction_in_top_q"].items():
        left.plot(fig8["train_sizes"], values, marker="o", label=f"top-{q}")
    left.set(xlabel="training samples N", ylabel="fraction of test samples",
             title="separate router (Fig. 8)")
    left.legend(fontsize=8)
    for name, values in fig9["fraction"].items():
        right.plot(fig9["train_sizes"], values, marker="o", label=name)
    right.set(xlabel="training samples N", title="joint router, largest gate (Fig. 9)")
    right.legend(fontsize=8)
    written.append(_save(fig, out / f"seed003_fig8_fig9_routers{tag}.png"))
    return written


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return shown(path)  # --plots may lie outside the checkout


def jobs(plan: Plan) -> list[tuple[str, int, int, int, int]]:
    wanted: set[tuple[str, int, int, int, int]] = set()
    for seed in range(plan.seeds):
        for size in plan.sizes:
            wanted |= {("cnn", size, seed, 16, 2), ("separate", size, seed, 2, 2),
                       ("joint", size, seed, 6, 2)}
    for seed in range(plan.l_seeds):
        for size in plan.l_sizes:
            wanted |= {("separate", size, seed, per_expert, 2) for per_expert in plan.l_values}
    for seed in range(plan.four_class_seeds):
        for size in plan.four_class_sizes:
            wanted |= {("cnn", size, seed, 16, 4), ("separate", size, seed, 2, 4),
                       ("joint", size, seed, 6, 4)}
    # Largest first, so that the last task to finish is a short one.
    return sorted(wanted, key=lambda j: -j[1] * (2 if j[0] == "separate" else 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and seeds (<= 10 min)")
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--raw", type=Path, default=None, help="per-run JSON lines file")
    parser.add_argument("--plots", type=Path, default=HERE / "plots")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    name = "quick" if args.quick else "full"
    plan = PLANS[name]
    import ray

    started = time.perf_counter()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        remote = ray.remote(num_cpus=1, max_retries=1)(run_one)
        pending = [remote.remote(*job, plan.num_test) for job in jobs(plan)]
        rows = gather_rows(pending, raw=args.raw, describe=lambda row: (
            f"{row['model']} N={row['train_size']} seed={row['seed']} l={row['l']} "
            f"c={row['classes']}: acc {row['test_accuracy']:.3f}"))
    finally:
        ray.shutdown()
    figures = summarise(rows, plan)
    tag = "-quick" if args.quick else ""
    for figure in figures:
        print(json.dumps({"plan": name, **figure}), flush=True)
    # After the figures are out: a plot that fails loses no training.
    written = plot(figures, args.plots, tag)
    print(json.dumps({"figure": "run", "plan": name, "runs": len(rows), "plots": written,
                      "wall_seconds": round(time.perf_counter() - started, 1),
                      "cpus": args.num_cpus}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
