"""server/ is laid out by floor, and imports only flow down: pool < batching < serving < http
< the process runner and CLI. A function-level import that goes up is a cycle in disguise, so
every import in a module counts, wherever it sits. The kinds floor (planner/combiner pairs)
sits between pool and batching."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SERVER = Path(__file__).resolve().parents[2] / "server"
# Each floor may import the floors before it in this list (and the shared bottom modules).
FLOORS = ["pool", "kinds", "batching", "serving", "http"]
BOTTOM = {"server._settings", "server._exceptions"}


def floor_of(module: str) -> int | None:
    """The floor index of a `server.*` module; None for the bottom and the top."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in FLOORS:
        return FLOORS.index(parts[1])
    return None


def imports_of(path: Path) -> list[str]:
    package = ".".join(path.relative_to(SERVER.parent).with_suffix("").parts[:-1])
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.append(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.append(node.module)
    return [name for name in found if name == "server" or name.startswith("server.")]


def modules() -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(SERVER.parent).with_suffix("").parts), path)
        for path in sorted(SERVER.rglob("*.py"))
    ]


def test_the_floors_exist() -> None:
    for floor in FLOORS:
        assert (SERVER / floor / "__init__.py").is_file(), floor
    # The flat modules of the old layout are gone: what is left at the top is the bottom
    # (settings, errors) and the top (process runner, its uvicorn connections and drain
    # window, and CLI).
    flat = {p.name for p in SERVER.glob("_*.py")}
    assert flat == {"__init__.py", "_settings.py", "_exceptions.py", "_runner.py",
                    "_connections.py", "_drain.py", "_cli.py", "_serve_cli.py"}


@pytest.mark.parametrize("name,path", modules(), ids=[name for name, _ in modules()])
def test_imports_flow_only_down(name: str, path: Path) -> None:
    own = floor_of(name)
    for imported in imports_of(path):
        if name in BOTTOM:
            assert imported in BOTTOM, f"{name} (bottom) imports {imported}"
            continue
        if own is None:
            continue  # the top (runner, CLI, package surface) may import any floor
        target = floor_of(imported)
        if imported == "server" or (target is None and imported not in BOTTOM):
            pytest.fail(f"{name} imports {imported}, which sits above its floor")
        assert target is None or target <= own, f"{name} imports {imported} from a floor above"
