"""Gating as the user's dial: calibrated τ, and the accuracy / experts / VRAM curve of gates.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gating.py [--quick] [--part calibration|curve|all]

calibration: the Ackley-2D quick store built with τ = 1 (the old default), then recalibrated
with `calibrate_store` on 2,000 fresh samples; MSE against the true Ackley function on 2,000
other random points for top_k = 1, 2, 3, before and after, served through the app.
curve: the demo store (Ackley-2D, K=16, ν=4, the quick preset, τ calibrated by the build) and
a K=256 store (same, on a 120×120 grid, k-means prototypes) under each gate setting — τ ∈
{0.01, 0.1, 1, 10} × the median nearest-prototype d² of the test rows, and the store's τ, with
top_k 1/2/3 and top_k 8 pruned by min_weight 0.02 or by top_p 0.9, each in tree routing
(top_k = k is the soft beam walk of width k on a calibrated store) and exact routing (the k
nearest), and the explicit soft beam [2, 2, ...]: test MSE against the true Ackley function,
mean experts per row and distance evaluations per row (the answers' `experts` and
`stats.distance_evals`), and over one-row requests the mean `stats.vram_bytes` (the peak of
one expert at a time, as the contract defines VRAM per request) and the bytes of every
expert the request touches. Writes benchmarks/plots/gating_curve[-quick].png: MSE against
experts per row and against bytes touched, one marker per setting, one colour per τ.
`--work DIR` keeps the curve's stores and reuses them.

Everything is served in-process (create_app over the in-process FakeExpertPool: the same
ActorCore as a Ray actor, no Ray), so the figures are the server's arithmetic, not timings.
Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from client import AsyncClient, LoadTestConfig, arun_loadtest, write_comparison
from server import Settings, create_app
from server.pool import FakeExpertPool
from trainer import BuildConfig, ackley, build_store, calibrate_store, quick_overrides


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({**record, "machine": platform.machine()}), flush=True)


@asynccontextmanager
async def served(store: Path, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with served_app(store, **overrides) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://b", timeout=600) as c:
            yield c


@asynccontextmanager
async def served_app(store: Path, **overrides: Any) -> AsyncIterator[Any]:
    values: dict[str, Any] = {
        "store": store, "watch_store": False, "actors": 1, "cache_bytes": 1 << 30,
        "max_batch_wait_ms": 0.0, "max_top_k": 16, "max_beam": 64,
        # The curve's τ span four decades around the data's scale, whatever τ the store holds.
        "max_temperature_ratio": 1e6,
    }
    values.update(overrides)
    settings = Settings(**values)
    app = create_app(settings, pool_factory=lambda s: FakeExpertPool(s))
    async with app.router.lifespan_context(app):
        yield app


async def predict(
    client: httpx.AsyncClient, x: np.ndarray, *, top_k: int | None = None,
    gate: dict[str, Any] | None = None, chunk: int = 500,
) -> dict[str, Any]:
    """Outputs, experts per row, distance evals per row and per-request VRAM over chunks."""
    outputs: list[list[float]] = []
    kept: list[int] = []
    evals: list[int] = []
    vram: list[int] = []
    for lo in range(0, len(x), chunk):
        body: dict[str, Any] = {"inputs": x[lo : lo + chunk].tolist(), "return_stats": True}
        if top_k is not None:
            body["top_k"] = top_k
        if gate:
            body["gate"] = gate
        response = await client.post("/v1/predict", json=body)
        response.raise_for_status()
        data = response.json()
        outputs += data["outputs"]
        kept += [len(e) for e in data["experts"]]
        evals += data["stats"]["distance_evals"]
        vram.append(data["stats"]["vram_bytes"])
        # One-row requests for VRAM per request as a single user sees it.
    return {"outputs": np.asarray(outputs), "kept": np.asarray(kept), "evals": np.asarray(evals),
            "vram": np.asarray(vram)}


async def one_row_vram(
    client: httpx.AsyncClient, x: np.ndarray, *, top_k: int | None, gate: dict[str, Any] | None
) -> float:
    """Mean stats.vram_bytes of one-row requests (a single user's request)."""
    values = []
    for row in x:
        body: dict[str, Any] = {"inputs": [row.tolist()], "return_stats": True}
        if top_k is not None:
            body["top_k"] = top_k
        if gate:
            body["gate"] = gate
        response = await client.post("/v1/predict", json=body)
        response.raise_for_status()
        values.append(response.json()["stats"]["vram_bytes"])
    return float(np.mean(values))


def build(
    out: Path, experts: int, temperature: float | None, seed: int = 0, **overrides: Any
) -> None:
    values: dict[str, Any] = {**quick_overrides("ackley2d"), **overrides}
    config = BuildConfig(
        out=out, dataset="ackley2d", experts=experts, branching=4, executor="local",
        temperature=temperature, seed=seed, **values,
    )
    build_store(config, progress=False)


async def calibration_part(work: Path) -> None:
    rng = np.random.default_rng(2026)
    x_eval = rng.uniform(-1, 1, size=(2000, 2)).astype(np.float32)
    y_eval = ackley(x_eval).reshape(-1, 1)
    x_fit = rng.uniform(-1, 1, size=(2000, 2))
    np.savez(work / "fit.npz", X=x_fit, y=ackley(x_fit).reshape(-1, 1))
    store = work / "ackley-tau1"
    build(store, 16, temperature=1.0)
    # "Before" is the previous release exactly: a format-1 manifest (no kind, no gate), so
    # top_k > 1 is the exact k nearest at τ = 1.
    data = json.loads((store / "manifest.json").read_text())
    data.pop("kind")
    data.pop("gate")
    data["format_version"] = 1
    (store / "manifest.json").write_text(json.dumps(data, indent=2))
    for stage in ("before", "after"):
        if stage == "after":
            calibrate_store(store, work / "fit.npz")
        manifest = json.loads((store / "manifest.json").read_text())
        async with served(store) as client:
            for k in (1, 2, 3):
                got = await predict(client, x_eval, top_k=k)
                mse = float(((got["outputs"] - y_eval) ** 2).mean())
                emit({"part": "calibration", "stage": stage, "top_k": k,
                      "temperature": manifest["temperature"],
                      "temperature_source": manifest.get("gate", {}).get(
                          "temperature_source", "format 1"),
                      "mse_vs_true": mse, "points": len(x_eval)})
    built = work / "ackley-built"
    build(built, 16, temperature=None)
    manifest = json.loads((built / "manifest.json").read_text())
    async with served(built) as client:
        for k in (1, 2, 3):
            got = await predict(client, x_eval, top_k=k)
            emit({"part": "calibration", "stage": "build-calibrated", "top_k": k,
                  "temperature": manifest["temperature"],
                  "calibration": manifest["gate"].get("calibration"),
                  "mse_vs_true": float(((got["outputs"] - y_eval) ** 2).mean()),
                  "points": len(x_eval)})


TAU_FACTORS = (0.01, 0.1, 1.0, 10.0)
PLOTS = Path(__file__).resolve().parent / "plots"


def curve_settings(depth: int) -> list[tuple[str, int, str, dict[str, Any]]]:
    """(label, top_k, mode, gate without temperature) of every curve point at one τ.

    tree: the store's own routing; on a calibrated store top_k = k > 1 there is the soft beam
    walk of width k (gate.tree_top_k = "beam"). exact: the k nearest prototypes.
    """
    settings: list[tuple[str, int, str, dict[str, Any]]] = []
    for mode in ("tree", "exact"):
        settings += [
            (f"{mode} top_k=1", 1, mode, {}),
            (f"{mode} top_k=2", 2, mode, {}),
            (f"{mode} top_k=3", 3, mode, {}),
            (f"{mode} top_k=8 min_weight=0.02", 8, mode, {"min_weight": 0.02}),
            (f"{mode} top_k=8 top_p=0.9", 8, mode, {"top_p": 0.9}),
        ]
    settings.append((f"tree beam={[2] * depth}", 1, "tree", {"beam": [2] * depth}))
    return settings


async def curve_store(
    name: str, store: Path, x_eval: np.ndarray, y_eval: np.ndarray, vram_rows: int
) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    async with served(store) as client:
        response = await client.get("/v1/model", params={"include_prototypes": "true"})
        response.raise_for_status()
        model = response.json()
        prototypes = np.asarray(model["prototypes"], dtype=np.float64)
        d2 = ((x_eval[:, None, :].astype(np.float64) - prototypes[None]) ** 2).sum(-1)
        median_d2 = float(np.median(d2.min(axis=1)))
        depth = round(np.log(len(prototypes)) / np.log(model["branching"]))
        # The τ the build calibrated is the fifth point: where it falls on the grid's scale.
        factors = [*TAU_FACTORS, model["temperature"] / median_d2]
        for factor in factors:
            tau = factor * median_d2
            tau_label = f"{factor:g}×" if factor in TAU_FACTORS else "store τ"
            for label, top_k, mode, gate in curve_settings(depth):
                body_gate = {**gate, "temperature": tau}
                got = await predict_mode(client, x_eval, top_k=top_k, mode=mode, gate=body_gate)
                vram, touched = await one_row_vram_mode(
                    client, x_eval[:vram_rows], top_k=top_k, mode=mode, gate=body_gate
                )
                point = {
                    "part": "curve", "store": name, "experts": len(prototypes),
                    "store_temperature": model["temperature"], "median_nearest_d2": median_d2,
                    "tau_factor": factor, "tau": tau_label, "temperature": tau,
                    "setting": label,
                    "top_k": top_k, "mode": mode, "gate": body_gate,
                    "mse_vs_true": float(((got["outputs"] - y_eval) ** 2).mean()),
                    "experts_per_row": float(got["kept"].mean()),
                    "distance_evals_per_row": float(got["evals"].mean()),
                    "vram_bytes_per_request": vram, "expert_bytes_per_request": touched,
                    "vram_rows": vram_rows,
                    "points": len(x_eval), "pool": "FakeExpertPool (in-process ActorCore)",
                }
                emit(point)
                points.append(point)
    return points


async def predict_mode(
    client: httpx.AsyncClient, x: np.ndarray, *, top_k: int, mode: str, gate: dict[str, Any],
    chunk: int = 500,
) -> dict[str, Any]:
    """`predict` with a routing mode (the curve's top_k points are the exact k nearest)."""
    outputs: list[list[float]] = []
    kept: list[int] = []
    evals: list[int] = []
    for lo in range(0, len(x), chunk):
        body = {"inputs": x[lo : lo + chunk].tolist(), "return_stats": True, "top_k": top_k,
                "mode": mode, "gate": gate}
        response = await client.post("/v1/predict", json=body)
        response.raise_for_status()
        data = response.json()
        outputs += data["outputs"]
        kept += [len(e) for e in data["experts"]]
        evals += data["stats"]["distance_evals"]
    return {"outputs": np.asarray(outputs), "kept": np.asarray(kept), "evals": np.asarray(evals)}


async def one_row_vram_mode(
    client: httpx.AsyncClient, x: np.ndarray, *, top_k: int, mode: str, gate: dict[str, Any]
) -> tuple[float, float]:
    """Means over one-row requests of stats.vram_bytes (the contract's VRAM per request: the
    peak of one expert at a time) and of the bytes of every expert the request touched."""
    peak, touched = [], []
    for row in x:
        body = {"inputs": [row.tolist()], "return_stats": True, "top_k": top_k, "mode": mode,
                "gate": gate}
        response = await client.post("/v1/predict", json=body)
        response.raise_for_status()
        stats = response.json()["stats"]
        peak.append(stats["vram_bytes"])
        touched.append(sum(stat["expert_bytes"] for stat in stats["experts"]))
    return float(np.mean(peak)), float(np.mean(touched))


def plot_curve(points: list[dict[str, Any]], path: Path) -> None:
    """MSE against experts per row (left) and against the bytes of the experts a request
    touches (right), per store. stats.vram_bytes is the peak of one expert at a time, flat
    across gates, so it is in the JSON lines but not plotted."""
    from matplotlib.figure import Figure

    stores = list(dict.fromkeys(p["store"] for p in points))
    figure = Figure(figsize=(11, 4.2 * len(stores)), layout="constrained")
    axes_grid = figure.subplots(len(stores), 2, squeeze=False)
    settings = list(dict.fromkeys(_marker_key(p["setting"]) for p in points))
    markers = dict(zip(settings, "os^DvP*X<>h", strict=True))
    labels = [f"{f:g}×" for f in TAU_FACTORS] + ["store τ"]
    colours = dict(zip(labels, ("tab:blue", "tab:orange", "tab:green", "tab:red", "black"),
                       strict=True))
    for row, store in enumerate(stores):
        mine = [p for p in points if p["store"] == store]
        for column, key, xlabel in (
            (0, "experts_per_row", "mean experts per row"),
            (1, "expert_bytes_per_request", "bytes of the experts a one-row request touches"),
        ):
            axes = axes_grid[row][column]
            for p in mine:
                axes.scatter(p[key], p["mse_vs_true"], marker=markers[_marker_key(p["setting"])],
                             color=colours[p["tau"]], s=40, alpha=0.8)
            axes.set(xlabel=xlabel, ylabel="test MSE vs true Ackley", yscale="log",
                     title=f"{store} (K={mine[0]['experts']})")
            axes.grid(alpha=0.3)
    handles = [axes_grid[0][0].scatter([], [], marker=m, color="grey", label=s)
               for s, m in markers.items()]
    handles += [axes_grid[0][0].scatter([], [], marker="o", color=c,
                                        label=f"τ = {f}med d²" if f != "store τ" else f)
                for f, c in colours.items()]
    figure.legend(handles=handles, loc="outside right upper", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)


def _marker_key(setting: str) -> str:
    return setting.split("=")[0] + " [2,...]" if "beam" in setting else setting


async def curve_part(work: Path, quick: bool, plot: Path) -> None:
    rng = np.random.default_rng(2027)
    rows = 1000 if quick else 4000
    x_eval = rng.uniform(-1, 1, size=(rows, 2)).astype(np.float32)
    y_eval = ackley(x_eval).reshape(-1, 1)
    demo = work / "demo"
    if not (demo / "manifest.json").exists():
        build(demo, 16, temperature=None)
    big = work / ("k256-quick" if quick else "k256")
    if not (big / "manifest.json").exists():
        # 40×40 (the quick grid) leaves ~5 training points per expert at K=256: a larger grid
        # keeps the experts meaningful; no baseline (not part of the curve). k-means
        # prototypes: with learned ones 81 of 256 cells were left without a training row
        # (quick run, 2026-11-23), so a third of the experts kept their initial weights.
        build(big, 256, temperature=None, grid_size=120 if quick else 200, baseline=False,
              prototypes="kmeans")
    points = await curve_store("demo", demo, x_eval, y_eval, 50 if quick else 200)
    points += await curve_store("k256", big, x_eval, y_eval, 50 if quick else 200)
    plot_curve(points, plot)
    emit({"part": "curve", "plot": str(plot)})


async def loadtest_part(work: Path, quick: bool, plot: Path) -> None:
    """`momlp loadtest --eval rows.npz --gate A --gate B ...` as a library call against the
    in-process app on the demo store: the load test's accuracy beside VRAM per request."""
    store = work / "demo"
    if not (store / "manifest.json").exists():
        build(store, 16, temperature=None)
    rng = np.random.default_rng(2028)
    x = rng.uniform(-1, 1, size=(1000, 2))
    np.savez(work / "eval.npz", x=x, y=ackley(x).reshape(-1, 1))
    median = 0.0896  # the demo store's median nearest-prototype d² (curve part, --quick)
    gates: list[dict[str, Any] | None] = [
        None, {"temperature": 0.01 * median}, {"temperature": 0.01 * median, "beam": [2, 2]},
        {"temperature": 0.1 * median, "beam": [2, 2]},
        {"temperature": 0.01 * median, "min_weight": 0.02},
    ]
    reports = []
    async with served_app(store) as app:
        for number, gate in enumerate(gates, start=1):
            config = LoadTestConfig(
                url="http://b", requests=40 if quick else 200, batch=25, concurrency=2,
                top_k=8 if gate and "min_weight" in gate else 1, gate=gate,
                eval_data=work / "eval.npz", report_dir=work / "loadtest" / f"gate-{number}",
                plots=False,
            )
            report = await arun_loadtest(config, client_factory=lambda c: AsyncClient(
                "http://b", transport=httpx.ASGITransport(app=app), max_retries=0))
            reports.append(report)
            accuracy = report.accuracy or {}
            emit({"part": "loadtest", "gate": gate, "top_k": config.top_k,
                  "metric": accuracy.get("metric"), "value": accuracy.get("value"),
                  "rows": accuracy.get("rows"), "experts_per_row": report.experts_per_row,
                  "vram_bytes_p50": report.vram_bytes["p50"], "ok": report.ok,
                  "errors": report.errors})
    written = write_comparison(gates, reports, work / "loadtest")
    png = [path for path in written if path.suffix == ".png"]
    if png:
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot.write_bytes(png[0].read_bytes())
        emit({"part": "loadtest", "plot": str(plot)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rows (≤ 10 min on 2 cores)")
    parser.add_argument("--part", choices=("calibration", "curve", "loadtest", "all"),
                        default="all")
    parser.add_argument("--plot", type=Path, default=None,
                        help="curve PNG (default benchmarks/plots/gating_curve[-quick].png); the"
                        " load test's gating_loadtest_gates[-quick].png goes beside it")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the curve's stores here and reuse them (default: a temp dir)")
    args = parser.parse_args()
    plot = args.plot or PLOTS / ("gating_curve-quick.png" if args.quick else "gating_curve.png")
    with tempfile.TemporaryDirectory(prefix="momlp-gating-") as tmp:
        work = Path(tmp)
        if args.part in ("calibration", "all"):
            asyncio.run(calibration_part(work))
        if args.part in ("curve", "all"):
            if args.work is not None:
                args.work.mkdir(parents=True, exist_ok=True)
            asyncio.run(curve_part(args.work or work, args.quick, plot))
        if args.part in ("loadtest", "all"):
            if args.work is not None:
                args.work.mkdir(parents=True, exist_ok=True)
            gates_png = plot.parent / ("gating_loadtest_gates-quick.png" if args.quick
                                       else "gating_loadtest_gates.png")
            asyncio.run(loadtest_part(args.work or work, args.quick, gates_png))


if __name__ == "__main__":
    main()
