"""The baseline of vs_ray_serve.py: a momlp store served by Ray Serve model multiplexing.

One deployment, `num_replicas` = momlp's actor count, one CPU and one torch thread each, like a
momlp actor. Each replica holds the store's prototype tree and routes every request's rows
itself (the same work as momlp's server); each expert is a multiplexed "model" loaded by
`@serve.multiplexed` with `max_num_models_per_replica` = the experts that fit in momlp's
per-actor byte budget, so both systems keep the same bytes resident. The client sends the
expert id of its first row in the `serve_multiplexed_model_id` header, which lets Serve's Python
proxy pick a replica that already holds that expert. HAProxy, the faster front of its
high-throughput setting, balances by least connections and does not read it (the HAProxy
configuration Serve writes has no rule on it); with 4-row requests the hit rate is 0.40-0.43
either way (benchmarks/RESULTS.md, "Forty-fifth session").

Ray Serve's performance guide names two more things to try for throughput, both options here:
`max_ongoing_requests` above its default of 5 (for `async` callables like this one), and dynamic
request batching (`@serve.batch`). Batched, a replica answers up to `batch_size` requests in one
call: it routes all their rows together, asks the multiplexed loader once per expert in the
batch, and runs each expert's rows of the whole batch through it at once (what momlp's server
does with its batches).

Imported by Ray's workers by module name (vs_ray_serve.py puts benchmarks/ on PYTHONPATH).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
from _peer_batch import answer_batch
from ray import serve
from starlette.requests import Request

from experts_store import ExpertMLP, Store
from router import PrototypeTree

__all__ = ["build_app"]


class _Resident:
    """A loaded expert; counts its bytes as resident until Ray Serve unloads it."""

    def __init__(self, expert_id: int, module: ExpertMLP, nbytes: int, ledger: _Ledger) -> None:
        self.expert_id = expert_id
        self.module = module
        self.nbytes = nbytes
        self._ledger = ledger
        self._released = False
        ledger.live.add(expert_id)
        ledger.resident += nbytes
        ledger.peak = max(ledger.peak, ledger.resident)

    def __del__(self) -> None:
        # Ray Serve calls __del__ on an LRU unload, and Python calls it again at collection.
        if not self._released:
            self._released = True
            self._ledger.live.discard(self.expert_id)
            self._ledger.resident -= self.nbytes


class _Ledger:
    def __init__(self) -> None:
        self.live: set[int] = set()
        self.resident = 0
        self.peak = 0


class MultiplexedExperts:
    """One replica: routes each request's (or batch's) rows, then runs each expert's rows
    through the multiplexed loader's copy of that expert (`_peer_batch.answer_batch`)."""

    def __init__(
        self,
        store_root: str,
        mode: Literal["tree", "exact"],
        models_per_replica: int,
        batch_size: int = 0,
        batch_wait_s: float = 0.0,
    ) -> None:
        torch.set_num_threads(1)
        self.store = Store.open(Path(store_root))
        self.tree = PrototypeTree.load(self.store.router_path)
        self.mode = mode
        self.ledger = _Ledger()
        self.name = f"replica-{os.getpid()}"

        async def load(model_id: str) -> _Resident:
            expert_id = int(model_id)
            module = self.store.load_expert(expert_id)
            return _Resident(expert_id, module, self.store.expert_nbytes(expert_id), self.ledger)

        # Wired per instance so that the cap (momlp's byte budget / expert bytes) is a
        # run-time choice; Ray Serve detects multiplexing set up this way.
        self.get_expert = serve.multiplexed(max_num_models_per_replica=models_per_replica)(load)
        # Also per instance, for the same reason (batch_size 0: every request answered alone).
        self.batched = (
            serve.batch(max_batch_size=batch_size, batch_wait_timeout_s=batch_wait_s)(
                self.answer_many
            )
            if batch_size > 0
            else None
        )

    async def answer_many(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        answers = await answer_batch(
            bodies,
            route=lambda x: self.tree.route(x, mode=self.mode).experts[:, 0].numpy(),
            get_expert=self.get_expert,
            live=self.ledger.live,
            output_dim=self.store.manifest.output_dim,
        )
        for answer in answers:
            answer["replica"] = self.name
            answer["resident_bytes"] = self.ledger.resident
        return answers

    async def __call__(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        if self.batched is not None:
            answer: dict[str, Any] = await self.batched(body)
            return answer
        # Alone: the same code as a batch of one.
        (alone,) = await self.answer_many([body])
        return alone


def build_app(
    store_root: Path,
    *,
    replicas: int,
    models_per_replica: int,
    mode: Literal["tree", "exact"],
    max_ongoing_requests: int | None = None,
    batch_size: int = 0,
    batch_wait_s: float = 0.0,
) -> Any:
    """The bound application, ready for `serve.run`; `max_ongoing_requests` None keeps Ray
    Serve's default, `batch_size` 0 answers each request alone."""
    options: dict[str, Any] = {}
    if max_ongoing_requests is not None:
        options["max_ongoing_requests"] = max_ongoing_requests
    deployment: Any = serve.deployment(
        MultiplexedExperts,
        name="momlp_multiplexed",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 1},
        **options,
    )
    return deployment.bind(str(store_root), mode, models_per_replica, batch_size, batch_wait_s)
