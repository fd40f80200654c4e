"""The SDK as a user meets it: a real uvicorn on loopback (the in-process pool) serving a store
of each kind, every wrapped endpoint called through `Client` and `AsyncClient`, which must give
the same answers and raise the same errors; and raw sockets standing in for servers and proxies
that misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import client
from client import AsyncClient, Client

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")
uvicorn = pytest.importorskip("uvicorn")

KINDS = ("momlp", "graph", "hyper", "pmoe")
NAMES = ["north", "south", "east"]  # a hyper store's named conditions
MAX_ROWS = 64
API_KEY = "clé-s3cret"  # the "keyed" server's: beyond ASCII, as the server allows


@dataclass(frozen=True)
class Served:
    kind: str
    url: str
    store: Path


def _store(kind: str, root: Path) -> Path:
    if kind == "corrupt":  # a momlp store whose every expert file fails its checksum
        _store("momlp", root)
        for path in (root / "experts").iterdir():
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        return root
    if kind == "momlp":
        from experts_store import ExpertArch, ExpertMLP, StoreWriter
        from router import PrototypeTree

        generator = torch.Generator().manual_seed(0)
        arch = ExpertArch(widths=(4, 16, 2))
        with StoreWriter(root) as writer:
            for expert_id in range(8):
                writer.add_expert(expert_id, ExpertMLP(arch, generator=generator))
            prototypes = torch.randn(8, 4, generator=generator)
            PrototypeTree.build(prototypes, branching=2, seed=0).save(writer.router_path)
            writer.publish(task="regression", input_dim=4, output_dim=2, routing="tree",
                           branching=2)
        return root
    if kind == "graph":
        from graph_support import tiny_graph_store

        tiny_graph_store(root)
        return root
    if kind == "hyper":
        from trainer.hyper import HyperNetwork, PrimarySpec, publish_hypernetwork

        torch.manual_seed(0)
        f = HyperNetwork(5, PrimarySpec(4, (8,), 2), depth=1, width=32)
        table = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
        publish_hypernetwork(root, f, conditions=table, condition_ids=NAMES)
        return root
    from experts_store import ImageLayout
    from trainer.pmoe import PatchMoE, publish_pmoe

    image = ImageLayout(height=6, width=4, channels=2, patch_height=3, patch_width=2)
    model = PatchMoE(
        num_patches=image.num_patches, patch_dim=image.patch_dim, num_experts=3,
        patches_per_expert=2, hidden=5, num_classes=3, gating="softmax",
        router_init_std=1.0, expert_init_std=0.5, seed=0,
    )
    publish_pmoe(model, root, train="joint", image=image)
    return root


@contextlib.contextmanager
def _serve(store: Path, **settings_fields: Any) -> Iterator[str]:
    from uvicorn_support import serving_in_thread

    from server import Settings, create_app
    from server.pool import FakeExpertPool

    # device named: a module fixture runs before the conftest's per-test MOMLP_DEVICE=cpu.
    settings = Settings(store=store, watch_store=False, actors=2, cache_bytes=1 << 20,
                        max_batch_wait_ms=0.0, device="cpu", max_rows=MAX_ROWS,
                        **settings_fields)
    app = create_app(settings, pool_factory=FakeExpertPool)
    with serving_in_thread(app, "momlp-sdk-live") as url:
        yield url


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Served]]:
    """One server per store kind, started on first use and kept for the module."""
    started: dict[str, Served] = {}
    with contextlib.ExitStack() as stack:

        def get(kind: str) -> Served:
            if kind not in started:
                fields = {"api_key": API_KEY} if kind == "keyed" else {}
                store = _store("momlp" if kind == "keyed" else kind,
                               tmp_path_factory.mktemp(kind) / "store")
                started[kind] = Served(kind, stack.enter_context(_serve(store, **fields)), store)
            return started[kind]

        yield get


def _rows(count: int, dim: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((count, dim))


def _script(kind: str, dim: int) -> list[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    """The calls a user makes of a store of `kind`: (label, method, args, kwargs)."""
    x = _rows(3, dim)
    extra: dict[str, Any] = {"conditions": {"condition_ids": "south"}} if kind == "hyper" else {}
    return [
        ("model", "model", (), {}),
        ("json", "predict", (x,), extra),
        ("npy", "predict", (x.astype(np.float32),), {**extra, "binary": True}),
        ("list", "predict", (x.tolist(),), extra),
        ("int", "predict", ((x * 10).astype(np.int32),), extra),
        ("route", "route", (x,), extra),
        ("top_k=2", "predict", (x,), {**extra, "top_k": 2}),
        ("gate", "predict", (x,), {**extra, "gate": {"temperature": 0.5}}),
        ("wrong dim", "predict", (np.zeros((2, dim + 1)),), extra),
        ("too many rows", "predict", (np.zeros((MAX_ROWS + 1, dim)),), extra),
        ("1-D", "predict", (x[0],), extra),
        ("NaN", "predict", (np.full((1, dim), np.nan),), extra),
        ("graph", "graph", (), {}),
        ("generate", "generate", (), {"condition_id": "north"}),
        ("health", "health", (), {}),
        ("ready", "ready", (), {}),
    ]


def _error(exc: client.MomlpError) -> tuple[Any, ...]:
    return ("error", type(exc).__name__, getattr(exc, "status_code", None),
            getattr(exc, "code", None), exc.message, getattr(exc, "detail", None))


def _plain(answer: Any) -> Any:
    return ("ok", answer.model_dump() if hasattr(answer, "model_dump") else answer)


def _run_sync(url: str, script: list[Any]) -> list[Any]:
    records = []
    with Client(url, max_retries=0) as momlp:
        for label, method, args, kwargs in script:
            try:
                records.append((label, _plain(getattr(momlp, method)(*args, **kwargs))))
            except client.MomlpError as exc:
                records.append((label, _error(exc)))
    return records


async def _run_async(url: str, script: list[Any]) -> list[Any]:
    records = []
    async with AsyncClient(url, max_retries=0) as momlp:
        for label, method, args, kwargs in script:
            try:
                records.append((label, _plain(await getattr(momlp, method)(*args, **kwargs))))
            except client.MomlpError as exc:
                records.append((label, _error(exc)))
    return records


@pytest.mark.parametrize("kind", KINDS)
def test_sync_and_async_give_the_same_answers_and_errors(
    served: Callable[[str], Served], kind: str
) -> None:
    url = served(kind).url
    with Client(url) as momlp:
        dim = momlp.model().input_dim
    script = _script(kind, dim)
    sync = _run_sync(url, script)
    assert sync == asyncio.run(_run_async(url, script))
    outcome = dict(sync)
    assert outcome["health"] == outcome["ready"] == ("ok", True)
    # JSON, .npy, lists and ints all reach the server as the same rows would.
    assert outcome["json"][0] == "ok", outcome["json"]
    np.testing.assert_allclose(outcome["npy"][1]["outputs"], outcome["json"][1]["outputs"],
                               rtol=1e-6)
    assert outcome["list"] == outcome["json"]
    assert outcome["route"][0] == "ok" and outcome["model"][1]["kind"] == kind
    # Refused by the client before sending, whatever the store.
    for label in ("1-D", "NaN"):
        assert outcome[label][:2] == ("error", "InputError"), outcome[label]
    assert outcome["wrong dim"][1:4] == ("InvalidInput", 422, "invalid_input")
    assert outcome["too many rows"][1:4] == ("PayloadTooLarge", 413, "payload_too_large")
    if kind != "momlp":  # one expert per row (per node): top_k is refused, naming it
        assert outcome["top_k=2"][1:4] == ("InvalidInput", 422, "invalid_input")
        assert outcome["top_k=2"][5] == {"field": "top_k"}
    assert (outcome["graph"][0] == "ok") == (kind == "graph")
    assert (outcome["generate"][0] == "ok") == (kind == "hyper")
    for label in ("graph", "generate"):
        if outcome[label][0] == "error":
            assert outcome[label][1:4] == ("NotFound", 404, "not_found")


def test_a_graph_prediction_names_each_nodes_expert(served: Callable[[str], Served]) -> None:
    with Client(served("graph").url, max_retries=0) as momlp:
        graph = momlp.graph()
        x = _rows(5, graph.input_dim, seed=1)
        prediction = momlp.predict(x, return_stats=True)
        model = momlp.model()
    names = [node.name for node in graph.nodes]
    assert prediction.nodes is not None and list(prediction.nodes) == names
    for row, experts in enumerate(prediction.experts):
        assert sorted(prediction.nodes[name][row] for name in names) == sorted(experts)
    for node in graph.nodes:  # each node's expert is one of that node's own
        assert set(prediction.nodes[node.name]) <= set(node.experts)
    stats = prediction.stats
    assert stats is not None and stats.graph is not None
    assert stats.graph.waves == len(graph.waves) == len(stats.graph.wave_vram_bytes)
    assert set(stats.graph.node_distance_evals) == set(names)
    wave_of = {node.name: node.wave for node in graph.nodes}
    assert all(stat.node is not None and stat.wave == wave_of[stat.node] for stat in stats.experts)
    assert sum(node.num_experts for node in graph.nodes) == model.num_experts


def test_a_hyper_store_routes_and_generates_through_the_sdk(
    served: Callable[[str], Served], tmp_path: Path
) -> None:
    from experts_store import load_expert

    hyper = served("hyper")
    x = _rows(4, 4, seed=2)
    with Client(hyper.url, max_retries=0) as momlp:
        # A name is every row's condition; its index in the table is each row's "expert".
        routing = momlp.route(x, conditions={"condition_ids": "east"})
        assert routing.experts == [[2]] * 4
        one_name = momlp.predict(x, conditions={"condition_ids": "south"}, return_stats=True)
        listed = momlp.predict(x, conditions={"condition_ids": ["south"] * 4})
        assert one_name.outputs == listed.outputs and one_name.experts == [[1]] * 4
        generated = momlp.generate(condition_id="south")
    assert one_name.stats is not None
    assert generated.key == one_name.stats.experts[0].key
    assert generated.store_version == one_name.store_version
    # The bytes are a store expert file: g(x; θ_south) is the prediction for "south".
    (tmp_path / "theta.safetensors").write_bytes(generated.data)
    module = load_expert(tmp_path / "theta.safetensors")
    with torch.no_grad():
        outputs = module(torch.as_tensor(x, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(outputs, np.asarray(one_name.outputs), rtol=1e-5, atol=1e-6)


def test_a_beam_given_as_one_width_is_that_width_at_every_level(
    served: Callable[[str], Served]
) -> None:
    with Client(served("momlp").url, max_retries=0) as momlp:
        x = _rows(4, 4, seed=3)
        as_list = momlp.predict(x, gate={"beam": [2]})
        assert momlp.predict(x, gate={"beam": 2}).outputs == as_list.outputs
        as_npy = momlp.predict(x, gate={"beam": 2}, binary=True)
        np.testing.assert_allclose(as_npy.outputs, as_list.outputs, rtol=1e-6)
        assert momlp.model().gate is not None


def test_the_store_gate_and_patch_layout_are_in_the_model(
    served: Callable[[str], Served]
) -> None:
    with Client(served("pmoe").url, max_retries=0) as momlp:
        model = momlp.model()
    assert model.gate is not None and model.gate["temperature"] == model.temperature
    assert model.pmoe is not None and model.pmoe["routing"] == "expert_choice"


def _predict(flavour: str, url: str, rows: Any, sleeps: list[float], **kwargs: Any) -> Any:
    """`predict(rows)` through a fresh client of `flavour`; back-off waits go to `sleeps`."""
    if flavour == "sync":
        with Client(url, sleep=sleeps.append, **kwargs) as momlp:
            return momlp.predict(rows)

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def call() -> Any:
        async with AsyncClient(url, sleep=sleep, **kwargs) as momlp:
            return await momlp.predict(rows)

    return asyncio.run(call())


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_an_expert_that_cannot_be_loaded_is_retried_only_within_max_backoff(
    served: Callable[[str], Served], flavour: str
) -> None:
    url = served("corrupt").url
    x = _rows(2, 4, seed=4)
    for max_backoff, waits in ((10.0, []), (60.0, [30.0, 30.0])):
        sleeps: list[float] = []
        with pytest.raises(client.ExpertUnavailable) as caught:
            _predict(flavour, url, x, sleeps, max_retries=2, max_backoff=max_backoff)
        error = caught.value
        assert (error.status_code, error.code, error.retry_after) == (503, "expert_unavailable",
                                                                      30.0)
        assert error.expert_id is not None and "checksum" in error.reason
        # The server will not read the file again for 30 s: a client that waits at most 10 s
        # gets the answer at once; one that waits 60 s waits the server's 30 s (not really).
        assert sleeps == waits


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_key_beyond_ascii_or_read_with_its_newline_is_accepted(
    served: Callable[[str], Served], flavour: str
) -> None:
    url = served("keyed").url
    x = _rows(2, 4, seed=5)
    # httpx refused the first with a bare UnicodeEncodeError when the client was made; the
    # second's newline made every call a ProtocolError.
    for key in (API_KEY, API_KEY + "\n"):
        assert _predict(flavour, url, x, [], api_key=key).outputs
    with pytest.raises(client.Unauthorized):
        _predict(flavour, url, x, [], api_key="cle-s3cret")
    with pytest.raises(ValueError, match="control character"):
        _predict(flavour, url, x, [], api_key="cl\x00e")


def test_one_sync_client_shared_by_threads_answers_each_its_own_rows(
    served: Callable[[str], Served]
) -> None:
    batches = [_rows(3, 4, seed=10 + i) for i in range(8)]
    with Client(served("momlp").url, max_retries=0) as momlp:
        alone = [momlp.predict(batch).outputs for batch in batches]
        with ThreadPoolExecutor(max_workers=8) as pool:
            shared = list(pool.map(lambda batch: momlp.predict(batch).outputs, batches * 4))
    assert shared == alone * 4


# --- servers and proxies that misbehave, on raw sockets -------------------------------------


@contextlib.contextmanager
def _raw_server(answer: Callable[[socket.socket], None]) -> Iterator[tuple[str, list[int]]]:
    """A listening socket whose every connection reads one request and runs `answer`; the
    base URL and a one-item list counting the requests received."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = [0]
    connections: list[socket.socket] = []
    done = threading.Event()

    def handle(connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            connection.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = connection.recv(65536)
                if not chunk:
                    return
                data += chunk
            received[0] += 1
            answer(connection)

    def accept() -> None:
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connections.append(connection)
            threading.Thread(target=handle, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", received
    finally:
        done.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        listener.close()
        for connection in connections:
            connection.close()
        thread.join(timeout=10)


def _never_answers(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.recv(1)  # until the client gives up and closes


def _closes_mid_answer(connection: socket.socket) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 400\r\nConnection: close\r\n\r\n{\"outputs\": [[1.0")
    connection.shutdown(socket.SHUT_RDWR)


def _proxy_502(connection: socket.socket) -> None:
    body = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
    connection.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nContent-Length: "
                       + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    connection.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize(
    ("answer", "error", "text"),
    [
        (_never_answers, client.TimeoutError, "ReadTimeout"),
        (_closes_mid_answer, client.NetworkError, "without sending complete message body"),
        (_proxy_502, client.ServerError, "502 Bad Gateway"),
    ],
    ids=["never-answers", "closes-mid-answer", "proxy-502"],
)
def test_a_misbehaving_server_is_one_attempt_and_one_error(
    flavour: str, answer: Callable[[socket.socket], None], error: type[Exception], text: str
) -> None:
    # A predict that may have been computed is never sent again: retries would double the work.
    with _raw_server(answer) as (url, received):
        with pytest.raises(error) as caught:
            _predict(flavour, url, [[0.0, 1.0]], [], timeout=0.5, max_retries=3)
    assert type(caught.value) is error and text in str(caught.value)
    assert received == [1]
