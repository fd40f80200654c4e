"""The checked archs of a manifest's rows, memoised by value: a store's experts share a few
archs, so each distinct one is checked (`ExpertArch.from_dict`) once, and every row of it
holds the one shared dict that check gave."""

from __future__ import annotations

import marshal
from typing import Any

from experts_store._arch import ExpertArch

__all__ = ["checked_arch", "shared_arch_dict"]

# Checked archs by their value: a store's experts share a few archs, and checking each of a
# K=100,000 manifest's rows three times took 3.8 of the 6.5 s that opening it cost (cProfile;
# benchmarks/RESULTS.md, fifty-second session). The key tells apart what from_dict does (1,
# 1.0, True, "1"), where == would not. Bounded: a hostile manifest could give every row its
# own arch.
_ARCHS: dict[bytes | str, tuple[ExpertArch, dict[str, Any]]] = {}
_MAX_ARCHS = 4096
# Each memoised arch's own dict (`to_dict`), which every entry of that arch is given as its
# `arch`; by the dict's id, the arch it checked to. An entry's later look-ups (`expert_arch`,
# three a row while a version opens) are then one hit instead of a repr each (fifty-fifth
# session), and a K=100,000 manifest holds a few arch dicts instead of 100,000. Nothing
# mutates an entry's `arch`; a `model_copy` that replaces it brings a dict of its own, which
# is checked by its key.
_BY_ID: dict[int, tuple[dict[str, Any], ExpertArch]] = {}


def _arch_key(data: dict[str, Any]) -> bytes | str:
    """A key equal for two archs exactly when their values are, types and key order included:
    marshal's bytes in format 2, which writes neither back-references nor interning, so equal
    values give equal bytes whatever their reference counts; a third of repr's time. repr for
    what marshal cannot write (nothing JSON decodes to)."""
    try:
        return marshal.dumps(data, 2)
    except ValueError:
        return repr(data)


def checked_arch(data: Any) -> ExpertArch:
    """`ExpertArch.from_dict(data)`, from the memo when the same values were checked before."""
    if type(data) is not dict:
        return ExpertArch.from_dict(data)
    shared = _BY_ID.get(id(data))
    if shared is not None and shared[0] is data:
        return shared[1]
    return _memo(data)[0]


def shared_arch_dict(data: Any) -> dict[str, Any]:
    """The checked arch of `data` as its shared dict (a dict of its own past the memo's bound)."""
    if type(data) is not dict:
        return ExpertArch.from_dict(data).to_dict()
    return _memo(data)[1]


def _memo(data: dict[str, Any]) -> tuple[ExpertArch, dict[str, Any]]:
    key = _arch_key(data)
    known = _ARCHS.get(key)
    if known is None:
        arch = ExpertArch.from_dict(data)
        known = (arch, arch.to_dict())
        if len(_ARCHS) < _MAX_ARCHS:
            _ARCHS[key] = known
            _BY_ID[id(known[1])] = (known[1], arch)
    return known
