"""Kind "graph" on the fake pool: plan/combine by waves, the HTTP fields, failures by node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from app_support import app_settings, fake_app, running
from graph_support import global_ids, inputs, offline, tiny_graph_store

from experts_store import Store
from server._settings import Settings
from server.batching import Batcher
from server.kinds import GateRequest, GraphModel, GraphOptions, open_model
from server.pool import FakeExpertPool, activation_peak_bytes

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def graph_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    root = tmp_path_factory.mktemp("graph") / "store"
    return root, tiny_graph_store(root)


def test_plan_and_combine_run_one_round_per_wave_on_the_fake_pool(graph_store) -> None:
    root, model = graph_store
    served = open_model(Store.open(root))
    assert isinstance(served, GraphModel)
    x = inputs(64, seed=1)
    routing = served.route(x, GraphOptions("tree"))
    # Route fills wave 0 only; the run routes the rest from upstream outputs.
    first = [served.nodes[n].index for n in served.waves[0]]
    assert bool((routing.node_experts[:, first] >= 0).all())
    assert bool((routing.node_experts[:, [i for i in range(7) if i not in first]] < 0).all())
    run = served.start(x, routing)
    pool = FakeExpertPool(app_settings(root))
    rounds = []

    async def drive() -> None:
        while (plan := run.plan()) is not None:
            for group in plan.groups:  # one group per (node, expert), each row once per node
                assert group.label and int(group.weights.sum()) == group.rows.numel()
            run.combine(plan, await pool.run(plan.pool_groups()))
            rounds.append({g.label for g in plan.groups})

    asyncio.run(drive())
    assert rounds == [set(w) for w in served.waves]
    hard = offline(model, x)
    assert torch.allclose(run.outputs, hard.outputs, atol=1e-5, rtol=0)
    assert routing.per_node() == {
        n: (ids, routing.per_node()[n][1]) for n, ids in global_ids(model, hard).items()
    }
    # Each node's tree walk costs at most ν·⌈log_ν K_v⌉ = 4 evaluations (K_v = ν = 4).
    assert int(routing.distance_evals.max()) <= 7 * 4


def test_a_failed_node_group_kills_its_rows_downstream_only(graph_store) -> None:
    root, _ = graph_store
    served = open_model(Store.open(root))
    x = inputs(64, seed=2)
    routing = served.route(x, GraphOptions("tree"))
    run = served.start(x, routing)
    pool = FakeExpertPool(app_settings(root))

    async def drive() -> torch.Tensor:
        plan = run.plan()
        assert plan is not None
        results = await pool.run(plan.pool_groups())
        bad = plan.groups[0]
        results[0] = type(results[0])(**{**vars(results[0]), "error": "gone", "outputs":
                                         torch.empty(0, 1)})
        run.combine(plan, results)
        later = run.plan()
        assert later is not None
        for group in later.groups:
            assert not set(group.rows.tolist()) & set(bad.rows.tolist())
        return bad.rows

    dead = asyncio.run(drive())
    assert bool((routing.node_experts[dead][:, served.nodes["root"].index] == -1).all())


async def test_predict_reports_each_nodes_expert_and_graph_stats(graph_store) -> None:
    root, model = graph_store
    x = inputs(50, seed=3)
    hard = offline(model, x)
    async with running(fake_app(root)) as client:
        body = (await client.post(
            "/v1/predict", json={"inputs": x.tolist(), "return_stats": True}
        )).json()
        graph = (await client.get("/v1/graph")).json()
        refused = await client.post("/v1/predict", json={"inputs": x.tolist(), "top_k": 2})
    assert torch.allclose(torch.tensor(body["outputs"]), hard.outputs, atol=1e-5, rtol=0)
    assert body["nodes"] == global_ids(model, hard)
    stats = body["stats"]
    assert stats["graph"]["waves"] == 3
    assert stats["vram_bytes"] == sum(stats["graph"]["wave_vram_bytes"])
    assert stats["graph"]["peak_wave_vram_bytes"] == max(stats["graph"]["wave_vram_bytes"])
    assert all(max(v) <= 4 for v in stats["graph"]["node_distance_evals"].values())
    assert {s["node"] for s in stats["experts"]} == {n.name for n in model.spec.nodes}
    assert len(graph["nodes"]) == 7 and graph["waves"][-1] == ["root"]
    assert ["l0_0", "l1_0"] in graph["edges"] and ["x:0", "l0_0"] in graph["edges"]
    assert all(n["num_experts"] == 4 and n["bytes"] > 0 for n in graph["nodes"])
    assert graph["max_distance_evals"] == 28
    # VRAM per request: at most one expert per node (loaded) plus each node's activations.
    activations = 7 * activation_peak_bytes([2, 8, 1], 50)
    assert stats["vram_bytes"] <= graph["one_expert_per_node_device_bytes"] + activations
    assert graph["one_expert_per_node_device_bytes"] * 4 == graph["total_expert_device_bytes"]
    assert refused.status_code == 422 and "top_k" in refused.text


async def test_route_gives_the_first_waves_experts_and_their_real_distances(graph_store) -> None:
    root, model = graph_store
    x = inputs(20, seed=5)
    hard = offline(model, x)
    async with running(fake_app(root)) as client:
        body = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
    first_wave = list(model.waves[0])
    ids = global_ids(model, hard)
    names = [n.name for n in model.spec.nodes]
    assert all(names.index(n) < len(first_wave) for n in first_wave)  # listed first
    for row in range(x.shape[0]):
        assert body["experts"][row] == [ids[n][row] for n in first_wave]
        # Euclidean distance from the node's inputs to its chosen prototype, computed here.
        expected = []
        with torch.no_grad():
            for name in first_wave:
                z = model.node_inputs(name, x[row : row + 1], {})
                prototype = model.node(name).prototypes[hard.experts[name][row]]
                expected.append(float(torch.linalg.vector_norm(z[0] - prototype)))
        np.testing.assert_allclose(body["distances"][row], expected, rtol=1e-4, atol=1e-6)
        assert min(body["distances"][row]) > 0


async def test_route_answers_the_first_wave_when_the_spec_lists_later_nodes_first(
    tmp_path: Path,
) -> None:
    # Root first: the first wave's nodes are the manifest's last columns.
    model = tiny_graph_store(tmp_path / "store", reverse=True)
    names = [n.name for n in model.spec.nodes]
    first_wave = [n for n in names if n in set(model.waves[0])]
    assert names.index(first_wave[0]) > 0
    x = inputs(12, seed=7)
    ids = global_ids(model, offline(model, x))
    async with running(fake_app(tmp_path / "store")) as client:
        body = (await client.post("/v1/route", json={"inputs": x.tolist()})).json()
    for row in range(x.shape[0]):
        assert body["experts"][row] == [ids[n][row] for n in first_wave]
        assert len(body["weights"][row]) == len(body["distances"][row]) == len(first_wave)
        assert min(body["distances"][row]) > 0


async def test_each_row_is_the_same_alone_and_inside_merged_batches(graph_store) -> None:
    """Batch invariance through the batcher: bitwise the same output (and node experts)
    alone as inside random requests merged into shared batches."""
    root, _ = graph_store
    served = open_model(Store.open(root))
    settings = Settings(max_batch_wait_ms=0.0, max_batch_rows=4096, cache_bytes=10**7)
    pool = FakeExpertPool(settings)
    batcher = Batcher(served, pool, settings)
    x = inputs(300, seed=4)
    options = served.resolve(GateRequest(), settings)
    try:
        alone = [await batcher.submit(x[i : i + 1], options) for i in range(300)]
        rng = np.random.default_rng(5)
        order = torch.from_numpy(rng.permutation(300))
        parts = torch.tensor_split(order, sorted(rng.choice(np.arange(1, 300), 9, replace=False)))
        answers = await asyncio.gather(*(batcher.submit(x[p], options) for p in parts))
        together = torch.empty(300, 1)
        experts = torch.empty(300, 7, dtype=torch.int64)
        for p, answer in zip(parts, answers, strict=True):
            together[p] = torch.from_numpy(answer.outputs)
            experts[p] = torch.from_numpy(answer.experts)
        assert torch.equal(torch.cat([torch.from_numpy(a.outputs) for a in alone]), together)
        assert torch.equal(torch.cat([torch.from_numpy(a.experts) for a in alone]), experts)
    finally:
        await batcher.close()
        await pool.close()


async def test_node_distance_evaluations_stay_within_nu_ceil_log_nu_k(tmp_path: Path) -> None:
    # K_v = 16, ν = 4: each node's balanced tree has ⌈log_4 16⌉ = 2 levels, so a row costs
    # at most 8 evaluations per node (the k-means tree could go 3 levels, 10-11).
    root = tmp_path / "store"
    model = tiny_graph_store(root, experts=16)
    x = inputs(200, seed=5)
    async with running(fake_app(root)) as client:
        body = (await client.post(
            "/v1/predict", json={"inputs": x.tolist(), "return_stats": True}
        )).json()
        graph = (await client.get("/v1/graph")).json()
    assert body["nodes"] == global_ids(model, offline(model, x))
    per_node = body["stats"]["graph"]["node_distance_evals"]
    assert set(per_node) == {n.name for n in model.spec.nodes}
    assert all(len(v) == 200 and max(v) <= 4 * 2 for v in per_node.values())
    assert all(model.node(n.name).tree.depth == 2 for n in model.spec.nodes)  # type: ignore[union-attr]
    assert graph["max_distance_evals"] == 7 * 8
