"""Router tests run on one torch thread: the machine is shared and routing is single-threaded."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    torch.set_num_threads(1)
