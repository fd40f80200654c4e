"""An expert's forward pass on an actor's device, in blocks of rows, with the activation
bytes it took: from the allocator's counters on CUDA (`_vram`), from tensor sizes on CPU."""

from __future__ import annotations

import threading

import numpy as np

from experts_store import FrozenExpert
from server.pool._device import activation_peak_bytes, aligned_input, by_blocks
from server.pool._vram import ActivationMeter

__all__ = ["DeviceForward"]


class DeviceForward:
    """`run(module, rows [m, n] float32)` -> (outputs [m, out], activation bytes), under the
    caller's inference_mode."""

    def __init__(self, device: str, row_block: int, meter: ActivationMeter | None) -> None:
        self.device = device
        self._row_block = row_block
        self._meter = meter
        # Per thread: whether it already ran a GEMM on the device (`run`).
        self._threads = threading.local()

    def run(self, module: FrozenExpert, rows: np.ndarray) -> tuple[np.ndarray, int]:
        m, n = rows.shape
        if n != module.arch.input_dim:
            raise ValueError(f"rows have {n} columns, the expert takes {module.arch.input_dim}")
        block = self._row_block
        x = aligned_input(rows, -(-m // block) * block, module.input_width)
        # Under ActorCore.run's inference_mode.
        if self._meter is not None:
            if not getattr(self._threads, "warm", False):
                # cuBLAS allocates a workspace on a thread's first GEMM (34.6 MB on an H100)
                # and keeps it for the thread's life: a fixed cost like the CUDA context, not
                # this batch's. One throwaway block first keeps it out of the VRAM figure.
                module(x[:block].to(self.device))
                self._threads.warm = True
            shape = (module.arch, module.input_width, x.shape[0] // block)
            y, activation = self._meter.run(
                shape, lambda: by_blocks(module, x.to(self.device, non_blocking=True), block)
            )
            return y[:m].to("cpu").numpy(), activation
        y = by_blocks(module, x, block)
        # The layers' tensor sizes (no forward hooks: they cost more than a small expert's
        # whole forward).
        return y[:m].numpy(), activation_peak_bytes(module.arch.widths, m, y.element_size())
