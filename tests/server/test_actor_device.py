"""Which device the Ray pool's actors use (`server.pool.actor_device`)."""

from __future__ import annotations

import pytest

from server import Settings
from server.pool import actor_count, actor_device

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("requested", "local_cuda", "cluster_gpus", "local_gpus", "device"),
    [
        ("auto", False, 0, 0, "cpu"),
        ("auto", True, 1, 1, "cuda"),  # one machine with a GPU
        ("auto", False, 2, 0, "cuda"),  # a head without a GPU, two GPU workers
        ("auto", False, 1, 1, "cpu"),  # a GPU this process's torch cannot use (CPU build)
        ("auto", False, 3, 1, "cuda"),  # ... but GPU workers beside it
        ("cpu", True, 4, 4, "cpu"),
        ("cuda", False, 0, 0, "cuda"),  # as asked; the actors then cannot be placed
    ],
)
def test_auto_means_cuda_when_the_actors_can_have_a_gpu(
    requested: str, local_cuda: bool, cluster_gpus: float, local_gpus: float, device: str
) -> None:
    chosen = actor_device(
        requested, local_cuda=local_cuda, cluster_gpus=cluster_gpus, local_gpus=local_gpus
    )
    assert chosen == device


def test_cuda_where_torch_has_none_is_refused_naming_why() -> None:
    import torch

    from server.pool import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine's torch can use CUDA")
    assert resolve_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match=r"--device cpu") as info:
        resolve_device("cuda")
    assert "sees no usable GPU" in str(info.value)


@pytest.mark.parametrize(
    ("given", "address", "gpus", "count"),
    [
        ({}, None, 2, 2),  # one actor per GPU
        ({}, "head:6379", 0, 1),  # a head whose GPU workers have not joined: one, waited for
        ({"actors": 4}, "head:6379", 0, 4),  # ... or as many as asked for, waited for
        ({"actors": 2}, "head:6379", 3, 3),  # never fewer than the GPUs there are
        ({"actors": 1}, None, 2, 2),
        ({"actors": 2}, None, 1, 1),  # an embedded Ray never gains a GPU: one per GPU
    ],
)
def test_cuda_starts_one_actor_per_gpu_or_the_actors_asked_for(
    given: dict[str, int], address: str | None, gpus: float, count: int
) -> None:
    # Before, --actors was ignored on CUDA: a KubeRay head that started before its two GPU
    # workers joined ran one GPU actor for the server's life.
    settings = Settings(ray_address=address, **given)
    assert actor_count("cuda", settings, gpus) == count
    assert actor_count("cpu", settings, gpus) == settings.actors


def test_an_embedded_ray_asked_for_more_gpu_actors_than_gpus_says_it_starts_one_per_gpu(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The one-GPU machine's scripts pass --actors 2 (a CPU count) with --device cuda.
    assert actor_count("cuda", Settings(actors=3), 2) == 2
    assert "--actors 3 on CUDA: this machine's Ray has 2 GPU(s), so 2 actor(s)" in caplog.text
