"""Bad input and abuse against a real server on loopback: every bad request gets its 4xx, the
server's memory stays bounded, and well-behaved clients keep being served meanwhile."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from reliability_support import (
    N,
    Reference,
    fake_app,
    publish_store,
    raw_request,
    read_response,
    rss_bytes,
    serve_in_thread,
)

pytestmark = pytest.mark.integration

MAX_BODY = 4 * 1024 * 1024
MAX_ROWS = 8192
# Growth of this process's RSS (the server runs in it) allowed over the whole abuse run.
RSS_SLACK = 256 * 1024 * 1024


class Bystander:
    """A well-behaved client predicting in a loop; every answer must be a correct 200."""

    def __init__(self, url: str, reference: Reference) -> None:
        self.url = url
        self.reference = reference
        self.answers = 0
        self.failures: list[str] = []
        self.peak_rss = rss_bytes()
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        rng = np.random.default_rng(0)
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while not self._stop.is_set():
                x = rng.normal(size=(3, N)).astype(np.float32)
                started = time.perf_counter()
                try:
                    answer = http.post("/v1/predict", json={"inputs": x.tolist(), "mode": "exact"})
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                    continue
                self.latencies.append(time.perf_counter() - started)
                self.peak_rss = max(self.peak_rss, rss_bytes())
                if answer.status_code != 200:
                    self.failures.append(answer.text)
                    continue
                body = answer.json()
                experts = np.asarray(body["experts"])[:, 0]
                expected = self.reference.outputs(experts, x)
                if not np.allclose(body["outputs"], expected, rtol=1e-5, atol=1e-6):
                    self.failures.append("wrong outputs")
                self.answers += 1
                time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Reference]]:
    store = tmp_path_factory.mktemp("abuse") / "store"
    publish_store(store)
    app = fake_app(store, max_body_bytes=MAX_BODY, max_rows=MAX_ROWS)
    with serve_in_thread(app) as url:
        yield url, Reference(store)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _npy_header_only(descr: str, shape: tuple[int, ...], payload: bytes) -> bytes:
    """An .npy body with any header (e.g. an object dtype) without pickling anything."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    return buffer.getvalue() + payload


def _bad_requests() -> list[tuple[str, dict[str, str], bytes, int]]:
    """(name, headers, body, expected status) of the bad requests sent over httpx."""
    js = {"Content-Type": "application/json"}
    npy = {"Content-Type": "application/x-npy"}
    raw = {"Content-Type": "application/octet-stream"}
    row = ",".join(["0.5"] * N)
    million = b'{"inputs": [' + b",".join([b"[0,0,0,0]"] * 1_000_000) + b"]}"
    over_rows = json.dumps({"inputs": [[0.5] * N] * (MAX_ROWS + 1)}).encode()
    return [
        ("malformed json", js, b'{"inputs": [[0.5, 0.5', 422),
        ("not json at all", js, b"\x00\xff garbage", 422),
        ("json scalar", js, b"42", 422),
        ("deeply nested json", js, b'{"inputs": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", 422),
        ("nested rows", js, b'{"inputs": [[[[[0.5]]]]]}', 422),
        ("10^6 rows json", js, million, 413),
        ("too many rows json", js, over_rows, 413),
        ("NaN", js, f'{{"inputs": [[NaN,{row[4:]}]]}}'.encode(), 422),
        ("Infinity", js, f'{{"inputs": [[Infinity,{row[4:]}]]}}'.encode(), 422),
        ("-Infinity", js, f'{{"inputs": [[-Infinity,{row[4:]}]]}}'.encode(), 422),
        ("1e400", js, f'{{"inputs": [[1e400,{row[4:]}]]}}'.encode(), 422),
        ("float32 overflow", js, f'{{"inputs": [[1e39,{row[4:]}]]}}'.encode(), 422),
        ("strings", js, b'{"inputs": [["0.5","0.5","0.5","0.5"]]}', 422),
        ("booleans", js, b'{"inputs": [[true,false,true,false]]}', 422),
        ("ragged", js, f'{{"inputs": [[{row}],[0.5]]}}'.encode(), 422),
        ("wrong dimension", js, b'{"inputs": [[0.5, 0.5]]}', 422),
        ("empty", js, b'{"inputs": []}', 422),
        ("unknown field", js, f'{{"inputs": [[{row}]], "inptus": 1}}'.encode(), 422),
        ("top_k 0", js, f'{{"inputs": [[{row}]], "top_k": 0}}'.encode(), 422),
        ("top_k huge", js, f'{{"inputs": [[{row}]], "top_k": {10**30}}}'.encode(), 422),
        ("npy NaN", npy, _npy(np.full((2, N), np.nan, dtype=np.float32)), 422),
        ("npy Inf", npy, _npy(np.full((2, N), np.inf, dtype=np.float64)), 422),
        ("npy int64", npy, _npy(np.ones((2, N), dtype=np.int64)), 422),
        ("npy float16", npy, _npy(np.ones((2, N), dtype=np.float16)), 422),
        ("npy complex", npy, _npy(np.ones((2, N), dtype=np.complex64)), 422),
        ("npy bool", npy, _npy(np.ones((2, N), dtype=bool)), 422),
        ("npy object (pickle)", npy, _npy_header_only("|O", (1, N), b"\x80\x04cos\nsystem\n"), 422),
        ("npy 3-D", npy, _npy(np.ones((2, N, 1), dtype=np.float32)), 422),
        ("npy 1-D", npy, _npy(np.ones(N, dtype=np.float32)), 422),
        ("npy truncated", npy, _npy(np.ones((4, N), dtype=np.float32))[:-5], 422),
        ("npy lies about rows", npy, _npy_header_only("<f4", (10**9, N), b""), 413),
        ("npy bad magic", npy, b"NOTNUMPY" + bytes(64), 422),
        ("raw NaN", {**raw, "X-Momlp-Rows": "1"}, np.full(N, np.nan, "<f4").tobytes(), 422),
        ("raw short", {**raw, "X-Momlp-Rows": "2"}, np.ones(N, "<f4").tobytes(), 422),
        ("raw no rows header", raw, np.ones(N, "<f4").tobytes(), 422),
        ("raw rows not int", {**raw, "X-Momlp-Rows": "1.5"}, np.ones(N, "<f4").tobytes(), 422),
        ("raw rows negative", {**raw, "X-Momlp-Rows": "-1"}, np.ones(N, "<f4").tobytes(), 422),
        ("raw 10^6 rows", {**raw, "X-Momlp-Rows": "1000000"}, np.ones(N, "<f4").tobytes(), 413),
        ("text/plain", {"Content-Type": "text/plain"}, b"0.5 0.5 0.5 0.5", 415),
        ("xml", {"Content-Type": "application/xml"}, b"<inputs/>", 415),
        ("huge json body", js, b" " * (MAX_BODY + 1), 413),
    ]


def test_bad_requests_get_their_4xx_while_others_are_served(
    server: tuple[str, Reference],
) -> None:
    url, reference = server
    start_rss = rss_bytes()
    cases = _bad_requests()
    wrong: list[tuple[str, int, str]] = []
    worst = 0.0
    with Bystander(url, reference) as bystander, httpx.Client(base_url=url, timeout=30.0) as http:
        for _ in range(2):
            for name, headers, body, expected in cases:
                started = time.perf_counter()
                answer = http.post("/v1/predict", content=body, headers=headers)
                worst = max(worst, time.perf_counter() - started)
                if answer.status_code != expected or "Traceback" in answer.text:
                    wrong.append((name, answer.status_code, answer.text[:200]))
                else:
                    error = answer.json()["error"]
                    assert set(error) == {"code", "message", "detail"}
                bystander.peak_rss = max(bystander.peak_rss, rss_bytes())
        time.sleep(0.2)  # lets the bystander get answers after the last abuse, too
    print(
        json.dumps(
            {
                "scenario": "bad input",
                "bad_requests": 2 * len(cases),
                "wrong_status": len(wrong),
                "worst_bad_request_s": round(worst, 3),
                "bystander_requests": bystander.answers,
                "bystander_errors": len(bystander.failures),
                "bystander_p99_ms": round(1000 * float(np.quantile(bystander.latencies, 0.99)), 1),
                "rss_growth_bytes": bystander.peak_rss - start_rss,
            }
        )
    )
    assert wrong == []
    assert bystander.failures == []
    assert bystander.answers > 0
    assert bystander.peak_rss - start_rss < RSS_SLACK


def _send_all(sock: socket.socket, data: bytes) -> int:
    """Send what the server takes; it may close early on a refused body. Bytes sent."""
    sent = 0
    try:
        for offset in range(0, len(data), 65536):
            sock.sendall(data[offset : offset + 65536])
            sent += len(data[offset : offset + 65536])
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def test_a_declared_length_over_the_limit_is_refused_unread(
    server: tuple[str, Reference],
) -> None:
    url, _ = server
    head = (
        "POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10**12}\r\n\r\n"
    ).encode()
    # No body is sent at all: the answer must not wait for one.
    status, body = raw_request(url, head + b'{"inputs": ', timeout_s=10.0)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "payload_too_large"


def test_a_chunked_body_without_length_is_cut_at_the_limit(
    server: tuple[str, Reference],
) -> None:
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    start_rss = rss_bytes()
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(
            b"POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b" " * 65536
        framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        # Up to 4x the limit; the server answers once the limit is crossed.
        sent = _send_all(sock, framed * (4 * MAX_BODY // len(chunk)))
        status, body = read_response(sock)
    assert status == 413, body
    assert sent > MAX_BODY
    assert rss_bytes() - start_rss < RSS_SLACK


def test_a_slow_client_does_not_hold_up_others(server: tuple[str, Reference]) -> None:
    url, reference = server
    host, port = url.removeprefix("http://").split(":")
    body = b'{"inputs": [[0.5, 0.5, 0.5, 0.5]], "mode": "nope"}'
    with Bystander(url, reference) as bystander:
        with socket.create_connection((host, int(port)), timeout=30.0) as sock:
            sock.sendall(
                b"POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
            )
            before = bystander.answers
            # One byte every 20 ms (about a second in all): bounded, but far slower than a client.
            for byte in body:
                sock.sendall(bytes([byte]))
                time.sleep(0.02)
            served_meanwhile = bystander.answers - before
            status, answer = read_response(sock)
    assert status == 422, answer
    assert json.loads(answer)["error"]["code"] == "invalid_input"
    assert served_meanwhile > 0
    assert bystander.failures == []


def test_many_idle_connections_do_not_stop_service(server: tuple[str, Reference]) -> None:
    url, reference = server
    host, port = url.removeprefix("http://").split(":")
    sockets: list[socket.socket] = []
    try:
        for _ in range(50):
            sock = socket.create_connection((host, int(port)), timeout=10.0)
            sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
            sockets.append(sock)
        with httpx.Client(base_url=url, timeout=30.0) as http:
            x = np.random.default_rng(1).normal(size=(2, N)).astype(np.float32)
            answer = http.post("/v1/predict", json={"inputs": x.tolist(), "mode": "exact"})
        assert answer.status_code == 200
        experts = np.asarray(answer.json()["experts"])[:, 0]
        np.testing.assert_allclose(
            answer.json()["outputs"], reference.outputs(experts, x), rtol=1e-5, atol=1e-6
        )
    finally:
        for sock in sockets:
            sock.close()
