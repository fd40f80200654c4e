"""Batch invariance vs row alignment on this CPU torch build, and what aligning costs.

Three parts, printed as tables:

1. `F.linear` alone: for reduction dims k and output dims n, does a row's output depend on its
   position (and on its buffer's base offset) in a 16..128-row batch? Which (k, n) fail.
   1b. With k a multiple of ROW_ALIGN and aligned rows: for which row counts M does a row's
   output differ from the same row alone in a 4-row block? (Why the CPU actor pads a group
   to a multiple of 4 rows, `ROW_BLOCK`.)
2. momlp experts through the served forward, before (the file's widths, the actor's old input
   copy) and after (`FrozenExpert.aligned` + `ActorCore._forward`): rows 0..31 of a 32-row
   group against the same row alone, over widths (d, h, h, o), d 1-9, h 1-40, o 1-3.
3. Time of one group's forward before/after, side by side (interleaved repeats, median).

    .venv/bin/python benchmarks/gemm_alignment.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from experts_store import ROW_ALIGN, ExpertArch, ExpertMLP, FrozenExpert
from server.pool import ROW_BLOCK, ActorCore, activation_peak_bytes

# The actor's row block before it was measured down to 4 (part 1b): 16 rows.
OLD_ROW_BLOCK = 16


def linear_grid(ks: range, ns: range, offsets: tuple[int, ...]) -> dict[tuple[int, int], list[int]]:
    """(k, base offset in floats) -> the n whose rows' bits depend on their position."""
    bad: dict[tuple[int, int], list[int]] = {}
    for k in ks:
        for n in ns:
            g = torch.Generator().manual_seed(k * 1000 + n)
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            for off in offsets:
                x = torch.randn(128 * k + off, generator=g)[off:].view(128, k)
                # The reference: each row alone, in a fresh (64-byte-aligned) 16-row block.
                alone = [F.linear(torch.cat([x[i : i + 1], x.new_zeros(15, k)]), w, b)[0]
                         for i in range(128)]
                if any(not torch.equal(F.linear(x[:m], w, b)[i], alone[i])
                       for m in (16, 32, 64, 128) for i in range(m)):
                    bad.setdefault((k, off), []).append(n)
    return bad


def row_counts(ks: list[int], ns: range, counts: range) -> dict[int, int]:
    """Row count M -> how many (k, n) have a row whose bits in an M-row GEMM differ from the
    same row alone in a 4-row block (aligned buffers)."""
    bad: dict[int, int] = {}
    for k in ks:
        for n in ns:
            g = torch.Generator().manual_seed(k * 1000 + n)
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            x = torch.randn(max(counts), k, generator=g)
            alone = torch.stack([F.linear(torch.cat([row[None], x.new_zeros(3, k)]), w, b)[0]
                                 for row in x])
            for m in counts:
                if not torch.equal(F.linear(x[:m], w, b), alone[:m]):
                    bad[m] = bad.get(m, 0) + 1
    return bad


def old_forward(module: FrozenExpert, rows: np.ndarray) -> np.ndarray:
    """`ActorCore._forward` (CPU) before aligning: the caller's rows, padded to 16 rows."""
    if not rows.flags.writeable:
        rows = np.array(rows)
    x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    m = int(x.shape[0])
    if m % OLD_ROW_BLOCK:
        x = torch.cat([x, x.new_zeros((OLD_ROW_BLOCK - m % OLD_ROW_BLOCK, x.shape[1]))])
    with torch.inference_mode():
        y = module(x)
        activation_peak_bytes(module.arch.widths, m, y.element_size())
        return y[:m].to("cpu").numpy()


def positions_bad(core: ActorCore, widths: tuple[int, ...], *, aligned: bool) -> int:
    torch.manual_seed(sum(widths))
    frozen = FrozenExpert.from_module(ExpertMLP(ExpertArch(widths=widths)).eval())
    x = np.random.default_rng(0).standard_normal((32, widths[0])).astype(np.float32)
    module = frozen.aligned()

    def run(rows: np.ndarray) -> np.ndarray:
        return core._forward(module, rows)[0] if aligned else old_forward(frozen, rows)

    full = run(x)
    return sum(not np.array_equal(full[i], run(x[i : i + 1])[0]) for i in range(32))


def timings(core: ActorCore, widths: tuple[int, ...], m: int, repeats: int) -> tuple[float, float]:
    torch.manual_seed(0)
    frozen = FrozenExpert.from_module(ExpertMLP(ExpertArch(widths=widths)).eval())
    module = frozen.aligned()
    rows = np.random.default_rng(0).standard_normal((m, widths[0])).astype(np.float32)
    before: list[float] = []
    after: list[float] = []
    for _ in range(repeats):
        for new, out in ((False, before), (True, after)):
            start = time.perf_counter()
            for _ in range(20):
                if new:
                    core._forward(module, rows)
                else:
                    old_forward(frozen, rows)
            out.append((time.perf_counter() - start) / 20 * 1e6)
    return statistics.median(before), statistics.median(after)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    core = ActorCore(name="bench", budget_bytes=1)

    top = 16 if args.quick else 40
    offsets = (0, 1, 2, 4, 8)
    print(f"1. F.linear, k, n in 1..{top}: the n failing, per k and base offset (floats) {offsets}")
    grid = linear_grid(range(1, top + 1), range(1, top + 1), offsets)
    for k in range(1, top + 1):
        fails = {off: grid[(k, off)] for off in offsets if (k, off) in grid}
        if fails:
            print(f"   k={k}: " + "; ".join(f"+{off}: n {ns}" for off, ns in fails.items()))

    ks = [ROW_ALIGN * j for j in range(1, 5 if args.quick else 17)] + [256, 512]
    counts = range(1, 65 if args.quick else 257)
    print(f"1b. F.linear, k in {ks[0]}..{ks[-1]} (multiples of {ROW_ALIGN}), n in 1..{top}, "
          f"M in 1..{counts[-1]}: configurations whose rows differ from a 4-row block alone")
    bad_counts = row_counts(ks, range(1, top + 1), counts)
    fours = sum(v for m, v in bad_counts.items() if m % 4 == 0)
    others = [m for m in counts if m % 4]
    differing = [m for m in others if m in bad_counts]
    print(f"   M a multiple of 4: {fours} (k, n) differ; other M: {len(differing)} of"
          f" {len(others)} have some (k, n) that differs, first {differing[:8]}"
          f" (the CPU actor's ROW_BLOCK is {ROW_BLOCK['cpu']})")

    hidden = range(1, 17 if args.quick else 41)
    print("2. experts (d, h, h, o): shapes with any of 32 positions differing from alone")
    for aligned in (False, True):
        bad = [(d, h, o) for d in range(1, 10) for h in hidden for o in (1, 2, 3)
               if positions_bad(core, (d, h, h, o), aligned=aligned)]
        total = 9 * len(hidden) * 3
        print(f"   {'after ' if aligned else 'before'}: {len(bad)} of {total} shapes;"
              f" by d {sorted(Counter(s[0] for s in bad).items())};"
              f" by o {sorted(Counter(s[2] for s in bad).items())}")
    for widths in ((3, 10, 10, 2), (3, 24, 24, 2), (2, 30, 30, 1), (8, 50, 50, 1)):
        print(f"   {widths}: before {positions_bad(core, widths, aligned=False)}/32,"
              f" after {positions_bad(core, widths, aligned=True)}/32 positions differ")

    print("3. forward of one group, µs (median of interleaved repeats): before -> after")
    repeats = 5 if args.quick else 15
    for widths in ((3, 10, 10, 2), (16, 64, 64, 8), (32, 512, 512, 8)):
        for m in (1, 16, 64):
            b, a = timings(core, widths, m, repeats)
            print(f"   {widths} rows={m}: {b:.1f} -> {a:.1f} ({(a - b) / b * 100:+.0f} %)")
    core.close()


if __name__ == "__main__":
    main()
