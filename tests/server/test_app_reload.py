"""Hot reload: a newly published store version replaces the serving generation atomically."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from app_support import (
    BlockingPool,
    app_settings,
    build_small_store,
    expert_outputs,
    fake_pool,
    manifest,
    republish,
    running,
)

from server import create_app
from server._settings import Settings
from server.pool import ExpertPool
from server.serving import ServingState, StoreVersionReader, read_store_version

pytestmark = pytest.mark.unit


async def test_reload_swaps_to_the_new_version_and_its_experts(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    old_version = manifest(store)["store_version"]
    app = create_app(app_settings(store), pool_factory=fake_pool)
    x = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
    async with running(app) as client:
        serving: ServingState = app.state.serving
        assert not await serving.reload()  # nothing new on disk
        new_version = republish(store, seed=42)
        assert new_version != old_version and read_store_version(store) == new_version
        assert await serving.reload()
        ready = (await client.get("/readyz")).json()
        answer = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
    assert ready["store_version"] == new_version
    assert answer["store_version"] == new_version
    experts = np.asarray(answer["experts"])[:, 0]
    expected = np.stack(
        [expert_outputs(store, int(e), x[i : i + 1])[0] for i, e in enumerate(experts)]
    )
    np.testing.assert_allclose(answer["outputs"], expected, rtol=1e-5, atol=1e-6)


async def test_requests_in_flight_finish_on_the_old_generation(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    old_version = manifest(store)["store_version"]
    pools: list[Any] = []

    def factory(settings: Settings) -> ExpertPool:
        # One pool serves every version; its first run blocks, so that the first request is
        # caught in flight on the old version.
        pools.append(BlockingPool(fake_pool(settings), blocked=1))
        return pools[-1]  # type: ignore[no-any-return]

    app = create_app(app_settings(store), pool_factory=factory)
    row = [[0.1, 0.2, 0.3, 0.4]]
    async with running(app) as client:
        serving: ServingState = app.state.serving
        in_flight = asyncio.create_task(client.post("/v1/predict", json={"inputs": row}))
        await pools[0].entered.wait()
        new_version = republish(store, seed=7)
        swapping = asyncio.create_task(serving.reload())
        while serving.version is None or serving.version.version != new_version:
            await asyncio.sleep(0)
        after = (await client.post("/v1/predict", json={"inputs": row})).json()
        assert not swapping.done()  # the old generation still has a request inside
        pools[0].gate.set()
        before = (await in_flight).json()
        assert await swapping
    assert before["store_version"] == old_version
    assert after["store_version"] == new_version


async def test_a_broken_new_store_keeps_the_old_generation_serving(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    old_version = manifest(store)["store_version"]
    app = create_app(app_settings(store), pool_factory=fake_pool)
    async with running(app) as client:
        (store / "manifest.json").write_text('{"store_version": "broken"}')
        with pytest.raises(Exception):  # noqa: B017 - whatever the store reader raises
            await app.state.serving.reload()
        ready = (await client.get("/readyz")).json()
    assert ready["store_version"] == old_version


class WatcherPolls:
    """The store watcher's sleep, replaced: each poll waits until `once()` lets it through."""

    def __init__(self) -> None:
        self._ticks: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()

    async def sleep(self, seconds: float) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._ticks.put(done)
        await done

    async def once(self) -> None:
        (await self._ticks.get()).set_result(None)
        # The poll has run when the watcher is back asking for its next sleep.
        await self._ticks.put(await self._ticks.get())


def watched_app(store: Path) -> tuple[Any, ServingState, WatcherPolls]:
    """An app on a fake pool whose store watcher polls when the test lets it (`polls`)."""
    app = create_app(app_settings(store, watch_store=True), pool_factory=fake_pool)
    serving: ServingState = app.state.serving
    polls = WatcherPolls()
    serving.sleep = polls.sleep
    return app, serving, polls


async def test_the_store_watcher_reloads_when_the_manifest_changes(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    app, serving, polls = watched_app(store)
    poll_once = polls.once
    async with running(app) as client:
        first = serving.version
        await poll_once()
        assert serving.version is first  # nothing changed on disk
        new_version = republish(store, seed=3)
        await poll_once()
        ready = (await client.get("/readyz")).json()
    assert ready["store_version"] == new_version


class _StepClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


async def test_a_refused_version_is_logged_once_and_retried_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import os

    import server.serving._state as state

    store = build_small_store(tmp_path / "store")
    clock = _StepClock()
    settings = app_settings(store, watch_store=True, watch_interval_s=2.0)
    app = create_app(settings, pool_factory=fake_pool, clock=clock)
    serving: ServingState = app.state.serving
    polls = WatcherPolls()
    poll_once = polls.once
    opened: list[Path] = []
    open_files = state._open_version_files

    def counting_open(root: Path, *args: Any) -> Any:
        opened.append(root)
        return open_files(root, *args)

    def publish_broken(version: str) -> None:
        # A published manifest whose router file does not exist.
        gone = "router-0123456789abcdef.safetensors"
        data = manifest(store) | {"store_version": version, "router_file": gone}
        (store / "manifest.tmp").write_text(json.dumps(data))
        os.replace(store / "manifest.tmp", store / "manifest.json")

    monkeypatch.setattr(state, "_open_version_files", counting_open)
    serving.sleep = polls.sleep
    async with running(app) as client:
        first = serving.version
        assert first is not None
        opened.clear()
        publish_broken("20990101T000000000000Z-broken")
        with caplog.at_level("DEBUG", logger="server.serving._state"):
            for _ in range(3):
                await poll_once()  # no time passes: one attempt, one error line
            assert len(opened) == 1
            clock.t += 2.5  # past the first wait (the poll interval): tried again, quietly
            await poll_once()
            await poll_once()
            assert len(opened) == 2
            clock.t += 2.5  # the wait has doubled to 4 s
            await poll_once()
            assert len(opened) == 2
            clock.t += 2.0
            await poll_once()
            assert len(opened) == 3
            # Another broken version is news: tried and logged at once.
            publish_broken("20990101T000000000001Z-broken")
            await poll_once()
            assert len(opened) == 4
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert [("-broken" in r.getMessage(), first.version in r.getMessage()) for r in errors] == [
            (True, True),
            (True, True),
        ]
        assert serving.version is first
        assert (await client.get("/readyz")).json()["store_version"] == first.version
        # A good publication is tried at the next poll, whatever the wait on the broken one.
        new_version = republish(store, seed=3)
        await poll_once()
        assert (await client.get("/readyz")).json()["store_version"] == new_version


async def test_the_start_says_how_much_of_the_store_one_actors_cache_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = build_small_store(tmp_path / "store")
    data = manifest(store)
    sizes = [entry["bytes"] for entry in data["experts"]]
    budget = 3 * max(sizes)
    app = create_app(app_settings(store, cache_bytes=budget), pool_factory=fake_pool)
    with caplog.at_level("INFO", logger="server.serving._state"):
        async with running(app):
            pass
    held = min(len(sizes), budget * len(sizes) // sum(sizes))
    assert (f"kind momlp, {len(sizes)} experts, {sum(sizes) / 2**20:.1f} MiB of expert files; "
            f"each actor's cache of {budget / 2**20:.1f} MiB holds about {held} of the "
            f"{len(sizes)} files") in caplog.text


async def test_metrics_name_the_served_version_and_kind_and_a_refused_one(
    tmp_path: Path,
) -> None:
    import os

    store = build_small_store(tmp_path / "store")
    app, serving, polls = watched_app(store)

    async def store_series(client: Any) -> list[str]:
        text = (await client.get("/metrics")).text
        return [line for line in text.splitlines() if line.startswith("momlp_store_")]

    async with running(app) as client:
        first = serving.version
        assert first is not None
        assert await store_series(client) == [
            f'momlp_store_info{{kind="momlp",version="{first.version}"}} 1.0'
        ]
        broken = "20990101T000000000000Z-broken"
        data = manifest(store) | {"store_version": broken, "router_file": "router-gone.safetensors"}
        (store / "manifest.tmp").write_text(json.dumps(data))
        os.replace(store / "manifest.tmp", store / "manifest.json")
        await polls.once()
        assert await store_series(client) == [
            f'momlp_store_info{{kind="momlp",version="{first.version}"}} 1.0',
            f'momlp_store_refused{{version="{broken}"}} 1.0',
        ]
        new_version = republish(store, seed=3)
        await polls.once()
        assert await store_series(client) == [
            f'momlp_store_info{{kind="momlp",version="{new_version}"}} 1.0'
        ]


async def test_a_swap_and_only_a_swap_has_the_pool_count_popularity_afresh(
    tmp_path: Path,
) -> None:
    store = build_small_store(tmp_path / "store")

    class Recording(BlockingPool):
        forgotten = 0

        async def forget_popularity(self) -> None:
            self.forgotten += 1
            await super().forget_popularity()

    pools: list[Recording] = []

    def factory(settings: Settings) -> ExpertPool:
        pools.append(Recording(fake_pool(settings), blocked=0))
        return pools[-1]

    app = create_app(app_settings(store), pool_factory=factory)
    async with running(app):
        serving: ServingState = app.state.serving
        assert not await serving.reload()
        assert pools[0].forgotten == 0
        republish(store, seed=42)
        assert await serving.reload()
        assert pools[0].forgotten == 1


async def test_a_pool_slow_to_reset_its_counts_does_not_hold_back_the_new_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = build_small_store(tmp_path / "store")
    monkeypatch.setattr("server.serving._state._FORGET_TIMEOUT_S", 0.05)

    class Stuck(BlockingPool):
        async def forget_popularity(self) -> None:
            await asyncio.Event().wait()  # an actor whose every thread is busy

    def factory(settings: Settings) -> ExpertPool:
        return Stuck(fake_pool(settings), blocked=0)

    app = create_app(app_settings(store), pool_factory=factory)
    async with running(app) as client:
        serving: ServingState = app.state.serving
        new_version = republish(store, seed=42)
        assert await asyncio.wait_for(serving.reload(), 5.0)
        answer = (await client.post("/v1/predict", json={"inputs": [[0.1] * 4]})).json()
    assert answer["store_version"] == new_version
    assert "did not reset their popularity counts" in caplog.text


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """What each whole-file parse of the watcher's reader found, in order."""
    from server.serving import _version

    found: list[str | None] = []
    parse = _version._store_version_of

    def counted(raw: bytes, pace: Any) -> str | None:
        found.append(version := parse(raw, pace))
        return version

    monkeypatch.setattr(_version, "_store_version_of", counted)
    return found


def test_the_watchers_reader_parses_the_manifest_again_only_when_its_file_changed(
    tmp_path: Path, parses: list[str | None]
) -> None:
    store = build_small_store(tmp_path / "store")
    first = manifest(store)["store_version"]
    reader = StoreVersionReader(store)
    assert [reader.store_version() for _ in range(5)] == [first] * 5
    assert parses == [first]  # a 43 MB manifest took ~0.7 s of GIL to parse, every poll
    second = republish(store, seed=7)  # a new file renamed over the manifest
    assert reader.store_version() == second and reader.store_version() == second
    assert parses == [first, second]
    # Edited in place (another size): read again.
    path = store / "manifest.json"
    edited = path.read_text().replace(second, second + "-edited")
    path.write_text(edited)
    assert reader.store_version() == second + "-edited"
    path.unlink()
    assert reader.store_version() is None
    path.write_text("{not json")
    assert reader.store_version() is None
    path.write_text(edited)
    assert reader.store_version() == second + "-edited" and len(parses) == 5


def test_the_watchers_reader_reads_a_large_manifest_only_to_its_version(
    tmp_path: Path, parses: list[str | None]
) -> None:
    experts = json.dumps([{"id": i, "file": f"experts/{i}.safetensors"} for i in range(5000)])
    assert len(experts) > 3 * 65536
    path = tmp_path / "manifest.json"
    reader = StoreVersionReader(tmp_path)
    # As a store's writer orders it: the version in the first bytes, the experts after.
    path.write_text('{"format_version": 2, "store_version": "v1", "experts": ' + experts + "}")
    assert reader.store_version() == "v1" and parses == []  # the 200 KB after it unread
    # A version after the experts (a hand-written manifest): the whole file, once.
    path.write_text('{"experts": ' + experts + ', "store_version": "v2"}')
    assert reader.store_version() == "v2" and parses == ["v2"]
    path.write_text('{"format_version": 2, "experts": ' + experts + "}")
    assert reader.store_version() is None and parses == ["v2", None]


async def test_a_swap_opens_at_a_pace_and_frees_the_old_version_when_it_is_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server.serving._state as state
    from experts_store import Pacer

    store = build_small_store(tmp_path / "store")
    paces: list[Any] = []
    open_files = state._open_version_files

    def recording_open(
        root: Path, budget_bytes: int, pace: Any, freeze_from: int, previous: Any, opened: Any
    ) -> Any:
        paces.append(pace)
        return open_files(root, budget_bytes, pace, freeze_from, previous, opened)

    monkeypatch.setattr(state, "_open_version_files", recording_open)
    app = create_app(app_settings(store), pool_factory=fake_pool)
    async with running(app):
        serving: ServingState = app.state.serving
        old = serving.version
        assert old is not None and old.experts and old.manifest.experts
        republish(store, seed=5)
        assert await serving.reload()
        await asyncio.gather(*serving._retiring)
        new = serving.version
        assert new is not None and new is not old
        assert gc.get_freeze_count() > 0  # the versions opened, out of the collector's scans
    assert gc.get_freeze_count() == 0  # handed back when the server stopped
    # The start had nobody to wait beside it; the swap had the requests being served.
    assert paces[0] is None and isinstance(paces[1], Pacer)
    # The retired version's per-expert rows are gone; the serving one's are whole.
    assert old.experts == [] and old.manifest.experts == [] and old.store.refs == []
    assert len(new.experts) == len(new.manifest.experts) == new.manifest.num_experts > 0


async def test_a_version_still_in_use_past_its_drain_is_not_emptied(tmp_path: Path) -> None:
    store = build_small_store(tmp_path / "store")
    app = create_app(app_settings(store, request_timeout_s=0.2), pool_factory=fake_pool)
    async with running(app):
        serving: ServingState = app.state.serving
        async with serving.use() as old:  # a request that outstays its drain
            republish(store, seed=6)
            assert await serving.reload()
            await asyncio.gather(*serving._retiring)
            assert len(old.experts) == old.manifest.num_experts > 0
            assert len(old.manifest.experts) == old.manifest.num_experts


def test_releasing_a_version_frees_its_rows_a_slice_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server.serving._version as _version
    from experts_store import Store
    from server.kinds import open_model
    from server.serving import StoreVersion

    monkeypatch.setattr(_version, "_RELEASE_SLICE", 2)
    store = Store.open(build_small_store(tmp_path / "store"))
    k = store.manifest.num_experts
    assert k >= 3
    model = open_model(store)
    version = StoreVersion(store, model, batcher=None, route_runner=None)  # type: ignore[arg-type]
    assert version.expert_rows and version.expert_ids  # the cached views, made
    rows, refs, kept = version.manifest.experts, version.experts, store.refs
    assert kept is not None and len(kept) == k  # the store keeps the refs it made
    seen: list[tuple[int, int, int]] = []
    version.release(lambda: seen.append((len(refs), len(rows), len(kept))))
    assert rows == [] and refs == [] and kept == [] and version.manifest.experts == []
    assert "expert_rows" not in version.__dict__ and "expert_ids" not in version.__dict__
    # Two rows per slice, a pace after each: the model's refs go down 2 by 2, then the rows,
    # then the store's refs (the last holder of each ref: where it is freed).
    slices = -(-k // 2)
    left = [max(k - 2 * i, 0) for i in range(1, slices + 1)]
    assert seen[-3 * slices :] == (
        [(n, k, k) for n in left] + [(0, n, k) for n in left] + [(0, 0, n) for n in left]
    )


async def test_a_republish_that_keeps_experts_keeps_their_rows_and_refs(tmp_path: Path) -> None:
    import shutil

    import torch

    from experts_store import ExpertArch, ExpertMLP, StoreWriter

    store = build_small_store(tmp_path / "store")
    old_rows = manifest(store)
    app = create_app(app_settings(store), pool_factory=fake_pool)
    x = np.random.default_rng(1).normal(size=(64, 4)).astype(np.float32)
    async with running(app) as client:
        serving: ServingState = app.state.serving
        old = serving.version
        assert old is not None
        old_entries, old_refs = list(old.manifest.experts), list(old.experts)
        # The same experts published again (hard links), but for expert 3's new weights.
        with StoreWriter(store) as writer:
            for row in old_rows["experts"]:
                if row["id"] == 3:
                    arch = ExpertArch.from_dict(row["arch"])
                    fresh = ExpertMLP(arch, generator=torch.Generator().manual_seed(99))
                    writer.add_expert(3, fresh)
                else:
                    writer.link_expert_file(row["id"], store / row["file"])
            shutil.copyfile(store / old_rows["router_file"], writer.router_path)
            writer.publish(task="regression", input_dim=4, output_dim=2, routing="tree",
                           branching=4)
        assert await serving.reload()
        new = serving.version
        assert new is not None and new is not old
        kept = [i for i in range(8) if new.manifest.experts[i] is old_entries[i]]
        refs_kept = [i for i in range(8) if new.experts[i] is old_refs[i]]
        answer = (await client.post("/v1/predict", json={"inputs": x.tolist()})).json()
    assert kept == refs_kept == [0, 1, 2, 4, 5, 6, 7]
    assert new.experts[3].sha256 == manifest(store)["experts"][3]["sha256"]
    assert new.experts[3].sha256 != old_refs[3].sha256
    assert answer["store_version"] == new.version
    experts = np.asarray(answer["experts"])[:, 0]
    assert 3 in experts  # the changed expert is among those that answered
    expected = np.stack(
        [expert_outputs(store, int(e), x[i : i + 1])[0] for i, e in enumerate(experts)]
    )
    np.testing.assert_allclose(answer["outputs"], expected, rtol=1e-5, atol=1e-6)


class _HeldOpen:
    """`_open_version_files`, replaced: when armed, an open waits after reading the store (as
    a large one does) until `release` is set."""

    __name__ = "_open_version_files"

    def __init__(self, open_files: Any) -> None:
        import threading

        self._open_files = open_files
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any) -> Any:
        armed, self.armed = self.armed, False
        try:
            return self._open_files(*args)
        finally:
            if armed:
                self.entered.set()
                self.release.wait(10)


async def _until(done: Any) -> None:
    for _ in range(2000):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


async def test_a_reload_after_a_publish_serves_it_though_an_older_swap_was_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server.serving._state as state

    store = build_small_store(tmp_path / "store")
    held = _HeldOpen(state._open_version_files)
    monkeypatch.setattr(state, "_open_version_files", held)
    app = create_app(app_settings(store), pool_factory=fake_pool)
    async with running(app) as client:
        first_publish = republish(store, seed=5)
        held.armed = True
        first = asyncio.create_task(client.post("/v1/admin/reload"))
        await _until(held.entered.is_set)  # that swap has read the first publish
        second_publish = republish(store, seed=6)
        second = asyncio.create_task(client.post("/v1/admin/reload"))
        await asyncio.sleep(0.05)
        held.release.set()
        answers = [(await first).json(), (await second).json()]
        ready = (await client.get("/readyz")).json()
    assert answers[0]["store_version"] == first_publish
    # The second reload was called after the second publish: it must not answer with the
    # swap that read the disk before it.
    assert answers[1]["reloaded"] and answers[1]["store_version"] == second_publish
    assert ready["store_version"] == second_publish


async def test_a_refusal_names_the_version_the_failed_open_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os


    store = build_small_store(tmp_path / "store")
    app, serving, polls = watched_app(store)
    reader = serving._version_on_disk
    broken = "20990101T000000000001Z-broken"

    def publish_broken_after_the_version_is_read(pace: Any = None) -> str | None:
        # A publish lands between the watcher's read of the version and its open.
        version = read_store_version(store)
        gone = "router-0123456789abcdef.safetensors"  # well formed, not there
        data = manifest(store) | {"store_version": broken, "router_file": gone}
        (store / "manifest.tmp").write_text(json.dumps(data))
        os.replace(store / "manifest.tmp", store / "manifest.json")
        return version

    async with running(app) as client:
        first = serving.version
        assert first is not None
        good = republish(store, seed=3)
        monkeypatch.setattr(reader, "store_version", publish_broken_after_the_version_is_read)
        with caplog.at_level("ERROR", logger="server.serving._state"):
            await polls.once()
        metrics = (await client.get("/metrics")).text
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and f"store version {broken} failed" in errors[0], errors
    assert f'momlp_store_refused{{version="{broken}"}} 1.0' in metrics
    assert good not in metrics  # the good version read first was not the one refused


async def test_a_manifest_cut_short_in_place_is_refused_though_its_start_names_the_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A copy onto a full disk leaves the start, with the served version in it: the watcher
    # said nothing, `momlp_store_refused` stayed empty, and the next restart failed.
    store = build_small_store(tmp_path / "store", K=200)
    app, serving, polls = watched_app(store)
    text = (store / "manifest.json").read_bytes()
    assert len(text) > 70_000  # longer than the start the watcher reads for the version
    async with running(app) as client:
        first = serving.version
        assert first is not None
        await polls.once()  # the watcher has seen the file whole
        with open(store / "manifest.json", "r+b") as fh:
            fh.truncate(len(text) - 1000)
        with caplog.at_level("ERROR", logger="server.serving._state"):
            await polls.once()
        metrics = (await client.get("/metrics")).text
        assert serving.version is first
        assert 'momlp_store_refused{version=""} 1.0' in metrics
        assert "not valid JSON" in caplog.text and f"{first.version} keeps serving" in caplog.text
        # Put back whole (a file of the size first seen): nothing refused any more.
        (store / "manifest.json").write_bytes(text)
        await polls.once()
        assert "momlp_store_refused{" not in (await client.get("/metrics")).text
        assert serving.version is first


def test_the_watchers_reader_does_not_wait_on_a_fifo_at_the_manifests_path(
    tmp_path: Path,
) -> None:
    import os
    import threading

    store = build_small_store(tmp_path / "store")
    reader = StoreVersionReader(store)
    assert reader.store_version() == manifest(store)["store_version"]
    (store / "manifest.json").unlink()
    os.mkfifo(store / "manifest.json")
    seen: list[str | None] = []
    thread = threading.Thread(target=lambda: seen.append(reader.store_version()), daemon=True)
    thread.start()
    thread.join(10)
    assert seen == [None]  # answered, and with no version


def test_the_watchers_reader_reads_no_manifest_past_the_cap(
    tmp_path: Path, parses: list[str | None]
) -> None:
    from experts_store import MAX_MANIFEST_BYTES

    store = build_small_store(tmp_path / "store")
    reader = StoreVersionReader(store)
    path = store / "manifest.json"
    path.unlink()
    with path.open("wb") as fh:  # sparse: no version in its start, so all of it was read
        fh.truncate(MAX_MANIFEST_BYTES + 1)
    assert reader.store_version() is None and parses == []
