"""`momlp loadtest --max-failed-fraction` against a real server (uvicorn on loopback, the
in-process pool): a store with two of its eight experts' files corrupted answers the requests
routed to them 503 (naming the expert) and the others 200, and the command's exit status
follows the flag in the closed and the open loop."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")
pytest.importorskip("uvicorn")

EXPERTS = 8
CORRUPTED = (0, 5)


def _store(root: Path) -> Path:
    from experts_store import ExpertArch, ExpertMLP, StoreWriter
    from router import PrototypeTree

    generator = torch.Generator().manual_seed(0)
    arch = ExpertArch(widths=(4, 16, 2))
    with StoreWriter(root) as writer:
        for expert_id in range(EXPERTS):
            writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
        prototypes = torch.randn(EXPERTS, 4, generator=generator)
        PrototypeTree.build(prototypes, branching=2, seed=0).save(writer.router_path)
        writer.publish(task="regression", input_dim=4, output_dim=2, routing="tree",
                       branching=2)
    for path in (root / "experts").iterdir():
        if int(path.name.split("-")[0]) in CORRUPTED:  # files are named <id>-<sha256[:16]>
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    return root


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from uvicorn_support import serving_in_thread

    from server import Settings, create_app
    from server.pool import FakeExpertPool

    settings = Settings(store=_store(tmp_path_factory.mktemp("partly-corrupt") / "store"),
                        watch_store=False, actors=2, cache_bytes=1 << 20,
                        max_batch_wait_ms=0.0, device="cpu")
    with serving_in_thread(create_app(settings, pool_factory=FakeExpertPool),
                           "momlp-loadtest-exit") as served:
        yield served


@pytest.mark.parametrize("loop", [["--concurrency", "4"], ["--rate", "200"]])
def test_exit_status_follows_max_failed_fraction_against_a_real_server(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], loop: list[str]
) -> None:
    from server._cli import main

    def loadtest(name: str, *flags: str) -> tuple[int, dict[str, Any], str]:
        report = tmp_path / name
        status = main(["loadtest", "--url", url, "--requests", "40", *loop, "--seed", "3",
                       "--report", str(report), "--no-plots", "--quiet", *flags])
        return status, json.loads((report / "report.json").read_text()), capsys.readouterr().err

    status, data, err = loadtest("no-limit")
    failed = data["errors"]
    # Some requests reached a corrupted expert, others not: the run is the mixed case.
    assert data["errors_by_status"] == {"503": failed} and 0 < failed < 40
    assert status == 0 and data["failure_check"] is None  # as before: no limit, no verdict

    status, data, err = loadtest("strict", "--max-failed-fraction", "0")
    assert status == 3
    assert data["failure_check"] == {
        "failed_fraction": failed / 40, "max_failed_fraction": 0.0, "passed": False,
    }
    assert err.splitlines()[-1] == (
        f"momlp loadtest: {failed / 40:.4g} of the requests failed ({failed} of 40), more than "
        "--max-failed-fraction 0 allows"
    )

    status, data, err = loadtest("lenient", "--max-failed-fraction", "1")
    assert status == 0 and data["failure_check"]["passed"] is True
    assert "max-failed-fraction" not in err
