"""A request's rows and options, checked once before the batcher queues them.

The check a batcher makes of what it is handed: a non-empty 2-D array of finite numbers of
the model's input dimension (integers taken as numbers), converted to a float32 tensor, with
options the store's kind accepts. It runs on the event loop for every request.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch

from server._exceptions import InvalidRequest
from server.kinds import ServedModel

__all__ = ["checked_rows"]

# Integer inputs taken as numbers (converted to float32 like floating ones).
_INTEGER_INPUTS = (np.dtype(np.int32), np.dtype(np.int64))

# Distinct option values a batcher remembers as checked (a few hundred bytes each).
_CHECKED_OPTIONS = 1024


def checked_rows(
    x: torch.Tensor | np.ndarray,
    options: Hashable,
    model: ServedModel,
    checked_options: set[Hashable],
) -> torch.Tensor:
    """`x` as a float32 tensor; `InvalidRequest` for a bad shape, dimension or number, or
    options `model` refuses. `checked_options` holds the option values already checked for
    `model` (the caller's, kept across requests); a new value is added once checked."""
    # Checked in numpy: a request's checks are a handful of calls on a few rows, and a
    # numpy call costs a fraction of a torch one on the event loop (7 -> 2 µs a request).
    if isinstance(x, torch.Tensor):
        # numpy has no bfloat16; float32 holds every bfloat16 value exactly.
        array = (x.float() if x.dtype == torch.bfloat16 else x).numpy(force=True)
    else:
        array = np.asarray(x)
    if array.ndim != 2 or array.shape[0] == 0:
        raise InvalidRequest("inputs must be a non-empty 2-D array", field="inputs")
    if array.shape[1] != model.input_dim:
        raise InvalidRequest(
            f"inputs have dimension {array.shape[1]}, the model expects "
            f"{model.input_dim}",
            field="inputs",
        )
    if not (array.dtype.kind == "f" or array.dtype in _INTEGER_INPUTS):
        raise InvalidRequest("inputs must be numbers", field="inputs")
    if array.dtype != np.float32:
        # A float64 beyond float32's range becomes inf (refused below), as torch's cast
        # does, without numpy's overflow warning.
        with np.errstate(over="ignore", invalid="ignore"):
            array = array.astype(np.float32)
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # torch warns on (and must not share) read-only memory
        array = array.copy()
    if not np.isfinite(array).all():
        raise InvalidRequest("inputs must be finite numbers", field="inputs")
    if options not in checked_options:
        model.check(options)
        # Requests mostly share a few option values (the store's gate, a client's
        # settings): each is checked once, not on every request.
        if len(checked_options) >= _CHECKED_OPTIONS:
            checked_options.clear()
        checked_options.add(options)
    return torch.from_numpy(array)
