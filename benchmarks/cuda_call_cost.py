"""Where a CUDA actor's fixed ~0.6 ms a call goes (issue 19 item 4; for a GPU session).

On an H100 one `ActorCore.run` with one group of a resident expert took ~560-620 µs whatever
its rows (1 to 64), against ~95 µs for a one-row call on one core of the 2-core VM, and one
CUDA actor served 961 rows/s where two CPU actors on the same machine served 2,073
(benchmarks/RESULTS.md, "The second GPU session"). This script times the call and each of
its parts apart, on one resident expert and one row, the device synchronised after each loop:

- `run_us`: `ActorCore.run([(expert, 1 row)])`, the actor's whole call;
- `h2d_us` / `h2d_pinned_us`: the 64-row input block to the device from pageable memory (what
  the actor does) and from a pinned buffer;
- `forward_us`: the expert's forward on a block already on the device (kernels only);
- `d2h_us`: the one output row back to the host;
- `counters_us`: reset, read, read of the allocator's counters (what each group paid before
  the activation meter, `server/pool/_vram.py`);
- `lease_us`: a hit's lease in the actor's cache, opened and released;
- `reply_us`: `ActorCore.resident()`, which every reply carries.

Then a torch.profiler table of 200 calls (host-side time by op, the CUDA runtime's calls
included) goes to the log. One JSON line per expert shape. On CPU (a dry run) the CUDA-only
parts are left out.

    python benchmarks/cuda_call_cost.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from cuda_row_block import addmm_cublaslt, expert_ref

from experts_store import FrozenExpert
from server.pool import ActorCore, row_block


def _median_us(fn: Callable[[], object], sync: Callable[[], None], inner: int,
               repeats: int) -> float:  # fmt: skip
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    return round(statistics.median(samples), 1)


def measure(device: str, widths: tuple[int, ...], folder: Path, inner: int, repeats: int,
            machine: str) -> None:  # fmt: skip
    """Print one JSON line of the parts' µs for `widths`, then the profiler's table."""
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    ref = expert_ref(folder, widths)
    core = ActorCore(name="cost", device=device, budget_bytes=ref.nbytes * 2)
    try:
        row = np.random.default_rng(0).standard_normal((1, widths[0])).astype(np.float32)
        core.run([(ref, row)])  # load, warm the kernels, the workspace, the meter
        with core.cache.lease(ref) as lease:
            module = lease.value
        if not isinstance(module, FrozenExpert):
            raise TypeError("the cache holds no expert for the file")
        block = torch.zeros((row_block(device), module.input_width))
        pinned = block.pin_memory() if cuda else block
        on_device = block.to(device)
        with torch.inference_mode():
            y = module(on_device)

        def lease_once() -> None:
            with core.cache.lease(ref):
                pass

        def counters() -> None:
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.memory_allocated(device)
            torch.cuda.max_memory_allocated(device)

        parts: dict[str, Callable[[], object]] = {
            "run_us": lambda: core.run([(ref, row)]),
            "h2d_us": lambda: block.to(device, non_blocking=True),
            "forward_us": lambda: module(on_device),
            "d2h_us": lambda: y[:1].to("cpu"),
            "lease_us": lease_once,
            "reply_us": core.resident,
        }
        if cuda:
            parts["h2d_pinned_us"] = lambda: pinned.to(device, non_blocking=True)
            parts["counters_us"] = counters
        line: dict[str, object] = {"benchmark": "cuda_call_cost", "device": device,
                                   "widths": list(widths)}  # fmt: skip
        with torch.inference_mode():
            for name, fn in parts.items():
                line[name] = _median_us(fn, sync, inner, repeats)
        line.update(addmm_cublaslt=addmm_cublaslt(),
                    machine=machine, torch=torch.__version__,
                    date=datetime.now(UTC).isoformat(timespec="seconds"))  # fmt: skip
        print(json.dumps(line), flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(200):
                core.run([(ref, row)])
            sync()
        print(f"profile of 200 calls, widths {widths}:", flush=True)
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    finally:
        core.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="one shape, fewer repeats")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "cuda_call_cost", "skipped": True,
                          "reason": "no CUDA device: unmeasured"}))  # fmt: skip
        return 0
    torch.set_num_threads(1)
    shapes = [(32, 512, 512, 8), (16, 256, 512, 8), (64, 1024, 1024, 64)]
    repeats, inner = (5, 20) if args.quick else (15, 100)
    machine = os.environ.get("MOMLP_BENCH_MACHINE", f"{os.cpu_count()} cpus")
    with tempfile.TemporaryDirectory() as tmp:
        for widths in shapes[:1] if args.quick else shapes:
            measure(args.device, widths, Path(tmp), inner, repeats, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
