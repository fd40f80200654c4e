"""Fixtures for experts_store: a small published store in a tmp dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from experts_store_helpers import publish


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    publish(root)
    return root
