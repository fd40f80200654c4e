"""The files of a store no manifest references any more: each is retired (`retired.json`
records when it stopped being referenced) and deleted only `retire_after_s` later, so a
server still serving an older version than the previous one keeps its files."""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

__all__ = ["DEFAULT_RETIRE_AFTER_S", "RETIRED_NAME", "retire_unreferenced"]

logger = logging.getLogger(__name__)

RETIRED_NAME = "retired.json"
# A server may serve a version older than the previous one (it refused the versions after
# it, or publishes came faster than its watch interval): ten minutes covers its lag, its
# in-flight requests and an operator's fix of a refused version.
DEFAULT_RETIRE_AFTER_S = 600.0
# The content-named files a publish moves in; anything else in the store is not a version's.
_PUBLISHED = (
    "experts/*.safetensors",
    "router-*.safetensors",
    "hyper-*.safetensors",
    "conditions-*.safetensors",
)


def retire_unreferenced(root: Path, keep: set[str], now: float, retire_after_s: float) -> None:
    """Retire the published files of `root` not in `keep` (store-relative names), and delete
    those retired at least `retire_after_s` before `now` (a timestamp)."""
    retired = _read_retired(root)
    still: dict[str, float] = {}
    for path in [path for pattern in _PUBLISHED for path in root.glob(pattern)]:
        name = path.relative_to(root).as_posix()
        if name in keep:
            continue
        since = retired.get(name, now)
        if now - since >= retire_after_s:
            logger.debug("removing %s, unreferenced since %s", path, since)
            path.unlink(missing_ok=True)
        else:
            still[name] = since
    _write_retired(root, still)


def _read_retired(root: Path) -> dict[str, float]:
    """The retired files and when each was retired; an unreadable ledger counts as empty
    (its files are retired anew: deleted later, never sooner)."""
    try:
        data = json.loads((root / RETIRED_NAME).read_text(encoding="utf-8"))
        return {str(name): float(since) for name, since in data["retired"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("unreadable %s in %s (%s): retiring its files anew", RETIRED_NAME, root,
                       exc)
        return {}


def _write_retired(root: Path, retired: dict[str, float]) -> None:
    path = root / RETIRED_NAME
    if not retired:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{RETIRED_NAME}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(json.dumps({"format": 1, "retired": retired}, indent=1, sort_keys=True),
                       encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # the files stay: a later publish retires them again
        logger.warning("cannot write %s in %s: %s", RETIRED_NAME, root, exc)
        tmp.unlink(missing_ok=True)
