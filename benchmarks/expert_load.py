"""Expert load time vs. a plain copy of the same bytes (issue "Foundation").

For float32 experts whose files are about 1, 16 and 128 MiB, measures on the best device
(CUDA if present, else CPU) from a warm page cache:

- ``load_ms``: ``load_expert(path, device, host_pool=...)`` without checksum verification
  (read, parse, build the module, and on CUDA the host-to-device copy), with the freed
  previous expert's buffer recycled as a Store does by default (an ExpertCache evicting
  one expert to load another);
- ``load_fresh_ms``: the same without the pool (every load gets fresh memory);
- ``load_checked_ms``: the same with the fast checksum (xxh3_128) verified while reading,
  what every load through a Store costs for a store published with checksums (issue 13);
- ``load_verified_ms``: the same with sha256 verification (what a Store's first read of an
  expert whose manifest row has no fast checksum costs);
- ``sha256_ms`` / ``xxh3_ms``: hashing the file's bytes alone (from memory, not from cache);
- ``read_ms``: one ``readv`` of the file into a preallocated buffer: the floor of any loader
  that copies the file out of the page cache (load_ms minus read_ms is the loader's own cost);
- ``copy_ms``: copying the same number of bytes from a host tensor into a preallocated
  tensor on the device (the bandwidth limit);
- ``load_tier_ms`` (CUDA only): a serving actor's load of an expert whose verified file it
  keeps in its pinned host tier (``--host-cache-bytes``; ``experts_store.HostTier``): the copy
  plus parsing, no read and no checksum. ``tier_ratio`` = copy_ms / load_tier_ms. A first
  load (read, checked, kept) is ``load_checked_ms``'s work;
- the parts of that tier load, apart: ``copy_offset_ms``, the copy of the file's tensor bytes
  from where they start in the (pinned) file buffer, past the header, into a preallocated
  device tensor; ``copy_alloc_ms`` (CUDA only), the same copy into a tensor the allocator
  hands out, as a load makes it; ``tier_host_ms``, the header's parse and the tensors' views,
  no copy; ``tier_rest_ms`` (CUDA only), load_tier_ms less copy_alloc_ms and tier_host_ms;

and prints one JSON line per size with medians and ``ratio`` = copy_ms / load_ms (the
fraction of copy bandwidth a load reaches). Goal: ratio >= 0.8 for experts >= 16 MiB on CPU.
``verified_over_load`` = load_checked_ms / load_ms is what integrity adds to a load; goal
<= 1.25 for experts >= 16 MiB (issue 13); ``sha256_over_load`` is the same for sha256.
Measurements are interleaved (every step once per repeat, in a shuffled order) so that
drift on a shared machine and cache effects between steps hit all of them alike.

    python benchmarks/expert_load.py [--quick] [--repeats N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import xxhash

from experts_store import (
    ExpertArch,
    ExpertMLP,
    ExpertRef,
    ExpertRefLoader,
    FrozenExpert,
    HostBufferPool,
    HostTier,
    load_expert,
    save_expert,
)

# Internals, to time a tier hit's parts apart (nothing outside the package needs them).
from experts_store._format import parse_header, tensor_views

MIB = 1024 * 1024


def arch_for(target_bytes: int) -> ExpertArch:
    """(64, w, w, 64) float32 expert whose parameters take about ``target_bytes``."""
    # 4 bytes x (w^2 + 130 w + 64 + 2 w) ~ target: solve the quadratic for w.
    w = int((-132 + math.sqrt(132**2 + 4 * (target_bytes / 4 - 64))) / 2)
    return ExpertArch(widths=(64, w, w, 64))


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def measure(
    path: Path, device: torch.device, repeats: int, arch: ExpertArch
) -> dict[str, float]:
    nbytes = path.stat().st_size
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    checksum = "xxh3_128:" + xxhash.xxh3_128_hexdigest(path.read_bytes())
    is_cuda = device.type == "cuda"

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize(device)

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=is_cuda)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.fill_(0)
    host = src.numpy()
    pool = HostBufferPool(2 * nbytes)
    landing = torch.empty(nbytes, dtype=torch.uint8)
    landing.fill_(0)

    def read_into_preallocated() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.readv(fd, [memoryview(landing.numpy())])  # type: ignore[arg-type]
        finally:
            os.close(fd)

    steps: dict[str, Callable[[], object]] = {
        "copy": lambda: dst.copy_(src, non_blocking=is_cuda),
        # store_root as an actor's load passes it: the link check is part of every load.
        "load": lambda: load_expert(path, device, host_pool=pool, store_root=str(path.parent)),
        "load_fresh": lambda: load_expert(path, device),
        "read": read_into_preallocated,
        "load_checked": lambda: load_expert(
            path, device, expected_checksum=checksum, host_pool=pool
        ),
        "load_verified": lambda: load_expert(path, device, expected_sha256=sha, host_pool=pool),
        "sha256": lambda: hashlib.sha256(memoryview(host)).digest(),  # type: ignore[arg-type]
        "xxh3": lambda: xxhash.xxh3_128_digest(memoryview(host)),  # type: ignore[arg-type]
    }
    # The parts of a tier hit, apart (the H200's 16 MiB tier load was 0.146 ms over its copy,
    # unexplained: RESULTS.md, "Fifty-sixth session"). The file's bytes as a tier keeps them,
    # and the same-sized device block its copy lands in.
    kept = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    kept = kept.pin_memory() if is_cuda else kept
    offset = parse_header(kept).data_offset
    landed = dst[offset:]

    def tier_host() -> FrozenExpert:
        header = parse_header(kept)
        return FrozenExpert(header.arch, tensor_views(landed, header))

    # From where a tier hit copies: past the header, an address no longer page-aligned.
    steps["copy_offset"] = lambda: landed.copy_(kept[offset:], non_blocking=is_cuda)
    steps["tier_host"] = tier_host  # parse and views, no copy
    if is_cuda:
        # The copy as `state_from_bytes` makes it: into a block the allocator hands out.
        steps["copy_alloc"] = lambda: kept[offset:].to(device, non_blocking=True)
        ref = ExpertRef(sha, str(path), arch.nbytes(), 0, checksum)
        tiered = ExpertRefLoader(device, host_tier=HostTier(2 * nbytes))
        steps["load_tier"] = lambda: tiered.load(ref)  # the warm-up below fills the tier
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        timed(step, sync)  # warm-up: page cache, allocator, lazy CUDA init
    rng = random.Random(0)
    order = list(steps)
    for _ in range(repeats):
        # A step runs faster right after one that warmed the same bytes into the CPU cache
        # (or slower after one that flushed it): shuffle so no step owns a position.
        rng.shuffle(order)
        for name in order:
            samples[name].append(timed(steps[name], sync))
    return {f"{name}_ms": statistics.median(v) * 1e3 for name, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 16 MiB, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--sizes-mib", type=int, nargs="*", default=None)
    parser.add_argument("--dir", default=None, help="where to write the expert files")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    sizes = args.sizes_mib or ([1, 16] if args.quick else [1, 16, 128])
    repeats = args.repeats or (5 if args.quick else 21)
    machine = os.environ.get(
        "MOMLP_BENCH_MACHINE", f"{platform.machine()} {os.cpu_count()} cpus {platform.node()}"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size in sizes:
            arch = arch_for(size * MIB)
            path = Path(tmp) / f"expert-{size}MiB.safetensors"
            save_expert(ExpertMLP(arch, generator=torch.Generator().manual_seed(0)), path)
            result = measure(path, device, repeats, arch)
            nbytes = path.stat().st_size
            ratio = result["copy_ms"] / result["load_ms"]
            verified_over_load = result["load_checked_ms"] / result["load_ms"]
            goal_applies = device.type == "cpu" and size >= 16
            line = {
                "benchmark": "expert_load",
                "device": str(device),
                "file_mib": size,
                "file_bytes": nbytes,
                "widths": list(arch.widths),
                "repeats": repeats,
                **{k: round(v, 3) for k, v in result.items()},
                "load_gbps": round(nbytes / result["load_ms"] / 1e6, 3),
                "copy_gbps": round(nbytes / result["copy_ms"] / 1e6, 3),
                "ratio": round(ratio, 3),
                "fresh_ratio": round(result["copy_ms"] / result["load_fresh_ms"], 3),
                "verified_ratio": round(result["copy_ms"] / result["load_verified_ms"], 3),
                **(
                    {
                        "tier_ratio": round(result["copy_ms"] / result["load_tier_ms"], 3),
                        # What the parts timed apart leave of a tier hit (syncs, the loader).
                        "tier_rest_ms": round(
                            result["load_tier_ms"]
                            - result["copy_alloc_ms"]
                            - result["tier_host_ms"],
                            3,
                        ),
                    }
                    if "load_tier_ms" in result
                    else {}
                ),
                "verified_over_load": round(verified_over_load, 3),
                "sha256_over_load": round(result["load_verified_ms"] / result["load_ms"], 3),
                "checksum": "excluded from load_ms; xxh3_128 in load_checked_ms, "
                "sha256 in load_verified_ms",
                "goal": "ratio >= 0.8 for >= 16 MiB on cpu",
                "goal_met": (ratio >= 0.8) if goal_applies else None,
                "verified_goal": "verified_over_load <= 1.25 for >= 16 MiB",
                "verified_goal_met": (verified_over_load <= 1.25) if size >= 16 else None,
                "machine": machine,
                "torch": torch.__version__,
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            print(json.dumps(line), flush=True)
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
