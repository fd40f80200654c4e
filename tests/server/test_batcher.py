from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from experts_store import ExpertRef, Store, load_expert
from router import Gate, GateRouting
from server import ExpertUnavailable, InvalidRequest, PoolClosed, PoolSaturated
from server._settings import Settings
from server.batching import Batcher, OpenConnections
from server.kinds import MomlpModel
from server.pool import ActorInfo, FakeExpertPool, Group, GroupResult, activation_peak_bytes
from server.serving import default_batcher

pytestmark = pytest.mark.unit

MakeStore = Callable[..., Path]
Built = tuple[Store, "Batcher", "GatedPool", "TableRouter", "FakeClock"]
Setup = Callable[..., Built]


class FakeClock:
    """Time moves only when the test says so; `sleep` returns once the clock passed its end."""

    def __init__(self) -> None:
        self.t = 100.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.t + seconds, future))
        await future

    def advance(self, seconds: float) -> None:
        self.t += seconds
        for end, future in self._sleepers:
            if end <= self.t and not future.done():
                future.set_result(None)
        self._sleepers = [(e, f) for e, f in self._sleepers if not f.done()]


class TableRouter:
    """Row i goes to expert round(x[i, 0]) mod K (then the next ids for top_k > 1)."""

    depth = 2

    def __init__(self, dim: int, num_prototypes: int) -> None:
        self.dim = dim
        self.num_prototypes = num_prototypes
        self.calls: list[int] = []
        self.threads: list[int] = []  # the thread each call ran on

    def gate(self, x: torch.Tensor, gate: Gate) -> GateRouting:
        self.calls.append(int(x.shape[0]))
        self.threads.append(threading.get_ident())
        top_k = gate.top_k
        first = x[:, 0].round().long() % self.num_prototypes
        experts = torch.stack([(first + j) % self.num_prototypes for j in range(top_k)], dim=1)
        weights = torch.softmax(-torch.arange(top_k, dtype=torch.float64), dim=0)
        weights = weights.expand(x.shape[0], top_k).contiguous()
        distances = torch.zeros(experts.shape, dtype=torch.float32)
        return GateRouting(experts, weights, distances, torch.full((x.shape[0],), 3 + top_k))


class GatedPool:
    """Wraps a pool; calls wait until `gate` is set, and every call is recorded."""

    def __init__(self, inner: FakeExpertPool, *, device: str | None = None) -> None:
        self.inner = inner
        self._device = device  # the actors' device, when not the inner pool's
        self.gate = asyncio.Event()
        self.gate.set()
        self.runs: list[list[Group]] = []
        self.prefetched: list[list[int]] = []

    async def run(
        self, groups: list[Group], *, wanted: Callable[[], bool] | None = None
    ) -> list[GroupResult]:
        self.runs.append(groups)
        await self.gate.wait()
        return await self.inner.run(groups, wanted=wanted)

    @property
    def budget_bytes(self) -> int:
        return self.inner.budget_bytes

    @property
    def device(self) -> str:
        return self.inner.device if self._device is None else self._device

    async def prefetch(self, experts: Sequence[ExpertRef]) -> None:
        self.prefetched.append([ref.expert_id for ref in experts])

    async def forget_popularity(self) -> None:
        await self.inner.forget_popularity()

    def residency(self) -> dict[str, list[str]]:
        return self.inner.residency()

    def actors(self) -> list[ActorInfo]:
        return self.inner.actors()

    async def close(self) -> None:
        await self.inner.close()


def refs(store: Store) -> list[ExpertRef]:
    return [store.expert_ref(e.id) for e in store.manifest.experts]


def inputs(experts: list[int], n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(len(experts), n, generator=torch.Generator().manual_seed(seed))
    x[:, 0] = torch.tensor(experts, dtype=torch.float32)
    return x


def reference(store: Store, experts: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> (
    torch.Tensor
):
    """Weighted sum over k of each row's experts, from files read independently."""
    experts, weights = torch.as_tensor(experts), torch.as_tensor(weights)
    modules = {}
    for e in experts.unique().tolist():
        entry = store.expert_entry(e)
        modules[e] = load_expert(store.root / entry.file, expected_sha256=entry.sha256)
    out = []
    with torch.no_grad():
        for i in range(x.shape[0]):
            row = sum(
                float(weights[i, j]) * modules[int(experts[i, j])](x[i : i + 1])[0]
                for j in range(experts.shape[1])
            )
            out.append(row)
    return torch.stack(out)  # type: ignore[arg-type]


@pytest.fixture
def setup(make_store: MakeStore) -> Setup:
    def build(
        open_connections: Callable[[], int | None] | None = None, **settings_kwargs: object
    ) -> Built:
        store = Store.open(make_store(K=6, n=3, width=8, out=2))
        fields: dict[str, object] = {
            "max_batch_wait_ms": 2.0, "batch_gap_ms": 0.0, "cache_bytes": 10**7
        }
        fields.update(settings_kwargs)
        settings = Settings(**fields)  # type: ignore[arg-type]
        clock = FakeClock()
        pool = GatedPool(FakeExpertPool(settings, clock=clock))
        router = TableRouter(dim=3, num_prototypes=6)
        model = MomlpModel(router, refs(store))
        batcher = Batcher(
            model, pool, settings, clock, sleep=clock.sleep, open_connections=open_connections
        )
        return store, batcher, pool, router, clock

    return build


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def settle_until(predicate: Callable[[], bool]) -> None:
    """Settle until `predicate` holds, bounded: a batch's routing may run on a thread, which a
    loaded machine schedules later than 20 turns of the loop (the fake clock stays put)."""
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never settled")


async def test_requests_within_the_window_share_one_router_and_pool_call(setup: Setup) -> None:
    store, batcher, pool, router, clock = setup()
    first = asyncio.create_task(batcher.submit(inputs([0, 1], 3, seed=1)))
    await settle()
    clock.advance(0.001)
    second = asyncio.create_task(batcher.submit(inputs([1, 2, 2], 3, seed=2)))
    await settle()
    assert router.calls == []  # the window (2 ms from the first request) is still open
    clock.advance(0.0015)
    a, b = await asyncio.gather(first, second)
    assert router.calls == [5]
    assert len(pool.runs) == 1
    assert sorted(g.expert_id for g in pool.runs[0]) == [0, 1, 2]
    assert [g.rows.shape[0] for g in sorted(pool.runs[0], key=lambda g: g.expert_id)] == [1, 2, 2]
    assert a.experts[:, 0].tolist() == [0, 1] and b.experts[:, 0].tolist() == [1, 2, 2]
    for x, answer in ((inputs([0, 1], 3, seed=1), a), (inputs([1, 2, 2], 3, seed=2), b)):
        expected = reference(store, answer.experts, answer.weights, x)
        torch.testing.assert_close(torch.from_numpy(answer.outputs), expected, rtol=1e-5, atol=1e-6)
    assert a.queue_ms == pytest.approx(2.5) and b.queue_ms == pytest.approx(1.5)
    third = asyncio.create_task(batcher.submit(inputs([3], 3)))
    await settle()
    clock.advance(0.002)
    await third
    assert router.calls == [5, 1]
    await batcher.close()
    await pool.close()


async def test_a_window_closes_early_once_requests_stop_joining_it(setup: Setup) -> None:
    _, batcher, pool, router, clock = setup(batch_gap_ms=0.5)
    first = asyncio.create_task(batcher.submit(inputs([0, 1], 3, seed=1)))
    await settle()
    clock.advance(0.0003)
    second = asyncio.create_task(batcher.submit(inputs([2], 3, seed=2)))
    await settle()
    clock.advance(0.0003)  # 0.6 ms after the first request but 0.3 after the last: open
    await settle()
    assert router.calls == []
    clock.advance(0.0003)  # 0.6 ms since a request joined: it closes, 1.1 ms before 2 ms
    a, b = await asyncio.gather(first, second)
    assert router.calls == [3] and len(pool.runs) == 1
    assert a.queue_ms == pytest.approx(0.9) and b.queue_ms == pytest.approx(0.6)
    lone = asyncio.create_task(batcher.submit(inputs([3], 3)))
    await settle()
    clock.advance(0.0005)  # a lone request waits the gap, not the window
    assert (await lone).queue_ms == pytest.approx(0.5)
    assert router.calls == [3, 1]
    await batcher.close()
    await pool.close()


async def test_a_window_closes_at_once_when_every_connection_has_a_request_in(
    setup: Setup,
) -> None:
    connections = OpenConnections()
    open_now = [3]
    connections.attach(lambda: open_now[0])
    _, batcher, pool, router, clock = setup(open_connections=connections, batch_gap_ms=0.6)
    first = asyncio.create_task(batcher.submit(inputs([0, 1], 3, seed=1)))
    second = asyncio.create_task(batcher.submit(inputs([2], 3, seed=2)))
    await settle()
    assert router.calls == []  # a third connection could still send
    third = asyncio.create_task(batcher.submit(inputs([3], 3, seed=3)))
    await settle()  # the clock never moves
    assert router.calls == [4]
    answers = await asyncio.gather(first, second, third)
    assert len(pool.runs) == 1
    assert [a.queue_ms for a in answers] == [0.0, 0.0, 0.0]
    # A request in a running batch holds its connection too: with 2 open and one batch held
    # at the pool, the next request is the last one that can come, so it goes at once.
    open_now[0] = 2
    pool.gate.clear()
    held = asyncio.create_task(batcher.submit(inputs([0], 3, seed=4)))
    await settle()
    clock.advance(0.0006)  # its gap: the batch goes, and waits at the pool
    await settle_until(lambda: router.calls == [4, 1])
    last = asyncio.create_task(batcher.submit(inputs([5], 3, seed=5)))
    await settle_until(lambda: router.calls == [4, 1, 1])
    pool.gate.set()
    assert (await last).queue_ms == 0.0 and (await held).queue_ms == pytest.approx(0.6)
    await batcher.close()
    await pool.close()


async def test_without_a_connection_count_a_window_waits_as_before(setup: Setup) -> None:
    # No count (in-process clients): 0 connections with requests waiting says nothing either.
    for count in (None, 0):
        connections = OpenConnections()
        if count is not None:
            connections.attach(lambda: 0)
        _, batcher, pool, router, clock = setup(open_connections=connections, batch_gap_ms=0.6)
        lone = asyncio.create_task(batcher.submit(inputs([0], 3)))
        await settle()
        assert router.calls == []
        clock.advance(0.0006)
        assert (await lone).queue_ms == pytest.approx(0.6)
        await batcher.close()
        await pool.close()


async def test_a_full_batch_goes_without_waiting_for_the_window(setup: Setup) -> None:
    _, batcher, pool, router, _clock = setup(max_batch_rows=4)
    answers = await asyncio.gather(
        batcher.submit(inputs([0, 1], 3)), batcher.submit(inputs([2, 3], 3))
    )
    assert router.calls == [4]
    assert [a.outputs.shape for a in answers] == [(2, 2), (2, 2)]
    await batcher.close()
    await pool.close()


async def test_top_k_outputs_are_the_gate_weighted_sum(setup: Setup) -> None:
    store, batcher, pool, _router, clock = setup(max_batch_wait_ms=0.0)
    x = inputs([0, 4, 5, 5], 3, seed=7)
    answer = await batcher.submit(x, Gate(top_k=3))
    assert answer.experts.tolist() == [[0, 1, 2], [4, 5, 0], [5, 0, 1], [5, 0, 1]]
    sums = torch.from_numpy(answer.weights.sum(1))
    torch.testing.assert_close(sums, torch.ones(4, dtype=torch.float64))
    expected = reference(store, answer.experts, answer.weights, x)
    torch.testing.assert_close(torch.from_numpy(answer.outputs), expected, rtol=1e-5, atol=1e-6)
    # (row, k) pairs are rows of their expert: expert 0 gets one pair from each row.
    stat0 = next(s for s in answer.stats if s.expert_id == 0)
    assert stat0.rows == 4
    assert answer.distance_evals.tolist() == [6, 6, 6, 6]
    await batcher.close()
    await pool.close()


async def test_stats_share_the_activation_peak_by_rows(setup: Setup) -> None:
    store, batcher, pool, _router, clock = setup()
    one = asyncio.create_task(batcher.submit(inputs([2], 3)))
    three = asyncio.create_task(batcher.submit(inputs([2, 2, 2, 4], 3, seed=3)))
    await settle()
    clock.advance(0.01)
    a, b = await asyncio.gather(one, three)
    widths = (3, 8, 2)
    peak = activation_peak_bytes(widths, 4)  # expert 2's batch had 1 + 3 rows
    [sa] = a.stats
    assert (sa.expert_id, sa.rows, sa.cache, sa.activation_bytes) == (2, 1, "miss", peak)
    assert sa.expert_bytes == store.expert_nbytes(2)
    assert sa.vram_bytes == store.expert_nbytes(2) + peak * 1 // 4
    sb2, sb4 = b.stats
    assert (sb2.expert_id, sb2.rows) == (2, 3)
    assert sb2.vram_bytes == store.expert_nbytes(2) + peak * 3 // 4
    assert sb4.vram_bytes == store.expert_nbytes(4) + activation_peak_bytes(widths, 1)
    assert b.vram_bytes == max(sb2.vram_bytes, sb4.vram_bytes)
    assert b.device_bytes == {"actor-0": store.expert_nbytes(2) + store.expert_nbytes(4)}
    again = asyncio.create_task(batcher.submit(inputs([2], 3)))
    await settle()
    clock.advance(0.01)
    assert (await again).stats[0].cache == "hit"
    await batcher.close()
    await pool.close()


async def test_full_queue_fails_fast_then_drains(setup: Setup) -> None:
    _, batcher, pool, _router, clock = setup(max_queue_rows=5, max_batch_wait_ms=0.0)
    pool.gate.clear()
    waiting = [asyncio.create_task(batcher.submit(inputs([e, e], 3))) for e in (0, 1)]
    await settle()
    assert batcher.queued_rows == 4
    with pytest.raises(PoolSaturated) as info:
        await batcher.submit(inputs([3, 3], 3))
    assert info.value.retry_after_s > 0
    assert info.value.fields["max_queue_rows"] == 5
    pool.gate.set()
    answers = await asyncio.gather(*waiting)
    assert [a.outputs.shape[0] for a in answers] == [2, 2]
    assert batcher.queued_rows == 0
    await batcher.submit(inputs([3, 3], 3))
    await batcher.close()
    await pool.close()


async def _until(condition: Callable[[], bool]) -> None:
    # Routing runs in a worker thread, so the loop has to yield real time (bounded) to it.
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def _busy_slots_and_a_queued_request(
    batcher: Batcher, pool: GatedPool
) -> tuple[list[asyncio.Task[Any]], asyncio.Task[Any]]:
    """Both batch slots held by gated runs (keys differ, so two batches), then one request
    queued behind them; the caller opens `pool.gate`."""
    pool.gate.clear()
    running = [
        asyncio.create_task(batcher.submit(inputs([0], 3), Gate(top_k=1))),
        asyncio.create_task(batcher.submit(inputs([2], 3), Gate(top_k=2))),
    ]
    await _until(lambda: len(pool.runs) == 2)
    return running, asyncio.create_task(batcher.submit(inputs([5, 1, 5], 3)))


async def test_a_batch_is_not_prefetched_for_itself(setup: Setup) -> None:
    _, batcher, pool, _router, _clock = setup(max_batch_wait_ms=0.0)
    await batcher.submit(inputs([5, 1, 5], 3))
    assert pool.prefetched == []
    await batcher.close()
    await pool.close()


async def test_queued_work_is_prefetched_while_every_slot_is_busy(setup: Setup) -> None:
    _, batcher, pool, router, _clock = setup(max_batch_wait_ms=0.0, prefetch=True)
    running, queued = await _busy_slots_and_a_queued_request(batcher, pool)
    await _until(lambda: bool(pool.prefetched))
    assert pool.prefetched == [[1, 5]]
    routed = len(router.calls)
    pool.gate.set()
    answer = await queued
    await asyncio.gather(*running)
    # The routing made for the prefetch is the one the batch used: no second router call.
    assert len(router.calls) == routed
    assert answer.experts[:, 0].tolist() == [5, 1, 5]
    await batcher.close()
    await pool.close()


@pytest.mark.parametrize(("device", "prefetched"), [("cpu", False), ("cuda", True)])
async def test_unless_set_prefetch_is_on_for_cuda_actors_only(
    make_store: MakeStore, device: str, prefetched: bool
) -> None:
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    cpu = Settings(max_batch_wait_ms=0.0, cache_bytes=10**7, device="cpu")
    assert cpu.prefetch is None
    clock = FakeClock()
    # The actors' device is only read. It is the pool's, not this process's: a server on a
    # head without a GPU (settings say "auto", so "cpu" here) may still drive CUDA actors.
    pool = GatedPool(FakeExpertPool(cpu, clock=clock), device=device)
    model = MomlpModel(TableRouter(dim=3, num_prototypes=6), refs(store))
    batcher = Batcher(
        model, pool, cpu.model_copy(update={"device": "auto"}), clock, sleep=clock.sleep
    )
    running, queued = await _busy_slots_and_a_queued_request(batcher, pool)
    if prefetched:
        await _until(lambda: bool(pool.prefetched))
    else:
        await asyncio.sleep(0.05)  # time enough for a prefetch to start, were it on
    assert bool(pool.prefetched) is prefetched
    pool.gate.set()
    await asyncio.gather(queued, *running)
    await batcher.close()
    await pool.close()


async def test_different_top_k_are_batched_separately(setup: Setup) -> None:
    _, batcher, pool, router, clock = setup()
    tasks = [
        asyncio.create_task(batcher.submit(inputs([0], 3), Gate(top_k=1))),
        asyncio.create_task(batcher.submit(inputs([1], 3), Gate(top_k=2))),
        asyncio.create_task(batcher.submit(inputs([2], 3), Gate(top_k=1))),
    ]
    await settle()
    clock.advance(0.01)
    await settle()
    clock.advance(0.01)
    answers = await asyncio.gather(*tasks)
    assert sorted(router.calls) == [1, 2]
    assert [a.experts.shape[1] for a in answers] == [1, 2, 1]
    await batcher.close()
    await pool.close()


async def test_an_unloadable_expert_fails_only_its_requests(setup: Setup) -> None:
    store, batcher, pool, _router, clock = setup()
    path = store.expert_path(3)
    path.write_bytes(path.read_bytes()[:-8] + b"corrupt!")
    good = asyncio.create_task(batcher.submit(inputs([1, 2], 3)))
    bad = asyncio.create_task(batcher.submit(inputs([1, 3], 3)))
    await settle()
    clock.advance(0.01)
    results = await asyncio.gather(good, bad, return_exceptions=True)
    assert not isinstance(results[0], BaseException)
    assert isinstance(results[1], ExpertUnavailable)
    assert results[1].expert_id == 3
    # The failure is remembered: the next request for 3 fails without another load attempt.
    calls_before = len(pool.inner.calls)
    with pytest.raises(ExpertUnavailable):
        await asyncio.gather(batcher.submit(inputs([3], 3)), _advance(clock))
    assert all(3 not in ids for _, ids in pool.inner.calls[calls_before:])
    await batcher.close()
    await pool.close()


async def _advance(clock: FakeClock) -> None:
    await settle()
    clock.advance(0.01)


async def test_invalid_requests_are_refused_before_batching(setup: Setup) -> None:
    _, batcher, pool, router, _clock = setup()
    for bad, kwargs in [
        (torch.zeros(2, 4), {}),
        (torch.zeros(0, 3), {}),
        (torch.zeros(3), {}),
        (torch.tensor([[0.0, float("nan"), 1.0]]), {}),
        (torch.zeros(1, 3), {"top_k": 7}),
        (torch.zeros(1, 3), {"top_k": 0}),
        (torch.zeros(1, 3), {"mode": "fast"}),
    ]:
        with pytest.raises(InvalidRequest):
            await batcher.submit(bad, Gate(**kwargs))  # type: ignore[arg-type]
    assert router.calls == [] and batcher.queued_rows == 0
    await batcher.close()
    await pool.close()


async def test_close_fails_waiting_requests_and_refuses_new_ones(setup: Setup) -> None:
    _, batcher, pool, _router, _clock = setup(max_batch_wait_ms=0.0)
    pool.gate.clear()
    waiting = asyncio.create_task(batcher.submit(inputs([0], 3)))
    await settle()
    await batcher.close()
    with pytest.raises(PoolClosed):
        await waiting
    with pytest.raises(PoolClosed):
        await batcher.submit(inputs([0], 3))
    pool.gate.set()
    await pool.close()


async def test_numpy_inputs_and_a_dead_actor_mid_stream(setup: Setup) -> None:
    store, batcher, pool, _router, _clock = setup(max_batch_wait_ms=0.0, actors=2)
    rng = np.random.default_rng(0)
    xs = []
    for _ in range(12):
        x = rng.standard_normal((3, 3)).astype(np.float32)
        x[:, 0] = rng.integers(0, 6, size=3)
        xs.append(x)
    pool.inner.kill("actor-0")
    pool.inner.kill("actor-1")  # both die once: their groups are retried on the restarted ones
    answers = await asyncio.gather(*(batcher.submit(x) for x in xs))
    for x, answer in zip(xs, answers, strict=True):
        xt = torch.from_numpy(x)
        expected = reference(store, answer.experts, answer.weights, xt)
        torch.testing.assert_close(torch.from_numpy(answer.outputs), expected, rtol=1e-5, atol=1e-6)
    await batcher.close()
    await pool.close()


async def test_a_request_the_router_refuses_does_not_fail_its_batch(
    make_store: MakeStore,
) -> None:
    from router import PrototypeTree

    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    settings = Settings(max_batch_wait_ms=0.0)
    pool = FakeExpertPool(settings)
    tree = PrototypeTree.load(store.router_path)
    batcher = Batcher(MomlpModel(tree, refs(store), store.manifest), pool, settings)
    good = inputs([0, 0], 3, seed=5)
    huge = torch.full((1, 3), 1e20)  # finite, but beyond what the router accepts
    a, b = await asyncio.gather(batcher.submit(good), batcher.submit(huge), return_exceptions=True)
    assert isinstance(b, InvalidRequest)
    assert not isinstance(a, BaseException)
    routed = tree.route(good).experts
    assert torch.equal(torch.from_numpy(a.experts), routed)
    expected = reference(store, routed, a.weights, good)
    torch.testing.assert_close(torch.from_numpy(a.outputs), expected)
    await batcher.close()
    await pool.close()


async def test_a_failing_collector_fails_its_requests_and_restarts(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, batcher, pool, _router, _clock = setup(max_batch_wait_ms=0.0)

    def broken() -> list[object]:
        raise RuntimeError("bug in batching")

    monkeypatch.setattr(batcher, "_take_batch", broken)
    with pytest.raises(RuntimeError, match="bug in batching"):
        await batcher.submit(inputs([0], 3))
    monkeypatch.undo()
    answer = await batcher.submit(inputs([1], 3))
    assert answer.experts.tolist() == [[1]]
    await batcher.close()
    await pool.close()


@pytest.mark.parametrize("limit", [1, 3])
async def test_the_server_runs_at_most_max_inflight_batches_at_once(
    make_store: MakeStore, limit: int
) -> None:
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    settings = Settings(max_batch_wait_ms=0.0, cache_bytes=10**7, max_inflight_batches=limit)
    clock = FakeClock()
    pool = GatedPool(FakeExpertPool(settings, clock=clock))
    model = MomlpModel(TableRouter(dim=3, num_prototypes=6), refs(store))
    batcher = default_batcher(model, pool, settings, clock)
    pool.gate.clear()
    # Different top_k never merge: four requests are four batches.
    tasks = [
        asyncio.create_task(batcher.submit(inputs([e], 3), Gate(top_k=k)))
        for e, k in zip([0, 1, 2, 3], [1, 2, 3, 4], strict=True)
    ]
    await _until(lambda: len(pool.runs) == limit)
    await asyncio.sleep(0.05)
    assert len(pool.runs) == limit
    pool.gate.set()
    answers = await asyncio.gather(*tasks)
    assert [a.experts.shape[1] for a in answers] == [1, 2, 3, 4]
    assert len(pool.runs) == 4
    await batcher.close()
    await pool.close()


async def test_small_batches_are_routed_on_the_event_loop_with_the_same_answers(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=6, n=3, width=8, out=2))
    loop_thread = threading.get_ident()
    outputs: dict[float, torch.Tensor] = {}
    for bound_ms in (0.0, 0.5):
        settings = Settings(max_batch_wait_ms=0.0, cache_bytes=10**7, inline_route_ms=bound_ms)
        router = TableRouter(dim=3, num_prototypes=6)
        pool = FakeExpertPool(settings)
        # A CPU clock that never moves: routing looks free once it has been timed.
        batcher = Batcher(MomlpModel(router, refs(store)), pool, settings, cpu_clock=FakeClock())
        answers = [await batcher.submit(inputs([0, 1, 2, 5], 3, seed=s)) for s in range(3)]
        await batcher.close()
        await pool.close()
        outputs[bound_ms] = torch.cat([torch.from_numpy(answer.outputs) for answer in answers])
        on_loop = [thread == loop_thread for thread in router.threads]
        # The first batch is timed in a thread; a bound of 0 keeps every batch there.
        assert on_loop == ([False] * 3 if bound_ms == 0.0 else [False, True, True])

    torch.testing.assert_close(outputs[0.5], outputs[0.0], rtol=0, atol=0)


async def test_numpy_and_torch_inputs_are_checked_alike(setup: Setup) -> None:
    """Inputs are checked in numpy: numpy and torch inputs of any accepted dtype give the
    float32 answer, and each refused one names what is wrong."""
    _, batcher, pool, _router, _clock = setup(max_batch_wait_ms=0.0)
    x = inputs([0, 1], 3, seed=3)
    want = await batcher.submit(x)
    read_only = x.numpy().copy()
    read_only.flags.writeable = False
    for same in (x.numpy(), x.double().numpy(), read_only, x.double(), x.to(torch.bfloat16)):
        got = await batcher.submit(same)
        expected = want
        if isinstance(same, torch.Tensor) and same.dtype == torch.bfloat16:
            expected = await batcher.submit(same.float())
        assert np.array_equal(got.outputs, expected.outputs)
    integers = await batcher.submit(np.array([[0, 1, 2], [1, 0, 0]], dtype=np.int64))
    as_floats = await batcher.submit(np.array([[0, 1, 2], [1, 0, 0]], dtype=np.float32))
    assert np.array_equal(integers.outputs, as_floats.outputs)
    for bad, message in [
        (np.zeros((1, 3), dtype=bool), "must be numbers"),
        (np.zeros((1, 3), dtype=np.uint8), "must be numbers"),
        (np.zeros((1, 3), dtype=np.complex64), "must be numbers"),
        (torch.zeros(1, 3, dtype=torch.int16), "must be numbers"),
        (np.array([[0.0, np.inf, 1.0]]), "finite"),
        (np.array([[1e39, 0.0, 0.0]]), "finite"),  # beyond float32
        (np.zeros((2, 4), dtype=np.float32), "dimension 4, the model expects 3"),
        (np.zeros((0, 3), dtype=np.float32), "non-empty 2-D"),
    ]:
        with pytest.raises(InvalidRequest, match=message) as info:
            await batcher.submit(bad)
        assert info.value.field == "inputs"
    await batcher.close()
    await pool.close()
