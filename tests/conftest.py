"""Shared fixtures: a per-test seeded numpy Generator and the skip rule for GPU-only tests."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

# Lets test modules import the shared helpers as `helpers` whatever the rootdir/import mode.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A Generator seeded from the test id: every case gets its own, reproducible inputs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    backend = jax.default_backend()
    if backend == "gpu":
        # The DeepSeek-V3-sized cases hold 4-7 GB of weights plus their reference's dequantized
        # copy: under xdist with --dist loadgroup they share one worker, so several never run
        # at once on one GPU (four at once do not fit in an H200's memory).
        for item in items:
            if "gpu" in item.keywords and "deepseek" in item.name:
                item.add_marker(pytest.mark.xdist_group("gpu_memory"))
        return
    skip_gpu = pytest.mark.skip(
        reason=f"needs an NVIDIA GPU (compiled Pallas kernels); JAX's default backend is "
        f"{backend!r}"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
