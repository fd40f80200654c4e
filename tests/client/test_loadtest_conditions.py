"""`momlp loadtest --conditions N --condition-distribution zipf:S` against a hyper store
(in-process app, fake pool): every request carries conditions; hits and misses add up."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from client import AsyncClient, LoadTestConfig, arun_loadtest

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")


async def test_conditions_workload_misses_once_per_condition_per_actor(tmp_path: Path) -> None:
    from server import Settings, create_app
    from server.pool import FakeExpertPool
    from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork

    torch.manual_seed(0)
    f = HyperNetwork(3, PrimarySpec(4, (8,), 2), depth=1, width=16)
    publish_hypernetwork(tmp_path / "store", f)
    settings = Settings(store=tmp_path / "store", watch_store=False, actors=2,
                        cache_bytes=1 << 20, max_batch_wait_ms=0.0)
    app = create_app(settings, pool_factory=FakeExpertPool)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        config = LoadTestConfig(url="http://momlp.test", requests=60, concurrency=1, batch=3,
                                conditions=20, condition_distribution="zipf:1.0", plots=False)
        report = await arun_loadtest(
            config,
            client_factory=lambda c: AsyncClient(c.url, transport=transport, max_retries=0),
        )
    assert report.ok == 60 and report.errors == 0
    assert report.workload["conditions"] == 20
    # The cache holds every θ and requests go one at a time: each condition misses once.
    assert 1 <= report.misses <= 20
    assert report.hits + report.misses >= 60
    assert report.vram_bytes["max"] > 4 * sum(p.numel() for p in f.f.parameters())
    # The server's θ keys, one per distinct condition, against what the workload drew.
    assert report.conditions_served == report.workload["distinct_drawn"]
    assert 1 < report.conditions_served <= 20
    assert f"conditions served {report.conditions_served} distinct θ" in report.summary()
    assert "experts served" not in report.summary()
    # The server's own loads: each θ once, and the hypernetwork on each actor that ran one.
    assert report.server_counts is not None
    assert report.server_counts["loads"] - report.conditions_served in (1, 2)
    assert report.server_counts["evictions"] == 0
    assert "θ and hypernetworks" in report.summary()



def test_cli_conditions_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from client import _cli

    seen: list[LoadTestConfig] = []
    def capture(config: LoadTestConfig, args: argparse.Namespace) -> object:
        seen.append(config)
        return argparse.Namespace(ok=1)

    monkeypatch.setattr(_cli, "_one", capture)
    root = argparse.ArgumentParser(prog="momlp")
    _cli.register(root.add_subparsers(dest="command"))
    args = root.parse_args(["loadtest", "--conditions", "1000",
                            "--condition-distribution", "zipf:1.0", "--quiet"])
    assert args.handler(args) == 0
    assert seen[0].conditions == 1000 and seen[0].condition_distribution == "zipf:1.0"
    bad = root.parse_args(["loadtest", "--conditions", "10", "--condition-distribution", "x"])
    assert bad.handler(bad) == 2
