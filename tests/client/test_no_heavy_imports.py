"""`client` works in an environment without torch, ray and numpy (blocked in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import json
    import math
    import sys

    BLOCKED = ("torch", "ray", "numpy", "safetensors", "matplotlib")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                # What Python raises when the package is not installed.
                raise ModuleNotFoundError(f"{name} is blocked", name=name.split(".")[0])
            return None

    sys.meta_path.insert(0, Block())

    import argparse
    import httpx
    import client
    from client import _cli

    PROTOTYPES = [[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]

    def nearest(row):
        return min(range(4), key=lambda i: math.dist(row, PROTOTYPES[i]))

    def handler(request):
        path = request.url.path
        if path == "/v1/model":
            return httpx.Response(200, json={
                "store_version": "v1", "format_version": 1, "task": "regression",
                "input_dim": 2, "output_dim": 1, "num_experts": 4, "branching": 2,
                "routing": "tree", "temperature": 1.0, "total_expert_bytes": 4000,
                "max_expert_bytes": 1000, "total_params": 1000, "prototypes": PROTOTYPES})
        if path == "/metrics":  # a gateway that does not pass it on
            return httpx.Response(404, json={"error": {"code": "not_found", "message": ""}})
        rows = json.loads(request.content)["inputs"]
        experts = [[nearest(r)] for r in rows]
        if path == "/v1/route":
            return httpx.Response(200, json={
                "experts": experts, "weights": [[1.0]] * len(rows),
                "distances": [[0.0]] * len(rows), "distance_evals": [4] * len(rows),
                "store_version": "v1"})
        stats = [{"expert_id": e[0], "rows": 1, "cache": "miss", "load_ms": 1.0,
                  "compute_ms": 0.1, "actor": "a", "expert_bytes": 1000,
                  "activation_bytes": 8, "vram_bytes": 1008} for e in experts]
        return httpx.Response(200, json={
            "outputs": [[sum(r)] for r in rows], "experts": experts,
            "weights": [[1.0]] * len(rows), "store_version": "v1",
            "stats": {"experts": stats, "vram_bytes": 1008, "device_bytes": {"a": 1000}}})

    with client.Client(transport=httpx.MockTransport(handler)) as c:
        prediction = c.predict([(0.1, 0.2), [0.9, 0.8]], return_stats=True)
        assert prediction.outputs == [[0.1 + 0.2], [0.9 + 0.8]], prediction.outputs
        assert c.predict([[0.1, 0.2]], binary=False).experts == [[0]]
        try:
            prediction.numpy()
        except ImportError:
            pass
        else:
            raise AssertionError("numpy() should need numpy")

    config = client.LoadTestConfig(
        requests=12, concurrency=2, batch=2, distribution="zipf:1.0", report_dir="report"
    )
    report = client.run_loadtest(
        config,
        client_factory=lambda cfg: client.AsyncClient(transport=httpx.MockTransport(handler)),
    )
    assert report.ok == 12 and report.rows == 24, report
    # Without matplotlib the page, the figures and the per-request file are still written.
    import pathlib
    page = pathlib.Path("report/report.html").read_text()
    assert "plots skipped: matplotlib not installed" in page and "<img" not in page
    assert len(pathlib.Path("report/requests.csv").read_text().splitlines()) == 13
    assert pathlib.Path("report/report.json").is_file()

    parser = argparse.ArgumentParser()
    _cli.register(parser.add_subparsers())
    assert parser.parse_args(["loadtest", "--requests", "3"]).requests == 3

    # The whole `momlp` command still starts; a command that needs torch says so.
    from server._cli import main as momlp
    assert momlp(["store", "info", "nowhere"]) == 2

    heavy = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    assert not heavy, heavy
    print("OK")
    """
)


def test_client_imports_and_works_without_torch_ray_numpy(tmp_path):
    script = tmp_path / "client_only.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("OK")
    assert "momlp store: needs the 'torch' package, which is not installed" in result.stderr
