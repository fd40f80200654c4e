"""save()/load(): safetensors round trip, and files that must be refused."""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from router_testdata import make_prototypes, make_queries
from safetensors.torch import load_file, save_file

from router import PrototypeTree, RouterFileError

pytestmark = pytest.mark.unit


@pytest.fixture
def tree() -> PrototypeTree:
    p = make_prototypes("clustered", 3000, 5, np.random.default_rng(0))
    return PrototypeTree.build(p, branching=4, seed=0, temperature=0.25)


def test_round_trip_gives_identical_routes(tree: PrototypeTree, tmp_path: Path) -> None:
    path = tmp_path / "router.safetensors"
    tree.save(path)
    back = PrototypeTree.load(path)
    assert (back.num_prototypes, back.dim, back.branching, back.depth) == (
        tree.num_prototypes, tree.dim, tree.branching, tree.depth,
    )
    assert back.temperature == 0.25
    assert torch.equal(back.prototypes, tree.prototypes)
    x = make_queries(tree.prototypes.numpy(), 200, np.random.default_rng(1))
    for mode in ("tree", "exact"):
        for k in (1, 3):
            a, b = tree.route(x, mode=mode, top_k=k), back.route(x, mode=mode, top_k=k)
            assert torch.equal(a.experts, b.experts)
            assert torch.equal(a.weights, b.weights)
            assert torch.equal(a.distance_evals, b.distance_evals)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_single_prototype_round_trip(tmp_path: Path) -> None:
    PrototypeTree.build(torch.tensor([[3.0]])).save(tmp_path / "r.safetensors")
    back = PrototypeTree.load(tmp_path / "r.safetensors")
    assert back.route(torch.tensor([[0.0]])).experts.tolist() == [[0]]


def test_file_is_plain_safetensors(tree: PrototypeTree, tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    tree.save(path)
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["__metadata__"]["format"] == "momlp-router"
    assert set(header) - {"__metadata__"} == {
        "prototypes", "internal_points", "internal_radius", "children",
    }


def test_the_same_router_is_written_as_the_same_bytes(tmp_path: Path) -> None:
    # Its file is named by its sha256: a rebuild with the same seed, or a republish of an
    # unchanged router, must not make a new file. safetensors orders the metadata at random.
    p = make_prototypes("clustered", 200, 3, np.random.default_rng(3))
    balanced = PrototypeTree.build(p, branching=3, seed=0, balanced=True)
    for name, tree in (("voronoi", PrototypeTree.build(p, branching=3, seed=0)),
                       ("balanced", balanced)):
        blobs = set()
        for i in range(12):
            tree.save(tmp_path / f"{name}{i}.safetensors")
            blobs.add((tmp_path / f"{name}{i}.safetensors").read_bytes())
        assert len(blobs) == 1, name
        (raw,) = blobs
        (length,) = struct.unpack("<Q", raw[:8])
        assert (8 + length) % 8 == 0  # the data stays aligned
        back = PrototypeTree.load(tmp_path / f"{name}0.safetensors")
        assert torch.equal(back.prototypes, tree.prototypes) and back.depth == tree.depth


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield int(request.param)
    finally:
        os.umask(previous)


def test_a_published_router_is_as_readable_as_the_store_s_experts(
    tree: PrototypeTree, tmp_path: Path, umask: int
) -> None:
    # A server on shared storage may run as another user: it must read the router too.
    from experts_store import ExpertArch, ExpertMLP, Store, StoreWriter

    with StoreWriter(tmp_path / "store") as writer:
        writer.add_expert(0, ExpertMLP(ExpertArch(widths=(5, 4, 1))))
        tree.save(writer.router_path)
        writer.publish(task="regression", input_dim=5, output_dim=1, routing="tree",
                       branching=4)
    store = Store.open(tmp_path / "store")
    expert_file = store.root / store.manifest.experts[0].file

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(expert_file) == 0o666 & ~umask
    assert mode(store.router_path) == mode(expert_file)


def _rewrite(src: Path, dst: Path, **changes: torch.Tensor) -> None:
    from safetensors import safe_open

    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(src))
    tensors.update(changes)
    save_file(tensors, str(dst), metadata=meta)


def test_missing_and_garbage_files(tmp_path: Path) -> None:
    with pytest.raises(RouterFileError) as err:
        PrototypeTree.load(tmp_path / "nope.safetensors")
    assert err.value.path == tmp_path / "nope.safetensors"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 100)
    with pytest.raises(RouterFileError):
        PrototypeTree.load(bad)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(3)}, str(other), metadata={"format": "pt"})
    with pytest.raises(RouterFileError, match="format"):
        PrototypeTree.load(other)


@pytest.mark.parametrize(
    "mutate",
    ["cycle", "out_of_range", "orphan", "dtype", "shape", "nan", "unpacked"],
)
def test_inconsistent_arrays_are_refused(
    tree: PrototypeTree, tmp_path: Path, mutate: str
) -> None:
    src = tmp_path / "good.safetensors"
    tree.save(src)
    t = load_file(str(src))
    children = t["children"].clone()
    change: dict[str, torch.Tensor] = {}
    if mutate == "cycle":
        children[1, 0] = 1
        change["children"] = children
    elif mutate == "out_of_range":
        children[0, 0] = children.shape[0] + tree.num_prototypes
        change["children"] = children
    elif mutate == "orphan":
        children[0, 1] = children[0, 0]
        change["children"] = children
    elif mutate == "dtype":
        change["children"] = children.to(torch.int32)
    elif mutate == "shape":
        change["internal_radius"] = t["internal_radius"][:-1].clone()
    elif mutate == "nan":
        protos = t["prototypes"].clone()
        protos[3, 0] = float("nan")
        change["prototypes"] = protos
    elif mutate == "unpacked":
        children[0, 0], children[0, -1] = -1, children[0, 0]
        change["children"] = children
    dst = tmp_path / "bad.safetensors"
    _rewrite(src, dst, **change)
    with pytest.raises(RouterFileError):
        PrototypeTree.load(dst)
