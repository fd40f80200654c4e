"""How the Ray Serve peer (`_rayserve_app.py`) answers a batch of requests (`@serve.batch`).

Apart from Ray Serve so that it can be tested without importing it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["Loaded", "answer_batch"]


class Loaded(Protocol):
    """What the multiplexed loader hands back: the expert is its `module`."""

    @property
    def module(self) -> Callable[[torch.Tensor], torch.Tensor]: ...


async def answer_batch(
    bodies: list[dict[str, Any]],
    *,
    route: Callable[[np.ndarray], np.ndarray],
    get_expert: Callable[[str], Awaitable[Loaded]],
    live: set[int],
    output_dim: int,
) -> list[dict[str, Any]]:
    """Answers to `bodies`, their rows routed together and each expert asked for once.

    A request counts a hit for each expert of its rows that was loaded before the batch asked
    for it, and a miss for each that was not (an expert loaded for the batch is a miss for
    every request that uses it).
    """
    parts = [np.asarray(body["inputs"], dtype=np.float32) for body in bodies]
    # A request answered alone (no batching, the peer's usual case) pays no batch's copy.
    x = parts[0] if len(parts) == 1 else np.concatenate(parts)
    experts = route(x)
    outputs = np.zeros((x.shape[0], output_dim), dtype=np.float32)
    used = np.unique(experts).tolist()
    was_loaded: dict[int, bool] = {}
    for expert_id in used:
        was_loaded[expert_id] = expert_id in live
        expert = await get_expert(str(expert_id))
        rows = experts == expert_id
        with torch.inference_mode():
            outputs[rows] = expert.module(torch.from_numpy(x[rows])).numpy()
    answers = []
    start = 0
    for part in parts:
        end = start + part.shape[0]
        mine = used if len(parts) == 1 else np.unique(experts[start:end]).tolist()
        hits = sum(was_loaded[e] for e in mine)
        answers.append(
            {
                "outputs": outputs[start:end].tolist(),
                "experts": [[int(e)] for e in experts[start:end]],
                "hits": hits,
                "misses": len(mine) - hits,
                # How many requests this call answered together.
                "batch": len(bodies),
            }
        )
        start = end
    return answers
