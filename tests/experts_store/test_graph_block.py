"""The manifest's graph block: refused at publish naming the node, files kept, verified."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from experts_store_helpers import stand_in_router

from experts_store import (
    ExpertArch,
    ExpertMLP,
    GraphBlock,
    GraphNodeEntry,
    ManifestError,
    Store,
    StoreWriter,
)
from server._cli import main

pytestmark = pytest.mark.unit

# Two leaves on x, one root on their outputs; 2 experts per node.
NODES = {"a": ["x:0", "x:1"], "b": ["x:2"], "root": ["a", "b"]}


def publish(root: Path, nodes: dict[str, list[str]] | None = None, *,
            arity: dict[str, int] | None = None) -> Any:
    """Write the graph (experts sized by each node's true arity unless `arity` says)."""
    nodes = nodes or NODES
    true_arity = {"a": 2, "b": 1, "root": 2}
    generator = torch.Generator().manual_seed(0)
    with StoreWriter(root) as writer:
        entries = []
        for v, (name, inputs) in enumerate(nodes.items()):
            width = (arity or {}).get(name, true_arity.get(name, 1))
            for k in range(2):
                writer.add_expert(2 * v + k, ExpertMLP(ExpertArch((width, 4, 1)),
                                                       generator=generator))
            router = root.parent / f"{root.name}-{name}.bin"
            router.write_bytes(stand_in_router(2, width, seed=v))
            entries.append(GraphNodeEntry(name=name, inputs=inputs, output_dim=1, branching=2,
                                          router_file=writer.stage_router(router),
                                          experts=[2 * v, 2 * v + 1]))
        return writer.publish(task="regression", input_dim=3, output_dim=1, routing="tree",
                              branching=2, kind="graph",
                              graph=GraphBlock(nodes=entries, outputs=["root"]))


@pytest.mark.parametrize(
    ("nodes", "arity", "node", "what"),
    [
        ({"a": ["x:0", "root"], "b": ["x:2"], "root": ["a", "b"]}, {"a": 2}, "a", "cycle"),
        ({"a": ["x:0", "x:1"], "b": ["nowhere"], "root": ["a", "b"]}, None, "b", "names no node"),
        ({"a": ["x:0", "x:9"], "b": ["x:2"], "root": ["a", "b"]}, None, "a", "not a column"),
        (NODES, {"root": 3}, "root", "maps 3 -> 1"),
    ],
    ids=["cycle", "undefined-input", "input-past-x", "arity-mismatch"],
)
def test_a_bad_graph_is_refused_at_publish_naming_the_node(
    tmp_path: Path, nodes: dict[str, list[str]], arity: dict[str, int] | None, node: str,
    what: str,
) -> None:
    root = tmp_path / "store"
    with pytest.raises(ManifestError) as caught:
        publish(root, nodes, arity=arity)
    assert f"node {node!r}" in str(caught.value) and what in str(caught.value)
    # Nothing was published: no manifest, no expert or router file in the store.
    assert not (root / "manifest.json").exists()
    assert not list(root.glob("experts/*")) and not list(root.glob("router-*"))


def test_node_routers_are_referenced_kept_and_verified(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    manifest = publish(root)
    assert manifest.graph is not None
    routers = manifest.graph.router_files
    assert len(routers) == 3 and routers <= manifest.referenced_files
    publish(root)  # a republish keeps the (same-content) node routers
    assert all((root / name).is_file() for name in routers)
    assert Store.open(root).verify() == []
    assert main(["store", "info", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [n["name"] for n in info["graph"]["nodes"]] == ["a", "b", "root"]
    assert info["graph"]["waves"] == 2 and info["graph"]["nodes"][2]["experts"] == [4, 5]
    (root / manifest.graph.node("b").router_file).write_bytes(b"corrupt")
    (root / manifest.experts[4].file).unlink()
    assert main(["store", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "node 'b' router" in out and "checksum mismatch" in out
    assert "expert 4 (node 'root')" in out
