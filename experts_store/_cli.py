"""`momlp store info|verify|calibrate|materialize DIR`. Only the standard library is imported
at module level. `calibrate` fits τ with the trainer, whose handler the CLI root passes in:
experts_store imports neither the trainer nor the router nor the server."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["register"]


def register(
    subparsers: Any,
    *,
    serve_check: Callable[[Any], str | None] | None = None,
    calibrate: Callable[[argparse.Namespace], int] | None = None,
) -> None:
    """Add the ``store`` command group to the root ``momlp`` parser, both passed by the CLI
    root from the layers above. `serve_check(store)`: why a server would refuse a store whose
    files each check out, or None. `calibrate(args)`: the handler of `store calibrate`
    (without one, where the trainer is not installed, the command is not offered)."""
    store = subparsers.add_parser("store", help="inspect and verify an expert store")
    commands = store.add_subparsers(dest="store_command", metavar="STORE_COMMAND", required=True)
    info = commands.add_parser("info", help="show a store's manifest summary and experts")
    info.add_argument("dir", metavar="DIR", help="store directory")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.set_defaults(handler=_info)
    verify = commands.add_parser("verify", help="check every file's checksum and header")
    verify.add_argument("dir", metavar="DIR", help="store directory")
    verify.add_argument(
        "--no-progress", dest="progress", action="store_false",
        help="no progress bar on stderr (bytes read of the experts' total)",
    )
    verify.set_defaults(handler=functools.partial(_verify, serve_check=serve_check))
    if calibrate is not None:
        _add_calibrate(commands, calibrate)
    materialize = commands.add_parser(
        "materialize",
        help="write a prototype-conditioned hyper store out as an ordinary K-expert store",
        description="Expert k = g(·; f(p_k)) as a store expert file, the same router, exact "
        "routing: a plain momlp server serves it with the same outputs.",
    )
    materialize.add_argument("dir", metavar="STORE", help="hyper store directory")
    materialize.add_argument("--out", required=True, metavar="DIR", help="new store directory")
    materialize.set_defaults(handler=_materialize)


def _add_calibrate(commands: Any, handler: Callable[[argparse.Namespace], int]) -> None:
    parser = commands.add_parser(
        "calibrate",
        help="fit the gate temperature on data and republish the store with it",
        description="Choose τ of the top-k gate softmax(-d²/τ) by the held-out loss of the "
        "top-k mixtures on FILE's rows, and publish it as a new store version (expert files "
        "unchanged; a running server hot-swaps it).",
    )
    parser.add_argument("dir", metavar="STORE", help="store directory")
    parser.add_argument(
        "--data", required=True, metavar="FILE", help=".npz (X, y), .csv or .parquet rows"
    )
    parser.add_argument(
        "--target", metavar="COLUMN", default=None,
        help="the column of a .csv or .parquet table that holds y",
    )
    parser.add_argument(
        "--top-k", default=None, metavar="K,K",
        help="top-k mixtures to fit for, each in 2..K (default: 2,3, those the store has)",
    )
    parser.set_defaults(handler=handler)


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _info(args: argparse.Namespace) -> int:
    from experts_store import Store, StoreError

    try:
        store = Store.open(args.dir)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    m = store.manifest
    summary: dict[str, Any] = {
        "store_version": m.store_version,
        "format_version": m.format_version,
        "created_at": m.created_at,
        "task": m.task,
        "input_dim": m.input_dim,
        "output_dim": m.output_dim,
        "num_experts": m.num_experts,
        "branching": m.branching,
        "routing": m.routing,
        "temperature": m.temperature,
        "kind": m.kind,
        "gate": m.gate_spec.model_dump(),
        "pmoe": m.pmoe.model_dump() if m.pmoe is not None else None,
        "router_file": m.router_file,
        "hyper": m.hyper.model_dump() if m.hyper is not None else None,
        "total_expert_bytes": m.total_expert_bytes,
        "total_params": m.total_params,
        "experts": [
            {
                "id": e.id,
                "bytes": e.bytes,
                "params": e.params,
                "widths": e.arch["widths"],
                "activation": e.arch.get("activation", "prelu"),
                "file": e.file,
                "sha256": e.sha256,
                "checksum": e.checksum,
            }
            for e in m.experts
        ],
    }
    if m.graph is not None:
        summary["graph"] = _graph_summary(m)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"store      {store.root}")
    print(f"version    {m.store_version} (format {m.format_version}, created {m.created_at})")
    print(f"task       {m.task}, {m.input_dim} -> {m.output_dim}")
    print(
        f"experts    K={m.num_experts}, branching ν={m.branching}, routing={m.routing}, "
        f"τ={m.temperature:g}"
    )
    gate = m.gate_spec
    how: str = gate.temperature_source
    if gate.calibration and gate.lift is None:
        c = gate.calibration
        how += f" on {c.get('rows')} rows of {c.get('data')}, top_k {c.get('top_k')}"
    print(f"kind       {m.kind}")
    print(f"gate       softmax(-{gate.score}/τ), τ={gate.temperature:.6g} ({how})")
    if gate.lift == "linear":
        c = gate.calibration or {}
        agree = c.get("tree_top1_agreement_train")
        print(
            f"           learned linear router softmax((w·x+b)/τ), τ={gate.temperature / 2:.6g}, "
            "served by the lift x -> [x, 1, 0, 0]: routing=exact is exact; routing=tree "
            "walks the lifted points, an APPROXIMATION"
            + (f" (top-1 = router argmax on {agree:.1%} of training rows)" if agree is not None
               else "")
        )
    if m.pmoe is not None:
        p = m.pmoe
        image = f", images {list(p.layout.image.shape)}" if p.layout.image is not None else ""
        print(
            f"patches    n={p.layout.num_patches} of d={p.layout.patch_dim}{image}; "
            f"{p.routing} l={p.patches_per_expert}, gating {p.gating}"
        )
    print(f"size       {_human_bytes(m.total_expert_bytes)} in experts, {m.total_params} params")
    if m.hyper is not None:
        _print_hyper(m.hyper)
        return 0
    print()
    if m.graph is not None:
        graph = summary["graph"]
        print(f"graph      {len(graph['nodes'])} nodes in {graph['waves']} waves, "
              f"outputs {', '.join(m.graph.outputs)}")
        for node in graph["nodes"]:
            print(f"  node {node['name']:<12} <- {', '.join(node['inputs']):<24} "
                  f"K={node['num_experts']:<4} ν={node['branching']} out={node['output_dim']} "
                  f"{_human_bytes(node['bytes'])}  experts {node['experts']}  "
                  f"{node['router_file']}")
    print()
    print(f"{'id':>6}  {'bytes':>12}  {'params':>12}  widths")
    owners = _node_of_expert(m)
    for e in m.experts:
        widths = "-".join(str(w) for w in e.arch["widths"])
        node = f"  node {owners[e.id]}" if e.id in owners else ""
        print(f"{e.id:>6}  {e.bytes:>12}  {e.params:>12}  {widths}{node}")
    return 0


def _print_hyper(h: Any) -> None:
    f = h.hypernetwork
    widths = "-".join(str(w) for w in h.primary.widths)
    print(f"hyper      x: {h.input_dim}, condition: {h.condition_dim}, conditions from "
          f"{h.condition_source}")
    print(f"primary g  {widths} ({h.primary.activation}, bias={h.primary.bias}), "
          f"|θ| = {h.theta_size} params, {_human_bytes(h.theta_nbytes)} as an expert")
    print(f"f          {f.file}: {'-'.join(str(w) for w in f.widths)}, {f.params} params, "
          f"{_human_bytes(f.bytes)}")
    table = h.conditions
    print(f"conditions {table.file}: {table.count} named" if table else "conditions none named")
def _routers_verified(manifest: Any) -> str:
    if manifest.graph is None:
        return "the router"
    return f"the routers of {len(manifest.graph.nodes)} graph nodes"


def _node_of_expert(manifest: Any) -> dict[int, str]:
    """Expert id -> the graph node it belongs to (empty for other kinds)."""
    if manifest.graph is None:
        return {}
    return {e: node.name for node in manifest.graph.nodes for e in node.experts}


def _graph_summary(manifest: Any) -> dict[str, Any]:
    """Every node of a graph store: inputs, K_v, ν, width, experts, bytes, router file."""
    graph = manifest.graph
    return {
        "waves": len(graph.waves()),
        "outputs": list(graph.outputs),
        "nodes": [
            {
                "name": node.name,
                "inputs": list(node.inputs),
                "output_dim": node.output_dim,
                "num_experts": node.num_experts,
                "branching": node.branching,
                "experts": list(node.experts),
                "bytes": sum(manifest.experts[e].bytes for e in node.experts),
                "router_file": node.router_file,
            }
            for node in graph.nodes
        ],
    }


def _verify(
    args: argparse.Namespace, *, serve_check: Callable[[Any], str | None] | None = None
) -> int:
    from experts_store import Store, StoreError, StoreProblem

    try:
        store = Store.open(args.dir)
        with _bytes_bar(store.manifest.total_expert_bytes, args.progress) as advance:
            problems = store.verify(progress=advance)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if serve_check is not None and not any(p.expert_id is None for p in problems):
        # Each file can check out and the store still not be one a server serves (a router
        # of K prototypes for K+1 experts): open it as `momlp serve` does.
        refused = serve_check(store)
        if refused is not None:
            problems.append(StoreProblem(None, f"a server would refuse the store: {refused}"))
    if not problems and store.manifest.hyper is not None:
        print(f"ok: the hypernetwork and its conditions verified (store version {store.version})")
        return 0
    if not problems:
        print(
            f"ok: {store.manifest.num_experts} experts and "
            f"{_routers_verified(store.manifest)} verified "
            f"(store version {store.version})"
        )
        return 0
    failing = sorted({p.expert_id for p in problems if p.expert_id is not None})
    owners = _node_of_expert(store.manifest)
    for problem in problems:
        if problem.expert_id is None:
            # The store's own files (routers, a hypernetwork, a conditions table) name
            # themselves in the message.
            print(f"FAIL {problem.message}")
            continue
        who = f"expert {problem.expert_id}"
        if problem.expert_id in owners:
            who += f" (node {owners[problem.expert_id]!r})"
        print(f"FAIL {who}: {problem.message}")
    if failing:
        print(f"failing experts: {' '.join(str(i) for i in failing)}")
    else:
        print("no expert fails; the store's own files above do")
    return 1


@contextmanager
def _bytes_bar(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr over `total` bytes; yields the function that advances it."""
    from experts_store._progress import progress_bar

    with progress_bar(
        total, "verify", "B", enabled=enabled and total > 0, unit_scale=True, unit_divisor=1024
    ) as bar:
        yield bar.update


def _materialize(args: argparse.Namespace) -> int:
    from experts_store import StoreError, materialize_store

    problem = _materialize_out_problem(args.dir, args.out)
    if problem is not None:
        print(f"error: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    try:
        manifest = materialize_store(args.dir, args.out)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"materialized {manifest.num_experts} experts ({manifest.total_expert_bytes} bytes) "
          f"into {args.out}, version {manifest.store_version}")
    return 0


def _materialize_out_problem(source: str, out: str) -> str | None:
    """Why `out` cannot take the materialized store, or None; checked before any expert is
    generated (materialize_store refuses these too, as StoreError: exit 1, not 2)."""
    from pathlib import Path

    target = Path(out).absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return "exists and is not a directory" if existing == target else (
            f"{existing} is not a directory")
    if existing == target and target.resolve() == Path(source).resolve():
        return "is the source store; materialize into another directory"
    return None
