"""`run_loadtest` against a real server (uvicorn + Ray actors): its figures against /metrics
and every request's device memory against a computation from the experts' architectures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from live_support import serve_app
from prometheus_client.parser import text_string_to_metric_families

from client import LoadTestConfig, run_loadtest
from experts_store import ExpertArch, ExpertMLP, Store, StoreWriter

pytestmark = [pytest.mark.integration, pytest.mark.ray]

K, N, OUT = 24, 4, 2
# Two architectures, so that the widest layer (hence the activation share) differs by expert.
ARCHS = (ExpertArch(widths=(N, 32, 48, OUT)), ExpertArch(widths=(N, 80, OUT)))


def _build_store(root: Path) -> Path:
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(7)
    with StoreWriter(root) as writer:
        for expert_id in range(K):
            writer.add_expert(expert_id, ExpertMLP(ARCHS[expert_id % 2], generator=generator))
        prototypes = 3.0 * torch.randn(K, N, generator=generator)
        PrototypeTree.build(prototypes, branching=4, seed=0).save(writer.router_path)
        writer.publish(task="regression", input_dim=N, output_dim=OUT, routing="tree", branching=4)
    return root


@pytest.fixture(scope="module")
def store_and_url(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Store, str]]:
    """A real server whose 2 actors each have room for a few experts only, so that a Zipf load
    both hits and misses."""

    from server import Settings, create_app

    root = _build_store(tmp_path_factory.mktemp("loadtest-live") / "store")
    store = Store.open(root)
    largest = max(store.expert_nbytes(e) for e in range(K))
    # CPU: the server computes activation bytes from tensor sizes there, which is what this
    # test recomputes; on CUDA it reads the allocator's peak counters instead.
    settings = Settings(
        store=root,
        port=0,
        device="cpu",
        actors=2,
        cache_bytes=4 * largest,
        watch_store=False,
        max_rows=512,
    )
    with serve_app(create_app(settings), name="momlp-uvicorn-loadtest") as url:
        yield store, url


def _counters(url: str) -> dict[str, float]:
    """Predict requests answered 200, cache hits and misses, as /metrics reports them."""
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    found = {"requests": 0.0, "hits": 0.0, "misses": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "momlp_requests_total":
                if (
                    sample.labels.get("endpoint") == "/v1/predict"
                    and sample.labels.get("status") == "200"
                ):
                    found["requests"] += sample.value
            elif sample.name == "momlp_cache_hits_total":
                found["hits"] += sample.value
            elif sample.name == "momlp_cache_misses_total":
                found["misses"] += sample.value
    return found


def _activation_share(store: Store, expert_id: int, rows: int) -> int:
    """Measured on a CPU forward of the expert itself: the largest input + output bytes of any
    of its layers (Linear, PReLU) over `rows` rows, seen by forward hooks."""
    module = store.load_expert(expert_id)
    sizes: list[int] = []

    def record(
        layer: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> None:
        sizes.append(sum(t.numel() * t.element_size() for t in (*inputs, output)))

    hooks = [
        layer.register_forward_hook(record)
        for layer in module.modules()
        if not list(layer.children())
    ]
    with torch.no_grad():
        module(torch.zeros(rows, N))
    for hook in hooks:
        hook.remove()
    assert sizes, "the expert has no layers"
    return max(sizes)


def test_report_agrees_with_the_server_counters_and_bounds_vram_per_request(
    store_and_url: tuple[Store, str],
) -> None:
    store, url = store_and_url
    before = _counters(url)
    report = run_loadtest(
        LoadTestConfig(
            url=url,
            requests=300,
            concurrency=8,
            batch=3,
            distribution="zipf:1.0",
            seed=11,
            save_requests=True,
            plots=False,
        )
    )
    after = _counters(url)

    assert report.requests == report.ok == 300 and report.errors == 0
    assert report.rows == 900
    assert after["requests"] - before["requests"] == report.ok
    assert after["hits"] - before["hits"] == report.hits
    assert after["misses"] - before["misses"] == report.misses
    # 4 experts of room per actor, 24 experts served: the load must both hit and miss.
    assert report.hits > 0 and report.misses > 0
    assert report.hits + report.misses == sum(len(r["expert_rows"]) for r in report.records or [])

    assert report.records is not None and len(report.records) == 300
    largest_bound = 0
    for record in report.records:
        expert_rows = {int(e): rows for e, rows in record["expert_rows"].items()}
        assert sum(expert_rows.values()) == record["rows"] == 3
        # The actor runs one expert at a time, so the request's figure is the max over experts.
        bounds = {
            e: store.expert_nbytes(e) + _activation_share(store, e, rows)
            for e, rows in expert_rows.items()
        }
        assert record["vram_bytes"] <= max(bounds.values())
        assert record["vram_bytes"] == max(bounds.values())
        largest_bound = max(largest_bound, *bounds.values())

    assert report.vram_bytes["max"] <= largest_bound
    # Dense equivalent: every expert's weights as an actor holds them (vram_bytes' measure;
    # a file adds its safetensors header).
    assert report.dense_equivalent_bytes == sum(
        store.expert_nbytes(e.id) for e in store.manifest.experts
    )
    assert report.vram_bytes["p99"] < report.dense_equivalent_bytes / 4
