"""Every server setting is in the README's configuration table, by its environment variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server import Settings

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_has_a_row_in_the_readme() -> None:
    rows = set(re.findall(r"^\| `(MOMLP_[A-Z0-9_]+)` \|", README.read_text(), re.MULTILINE))
    missing = [f"MOMLP_{name.upper()}" for name in Settings.model_fields]
    missing = [env for env in missing if env not in rows]
    assert missing == [], f"settings without a row in README.md's configuration table: {missing}"
