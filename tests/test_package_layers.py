"""The packages import only downwards, as DESIGN's layout table fixes: experts_store and router
import no other package of the project, trainer only those two, client none (it must work
where torch and ray are not installed), server any of them. Every import counts, wherever it
sits: a function-level import that goes up is a cycle in disguise (server/'s own floors are
checked by tests/server/test_layers.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MAY_IMPORT = {
    "experts_store": set(),
    "router": set(),
    "trainer": {"experts_store", "router"},
    "client": set(),
    "server": {"experts_store", "router", "trainer"},
}


def project_imports(path: Path) -> set[str]:
    """The project packages `path` imports anywhere in it (absolute imports; a relative one
    stays inside its own package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & MAY_IMPORT.keys()
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    upward = {
        str(path.relative_to(ROOT)): sorted(project_imports(path) - MAY_IMPORT[package] - {package})
        for path in files
    }
    assert {name: found for name, found in upward.items() if found} == {}


def test_the_check_sees_a_function_level_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from trainer import calibrate_store\n    import router.x\n")
    assert project_imports(module) == {"trainer", "router"}
