"""Reading an expert file onto a device: as a trainable ExpertMLP, or as a FrozenExpert.

Both go through `read_expert_state` (read with optional checksums, header checks, one
copy to the device); they differ only in what is built around the tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from experts_store._arch import ExpertArch
from experts_store._checksum import ExpectedDigest
from experts_store._exceptions import ExpertFormatError
from experts_store._format import all_finite, parse_header, read_expert_bytes, tensor_views
from experts_store._frozen import FrozenExpert
from experts_store._hostbuf import HostBufferPool
from experts_store._model import ExpertMLP

__all__ = [
    "load_expert", "load_frozen_expert", "read_checked_bytes", "read_expert_state",
    "state_from_bytes",
]

logger = logging.getLogger(__name__)


def _assign(expert: ExpertMLP, state: Mapping[str, Tensor]) -> None:
    """Put the file's tensors into the meta skeleton in place of its parameters and buffers.

    parse_header has already matched names, dtypes and shapes with the arch, so this skips
    load_state_dict's per-tensor checks, which cost more than reading a small expert.
    """
    modules = dict(expert.named_modules())
    for name, tensor in state.items():
        owner, _, leaf = name.rpartition(".")
        module = modules[owner]
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor)
        else:
            module._buffers[leaf] = tensor


def load_expert(
    path: Path | str,
    device: str | torch.device = "cpu",
    *,
    expected_sha256: str | None = None,
    expected_checksum: str | None = None,
    expert_id: int | None = None,
    host_pool: HostBufferPool | None = None,
    store_root: str | None = None,
) -> ExpertMLP:
    """Rebuild the expert saved at ``path`` on ``device``, in eval mode.

    ``expected_checksum`` (``"xxh3_128:<hex>"``, a manifest's ``checksum``) and
    ``expected_sha256`` (bare hex), when given, are checked against the file's bytes, hashed
    while they are read and before anything is parsed; a mismatch raises
    ExpertChecksumError, a checksum of an unknown algorithm ExpertFormatError. The fast
    checksum adds 15-25% to the load of a large expert, sha256 6-10x the load.
    A bad header, arch, dtype or shape raises ExpertFormatError; a missing file
    ExpertFileMissing; all name ``expert_id``. ``host_pool`` recycles the host buffers of
    large CPU experts (see HostBufferPool). ``store_root``: the store the file belongs to;
    a file a symbolic link leads out of it is refused unread (ExpertFormatError).
    """
    arch, state = read_expert_state(
        path,
        device,
        expected_sha256=expected_sha256,
        expected_checksum=expected_checksum,
        expert_id=expert_id,
        host_pool=host_pool,
        store_root=store_root,
    )
    expert = ExpertMLP(arch, device="meta")
    _assign(expert, state)
    return expert.eval()


def read_expert_state(
    path: Path | str,
    device: str | torch.device = "cpu",
    *,
    expected_sha256: str | None = None,
    expected_checksum: str | None = None,
    expert_id: int | None = None,
    host_pool: HostBufferPool | None = None,
    expected_bytes: int | None = None,
    check_finite: bool = False,
    store_root: str | None = None,
) -> tuple[ExpertArch, dict[str, Tensor]]:
    """The expert's architecture and tensors on ``device``, checked as load_expert says;
    ``expected_bytes``: the file's size (refused unread if it differs); ``check_finite``:
    ExpertFormatError if a weight is NaN or infinite."""
    target = torch.device(device)
    # On CUDA the read lands in pinned memory so the one host-to-device copy is a DMA.
    pin = target.type == "cuda" and torch.cuda.is_available()
    buf = read_checked_bytes(
        path,
        expected_sha256=expected_sha256,
        expected_checksum=expected_checksum,
        expert_id=expert_id,
        pin_memory=pin,
        host_pool=None if pin else host_pool,
        expected_bytes=expected_bytes,
        store_root=store_root,
    )
    return state_from_bytes(
        buf, target, expert_id=expert_id, pinned=pin, check_finite=check_finite
    )


def read_checked_bytes(
    path: Path | str,
    *,
    expected_sha256: str | None = None,
    expected_checksum: str | None = None,
    expert_id: int | None = None,
    pin_memory: bool = False,
    host_pool: HostBufferPool | None = None,
    expected_bytes: int | None = None,
    store_root: str | None = None,
) -> Tensor:
    """The file's bytes on the host, hashed as they are read and checked before returning
    (a file of another size than ``expected_bytes``, or one a link leads out of
    ``store_root``, is refused unread)."""
    checks: list[ExpectedDigest] = []
    if expected_checksum is not None:
        checks.append(ExpectedDigest(expected_checksum, expert_id=expert_id))
    if expected_sha256 is not None:
        checks.append(ExpectedDigest(expected_sha256, expert_id=expert_id, bare_sha256=True))
    buf = read_expert_bytes(
        path,
        expert_id=expert_id,
        pin_memory=pin_memory,
        host_pool=host_pool,
        digests=[check.digest for check in checks],
        expected_bytes=expected_bytes,
        store_root=store_root,
    )
    for check in checks:
        check.check()
    return buf


def state_from_bytes(
    buf: Tensor,
    device: torch.device,
    *,
    expert_id: int | None = None,
    pinned: bool = False,
    check_finite: bool = False,
) -> tuple[ExpertArch, dict[str, Tensor]]:
    """Parse a whole expert file held in `buf` (host uint8) into tensors on `device`.

    On CPU the tensors are views of `buf`; elsewhere one copy, non-blocking from `pinned`
    memory and waited for before returning, so `buf` may be reused or kept afterwards.
    `check_finite`: ExpertFormatError if a weight is NaN or infinite (checked where the
    tensors landed, so on a GPU by the GPU).
    """
    header = parse_header(buf, expert_id=expert_id)
    data = buf[header.data_offset :]
    if device.type != "cpu":
        data = data.to(device, non_blocking=pinned)
    if check_finite and not all_finite(data, header):
        raise ExpertFormatError(
            expert_id=expert_id, reason="its weights hold NaN or infinite values"
        )
    state = tensor_views(data, header)
    if pinned and device.type == "cuda":
        # The copy reads `buf`, which the caller frees or keeps: make it finish first.
        torch.cuda.current_stream(device).synchronize()
    logger.debug("loaded expert %s to %s", expert_id, device)
    return header.arch, state


def load_frozen_expert(
    path: Path | str,
    device: str | torch.device = "cpu",
    *,
    expected_sha256: str | None = None,
    expected_checksum: str | None = None,
    expert_id: int | None = None,
    host_pool: HostBufferPool | None = None,
    expected_bytes: int | None = None,
    check_finite: bool = False,
    store_root: str | None = None,
) -> FrozenExpert:
    """The expert at ``path`` for inference only (see FrozenExpert); checked as
    read_expert_state says."""
    arch, state = read_expert_state(
        path,
        device,
        expected_sha256=expected_sha256,
        expected_checksum=expected_checksum,
        expert_id=expert_id,
        host_pool=host_pool,
        expected_bytes=expected_bytes,
        check_finite=check_finite,
        store_root=store_root,
    )
    return FrozenExpert(arch, state)
