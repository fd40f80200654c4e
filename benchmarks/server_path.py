"""momlp's server path alone: CPU per request with no sockets and no actor work.

`vs_ray_serve.py` and `serve_ab.py` measure whole systems; between two trials of the same
code their rows/s move ±15-20 % on the 2-core VM, so a cut of a few per cent of the server's
own Python cannot be seen there. This script measures that Python alone: it drives the app
`momlp serve` runs (`create_app`) in process through ASGI calls, with `--concurrency`
closed-loop clients sending `vs_ray_serve.py`'s bodies (pre-encoded), and a pool whose actors
answer at once. Every layer of the server runs as in `momlp serve` (middlewares, parsing,
validation, batching with the open-connection rule, routing, the plan, the channel's frame
encoding, the reply's decoding, the combine, stats and the JSON answer); what is left out is
uvicorn's socket work and the actors' own work.

An instant actor answers each group with zeros, framed by the actor's `encode_reply` and
decoded by the server's `decode_reply`. Its own CPU (building and framing the reply) is
timed and subtracted. The driver's own cost (an ASGI scope and two closures per request) is
measured against a bare ASGI app and reported, not subtracted.

Each trial runs in a fresh interpreter. `--code BASE,NEW` compares two commits (each trial's
interpreter imports the commit's worktree first), alternating the order every other trial:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/server_path.py --code HEAD~1,HEAD --trials 6

Prints one JSON line per trial, then one with each side's median and NEW / BASE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from serve_ab import code_trees
from vs_ray_serve import ISSUE_WORKLOAD, MACHINE, add_workload_args, prepare

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

Message = MutableMapping[str, Any]
Asgi = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, store="momlp-vs-issue", **ISSUE_WORKLOAD)
    parser.set_defaults(requests=6000, warmup=600)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--code", help="two comma-separated git commits to compare")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="this checkout", help=argparse.SUPPRESS)
    parser.add_argument("--trial", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(asyncio.run(_one_trial(args))), flush=True)
        return 0
    sides = [None] if args.code is None else args.code.split(",")
    if args.code is not None and (len(sides) != 2 or sides[0] == sides[1]):
        parser.error("--code takes two different commits, BASE,NEW")
    prepare(args)  # builds the store once, outside the timed trials
    results: dict[str, list[float]] = {}
    with code_trees([s for s in sides if s is not None]) as trees:
        for trial in range(args.trials):
            for side in sides if trial % 2 == 0 else sides[::-1]:
                label = side or "this checkout"
                line = _spawn(args, trial, label, trees.get(side) if side else None)
                print(json.dumps(line), flush=True)
                results.setdefault(label, []).append(line["server_cpu_us_per_request"])
    medians = {label: statistics.median(values) for label, values in results.items()}
    summary: dict[str, Any] = {
        "benchmark": "server_path", "stat": "median server CPU µs per request",
        "medians": medians, "trials": args.trials,
    }  # fmt: skip
    if len(sides) == 2:
        base, new = (str(s) for s in sides)
        summary["new_over_base"] = medians[new] / medians[base]
    print(json.dumps(summary), flush=True)
    return 0


def _spawn(args: argparse.Namespace, trial: int, label: str, code: Path | None) -> dict[str, Any]:
    """One trial in a fresh interpreter that imports `code`'s momlp (default: this one's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(code or REPO), *filter(None, [env.get("PYTHONPATH")])])
    command = [
        sys.executable, str(Path(__file__).resolve()), "--one", "--label", label,
        "--trial", str(trial), "--store", str(args.store), "--experts", str(args.experts),
        "--widths", args.widths, "--actors", str(args.actors),
        "--experts-per-actor", str(args.experts_per_actor),
        "--rows-per-request", str(args.rows_per_request), "--requests", str(args.requests),
        "--warmup", str(args.warmup), "--concurrency", str(args.concurrency),
        "--seed", str(args.seed),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=code or REPO)
    if done.returncode != 0:
        raise SystemExit(f"trial {trial} of {label} failed:\n{done.stderr[-4000:]}")
    line: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return line


async def _one_trial(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: a trial's interpreter must import the momlp on its PYTHONPATH.
    import server
    from server import Settings
    from server.http import create_app

    store, widths, _expert_bytes, work = prepare(args)
    bodies = [json.dumps({"inputs": rows, "return_stats": True}).encode() for _, rows in work]
    pool_cls = _instant_pool_class(widths[-1])
    settings = Settings(store=store.root, actors=args.actors, cache_bytes=args.budget)
    app = create_app(settings, pool_factory=pool_cls)
    clients = args.concurrency
    # uvicorn's count with every client's keep-alive connection open (`run_server` attaches
    # it): windows close once every client has a request in, as under `momlp serve`.
    app.state.connections.attach(lambda: clients)
    floor_us = await _cpu_per_request(_bare_app, bodies[: args.warmup], clients)
    async with app.router.lifespan_context(app):
        _check_answer(store, work[0][1], await _post(app, bodies[0], 0, keep=True))
        await _cpu_per_request(app, bodies[: args.warmup], clients)
        batcher = app.state.serving.version.batcher
        batches_before = batcher.batches
        pool_cls.stub_cpu_s = 0.0
        wall = time.perf_counter()
        cpu_us = await _cpu_per_request(app, bodies[args.warmup :], clients)
        wall = time.perf_counter() - wall
        batches = batcher.batches - batches_before
    measured = len(bodies) - args.warmup
    stub_us = pool_cls.stub_cpu_s / measured * 1e6
    return {
        "benchmark": "server_path", "code": args.label, "trial": args.trial,
        "momlp": str(Path(server.__file__).resolve().parent.parent),
        "server_cpu_us_per_request": cpu_us - stub_us,
        "stub_actor_cpu_us_per_request": stub_us,
        "driver_floor_cpu_us_per_request": floor_us,
        "wall_us_per_request": wall / measured * 1e6,
        "requests": measured, "batches": batches, "requests_per_batch": measured / batches,
        "concurrency": clients, "rows_per_request": args.rows_per_request,
        "store": str(store.root), "machine": MACHINE,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }  # fmt: skip


def _check_answer(store: Any, rows: list[list[float]], answer: tuple[int, bytes]) -> None:
    """The instant actors' zeros, and each row's expert as the store's own router picks it
    (tree mode, top 1: `momlp serve`'s defaults): the path measured is the path that serves."""
    import numpy as np

    from router import PrototypeTree

    status, body = answer
    if status != 200:
        raise SystemExit(f"POST /v1/predict answered {status}: {body[:500]!r}")
    got = json.loads(body)
    routed = (
        PrototypeTree.load(store.router_path)
        .route(np.asarray(rows, dtype=np.float32), mode="tree")
        .experts[:, 0]
        .tolist()
    )
    if np.any(np.asarray(got["outputs"])) or [e[0] for e in got["experts"]] != routed:
        raise SystemExit(f"unexpected answer: {got} (router: {routed})")


def _instant_pool_class(out_dim: int) -> Any:
    """A `FakeExpertPool` whose actors answer every group at once with zeros, through the
    channel's frame encoding and decoding; `stub_cpu_s` sums what the actor side cost."""
    import numpy as np

    from server.pool import ActorReply, GroupOutcome
    from server.pool._fake import FakeExpertPool
    from server.pool._wire import PREFIX, RunEncoder, decode_reply, encode_reply

    class InstantPool(FakeExpertPool):
        stub_cpu_s = 0.0

        def __init__(self, settings: Any) -> None:
            super().__init__(settings)
            self._encoders: dict[str, RunEncoder] = {}
            self._call = 0

        async def _call_run(self, actor: str, payload: Any) -> Any:
            self._call += 1
            # The server's side of `Channel.run`: the frame it would write.
            self._encoders.setdefault(actor, RunEncoder()).encode(self._call, payload)
            started = time.thread_time()
            outcomes = [
                GroupOutcome(
                    expert_id=ref.expert_id,
                    outputs=np.zeros((rows.shape[0], out_dim), np.float32),
                    hit=True,
                    expert_bytes=ref.nbytes,
                )
                for ref, rows in payload
            ]
            frame = encode_reply(
                self._call,
                ActorReply(actor=actor, results=outcomes, device_bytes=0, resident={}),
            )
            InstantPool.stub_cpu_s += time.thread_time() - started
            # The server's side of `Channel._receive`.
            header_len, body_len = PREFIX.unpack(frame[: PREFIX.size])[1:]
            header = frame[PREFIX.size : PREFIX.size + header_len]
            body = frame[PREFIX.size + header_len : PREFIX.size + header_len + body_len]
            _, reply = decode_reply(header, body)
            if isinstance(reply, str):
                raise RuntimeError(reply)
            return reply

    return InstantPool


async def _bare_app(scope: Message, receive: Any, send: Any) -> None:
    """The driver's floor: read the body, answer a fixed one."""
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def _cpu_per_request(app: Asgi, bodies: list[bytes], clients: int) -> float:
    """Process CPU µs per request for `bodies`, sent by `clients` closed-loop clients."""
    queue = iter(bodies)

    async def client(index: int) -> None:
        for body in queue:
            status, _ = await _post(app, body, index)
            if status != 200:
                raise SystemExit(f"POST /v1/predict answered {status}")

    started = time.process_time()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return (time.process_time() - started) / len(bodies) * 1e6


async def _post(app: Asgi, body: bytes, index: int, *, keep: bool = False) -> tuple[int, bytes]:
    """One POST /v1/predict: its status, and its body when `keep`."""
    sent = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif keep:
            chunks.append(message.get("body", b""))

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/predict",
        "raw_path": b"/v1/predict", "query_string": b"", "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000 + index), "server": ("127.0.0.1", 8000), "state": {},
    }  # fmt: skip
    await app(scope, receive, send)
    return status, b"".join(chunks)


if __name__ == "__main__":
    raise SystemExit(main())
