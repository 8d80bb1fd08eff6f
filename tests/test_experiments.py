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


def test_chain_probe_checks_two_kernels_and_lowers_one(capsys):
    """experiments/chain_probe.py (session 22: one kernel for both GEMMs, semaphores per
    block): the two-kernel mode reads back what phase 1 wrote, in the interpreter, and every
    mode (the one-kernel modes use global semaphores, which the interpreter lacks) lowers for
    sm_90."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    probe = _load("chain_probe")
    assert probe.main(["--interpret"]) == 0
    out = capsys.readouterr().out
    assert "interpret two: ok" in out
    assert all(f"lowers for sm_90: {mode}" in out for mode in probe.MODES)


def test_chain_probe_check_catches_rows_not_read_back(monkeypatch):
    """chain_probe's check fails when phase 2 did not read what phase 1 wrote (here: its rows
    read back replaced by zeros, as an unordered read of a fresh output can give)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    import jax

    probe = _load("chain_probe")
    keys = jax.random.split(jax.random.key(3), 2)
    d1, d2 = probe.random_data(keys[0], 4, 3, 8), probe.random_data(keys[1], 6, 2, 8)
    o1, o2 = probe.expected(d1, d2, 2)
    o2 = o2.copy()
    o2[:, 0] = 0
    monkeypatch.setattr(probe, "two_phase", lambda *a, **k: (o1, o2))
    assert probe.check(d1, d2, blocks=2, stages=2, mode="one").startswith(
        "WRONG: 0 phase-1 rows, 6"
    )
