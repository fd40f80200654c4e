"""The actor's row block, the default against another, side by side (issue 19 item 4).

A CUDA actor pads each group to whole blocks of `ROW_BLOCK["cuda"]` = 64 rows and runs every
block as its own GEMMs: on an H100 a row's bits differed between a 16-row and a 64-row GEMM,
so a 64-row group run as one GEMM broke batch invariance (benchmarks/RESULTS.md, "The first
GPU session"). Whether 16-row blocks, each its own GEMM, would be invariant too, and what 64
costs against 16 for the 1-3-row groups that Zipf traffic mostly makes, was not measured.
This script measures both, in one run, through `ActorCore.run` (the actor's real forward):

- `us`: median wall µs of one call with one group of m rows (m = 1, 3, 16, 40, 64) of a
  resident expert, the blocks interleaved round by round, device synchronised;
- `invariant`: whether each of 64 rows got the same bits alone as inside groups of 48
  random sizes (1-160 rows) of other rows.

One JSON line per (widths, block). On CPU (a dry run; default blocks 4 and 16) the same.

    python benchmarks/cuda_row_block.py [--device cuda] [--blocks 16,64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from experts_store import ExpertArch, ExpertMLP, ExpertRef, save_expert
from server.pool import ActorCore, row_block

SIZES = (1, 3, 16, 40, 64)


def addmm_cublaslt() -> bool:
    """Whether a bias GEMM takes cuBLASLt, torch's default, or (DISABLE_ADDMM_CUDA_LT=1, as
    gpu_session.sh sets it; torch reads it once per process) a plain GEMM after a bias copy."""
    return os.environ.get("DISABLE_ADDMM_CUDA_LT") != "1"


def expert_ref(folder: Path, widths: tuple[int, ...]) -> ExpertRef:
    arch = ExpertArch(widths=widths)
    expert = ExpertMLP(arch, generator=torch.Generator().manual_seed(sum(widths))).eval()
    path = folder / f"expert-{'-'.join(map(str, widths))}.safetensors"
    saved = save_expert(expert, path)
    return ExpertRef(saved.sha256, str(path), arch.nbytes(), 0, saved.checksum)


def _outputs(core: ActorCore, ref: ExpertRef, rows: np.ndarray) -> np.ndarray:
    outcome = core.run([(ref, rows)]).results[0]
    if outcome.error is not None or outcome.outputs is None:
        raise RuntimeError(f"the actor failed a group: {outcome.error}")
    return outcome.outputs


def invariant(core: ActorCore, ref: ExpertRef, x: np.ndarray, rng: np.random.Generator) -> bool:
    alone = np.concatenate([_outputs(core, ref, x[i : i + 1]) for i in range(len(x))])
    for _ in range(48):
        picks = rng.integers(0, len(x), int(rng.integers(1, 161)))
        if not np.array_equal(_outputs(core, ref, x[picks]), alone[picks]):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", default=None, help="row blocks (cuda 16,64; cpu 4,16)")
    parser.add_argument("--quick", action="store_true", help="one shape, fewer repeats")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "cuda_row_block", "skipped": True,
                          "reason": "no CUDA device: unmeasured"}))  # fmt: skip
        return 0
    torch.set_num_threads(1)
    blocks = [int(b) for b in (args.blocks or ("16,64" if cuda else "4,16")).split(",")]
    shapes = [(16, 256, 512, 8), (32, 512, 512, 8), (64, 1024, 1024, 64)]
    repeats, inner = (5, 10) if args.quick else (15, 40)
    machine = os.environ.get(
        "MOMLP_BENCH_MACHINE", f"{platform.machine()} {os.cpu_count()} cpus {platform.node()}"
    )
    rng = np.random.default_rng(0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(args.device)

    with tempfile.TemporaryDirectory() as tmp:
        for widths in shapes[:1] if args.quick else shapes:
            ref = expert_ref(Path(tmp), widths)
            cores = {
                b: ActorCore(name=f"b{b}", device=args.device, budget_bytes=ref.nbytes * 2,
                             rows_per_block=b)
                for b in blocks
            }  # fmt: skip
            x = rng.standard_normal((64, widths[0])).astype(np.float32)
            samples: dict[tuple[int, int], list[float]] = {
                (b, m): [] for b in blocks for m in SIZES
            }
            try:
                for core in cores.values():
                    _outputs(core, ref, x)  # load, warm the kernels and the workspace
                for _ in range(repeats):
                    for m in SIZES:
                        for b in blocks:
                            sync()
                            start = time.perf_counter()
                            for _ in range(inner):
                                _outputs(cores[b], ref, x[:m])
                            sync()
                            samples[(b, m)].append((time.perf_counter() - start) / inner * 1e6)
                for b, core in cores.items():
                    line = {
                        "benchmark": "cuda_row_block",
                        "device": args.device,
                        "widths": list(widths),
                        "row_block": b,
                        "default": b == row_block(args.device),
                        "us": {str(m): round(statistics.median(samples[(b, m)]), 1)
                               for m in SIZES},
                        "invariant": invariant(core, ref, x, rng),
                        "addmm_cublaslt": addmm_cublaslt(),
                        "repeats": repeats,
                        "machine": machine,
                        "torch": torch.__version__,
                        "date": datetime.now(UTC).isoformat(timespec="seconds"),
                    }  # fmt: skip
                    print(json.dumps(line), flush=True)
            finally:
                for core in cores.values():
                    core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
