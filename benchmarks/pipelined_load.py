"""How close can reading an expert's file come to a pinned host-to-device copy? (issue 19)

`expert_load.py` on an H100 machine: a 16 MiB expert loads in 3.0 ms, 2.4 ms of which is one
`readv` of the file out of the page cache, while a pinned copy of the same bytes to the device
takes 0.35 ms. Before changing the loader, this measures what a loader that reads with several
threads, each copying its chunk to the device as soon as it lands, could reach: raw bytes only
(no header parse, no module), from a warm page cache, in a pinned buffer allocated once.

- `copy_ms`: pinned host buffer -> device, the same bytes (the bandwidth limit);
- `read_ms[t]`: the file read into the pinned buffer by t threads, in chunks (`os.preadv`
  releases the GIL, so the kernel's copies out of the page cache run in parallel);
- `pipelined_ms[t]`: the same with each chunk's copy to the device queued at once on the
  reading thread's stream, all streams synchronized at the end;
- `ratio[t]` = copy_ms / pipelined_ms[t], the figure `expert_load.py` calls `ratio`.

On a machine without CUDA the device copy is a copy into a preallocated host tensor.
Medians of interleaved repeats. One JSON line per file size.

    python benchmarks/pipelined_load.py [--quick] [--device cuda] [--threads 1,2,4,8]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

CHUNK = 4 << 20  # bytes a thread reads (and copies) at a time
MACHINE = os.environ.get("MOMLP_BENCH_MACHINE", "2-core x86-64 VM, no GPU")


class Pipeline:
    """A pinned buffer and a device buffer of `nbytes`, and one stream per reading thread."""

    def __init__(self, nbytes: int, device: torch.device, threads: int) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.view = memoryview(self.host.numpy())  # type: ignore[arg-type]
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.device = device
        self.pool = ThreadPoolExecutor(max_workers=max(threads, 1))
        self.streams = [torch.cuda.Stream(device) for _ in range(threads)] if cuda else []  # type: ignore[no-untyped-call]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def copy(self) -> None:
        self.dev.copy_(self.host, non_blocking=True)
        self.sync()

    def read(self, path: Path, threads: int, *, to_device: bool) -> None:
        nbytes = self.host.numel()
        chunks = [(o, min(CHUNK, nbytes - o)) for o in range(0, nbytes, CHUNK)]
        fd = os.open(path, os.O_RDONLY)
        try:
            def worker(index: int) -> None:
                stream = self.streams[index] if self.streams else None
                for offset, size in chunks[index::threads]:
                    got = os.preadv(fd, [self.view[offset : offset + size]], offset)
                    if got != size:
                        raise OSError(f"short read at {offset}: {got} of {size}")
                    if to_device:
                        src = self.host[offset : offset + size]
                        dst = self.dev[offset : offset + size]
                        if stream is None:
                            dst.copy_(src)
                        else:
                            with torch.cuda.stream(stream):
                                dst.copy_(src, non_blocking=True)

            list(self.pool.map(worker, range(threads)))
            self.sync()
        finally:
            os.close(fd)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000.0


def measure(path: Path, device: torch.device, threads: list[int], repeats: int) -> dict[str, Any]:
    nbytes = path.stat().st_size
    pipe = Pipeline(nbytes, device, max(threads))
    steps: dict[str, Callable[[], None]] = {"copy": pipe.copy}
    for t in threads:
        steps[f"read_{t}"] = functools.partial(pipe.read, path, t, to_device=False)
        steps[f"pipelined_{t}"] = functools.partial(pipe.read, path, t, to_device=True)
    for fn in steps.values():  # warm-up: page cache, streams, the pool's threads
        fn()
    with path.open("rb") as handle:
        expected = torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8)
    if not torch.equal(pipe.dev.cpu(), expected):
        raise AssertionError("the pipelined read did not deliver the file's bytes")
    samples: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for _ in range(repeats):
        random.shuffle(order)
        for name in order:
            samples[name].append(_timed(steps[name]))
    med = {name: statistics.median(values) for name, values in samples.items()}
    pipe.pool.shutdown()
    return {
        "bench": "pipelined_load", "device": str(device), "file_mib": nbytes >> 20,
        "chunk_mib": CHUNK >> 20, "repeats": repeats, "copy_ms": round(med["copy"], 3),
        "read_ms": {t: round(med[f"read_{t}"], 3) for t in threads},
        "pipelined_ms": {t: round(med[f"pipelined_{t}"], 3) for t in threads},
        "ratio": {t: round(med["copy"] / med[f"pipelined_{t}"], 3) for t in threads},
        "copy_gbps": round(nbytes / med["copy"] / 1e6, 2),
        "machine": MACHINE, "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB only, fewer repeats")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--sizes-mib", type=int, nargs="*", default=None)
    args = parser.parse_args(argv)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    threads = [int(t) for t in args.threads.split(",")]
    sizes = args.sizes_mib or ([16] if args.quick else [16, 128])
    repeats = 5 if args.quick else 15
    with tempfile.TemporaryDirectory(prefix="pipelined-load-") as tmp:
        for mib in sizes:
            path = Path(tmp) / f"expert-{mib}.bin"
            path.write_bytes(os.urandom(mib << 20))
            print(json.dumps(measure(path, device, threads, repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
