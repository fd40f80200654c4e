"""Does one grouped matmul over several cached experts pay on CPU? (issue 19 item 2)

An actor call carries G groups, each a few rows for one resident expert, and runs one expert
forward per group (`ActorCore._forward`: rows padded to the CPU row block of 4). The
alternative is one `torch.nn.functional.grouped_mm` per layer over all G groups, which needs
each layer's weights of the G experts side by side in one [G, K, N] tensor. Three ways are
timed per call, CPU time of this thread, experts drawn from a pool of resident ones so that
their weights are not all in cache:

- `separate`: the actor's way, one `FrozenExpert` forward per group (aligned expert, 4-row
  blocks);
- `grouped_slab`: grouped_mm over weights stacked once beforehand for the whole pool, the
  groups of experts not in the call left empty, so no weight is copied per call (the best
  case: a cache that kept all its experts of one shape in such slabs, which momlp's does not);
- `grouped_stack`: the same, stacking the G experts' separate tensors per call (what grouping
  would cost with today's cache, which holds each expert's tensors apart).

Also prints the largest difference from the separate forwards' outputs. With `--device cuda`
(benchmarks/gpu_session.sh) the figures are wall µs per call after a device synchronize, and
the CPU row block is replaced by the CUDA one; a way the device's grouped_mm refuses (dtype,
architecture) is reported as unsupported, not failed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grouped_forward.py [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from experts_store import ExpertArch, ExpertMLP, FrozenExpert
from server.pool import row_block

MACHINE = os.environ.get("MOMLP_BENCH_MACHINE", "2-core x86-64 VM, no GPU")
Weights = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def expert_weights(expert: FrozenExpert) -> Weights:
    """(W [N, K], b [N], PReLU γ or None for the output layer) per layer, aligned widths."""
    return [(layer[0], layer[1], layer[2] if len(layer) > 2 else None) for layer in expert._layers]


def separate(experts: list[FrozenExpert], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [expert(x) for expert, x in zip(experts, xs, strict=True)]


def grouped(
    stacked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    x: torch.Tensor,
    sizes: torch.Tensor,
) -> torch.Tensor:
    """One grouped_mm per layer; `stacked` holds each layer's [G, K, N], [G, N], [G, N] and
    group g takes the next sizes[g] rows of x (0: none)."""
    offs = torch.cumsum(sizes, 0).to(torch.int32)
    h = x
    for weight, bias, gamma in stacked:
        h = F.grouped_mm(h, weight, offs=offs) + bias.repeat_interleave(sizes, dim=0)
        if gamma is not None:
            h = torch.where(h > 0, h, h * gamma.repeat_interleave(sizes, dim=0))
    return h


def stack(weights: list[Weights]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    layers = []
    for j in range(len(weights[0])):
        w = torch.stack([ws[j][0].t() for ws in weights])  # [G, K, N], a copy
        b = torch.stack([ws[j][1] for ws in weights])
        g0 = weights[0][j][2]
        g = torch.stack([ws[j][2] for ws in weights]) if g0 is not None else None  # type: ignore[misc]
        layers.append((w, b, g))
    return layers


def timed(fn: Callable[[], Any], repeats: int, inner: int, device: str) -> float:
    """Median µs of one call over `repeats` rounds of `inner` calls: this thread's CPU time on
    CPU, wall time to a finished device on CUDA (kernels run asynchronously)."""
    cuda = device.startswith("cuda")
    clock = time.perf_counter if cuda else time.thread_time
    fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = clock()
        for _ in range(inner):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        samples.append((clock() - start) / inner * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pool", type=int, default=20, help="resident experts drawn from")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "grouped_forward", "device": device, "skipped": True,
                          "reason": "no CUDA device: unmeasured"}))
        return
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    block = row_block(device)
    repeats, inner = (5, 20) if args.quick else (15, 50)
    shapes = [(16, 256, 512, 8), (32, 512, 512, 8), (8, 64, 64, 8)]
    for widths in shapes[:2] if args.quick else shapes:
        torch.manual_seed(sum(widths))
        experts = [
            FrozenExpert.from_module(ExpertMLP(ExpertArch(widths=widths)).eval().to(device))
            .aligned()
            for _ in range(args.pool)
        ]
        weights = [expert_weights(e) for e in experts]
        slab = stack(weights)  # the whole pool side by side, once
        for groups, rows in ((4, 1), (12, 1), (12, 3)):
            # In pool order, so that the slab's groups are the call's experts in order.
            picks = sorted(rng.choice(args.pool, size=groups, replace=False).tolist())
            chosen = [experts[i] for i in picks]
            # Each group's rows padded to the row block, as the actor does.
            padded = -(-rows // block) * block
            xs = [torch.randn(padded, widths[0], device=device) for _ in picks]
            x = torch.cat(xs)
            sizes = torch.full((groups,), padded, dtype=torch.long, device=device)
            slab_sizes = torch.zeros(args.pool, dtype=torch.long, device=device)
            slab_sizes[picks] = padded

            def from_slab(
                x: torch.Tensor = x, sizes: torch.Tensor = slab_sizes, slab: Any = slab
            ) -> torch.Tensor:
                return grouped(slab, x, sizes)

            def from_stack(
                x: torch.Tensor = x, sizes: torch.Tensor = sizes, picks: list[int] = picks,
                weights: list[Weights] = weights,
            ) -> torch.Tensor:
                return grouped(stack([weights[i] for i in picks]), x, sizes)

            ways: dict[str, Callable[[], Any]] = {
                "separate": partial(separate, chosen, xs),
                "grouped_slab": from_slab,
                "grouped_stack": from_stack,
            }
            us: dict[str, float] = {}
            unsupported: dict[str, str] = {}
            diff = 0.0
            with torch.inference_mode():
                want = torch.cat(separate(chosen, xs))
                for name, way in ways.items():
                    try:
                        got = way()
                    except (RuntimeError, NotImplementedError) as exc:
                        if device == "cpu":
                            raise  # the CPU path is the one this script vouches for
                        unsupported[name] = str(exc).splitlines()[0][:200]
                        continue
                    if name != "separate":
                        diff = max(diff, float((got - want).abs().max()))
                    us[name] = timed(way, repeats, inner, device)
            print(json.dumps({
                "benchmark": "grouped_forward", "device": device, "widths": list(widths),
                "groups": groups, "rows_per_group": rows, "row_block": block,
                "pool": args.pool,
                "us_per_call": {k: round(v, 1) for k, v in us.items()},
                "us_measure": "wall, device synchronized" if device != "cpu" else "thread CPU",
                "vs_separate": {k: round(v / us["separate"], 2) for k, v in us.items()},
                "unsupported": unsupported or None,
                "max_abs_diff": diff, "torch": torch.__version__,
                "machine": MACHINE, "cpu": platform.processor() or platform.machine(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            }), flush=True)


if __name__ == "__main__":
    main()
