"""Fixtures for the tests that run the reference's emulated FP8 accumulator (reference/mma_accumulator.py)."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """The emulated accumulator runs many small ops per k-block: one thread avoids the pool's synchronisation,
    which dominates on a loaded machine (10-20x on 2 shared CPUs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
