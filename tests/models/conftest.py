"""Shared setup for the model tests: one torch thread per test module on a shared machine."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread: on a shared 2-core machine, 2 OpenMP threads competing with other
    processes spin at barriers and made an 8-token generate() 10x slower (30 s vs 2.6 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
