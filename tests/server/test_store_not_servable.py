"""A store whose files each read but do not fit together is refused when it is opened, at
startup and on reload, in one line naming the file or the mismatch; `momlp store verify`
refuses it too, by the same open (server/kinds/_registry.py, experts_store/_cli.py).

Each case rewrites one file of a published store and renames it by its new content, with the
manifest's name (and, for a hyper store's files, sha256 and bytes) updated to match, as a
writer other than momlp's would: every checksum holds, only the contents disagree."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from app_support import app_settings, build_small_store, fake_app, fake_pool, manifest, running
from graph_support import tiny_graph_store
from safetensors.torch import load, save

import server._runner
import server.pool
from experts_store import ImageLayout, Store
from router import PrototypeTree, RouterFileError
from server import StoreNotServable, create_app
from server._cli import main
from server.kinds import open_model
from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork
from trainer.pmoe import PatchMoE, publish_pmoe

pytestmark = pytest.mark.unit

Tensors = dict[str, torch.Tensor]


def rewrite(
    root: Path, block: Sequence[str | int], change: Callable[[Tensors, dict[str, str]], bytes]
) -> str:
    """Replace the file that manifest[block...]["file"] (or ["router_file"]) names by
    `change(tensors, metadata)`, content-named; returns the new name."""
    data = manifest(root)
    entry: Any = data
    for key in block:
        entry = entry[key]
    field = "file" if "file" in entry else "router_file"
    old = root / entry[field]
    raw = old.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    metadata = json.loads(raw[8 : 8 + size]).get("__metadata__", {})
    new = change(load(raw), metadata)
    sha = hashlib.sha256(new).hexdigest()
    name = f"{old.name.split('-')[0]}-{sha[:16]}.safetensors"
    (root / name).write_bytes(new)  # the old file stays: other entries may name it
    entry[field] = name
    if "sha256" in entry:
        entry.update(sha256=sha, bytes=len(new))
    (root / "manifest.json").write_text(json.dumps(data, indent=1))
    return name


def tree_file(prototypes: torch.Tensor, tmp: Path) -> bytes:
    PrototypeTree.build(prototypes.contiguous(), branching=2, seed=0).save(tmp)
    return tmp.read_bytes()


def refusal(root: Path) -> Exception:
    with pytest.raises((StoreNotServable, RouterFileError)) as info:
        open_model(Store.open(root))
    return info.value


def hyper_store(root: Path) -> Path:
    torch.manual_seed(0)
    f = HyperNetwork(5, PrimarySpec(4, (8,), 2), depth=1, width=16)
    table = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    publish_hypernetwork(root, f, conditions=table, condition_ids=["a", "b", "c"])
    return root


def pmoe_store(root: Path) -> Path:
    image = ImageLayout(height=6, width=4, channels=2, patch_height=3, patch_width=2)
    model = PatchMoE(
        num_patches=image.num_patches, patch_dim=image.patch_dim, num_experts=3,
        patches_per_expert=2, hidden=5, num_classes=3, gating="softmax", router_init_std=1.0,
        expert_init_std=0.5, seed=0,
    )
    publish_pmoe(model, root, train="joint", image=image)
    return root


def test_a_router_of_fewer_prototypes_than_experts_is_one_line_at_startup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real uvicorn start (fake pool): the reason in one line, exit 1, no traceback."""
    monkeypatch.setattr(server.pool, "ray_session", lambda **kwargs: contextlib.nullcontext(False))
    store = build_small_store(tmp_path / "s", K=8)
    rewrite(store, [], lambda t, m: tree_file(t["prototypes"][:7], tmp_path / "t.safetensors"))
    with caplog.at_level("INFO"):
        code = server._runner.run_server(
            app_settings(store, port=0),
            app_factory=lambda s: create_app(s, pool_factory=fake_pool),
        )
    assert code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert (f"cannot serve {store}: 8 experts for a router of 7 prototypes (a store of kind "
            "'momlp')") in errors
    assert not any("Traceback" in m for m in errors), errors


async def test_a_reload_to_a_store_that_does_not_fit_keeps_the_served_version(
    tmp_path: Path,
) -> None:
    store = build_small_store(tmp_path / "s", K=8)
    served = manifest(store)["store_version"]
    x = np.zeros((2, 4), dtype=np.float32).tolist()
    async with running(fake_app(store)) as client:
        before = (await client.post("/v1/predict", json={"inputs": x})).json()
        rewrite(store, [], lambda t, m: tree_file(t["prototypes"][:7], tmp_path / "t.safetensors"))
        data = manifest(store)
        data["store_version"] = "does-not-fit"
        (store / "manifest.json").write_text(json.dumps(data))
        reload = await client.post("/v1/admin/reload")
        after = (await client.post("/v1/predict", json={"inputs": x})).json()
    assert reload.status_code == 503, reload.text
    assert reload.json()["error"]["detail"]["reason"] == (
        "8 experts for a router of 7 prototypes (a store of kind 'momlp')"
    )
    assert after == before and after["store_version"] == served


def test_a_graph_node_router_of_the_wrong_size_is_refused_naming_the_node(
    tmp_path: Path,
) -> None:
    root = tmp_path / "g"
    tiny_graph_store(root)
    node = manifest(root)["graph"]["nodes"][0]["name"]
    rewrite(root, ["graph", "nodes", 0],
            lambda t, m: tree_file(t["prototypes"][:3], tmp_path / "t.safetensors"))
    error = refusal(root)
    assert isinstance(error, StoreNotServable)
    assert f"node {node!r}: its router has 3 prototypes" in str(error)


@pytest.mark.parametrize("case", ["nan", "float16", "not safetensors"])
def test_a_pmoe_router_that_is_not_a_finite_float32_matrix_is_refused(
    tmp_path: Path, case: str
) -> None:
    root = pmoe_store(tmp_path / "p")

    def change(tensors: Tensors, metadata: dict[str, str]) -> bytes:
        weight = tensors["router_weight"]
        if case == "not safetensors":
            return b"\x10\x00\x00\x00\x00\x00\x00\x00{}"
        if case == "nan":
            weight = torch.full_like(weight, float("nan"))
        return save({"router_weight": weight.half() if case == "float16" else weight})

    name = rewrite(root, [], change)
    error = refusal(root)
    assert isinstance(error, RouterFileError) and error.path.name == name
    expected = {
        "nan": "'router_weight' is not finite",
        "float16": "no float32 [k, d] 'router_weight' (got torch.float16 [3, 12])",
        "not safetensors": "not a readable safetensors file",
    }[case]
    assert expected in str(error)


@pytest.mark.parametrize("case", ["columns", "ids", "deep ids", "nan", "f16", "float widths"])
def test_a_hyper_store_whose_f_or_table_differs_from_its_block_is_refused(
    tmp_path: Path, case: str
) -> None:
    root = hyper_store(tmp_path / "h")
    of_f = case in ("f16", "float widths")
    block = "hypernetwork" if of_f else "conditions"

    def change(tensors: Tensors, metadata: dict[str, str]) -> bytes:
        if case == "columns":
            tensors["conditions"] = tensors["conditions"][:, :3].contiguous()
        elif case == "ids":
            metadata["ids"] = "[oops"
        elif case == "deep ids":
            metadata["ids"] = "[" * 100_000  # past the JSON parser's depth: RecursionError
        elif case == "nan":
            tensors["conditions"][1, 2] = float("nan")
        elif case == "float widths":
            metadata["widths"] = "[5.0, 16, 16, 48]"  # equal to the manifest's, as floats
        else:
            tensors = {name: t.half() for name, t in tensors.items()}
        return save(tensors, metadata=metadata)

    name = rewrite(root, ["hyper", block], change)
    error = refusal(root)
    assert isinstance(error, StoreNotServable)
    label = "hypernetwork" if of_f else "conditions"
    expected = {
        "columns": "a table of shape [3, 3], the manifest's is [3, 5]",
        "ids": "its 'ids' metadata is not JSON",
        "deep ids": "its 'ids' metadata is not JSON",
        "nan": "the table holds NaN or infinite values",
        "f16": "layers.0.weight is F16 [16, 5], f of widths [5, 16, 16, 48] needs F32 [16, 5]",
        # What an actor pinning f would refuse, refused before the store goes live.
        "float widths": "widths [5.0, 16, 16, 48] are not two or more positive ints",
    }[case]
    assert str(error) == f"{label} {name}: {expected} (a store of kind 'hyper')"


def test_a_prototype_hyper_store_whose_router_is_not_its_table_is_refused(
    tmp_path: Path,
) -> None:
    torch.manual_seed(2)
    f = HyperNetwork(4, PrimarySpec(4, (8,), 2), depth=1, width=16)
    prototypes = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    other = PrototypeTree.build(prototypes.flip(0).contiguous(), branching=2, seed=0)
    root = tmp_path / "h"
    publish_hypernetwork(root, f, conditions=prototypes,
                         condition_ids=[str(k) for k in range(6)], router=other)
    # Row k would be served by g(·; f(p_k)) of another prototype than the one it was routed to.
    error = refusal(root)
    assert str(error) == (
        "the router's prototypes are not the conditions table's rows (a store of kind 'hyper')"
    )


def test_verify_fails_a_store_a_server_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "g"
    tiny_graph_store(root)
    assert main(["store", "verify", "--no-progress", str(root)]) == 0
    capsys.readouterr()
    rewrite(root, ["graph", "nodes", 0],
            lambda t, m: tree_file(t["prototypes"][:3], tmp_path / "t.safetensors"))
    assert main(["store", "verify", "--no-progress", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAIL a server would refuse the store: node " in out
    assert "its router has 3 prototypes" in out
    assert "no expert fails" in out
