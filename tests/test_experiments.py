"""Checks of the experiment scripts planned for a GPU run (experiments/), so that a device call
does not fail on something a CPU could have caught."""

from __future__ import annotations

import pathlib

import helpers
import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"
EXAMPLES = EXPERIMENTS.parent / "examples"


def _load(name):
    return helpers.load_script(
        EXPERIMENTS / f"{name}.py", f"experiment_{name}", [EXPERIMENTS, EXAMPLES]
    )


def test_convert_cost_variants_find_their_lines():
    """Each timing-only variant of convert_cost_probe.py replaces lines that occur exactly once
    in the GEMM's source, and the variant's module builds a GEMM function."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    probe = _load("convert_cost_probe")
    assert set(probe.VARIANTS) >= {"default", "no zero point", "no group scale", "no conversion"}
    for name in probe.VARIANTS:
        assert callable(probe.variant_gemm(name))
