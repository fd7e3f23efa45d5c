"""Shared test helpers: GPU tests (`@pytest.mark.gpu`) skip cleanly when CUDA is absent."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Parametrise a test over devices with `@pytest.mark.parametrize("device", DEVICES)`:
# the CUDA case carries the `gpu` mark and skips without a GPU.
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

# Helper modules whose asserts should report like a test's.
pytest.register_assert_rewrite("compile_helpers")
