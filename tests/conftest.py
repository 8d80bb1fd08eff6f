"""Shared fixtures: a per-test seeded numpy Generator, the skip rule for GPU-only tests and
the release of the compiled programs a CPU test worker holds."""

from __future__ import annotations

import ctypes
import gc
import os
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


def _glibc_malloc_trim():
    """glibc's malloc_trim (returns freed heap pages to the system), or None off glibc."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except AttributeError:
        return None


_MALLOC_TRIM = _glibc_malloc_trim()
# A worker's resident memory above which its compiled programs are dropped after a test.
_RELEASE_ABOVE_BYTES = 2 << 30


def _resident_bytes() -> int | None:
    """This process's resident memory from /proc (Linux), or None where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


@pytest.fixture(autouse=True)
def release_compiled_programs():
    """On the CPU, drops JAX's compiled programs after a test once the process holds over 2 GB.

    The interpreted kernels compile to large XLA:CPU programs, few of which a later test reuses;
    kept, they and the heap they fragment grew each xdist worker by ~10 MB per kernel test (to
    4.6 GB in one run of the suite; a CI run with two workers on 24 GB failed on MemoryError).
    Dropped and the freed heap handed back (glibc's malloc_trim), a worker falls to a few hundred
    MB. Not after every test: a cleared cache makes the next test compile jnp's own small
    programs again, which about doubled the suite's time. On a GPU the compiled kernels are
    small and compiling them again costs GPU time, so they are kept.
    """
    yield
    if jax.default_backend() != "cpu":
        return
    resident = _resident_bytes()
    if resident is None or resident < _RELEASE_ABOVE_BYTES:
        return
    jax.clear_caches()
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


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
