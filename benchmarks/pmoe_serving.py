"""Serving kind "pmoe" (issue 18): paper 003's trained models through a real `momlp serve`.

Trains (trainer.pmoe.build_pmoe, what `momlp build --kind pmoe` runs) on digits-patches with
the paper's settings (--quick: 300 training samples, 30 epochs): separate (k=2, l=2), joint
(k=8, l=6), the joint model's experts under token choice, and the 4-class separate variant
(k=4, l=2). One `momlp serve` process (2 actors, embedded Ray) serves each in turn (republish
into its store + POST /v1/admin/reload). One JSON line per store:

- max_abs_diff: max |served - offline| over the test samples (1,000), and both accuracies
- route_equal: fraction of samples whose /v1/route patches equal the offline top-l exactly
- patches_ratio: stats patches_computed / patches_dense, against l/n
- batch_invariant: samples (of 20) whose output alone is bitwise the one inside a random batch
- rows_per_s: the test samples as 10 npy requests of 100 rows, warm, one at a time
- token choice: experts loaded (stats) for the sample that picked the fewest, of k

    python benchmarks/pmoe_serving.py --quick      # ~2 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from trainer.pmoe import (
    PMoEBuild,
    PMoEBuildConfig,
    build_pmoe,
    predict_logits,
    publish_pmoe,
    token_choice_logits,
)

_URL = re.compile(r"momlp serving .* at (http://127\.0\.0\.1:\d+)")


@contextmanager
def momlp_serve(store: Path) -> Iterator[str]:
    """A `momlp serve` child (2 actors, embedded Ray of 2 CPUs); yields its URL."""
    script = Path(sys.executable).parent / "momlp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        [str(script), "serve", "--store", str(store), "--port", "0", "--actors", "2",
         "--ray-num-cpus", "2", "--no-watch-store"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            match = _URL.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(180):
            raise RuntimeError("momlp serve did not start within 180 s")
        yield found[0]
    finally:
        process.terminate()
        process.wait(timeout=60)


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.float32))
    return buf.getvalue()


def post(url: str, path: str, array: np.ndarray, **params: Any) -> dict[str, Any]:
    answer = httpx.post(
        f"{url}{path}", content=npy(array), params=params, timeout=300,
        headers={"content-type": "application/x-npy"},
    )
    answer.raise_for_status()
    body: dict[str, Any] = answer.json()
    return body


def serve_build(url: str, root: Path, build: PMoEBuild) -> None:
    spec = build.manifest.pmoe
    assert spec is not None
    publish_pmoe(build.model, root, train=spec.train, image=spec.layout.image,
                 routing=spec.routing, tree=build.tree)
    httpx.post(f"{url}/v1/admin/reload", timeout=120).raise_for_status()


def measure(url: str, name: str, build: PMoEBuild) -> dict[str, Any]:
    x = build.x_test.reshape(len(build.x_test), -1).numpy()
    spec = build.manifest.pmoe
    assert spec is not None
    if build.tree is not None:
        offline = token_choice_logits(build.model, build.tree, build.x_test).numpy()
    else:
        offline = predict_logits(build.model, build.x_test).numpy()
    answer = post(url, "/v1/predict", x, return_stats="true")
    served = np.asarray(answer["outputs"])
    stats = answer["stats"]
    y = build.y_test.numpy()
    row: dict[str, Any] = {
        "store": name, "routing": spec.routing, "gating": spec.gating,
        "k": build.model.num_experts, "l": spec.patches_per_expert, "n": spec.layout.num_patches,
        "samples": len(x),
        "max_abs_diff": float(np.abs(served - offline).max()),
        "served_accuracy": float((served.argmax(1) == y).mean()),
        "offline_accuracy": float((offline.argmax(1) == y).mean()),
        "patches_computed": stats["patches_computed"], "patches_dense": stats["patches_dense"],
        "patches_ratio": stats["patches_computed"] / stats["patches_dense"],
    }
    routed = post(url, "/v1/route", x)["patches"]
    if spec.routing == "expert_choice":
        with torch.no_grad():
            expected = build.model.route(build.x_test).indices.tolist()
        got = [[e["patches"] for e in r] for r in routed]
        row["route_equal"] = float(np.mean([a == b for a, b in zip(got, expected, strict=True)]))
        row["l_over_n"] = str(Fraction(spec.patches_per_expert or 0, spec.layout.num_patches))
        row["ratio_is_l_over_n"] = Fraction(
            stats["patches_computed"], stats["patches_dense"]
        ) == Fraction(spec.patches_per_expert or 0, spec.layout.num_patches)
    else:
        picked = [{e["expert_id"] for e in r} for r in routed]
        sample = min(range(len(x)), key=lambda r: len(picked[r]))
        one = post(url, "/v1/predict", x[sample : sample + 1], return_stats="true")["stats"]
        row["token_experts_picked_min"] = len(picked[sample])
        row["token_experts_loaded_for_it"] = len(one["experts"])
        row["token_experts_picked_mean"] = float(np.mean([len(p) for p in picked]))
    rng = np.random.default_rng(0)
    same = 0
    for s in rng.choice(len(x), size=20, replace=False):
        alone = post(url, "/v1/predict", x[s : s + 1])["outputs"][0]
        others = rng.choice(len(x), size=int(rng.integers(5, 300)), replace=False)
        at = int(rng.integers(0, len(others)))
        batch = np.concatenate([x[others[:at]], x[s : s + 1], x[others[at:]]])
        same += post(url, "/v1/predict", batch)["outputs"][at] == alone
    row["batch_invariant"] = f"{same}/20"
    start = time.perf_counter()
    for chunk in np.array_split(x, 10):
        post(url, "/v1/predict", chunk)
    row["rows_per_s"] = round(len(x) / (time.perf_counter() - start), 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="also append the lines here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train = {"num_train": 300, "epochs": 30, "router_epochs": 30} if args.quick else {
        "num_train": 1000,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def build(name: str, **options: Any) -> PMoEBuild:
            config = PMoEBuildConfig(out=root / name, num_test=1000, **{**train, **options})
            return build_pmoe(config, progress=False)

        builds = {
            "separate k=2 l=2": build("separate"),
            "joint k=8 l=6": build("joint", train="joint", num_experts=8, patches_per_expert=6),
            "token choice k=8": build("token", train="joint", num_experts=8,
                                      patches_per_expert=6, routing="token_choice"),
            "4-class separate k=4 l=2": build("four", dataset="digits-patches-4class"),
        }
        served = root / "served"
        first = builds["separate k=2 l=2"]
        assert first.manifest.pmoe is not None
        publish_pmoe(first.model, served, image=first.manifest.pmoe.layout.image)
        with momlp_serve(served) as url:
            for name, b in builds.items():
                serve_build(url, served, b)
                line = json.dumps({"benchmark": "pmoe_serving", "quick": args.quick,
                                   **measure(url, name, b)})
                print(line, flush=True)
                if args.out is not None:
                    with open(args.out, "a", encoding="utf-8") as f:
                        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
