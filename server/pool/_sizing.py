"""How many actors the Ray pool starts, and on which device.

Ray is imported inside the functions, so importing this module does not start or need Ray.
"""

from __future__ import annotations

import logging

from server._settings import Settings

__all__ = ["actor_count", "actor_device", "local_node_gpus"]

logger = logging.getLogger(__name__)


def actor_device(
    requested: str, *, local_cuda: bool, cluster_gpus: float, local_gpus: float
) -> str:
    """The device the actors use: `auto` is CUDA when they can have a GPU.

    That is when this process's torch sees one, or when the Ray cluster has GPUs on other
    nodes: a head without a GPU (KubeRay, the launcher config in deploy/) still drives GPU
    workers. GPUs on this node that this process's torch cannot use (a CPU build of torch)
    do not count.
    """
    if requested != "auto":
        return requested
    if local_cuda:
        return "cuda"
    return "cuda" if cluster_gpus - local_gpus >= 1 else "cpu"


def actor_count(device: str, settings: Settings, cluster_gpus: float) -> int:
    """How many actors the pool starts: `settings.actors` on CPU; on CUDA one per GPU of the
    cluster, or on a cluster (`ray_address`) `settings.actors` GPU actors where it was given
    and is more.

    A head that starts before its GPU workers join (KubeRay, deploy/ray-cluster.yaml) counts
    none yet: `--ray-address ... --device cuda --actors N` waits for N GPU actors to be placed.
    An embedded Ray never gains a GPU: there `--actors` (a CPU count, as a one-GPU machine's
    scripts pass it) stays one actor per GPU, with a warning when it asked for more.
    """
    if not device.startswith("cuda"):
        return settings.actors
    gpus = int(cluster_gpus)
    asked = settings.actors if "actors" in settings.model_fields_set else 1
    if settings.ray_address is None:
        if asked > gpus:
            logger.warning("--actors %d on CUDA: this machine's Ray has %d GPU(s), so %d "
                           "actor(s), one per GPU", asked, gpus, max(1, gpus))
        return max(1, gpus)
    return max(asked, gpus)


def local_node_gpus() -> float:
    """GPUs Ray counts on this process's node."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node.get("NodeID") == node_id:
            return float(node.get("Resources", {}).get("GPU", 0))
    return 0.0
