"""Checks of the experiment scripts planned for a GPU run (experiments/), so that a device call
does not fail on something a CPU could have caught."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"
EXAMPLES = EXPERIMENTS.parent / "examples"


def _load(name):
    sys.path[:0] = [str(EXPERIMENTS), str(EXAMPLES)]
    try:
        spec = importlib.util.spec_from_file_location(
            f"experiment_{name}", EXPERIMENTS / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        del sys.path[:2]


def test_convert_cost_variants_find_their_lines():
    """Each timing-only variant of convert_cost_probe.py replaces lines that occur exactly once
    in the GEMM's source, and the variant's module builds a GEMM function."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    probe = _load("convert_cost_probe")
    assert set(probe.VARIANTS) >= {"default", "no zero point", "no group scale", "no conversion"}
    for name in probe.VARIANTS:
        assert callable(probe.variant_gemm(name))
