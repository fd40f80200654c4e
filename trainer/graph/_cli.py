"""`momlp build --kind graph`: the handler (`trainer._cli` parses, then hands over here)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

__all__ = ["handle_graph_build"]

# Options that shape the tree8/tree16 graph, with their least value and default.
_TREE_OPTIONS = {"experts": (1, 4), "width": (1, 8), "branching": (2, 4)}


def handle_graph_build(args: argparse.Namespace) -> int:
    """Build and publish a graph store from the parsed `momlp build` arguments."""
    import torch

    from router import RouterError
    from trainer import ConfigError, TrainerError

    from ._publish import GraphBuildConfig, build_graph_store, load_graph_spec
    from ._spec import binary_tree_spec
    from ._train import GraphTraining

    settings = GraphTraining(soft_epochs=10, hard_epochs=10) if args.quick else GraphTraining()
    overrides = {"lr": args.lr, "batch_size": args.batch_size, "seed": args.seed,
                 "routing": args.routing, "prototype_lr": args.prototype_lr}
    if args.epochs is not None:
        overrides.update(soft_epochs=args.epochs, hard_epochs=args.epochs,
                         expert_epochs=args.epochs)
    if args.graph_finetune_epochs is not None:
        overrides["finetune_epochs"] = args.graph_finetune_epochs
    if args.prototype_epochs is not None:
        overrides["prototype_epochs"] = args.prototype_epochs
    settings = dataclasses.replace(
        settings, **{k: v for k, v in overrides.items() if v is not None}
    )
    given = {k: getattr(args, k) for k in _TREE_OPTIONS if getattr(args, k) is not None}
    tree = {k: given.get(k, default) for k, (_, default) in _TREE_OPTIONS.items()}
    try:
        for option, value in given.items():
            if args.graph is not None:
                raise ConfigError("shapes the tree8/tree16 graph; a --graph spec sets each "
                                  "node's experts, widths and branching", option=option)
            least = _TREE_OPTIONS[option][0]
            if value < least:
                raise ConfigError(f"must be at least {least}, got {value}", option=option)
        if args.torch_threads is not None:
            torch.set_num_threads(args.torch_threads)
        spec = load_graph_spec(args.graph) if args.graph is not None else None
        if spec is None and args.dataset is not None and args.dataset.startswith("tree"):
            spec = binary_tree_spec(int(args.dataset[4:]), experts=tree["experts"],
                                    hidden=(tree["width"], tree["width"]),
                                    branching=tree["branching"])
        config = GraphBuildConfig(
            out=args.out, spec=spec, dataset=args.dataset, data=args.data,
            training=args.graph_training, settings=settings,
            samples=(2000 if args.quick else 4000) if args.samples is None else args.samples,
            test_fraction=0.2 if args.test_fraction is None else args.test_fraction,
            executor=args.executor or "ray", ray_address=args.ray_address,
            num_cpus=args.num_cpus,
        )
        manifest = build_graph_store(config, progress=args.progress)
    except (TrainerError, RouterError) as exc:  # RouterError: inputs the router cannot take
        print(f"momlp build: {exc}", file=sys.stderr)
        return 2
    assert manifest.graph is not None
    print(json.dumps({
        "store": str(args.out), "store_version": manifest.store_version, "kind": "graph",
        "nodes": len(manifest.graph.nodes), "num_experts": manifest.num_experts,
    }))
    return 0
