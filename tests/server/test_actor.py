from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from experts_store import Store, StoreError, load_expert
from server.pool import ActorCore, ActorInfo, ActorReply, activation_peak_bytes

pytestmark = pytest.mark.unit

MakeStore = Callable[..., Path]


class IdCore:
    """An `ActorCore` addressed by one store's expert ids, as the server addresses it through
    that store's `ExpertRef`s; resident experts are reported back as ids."""

    def __init__(self, store: Store, **kwargs: Any) -> None:
        self.store = store
        self.core = ActorCore(**kwargs)
        self.ids = {store.expert_ref(e.id).sha256: e.id for e in store.manifest.experts}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    def _ids(self, resident: dict[str, int]) -> dict[int, int]:
        return {self.ids[key]: nbytes for key, nbytes in resident.items()}

    def run(self, groups: Sequence[tuple[int, np.ndarray]]) -> ActorReply:
        reply = self.core.run([(self.store.expert_ref(e), rows) for e, rows in groups])
        return dataclasses.replace(reply, resident=self._ids(reply.resident))  # type: ignore[arg-type]

    def prefetch(self, experts: Sequence[int]) -> dict[int, int]:
        return self._ids(self.core.prefetch([self.store.expert_ref(e) for e in experts]))

    def info(self) -> ActorInfo:
        info = self.core.info()
        return dataclasses.replace(info, resident=sorted(self.ids[k] for k in info.resident))  # type: ignore[arg-type]


def test_look_ahead_is_off_on_cpu_unless_asked_for(make_store: MakeStore) -> None:
    # On CPU a helper thread's hand-offs cost more than the load they would hide.
    store = Store.open(make_store(K=2, n=2, width=4, out=1))
    assert not IdCore(store, name="a0", budget_bytes=10**8).lookahead
    assert IdCore(store, name="a0", budget_bytes=10**8, lookahead=True).lookahead


def direct(store: Store, expert_id: int, rows: np.ndarray) -> np.ndarray:
    """Independent reference: read the file ourselves and run the expert."""
    entry = store.expert_entry(expert_id)
    expert = load_expert(store.root / entry.file, expected_sha256=entry.sha256)
    with torch.no_grad():
        return expert(torch.tensor(rows)).numpy()


def rows_for(n: int, m: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, n)).astype(np.float32)


@pytest.mark.parametrize("lookahead", [False, True])
def test_outputs_equal_a_direct_forward_with_hit_and_miss_stats(
    make_store: MakeStore, lookahead: bool
) -> None:
    store = Store.open(make_store(K=6, n=5, width=12, out=3))
    core = IdCore(store, lookahead=lookahead, name="a0", budget_bytes=10**8)
    groups = [(e, rows_for(5, 4 + e, seed=e)) for e in (0, 3, 5)]
    first = core.run(groups)
    second = core.run(groups)
    for reply in (first, second):
        assert reply.actor == "a0"
        assert [o.expert_id for o in reply.results] == [0, 3, 5]
        for (expert_id, rows), outcome in zip(groups, reply.results, strict=True):
            assert outcome.error is None and outcome.outputs is not None
            # atol: the actor computes with aligned widths (zero padding), so a small output
            # may round differently from the unpadded forward's.
            np.testing.assert_allclose(
                outcome.outputs, direct(store, expert_id, rows), rtol=1e-6, atol=1e-7
            )
            assert outcome.expert_bytes == store.expert_nbytes(expert_id)
    assert [o.hit for o in first.results] == [False, False, False]
    assert [o.hit for o in second.results] == [True, True, True]
    assert sorted(second.resident) == [0, 3, 5]
    assert second.device_bytes == sum(store.expert_nbytes(e) for e in (0, 3, 5))
    core.close()


def test_a_cpu_actor_ignores_a_host_tier_with_a_warning_and_serves(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store.open(make_store(K=2, n=5, width=12, out=3))
    with caplog.at_level("WARNING", logger="server.pool._actor"):
        core = IdCore(store, name="a0", budget_bytes=10**8, host_cache_bytes=2**30)
    assert "host_cache_bytes applies to CUDA actors only" in caplog.text
    rows = rows_for(5, 3, seed=1)
    outcome = core.run([(1, rows)]).results[0]
    assert outcome.error is None and outcome.outputs is not None
    np.testing.assert_allclose(outcome.outputs, direct(store, 1, rows), rtol=1e-6, atol=1e-7)
    core.close()


def test_activation_bytes_are_the_largest_layer_input_plus_output(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=2, n=3, width=40, out=2, hidden_layers=2))
    core = IdCore(store, name="a0", budget_bytes=10**8)
    [outcome] = core.run([(1, rows_for(3, 17, seed=0))]).results
    # Layers 3->40, 40->40, 40->2 and PReLUs on 40: the biggest holds 40+40 floats per row.
    assert outcome.activation_bytes == 17 * 4 * 80 == activation_peak_bytes((3, 40, 40, 2), 17)
    core.close()


def test_resident_bytes_never_exceed_the_budget(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=30, n=4, width=8, out=2))
    per_expert = store.expert_nbytes(0)
    budget = 5 * per_expert
    core = IdCore(store, name="a0", budget_bytes=budget)
    rng = np.random.default_rng(1)
    misses = 0
    for step in range(40):
        experts = rng.choice(30, size=rng.integers(1, 8), replace=False)
        reply = core.run([(int(e), rows_for(4, 3, seed=step)) for e in experts])
        assert reply.device_bytes <= budget
        assert sum(reply.resident.values()) <= budget
        assert all(o.error is None for o in reply.results)
        misses += sum(not o.hit for o in reply.results)
    assert core.cache.stats.evictions > 0
    assert misses == core.cache.stats.misses
    core.close()


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_budget_of_one_expert_still_serves_many(
    make_store: MakeStore, lookahead: bool
) -> None:
    store = Store.open(make_store(K=4, n=2, width=4, out=1))
    core = IdCore(store, lookahead=lookahead, name="a0", budget_bytes=store.expert_nbytes(0))
    groups = [(e, rows_for(2, 2, seed=e)) for e in range(4)]
    reply = core.run(groups)
    for (expert_id, rows), outcome in zip(groups, reply.results, strict=True):
        assert outcome.outputs is not None
        np.testing.assert_allclose(outcome.outputs, direct(store, expert_id, rows), rtol=1e-6)
    assert list(reply.resident) == [3]
    core.close()


def corrupt(store: Store, expert_id: int) -> Path:
    path = store.expert_path(expert_id)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_corrupted_expert_fails_only_its_group(
    make_store: MakeStore, lookahead: bool
) -> None:
    store = Store.open(make_store(K=3, n=2, width=4, out=1))
    corrupt(store, 1)
    core = IdCore(store, lookahead=lookahead, name="a0", budget_bytes=10**8)
    reply = core.run([(e, rows_for(2, 2, seed=e)) for e in range(3)])
    good0, bad, good2 = reply.results
    assert good0.error is None and good2.error is None
    assert bad.outputs is None and bad.error_kind == "load"
    assert bad.error is not None and "1" in bad.error
    assert sorted(reply.resident) == [0, 2]
    core.close()


def test_a_fifo_at_an_experts_path_fails_its_group_without_holding_the_actor(
    make_store: MakeStore,
) -> None:
    # The read blocked for good: that request, then every other expert's, timed out (504).
    import os
    import threading

    store = Store.open(make_store(K=3, n=2, width=4, out=1))
    store.expert_path(1).unlink()
    os.mkfifo(store.expert_path(1))
    core = IdCore(store, name="a0", budget_bytes=10**8)
    replies: list[ActorReply] = []
    groups = [(e, rows_for(2, 2, seed=e)) for e in range(3)]
    worker = threading.Thread(target=lambda: replies.append(core.run(groups)), daemon=True)
    worker.start()
    worker.join(30)
    assert replies, "the actor's run is still waiting on the FIFO"
    good0, bad, good2 = replies[0].results
    assert good0.error is None and good2.error is None
    assert bad.error_kind == "load" and bad.error is not None
    assert "not a regular file" in bad.error and "expert 1" in bad.error
    core.close()


def test_a_loader_error_no_check_foresaw_fails_only_its_group(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Escaping the load, it failed every group of the call (503 actor_failed for all).
    store = Store.open(make_store(K=3, n=2, width=4, out=1))
    core = IdCore(store, name="a0", budget_bytes=10**8)
    cache = core.core._cache
    real_lease = cache.lease

    def lease(ref: Any, **options: Any) -> Any:
        if ref.expert_id == 1:
            raise RuntimeError("mat1 and mat2 must have the same dtype")
        return real_lease(ref, **options)

    monkeypatch.setattr(cache, "lease", lease)
    good0, bad, good2 = core.run([(e, rows_for(2, 2, seed=e)) for e in range(3)]).results
    assert good0.error is None and good2.error is None
    assert bad.error_kind == "load"
    assert bad.error == (
        "expert 1 could not be loaded: RuntimeError: mat1 and mat2 must have the same dtype"
    )
    core.close()


@pytest.mark.parametrize("error", [RuntimeError, StoreError])
def test_a_load_failure_names_the_file_as_the_store_does_not_where_it_lies(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    # The reply's text reaches the client's 503: the server's directories are not its business.
    root = make_store(K=2, n=2, width=4, out=1)
    store = Store.open(root)
    core = IdCore(store, name="a0", budget_bytes=10**8)
    cache = core.core._cache

    def lease(ref: Any, **options: Any) -> Any:
        raise error(f"cannot read {ref.path}: Input/output error")

    monkeypatch.setattr(cache, "lease", lease)
    (bad,) = core.run([(1, rows_for(2, 2, seed=1))]).results
    assert bad.error_kind == "load" and bad.error is not None
    assert str(root) not in bad.error, bad.error
    name = Path(store.expert_path(1)).name
    assert f"cannot read experts/{name}: Input/output error" in bad.error, bad.error
    core.close()


def test_missing_file_is_a_load_error(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=2, n=2, width=4, out=1))
    store.expert_path(0).unlink()
    core = IdCore(store, name="a0", budget_bytes=10**8)
    [outcome] = core.run([(0, rows_for(2, 1, seed=0))]).results
    assert outcome.error_kind == "load"
    core.close()


def test_prefetch_evicts_only_experts_no_arrived_call_needs(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=8, n=2, width=4, out=1))
    # lru, so that the victim order is plain recency.
    core = IdCore(store, name="a0", budget_bytes=2 * store.expert_nbytes(0), cache_policy="lru")
    core.run([(0, rows_for(2, 1, seed=0))])
    core.run([(1, rows_for(2, 1, seed=1))])
    assert sorted(core.prefetch([4])) == [1, 4]  # 0 was the least recently used
    # A run for expert 1 arrives while the device is busy: 1 is now protected from prefetch.
    with ThreadPoolExecutor(1) as pool:
        with core._compute_lock:
            waiting = pool.submit(core.run, [(1, rows_for(2, 1, seed=2))])
            while not core._wanted:
                time.sleep(0.001)  # wait for the other thread to register, not for time
            assert sorted(core.prefetch([6])) == [1, 6]  # evicts 4, although 1 is older
        [outcome] = waiting.result().results
    assert outcome.hit
    info = core.info()
    assert info.resident == [1, 6] and info.budget_bytes == 2 * store.expert_nbytes(0)
    core.close()


def test_prefetch_skips_what_cannot_fit_without_evicting_needed_experts(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=4, n=2, width=4, out=1))
    core = IdCore(store, name="a0", budget_bytes=2 * store.expert_nbytes(0))
    assert sorted(core.prefetch([0, 1, 2])) == [0, 1]  # 2 would evict 0 or 1, both asked for
    core.close()


def test_read_only_rows_are_accepted(make_store: MakeStore) -> None:
    store = Store.open(make_store(K=1, n=2, width=4, out=1))
    core = IdCore(store, name="a0", budget_bytes=10**8)
    rows = rows_for(2, 3, seed=0)
    rows.flags.writeable = False  # as Ray hands them over from its object store
    [outcome] = core.run([(0, rows)]).results
    assert outcome.outputs is not None
    np.testing.assert_allclose(outcome.outputs, direct(store, 0, rows), rtol=1e-6)
    core.close()


def test_a_file_corrupted_after_a_good_load_is_refused_when_read_again(
    make_store: MakeStore,
) -> None:
    store = Store.open(make_store(K=2, n=2, width=4, out=1))
    assert store.expert_entry(0).checksum is not None  # new stores carry the fast checksum
    core = IdCore(store, name="a0", budget_bytes=store.expert_nbytes(0))  # room for one
    [first] = core.run([(0, rows_for(2, 1, seed=0))]).results
    assert first.error is None
    corrupt(store, 0)
    core.run([(1, rows_for(2, 1, seed=1))])  # evicts expert 0
    [again] = core.run([(0, rows_for(2, 1, seed=0))]).results
    assert again.outputs is None and again.error_kind == "load"
    assert again.error is not None and "checksum" in again.error
    core.close()
