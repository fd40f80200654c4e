"""`momlp loadtest --gate / --eval`: the gate reaches every request body; the accuracy in
report.json equals an independent computation on the answers the server gave."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from client import AsyncClient, LoadTestConfig, _loadtest, arun_loadtest
from client._cli import register

pytestmark = pytest.mark.unit


class Recorder:
    """Wraps a handler: keeps each /v1/predict body and answer; can rewrite answers."""

    def __init__(self, inner, *, model_patch=None, outputs=None):
        self.inner = inner
        self.model_patch = model_patch or {}
        self.outputs = outputs
        self.bodies: list[dict] = []
        self.answers: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        response = self.inner(request)
        if request.url.path == "/v1/model":
            return httpx.Response(200, json={**json.loads(response.content), **self.model_patch})
        if request.url.path != "/v1/predict" or response.status_code != 200:
            return response
        body = json.loads(request.content)
        answer = json.loads(response.content)
        if self.outputs is not None:
            answer["outputs"] = [self.outputs(row) for row in body["inputs"]]
        self.bodies.append(body)
        self.answers.append(answer)
        return httpx.Response(200, json=answer)


def factory(handler):
    return lambda config: AsyncClient(transport=httpx.MockTransport(handler), max_retries=0)


def eval_file(tmp_path, rows=10, seed=0, classes=None):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 3, size=(rows, 2))
    y = rng.integers(0, classes, size=rows) if classes else rng.normal(size=(rows, 1))
    path = tmp_path / "eval.npz"
    np.savez(path, x=x, y=y)
    return path, x, y


def target_of(x, y, row):
    # Rows are sent as floats of the file's values: find each by exact match.
    (index,) = np.flatnonzero((x == np.asarray(row)).all(axis=1))
    return y[index]


async def test_gate_reaches_every_request_body(make_server, fake_clock):
    recorder = Recorder(make_server().handler)
    # The fake ignores the gate; top_k 2 makes experts per row differ from 1.
    gate = {"temperature": 0.05, "min_weight": 0.02, "beam": [2, 2]}
    config = LoadTestConfig(requests=9, concurrency=3, batch=2, top_k=2, gate=gate)
    report = await arun_loadtest(config, client_factory=factory(recorder), clock=fake_clock,
                                 sleep=fake_clock.sleep)
    assert len(recorder.bodies) == 9
    assert all(body["gate"] == gate for body in recorder.bodies)
    kept = [len(experts) for answer in recorder.answers for experts in answer["experts"]]
    assert report.experts_per_row == pytest.approx(np.mean(kept))


async def test_no_gate_sends_no_gate(make_server, fake_clock):
    recorder = Recorder(make_server().handler)
    await arun_loadtest(LoadTestConfig(requests=3), client_factory=factory(recorder),
                        clock=fake_clock, sleep=fake_clock.sleep)
    assert recorder.bodies and all("gate" not in body for body in recorder.bodies)


def test_unknown_gate_field_is_refused_before_the_run():
    with pytest.raises(ValueError, match="unknown gate fields"):
        LoadTestConfig(gate={"tau": 1.0})


async def test_eval_mse_equals_the_answers_mse(make_server, fake_clock, tmp_path):
    path, x, y = eval_file(tmp_path, rows=10)
    recorder = Recorder(make_server().handler)
    # Passes of 3 + 3 + 3 + 1 rows: 7 requests send 19 rows, the file once and 9 rows again.
    config = LoadTestConfig(requests=7, concurrency=2, batch=3, eval_data=path,
                            report_dir=tmp_path / "report", plots=False)
    report = await arun_loadtest(config, client_factory=factory(recorder), clock=fake_clock,
                                 sleep=fake_clock.sleep)
    errors = [
        (output[0] - float(target_of(x, y, row)[0])) ** 2
        for body, answer in zip(recorder.bodies, recorder.answers, strict=True)
        for row, output in zip(body["inputs"], answer["outputs"], strict=True)
    ]
    assert len(errors) == 19
    assert report.accuracy is not None and report.accuracy["metric"] == "mse"
    assert report.accuracy["value"] == pytest.approx(np.mean(errors), rel=1e-12)
    assert report.accuracy["rows"] == 19
    sent = [tuple(row) for body in recorder.bodies for row in body["inputs"]]
    assert set(sent) == {tuple(row) for row in x}, "every file row was sent"
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["accuracy"]["value"] == pytest.approx(np.mean(errors), rel=1e-12)
    page = (tmp_path / "report" / "report.html").read_text()
    assert 'data-key="accuracy/value"' in page and "test MSE (--eval)" in page
    assert f"{np.mean(errors):.6g}" in page


async def test_eval_accuracy_for_a_classifier(make_server, fake_clock, tmp_path):
    path, x, y = eval_file(tmp_path, rows=12, classes=3)

    def logits(row):
        # A deterministic classifier that is right on some rows and wrong on others.
        return [row[0], row[1], 1.5]

    recorder = Recorder(
        make_server().handler,
        model_patch={"task": "classification", "output_dim": 3},
        outputs=logits,
    )
    config = LoadTestConfig(requests=4, concurrency=1, batch=3, eval_data=path)
    report = await arun_loadtest(config, client_factory=factory(recorder), clock=fake_clock,
                                 sleep=fake_clock.sleep)
    correct = [
        int(np.argmax(output)) == int(target_of(x, y, row))
        for body, answer in zip(recorder.bodies, recorder.answers, strict=True)
        for row, output in zip(body["inputs"], answer["outputs"], strict=True)
    ]
    assert len(correct) == 12 and 0 < sum(correct) < 12
    assert report.accuracy is not None and report.accuracy["metric"] == "accuracy"
    assert report.accuracy["value"] == pytest.approx(sum(correct) / 12)


async def test_eval_file_of_the_wrong_width_is_refused(make_server, fake_clock, tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, x=np.zeros((4, 3)), y=np.zeros(4))
    config = LoadTestConfig(requests=2, eval_data=path)
    with pytest.raises(ValueError, match=r"input_dim"):
        await arun_loadtest(config, client_factory=factory(make_server().handler),
                            clock=fake_clock, sleep=fake_clock.sleep)


def parser():
    import argparse

    root = argparse.ArgumentParser()
    register(root.add_subparsers())
    return root


def test_cli_gate_and_eval_reach_the_report(make_server, tmp_path, monkeypatch, capsys):
    path, x, y = eval_file(tmp_path, rows=6)
    recorder = Recorder(make_server(clock=None).handler)
    monkeypatch.setattr(_loadtest, "default_client_factory", factory(recorder))
    gate = {"temperature": 0.5, "top_p": 0.9}
    args = parser().parse_args([
        "loadtest", "--requests", "4", "--batch", "3", "--gate", json.dumps(gate),
        "--eval", str(path), "--report", str(tmp_path / "r"), "--no-plots", "--quiet",
    ])
    assert args.handler(args) == 0
    assert all(body["gate"] == gate for body in recorder.bodies)
    out = capsys.readouterr().out
    assert "mse " in out and "answered rows" in out
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["config"]["gate"] == gate and data["accuracy"]["rows"] == 12


def test_cli_gate_that_is_not_an_object_exits_2(capsys):
    args = parser().parse_args(["loadtest", "--gate", "[1, 2]"])
    assert args.handler(args) == 2
    assert "--gate must be a JSON object" in capsys.readouterr().err


def test_cli_several_gates_are_compared(make_server, tmp_path, monkeypatch, capsys):
    path, x, y = eval_file(tmp_path, rows=6)
    recorder = Recorder(make_server(clock=None).handler)
    monkeypatch.setattr(_loadtest, "default_client_factory", factory(recorder))
    gates = [{"temperature": 0.5}, {"top_p": 0.9, "beam": [2]}]
    args = parser().parse_args([
        "loadtest", "--requests", "2", "--batch", "3", "--gate", json.dumps(gates[0]),
        "--gate", json.dumps(gates[1]), "--eval", str(path), "--report", str(tmp_path / "r"),
        "--quiet",
    ])
    assert args.handler(args) == 0
    assert [body["gate"] for body in recorder.bodies] == [gates[0]] * 2 + [gates[1]] * 2
    rows = json.loads((tmp_path / "r" / "gates.json").read_text())
    assert [row["gate"] for row in rows] == gates
    for number, row in enumerate(rows, start=1):
        run = json.loads((tmp_path / "r" / f"gate-{number}" / "report.json").read_text())
        assert run["config"]["gate"] == gates[number - 1]
        assert row["value"] == run["accuracy"]["value"]
        assert row["vram_bytes_p50"] == run["vram_bytes"]["p50"]
    assert (tmp_path / "r" / "gates.png").stat().st_size > 0
    assert "gates compared" in capsys.readouterr().out


def test_cli_eval_sends_each_row_once_and_reads_a_build_file(
    make_server, tmp_path, monkeypatch, capsys
):
    # An .npz as `momlp build --data` reads it: arrays X and y. 7 rows in requests of 3.
    rng = np.random.default_rng(4)
    x, y = rng.uniform(0, 3, size=(7, 2)), rng.normal(size=(7, 1))
    path = tmp_path / "rows.npz"
    np.savez(path, X=x, y=y)
    recorder = Recorder(make_server(clock=None).handler)
    monkeypatch.setattr(_loadtest, "default_client_factory", factory(recorder))
    args = parser().parse_args([
        "loadtest", "--batch", "3", "--concurrency", "1", "--eval", str(path),
        "--report", str(tmp_path / "r"), "--no-plots", "--quiet",
    ])
    assert args.handler(args) == 0
    sent = [row for body in recorder.bodies for row in body["inputs"]]
    # Three requests of 3, 3 and 1 rows: every row once.
    assert [len(body["inputs"]) for body in recorder.bodies] == [3, 3, 1]
    assert sorted(map(tuple, sent)) == sorted(map(tuple, x.tolist()))
    data = json.loads((tmp_path / "r" / "report.json").read_text())
    assert data["config"]["requests"] == 3 and data["accuracy"]["rows"] == 7


def test_cli_gates_compared_without_eval_print_no_metric(
    make_server, tmp_path, monkeypatch, capsys
):
    recorder = Recorder(make_server(clock=None).handler)
    monkeypatch.setattr(_loadtest, "default_client_factory", factory(recorder))
    args = parser().parse_args([
        "loadtest", "--requests", "2", "--gate", '{"temperature": 0.5}',
        "--gate", '{"top_p": 0.9}', "--no-plots", "--quiet",
    ])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "gates compared (experts per row, vram/request p50 bytes):" in out
    assert "None" not in out


@pytest.mark.parametrize(
    ("metric", "largest", "xlabel", "title", "scale"),
    [
        ("mse", 37_636.0, "device memory per request p50 (KiB)",
         "Test MSE against device memory per request, one marker per gate", 2**10),
        ("accuracy", 3 * 2**20, "device memory per request p50 (MiB)",
         "Test accuracy against device memory per request, one marker per gate", 2**20),
    ],
)
def test_the_gate_comparison_plot_names_its_metric_and_a_readable_unit(
    metric, largest, xlabel, title, scale
):
    from client._compare import comparison_axes

    labels, got_scale = comparison_axes(metric, largest)
    assert labels["xlabel"] == xlabel
    assert labels["ylabel"] == ("test MSE" if metric == "mse" else "test accuracy")
    assert labels["title"] == title
    assert got_scale == scale


def test_an_eval_file_that_is_not_an_eval_set_is_one_clean_error(tmp_path):
    import io
    import os
    import zipfile
    from pathlib import Path

    from client._eval import load_eval_set
    from client._exceptions import InputError

    x = np.random.default_rng(0).uniform(-1, 1, (20, 2))
    np.save(tmp_path / "plain.npy", x)
    (tmp_path / "empty.npz").write_bytes(b"")
    np.savez(tmp_path / "strings.npz", x=x, y=np.array(["a", "b"] * 10))
    np.savez(tmp_path / "nan.npz", x=x, y=np.where(np.arange(20) == 3, np.nan, 1.0))
    np.savez(tmp_path / "complex.npz", x=x + 1j, y=np.zeros(20))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)}
    )
    with zipfile.ZipFile(tmp_path / "lying.npz", "w") as archive:
        archive.writestr("x.npy", header.getvalue())
        archive.writestr("y.npy", b"")
    os.mkfifo(tmp_path / "fifo.npz")  # its read blocked the load test for good
    cases = {
        "plain.npy": ("regression", "one array (np.save), not an .npz archive"),
        "empty.npz": ("regression", "cannot read an .npz"),
        "strings.npz": ("classification", "y must hold real numbers (<U1)"),
        "nan.npz": ("classification", "y must be finite labels"),
        "complex.npz": ("regression", "x must hold real numbers (complex128)"),
        "lying.npz": ("regression", "Unable to allocate 3.64 TiB"),
        "fifo.npz": ("regression", "not a regular file"),
    }
    for name, (task, words) in cases.items():
        with pytest.raises(InputError) as info:
            load_eval_set(Path(tmp_path / name), task=task, input_dim=2, output_dim=1)
        assert words in str(info.value), (name, str(info.value))
