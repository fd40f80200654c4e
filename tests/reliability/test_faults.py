"""Faults while serving: a dying actor, a corrupted expert file, a store republished under load,
a full disk mid-publish, and a build killed half-way. Counts of what was sent, failed, lost and
duplicated are printed (`-s`) for benchmarks/RESULTS.md."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from reliability_support import N, Reference, error_code, fake_app, publish_store, running

from experts_store import Store, StoreWriteError

pytestmark = pytest.mark.unit


def _report(scenario: str, **figures: Any) -> None:
    print(json.dumps({"scenario": scenario, **figures}))


def _rows(reference: Reference, rng: np.random.Generator, experts: list[int]) -> np.ndarray:
    """One row next to each listed expert's prototype (exact routing sends it there)."""
    near = reference.prototypes[experts] + rng.normal(scale=1e-3, size=(len(experts), N))
    return near.astype(np.float32)


async def _stream(
    client: httpx.AsyncClient,
    reference: dict[str, Reference],
    *,
    requests: int,
    concurrency: int,
    on_sent: Any = None,
    peak: dict[str, int] | None = None,
) -> list[tuple[int, float, float, httpx.Response]]:
    """`requests` predictions, `concurrency` at a time; each answer checked against the files of
    the version it names. Returns (seq, start, end, response) per request; `peak` collects the
    largest resident bytes each actor reported after a call."""
    loop = asyncio.get_running_loop()
    seqs = iter(range(requests))
    done: list[tuple[int, float, float, httpx.Response]] = []

    async def worker() -> None:
        for seq in seqs:
            rng = np.random.default_rng(seq)
            x = rng.normal(size=(4, N)).astype(np.float32)
            if on_sent is not None:
                await on_sent(seq)
            start = loop.time()
            answer = await client.post(
                "/v1/predict", json={"inputs": x.tolist(), "mode": "exact", "return_stats": True}
            )
            end = loop.time()
            done.append((seq, start, end, answer))
            if answer.status_code == 200:
                body = answer.json()
                ref = reference[body["store_version"]]
                if peak is not None:
                    for actor, resident in body["stats"]["device_bytes"].items():
                        peak[actor] = max(peak.get(actor, 0), resident)
                experts = np.asarray(body["experts"])[:, 0]
                np.testing.assert_array_equal(experts, ref.nearest(x))
                np.testing.assert_allclose(
                    body["outputs"], ref.outputs(experts, x), rtol=1e-5, atol=1e-6
                )

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


async def test_actors_killed_during_load_lose_no_request(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish_store(store)
    ref = Reference(store)
    # Room for three experts per actor, so that loads and evictions go on throughout.
    budget = 3 * Store.open(store).expert_nbytes(0)
    app = fake_app(store, cache_bytes=budget)
    async with running(app) as client:
        pool = app.state.serving.pool
        kills = 0

        async def kill_now_and_then(seq: int) -> None:
            nonlocal kills
            if seq % 15 == 7:
                pool.kill(f"actor-{(seq // 15) % 2}")
                kills += 1

        peak: dict[str, int] = {}
        done = await _stream(
            client,
            {ref.version: ref},
            requests=90,
            concurrency=4,
            on_sent=kill_now_and_then,
            peak=peak,
        )
    statuses = [answer.status_code for *_, answer in done]
    seqs = sorted(seq for seq, *_ in done)
    _report(
        "actor killed during load",
        requests=len(seqs),
        kills=kills,
        errors=sum(s != 200 for s in statuses),
        lost=90 - len(set(seqs)),
        duplicated=len(seqs) - len(set(seqs)),
        peak_resident_bytes=max(peak.values()),
        budget_bytes=budget,
    )
    assert kills == 6
    assert max(peak.values()) <= budget
    assert seqs == list(range(90))
    assert set(statuses) == {200}


async def test_a_corrupted_expert_fails_only_its_requests(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish_store(store)
    ref = Reference(store)
    bad = 5
    rng = np.random.default_rng(0)
    app = fake_app(store)
    async with running(app) as client:
        good_experts = [e for e in range(8) if e != bad]
        warm = await client.post(
            "/v1/predict", json={"inputs": _rows(ref, rng, good_experts).tolist(), "mode": "exact"}
        )
        assert warm.status_code == 200
        # Corrupt the file while serving, before the expert was ever loaded: same size, other bytes.
        path = store / ref.manifest["experts"][bad]["file"]
        data = bytearray(path.read_bytes())
        data[-64:] = bytes(64)
        path.write_bytes(bytes(data))
        answers = []
        for _ in range(5):
            for experts in ([bad], [bad, 1], [2, 3], [0]):
                x = _rows(ref, rng, experts)
                answers.append(
                    (
                        experts,
                        await client.post(
                            "/v1/predict", json={"inputs": x.tolist(), "mode": "exact"}
                        ),
                    )
                )
        actors = (await client.get("/v1/experts")).json()["actors"]
    failed = 0
    for experts, answer in answers:
        if bad in experts:
            failed += 1
            assert answer.status_code == 503, answer.text
            assert error_code(answer) == "expert_unavailable"
            assert answer.json()["error"]["detail"]["expert_id"] == bad
            assert str(bad) in answer.json()["error"]["message"]
        else:
            assert answer.status_code == 200, answer.text
    _report(
        "expert file corrupted while serving",
        requests=len(answers),
        errors=failed,
        errors_not_needing_it=0,
        lost=0,
        peak_resident_bytes=max(a["resident_bytes"] for a in actors),
        budget_bytes=actors[0]["budget_bytes"],
    )
    assert all(a["resident_bytes"] <= a["budget_bytes"] for a in actors)
    assert all(bad not in a["resident"] for a in actors)


async def test_a_store_republished_under_load_switches_versions_cleanly(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish_store(store, seed=0)
    old = Reference(store)
    references = {old.version: old}
    app = fake_app(store)
    marks: dict[str, float] = {}
    async with running(app) as client:
        loop = asyncio.get_running_loop()

        async def republish(seq: int) -> None:
            if seq == 40:
                # The writer runs on a thread while requests keep flowing.
                new_version = await asyncio.to_thread(publish_store, store, seed=1)
                references[new_version] = Reference(store)
                marks["reload_start"] = loop.time()
                answer = await client.post("/v1/admin/reload")
                marks["reload_end"] = loop.time()
                assert answer.status_code == 200
                assert answer.json()["store_version"] == new_version

        peak: dict[str, int] = {}
        done = await _stream(
            client, references, requests=100, concurrency=4, on_sent=republish, peak=peak
        )
    new = next(v for v in references if v != old.version)
    versions = {seq: answer.json().get("store_version") for seq, _, _, answer in done}
    before = [versions[seq] for seq, _, end, _ in done if end < marks["reload_start"]]
    after = [versions[seq] for seq, start, _, _ in done if start > marks["reload_end"]]
    statuses = [answer.status_code for *_, answer in done]
    _report(
        "store republished under load",
        requests=len(done),
        errors=sum(s != 200 for s in statuses),
        lost=100 - len(versions),
        duplicated=len(done) - len(versions),
        served_by_old=sum(v == old.version for v in versions.values()),
        served_by_new=sum(v == new for v in versions.values()),
        peak_resident_bytes=max(peak.values()),
        budget_bytes=1 << 20,
    )
    assert set(statuses) == {200}
    assert sorted(versions) == list(range(100))
    assert before and set(before) == {old.version}
    assert after and set(after) == {new}


@pytest.mark.parametrize(
    ("call", "fail_at"),
    [("replace", 1), ("replace", 5), ("replace", 10), ("fsync", 2), ("write_manifest", 1)],
)
def test_a_full_disk_mid_publish_leaves_the_previous_store_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, fail_at: int
) -> None:
    store = tmp_path / "store"
    publish_store(store, seed=0)
    before = (store / "manifest.json").read_bytes()
    old = Reference(store)
    calls = {"n": 0}

    def full(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    import experts_store._writer as writer_module

    if call == "write_manifest":
        # The staged manifest.json is the last file written before the atomic switch.
        real_open = open

        def open_full(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).endswith("manifest.json") and ".staging-" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr("builtins.open", open_full)
    else:
        real = getattr(os, call)
        monkeypatch.setattr(writer_module.os, call, full)
    files = sorted(p for p in store.rglob("*") if ".staging-" not in str(p))
    with pytest.raises(StoreWriteError) as caught:
        publish_store(store, seed=1)
    monkeypatch.undo()
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.ENOSPC
    assert str(caught.value).startswith(f"cannot write {store}")
    assert "No space left on device; nothing was published" in str(caught.value)
    # The previous store is the live one, byte for byte, and every file it names verifies;
    # nothing of the new version stays in the store (its files took the room a retry needs).
    assert (store / "manifest.json").read_bytes() == before
    assert sorted(p for p in store.rglob("*") if ".staging-" not in str(p)) == files
    reopened = Store.open(store)
    assert reopened.version == old.version
    assert reopened.verify() == []
    assert not list(store.glob(".staging-*"))
    x = np.random.default_rng(3).normal(size=(5, N)).astype(np.float32)
    experts = old.nearest(x)
    for i, expert in enumerate(experts):
        module = reopened.load_expert(int(expert))
        np.testing.assert_allclose(
            module(torch.as_tensor(x[i : i + 1])).detach().numpy(),
            old.outputs(experts[i : i + 1], x[i : i + 1]),
            rtol=1e-6,
        )
    # Once there is room again, a publish goes through.
    assert publish_store(store, seed=1) != old.version


_KILLED_BUILD = """
import sys, time, torch
from pathlib import Path
from experts_store import ExpertArch, ExpertMLP, StoreWriter
writer = StoreWriter(Path(sys.argv[1])).__enter__()
arch = ExpertArch(widths=(4, 16, 2))
for i in range(8):
    writer.add_expert(i, ExpertMLP(arch))
print("staged", flush=True)
time.sleep(60)
"""


async def test_a_killed_build_leaves_nothing_half_written(tmp_path: Path) -> None:
    store = tmp_path / "store"
    publish_store(store, seed=0)
    old = Reference(store)
    build = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BUILD, str(store)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert build.stdout is not None
        assert build.stdout.readline().strip() == "staged"
    finally:
        build.send_signal(signal.SIGKILL)
        build.wait(timeout=30)
        if build.stdout is not None:
            build.stdout.close()
    staging = list(store.glob(".staging-*"))
    assert staging, "the killed build left no staging dir: the scenario did not happen"
    # A server (re)started now serves the previous version, and the store verifies.
    assert Store.open(store).verify() == []
    app = fake_app(store)
    x = np.random.default_rng(4).normal(size=(6, N)).astype(np.float32)
    async with running(app) as client:
        answer = await client.post("/v1/predict", json={"inputs": x.tolist(), "mode": "exact"})
        ready = await client.get("/readyz")
    assert ready.json()["store_version"] == old.version
    body = answer.json()
    assert body["store_version"] == old.version
    experts = np.asarray(body["experts"])[:, 0]
    np.testing.assert_allclose(body["outputs"], old.outputs(experts, x), rtol=1e-5, atol=1e-6)
    _report("build killed mid-way", staging_dirs_left=len(staging), store_verifies=True)
