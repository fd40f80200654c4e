"""A manifest's JSON types are taken as they are: a count of "3", 3.0 or true is refused,
naming the field, in every kind's block; every kind momlp writes still opens; a manifest past
MAX_MANIFEST_BYTES is refused unread; `read_manifest` raises the package's own error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from experts_store_helpers import publish
from pydantic import ValidationError
from test_graph_block import publish as publish_graph

import trainer.hyper as hyper
from experts_store import (
    MAX_MANIFEST_BYTES,
    ImageLayout,
    ManifestError,
    Store,
    read_manifest,
)
from trainer.pmoe import PatchMoE, publish_pmoe

pytestmark = pytest.mark.unit


def publish_hyper(root: Path) -> None:
    torch.manual_seed(0)
    f = hyper.HyperNetwork(3, hyper.PrimarySpec(4, (6, 5), 2, bias=True), depth=1, width=16)
    hyper.publish_hypernetwork(root, f, conditions=torch.randn(4, 3), condition_ids=list("wxyz"))


def publish_patches(root: Path) -> None:
    image = ImageLayout(height=6, width=4, channels=2, patch_height=3, patch_width=2)
    model = PatchMoE(
        num_patches=image.num_patches, patch_dim=image.patch_dim, num_experts=3,
        patches_per_expert=1, hidden=5, num_classes=3, gating="softmax",
        router_init_std=1.0, expert_init_std=0.5, seed=0,
    )
    publish_pmoe(model, root, train="joint", image=image)


PUBLISH: dict[str, Callable[[Path], Any]] = {
    "momlp": publish,
    "graph": publish_graph,
    "hyper": publish_hyper,
    "pmoe": publish_patches,
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Each kind's manifest.json as momlp writes it."""
    texts = {}
    for kind, publish_kind in PUBLISH.items():
        root = tmp_path_factory.mktemp(kind) / "store"
        publish_kind(root)
        texts[kind] = (root / "manifest.json").read_bytes()
    return texts


@pytest.mark.parametrize("kind", sorted(PUBLISH))
def test_every_kind_momlp_writes_still_opens(kind: str, tmp_path: Path) -> None:
    root = tmp_path / "store"
    PUBLISH[kind](root)
    assert Store.open(root).manifest.kind == kind
    assert Store.open(root).verify() == []


# (kind, the field's place in the manifest, the value it gets; "{value}": its own as a
# string). Each is one pydantic converted to the value the field had (or, for format_version,
# to format 1), so that the manifest opened as if it were right.
CASES = [
    ("momlp", "format_version", True),  # read as format 1
    ("momlp", "input_dim", "3"),
    ("momlp", "branching", 2.0),
    ("momlp", "num_experts", "3"),
    ("momlp", "temperature", True),  # read as 1.0
    ("momlp", "experts.0.bytes", "{value}"),
    ("graph", "graph.nodes.0.output_dim", True),
    ("graph", "graph.nodes.0.branching", "2"),
    ("graph", "graph.nodes.1.experts.0", 2.0),
    ("hyper", "hyper.condition_dim", 3.0),
    ("hyper", "hyper.primary.widths.0", "4"),
    ("hyper", "hyper.primary.bias", 1),
    ("hyper", "hyper.hypernetwork.bytes", "{value}"),
    ("hyper", "hyper.layout.1.offset", 24.0),
    ("hyper", "hyper.conditions.count", "4"),
    ("pmoe", "pmoe.num_classes", 3.0),
    ("pmoe", "pmoe.patches_per_expert", True),
    ("pmoe", "pmoe.layout.image.height", "6"),
]


def _set(data: Any, place: str, value: Any) -> None:
    *path, last = [int(p) if p.isdigit() else p for p in place.split(".")]
    for part in path:
        data = data[part]
    data[last] = str(data[last]) if value == "{value}" else value


@pytest.mark.parametrize(("kind", "place", "value"), CASES)
def test_a_field_of_another_json_type_is_refused_naming_it(
    stores: dict[str, bytes], tmp_path: Path, kind: str, place: str, value: Any
) -> None:
    data = json.loads(stores[kind])
    _set(data, place, value)
    text = json.dumps(data).encode()
    (tmp_path / "manifest.json").write_bytes(text)
    with pytest.raises(ManifestError) as info:
        Store.open(tmp_path)
    message = str(info.value)
    assert message.startswith(f"bad manifest in {tmp_path}: {place}: Input should be a valid")
    assert f"got {json.dumps(_value_at(data, place))}" in message, message
    with pytest.raises(ManifestError, match=f"^bad manifest: {place}: "):
        read_manifest(text)


def _value_at(data: Any, place: str) -> Any:
    for part in place.split("."):
        data = data[int(part) if part.isdigit() else part]
    return data


def test_read_manifest_raises_the_packages_error_with_pydantics_as_its_cause(
    stores: dict[str, bytes],
) -> None:
    data = json.loads(stores["momlp"])
    data["routing"] = "sideways"
    with pytest.raises(ManifestError, match="^bad manifest: routing: ") as info:
        read_manifest(json.dumps(data).encode())
    assert info.value.root is None and isinstance(info.value.__cause__, ValidationError)
    for raw, says in [(b"{not json", "not valid JSON"), (b"[" * 10**5, "nested too deeply")]:
        with pytest.raises(ManifestError, match=says):
            read_manifest(raw)
    with pytest.raises(ManifestError, match=f"bad manifest in {Path('/srv/s')}: not valid JSON"):
        read_manifest(b"", root="/srv/s")


def test_a_manifest_larger_than_the_cap_is_refused_unread(store_root: Path) -> None:
    manifest = store_root / "manifest.json"
    # Sparse: the size is what is judged, nothing is written to disk or read.
    with open(manifest, "r+b") as fh:
        fh.truncate(MAX_MANIFEST_BYTES + 1)
    assert manifest.stat().st_size == MAX_MANIFEST_BYTES + 1
    with pytest.raises(ManifestError) as info:
        Store.open(store_root)
    assert str(info.value) == (
        f"bad manifest in {store_root}: manifest.json holds {MAX_MANIFEST_BYTES + 1} bytes, "
        f"more than the {MAX_MANIFEST_BYTES} a manifest may (MAX_MANIFEST_BYTES)"
    )
    assert MAX_MANIFEST_BYTES == 2**30

