"""The client against the real FastAPI app (in-process ASGI, fake pool, no Ray): the v1 JSON
contract as the server actually writes it, and load-test figures that match its /metrics."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

import client
from client import AsyncClient, LoadTestConfig, arun_loadtest
from client._server_counts import SERVER_COUNTERS

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")


def build_store(root: Path, *, num_experts: int = 16, dim: int = 3) -> Path:
    from experts_store import ExpertArch, ExpertMLP, StoreWriter
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(0)
    arch = ExpertArch(widths=(dim, 8, 2))
    with StoreWriter(root) as writer:
        for expert_id in range(num_experts):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        prototypes = torch.randn(num_experts, dim, generator=generator)
        PrototypeTree.build(prototypes, branching=4, seed=0).save(writer.router_path)
        writer.publish(task="regression", input_dim=dim, output_dim=2, routing="tree", branching=4)
    return root


@pytest.fixture
async def app_transport(tmp_path: Path) -> AsyncIterator[httpx.ASGITransport]:
    from server import Settings, create_app
    from server.pool import FakeExpertPool

    settings = Settings(
        store=build_store(tmp_path / "store"),
        watch_store=False,
        actors=2,
        cache_bytes=2048,
        max_batch_wait_ms=0.0,
    )
    app = create_app(settings, pool_factory=FakeExpertPool)
    async with app.router.lifespan_context(app):
        yield httpx.ASGITransport(app=app)


def make_client(transport: httpx.ASGITransport) -> AsyncClient:
    return AsyncClient("http://momlp.test", transport=transport, max_retries=0)


def counter(metrics: str, name: str) -> float:
    """Sum of a Prometheus counter over all its label sets."""
    pattern = rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$"
    return sum(float(value) for value in re.findall(pattern, metrics, re.MULTILINE))


async def test_every_sdk_call_decodes_the_app_answers(app_transport):
    async with make_client(app_transport) as momlp:
        assert await momlp.health() and await momlp.ready()
        model = await momlp.model(include_prototypes=True)
        assert model.num_experts == 16 and model.prototypes is not None
        rows = np.asarray(model.prototypes, dtype=np.float32)[:5] + 0.01
        routing = await momlp.route(rows, mode="exact")
        assert [e[0] for e in routing.experts] == [0, 1, 2, 3, 4]
        as_json = await momlp.predict(rows, top_k=2, return_stats=True)
        as_npy = await momlp.predict(rows, top_k=2, return_stats=True, binary=True)
        np.testing.assert_allclose(as_npy.numpy(), as_json.numpy(), rtol=1e-5, atol=1e-6)
        assert as_json.stats is not None and as_json.stats.experts
        experts = await momlp.experts()
        assert {actor.name for actor in experts.actors} == {"actor-0", "actor-1"}
        assert "momlp_requests_total" in await momlp.metrics()
        with pytest.raises(client.InvalidInput) as caught:
            await momlp.predict([[1.0, 2.0]])
        assert caught.value.code == "invalid_input"
        # The id the server gave the answer, for quoting to its operator.
        assert re.fullmatch(r"[0-9a-f]{16}", caught.value.request_id or "")


async def test_loadtest_figures_match_the_server_metrics(app_transport):
    async with make_client(app_transport) as momlp:
        before = await momlp.metrics()
    report = await arun_loadtest(
        LoadTestConfig(requests=60, concurrency=4, batch=3, distribution="zipf:1.0"),
        client_factory=lambda config: make_client(app_transport),
    )
    async with make_client(app_transport) as momlp:
        after = await momlp.metrics()
    assert report.ok == 60 and report.rows == 180
    for name, figure in (
        ("momlp_cache_hits_total", report.hits),
        ("momlp_cache_misses_total", report.misses),
    ):
        assert counter(after, name) - counter(before, name) == figure
    # The server's own counters over the run, each load once.
    assert report.server_counts is not None
    for key, name in SERVER_COUNTERS.items():
        assert report.server_counts[key] == counter(after, name) - counter(before, name)
    assert 0 < report.server_counts["loads"] <= report.misses
    assert f"loaded {report.server_counts['loads']} experts" in report.summary()
    assert report.workload["experts_with_inputs"] == 16
    assert 0 < report.vram_ratio < 1
    # The dense model in vram_bytes' measure: every expert's weights as a device holds them
    # (16 experts of 3*8 + 8 + 8 + 8*2 + 2 float32 values), not their files, whose safetensors
    # headers are as large as these tiny experts.
    assert report.dense_equivalent_bytes == 16 * 4 * (3 * 8 + 8 + 8 + 8 * 2 + 2)
