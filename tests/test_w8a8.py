"""Tests of int8 MoE: W8A8 (int8 activations per token or static) and W8A16, and its oracle.

The 'xla' backend is the oracle: it quantizes the activations exactly as the kernels do
(`_activations.quantize_activations_*`, the same XLA code) and computes the products exactly
(int32 per group, scales in f32). It is itself checked against float64 numpy that quantizes in
numpy. Kernel outputs are compared with it on the same weights, so neither weight nor
activation quantization error hides inside a tolerance. Inputs are random (never zeros), fresh
per case, seeded from the test id.

How to run:
    CPU (CI): `pytest tests/test_w8a8.py` runs the kernels in the Pallas interpreter
        ("pallas_interpret") on small shapes; tests marked `gpu` are skipped.
    GPU: `pytest -m gpu tests/test_w8a8.py` runs DeepSeek-V3 shapes compiled ("pallas": E=256,
        top-8, H=7168, I=2048, int8 per-channel weights, M = 1, 256, 4096; w13's qweight is
        uint32 [256, 4096, 1792], 7.5 GB; needs ~20 GB of GPU memory).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from pathlib import Path

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_cases import FusedMoeCases, MoeCase
from jax.experimental import pallas as pl

import wna16_jax as wj
from pallas_kernels.mgpu import config as mgpu_config
from pallas_kernels.mgpu import fused_moe as mgpu_moe
from pallas_kernels.pallas import fused_moe as pallas_moe
from pallas_kernels.pallas import w8a8_gemm as w8a8_module
from wna16_jax import _activations, _configs, _dispatch, _reference, formats
from wna16_jax._types import BlockConfig, QuantizedExperts

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
IMPLEMENTATION = "pallas" if ON_GPU else "pallas_interpret"

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
PER_TOKEN = wj.ActivationQuant("int8_per_token")

# ---- tolerances -----------------------------------------------------------------------------

# Kernels against the 'xla' oracle under the same activation quantization (norm-wise relative
# error; element-wise with ELEMENT_SLACK). The integer dots are exact and the epilogue order is
# the oracle's, so only f32 summation order separates them (split-K partial tiles, the sum over
# k slots), plus the rare element whose second quantization lands on the other side of a
# rounding boundary (one step, 1/127 of its row's max, ~1e-3 of the output norm). Measured in
# the interpreter: 0 without split-K (bitwise equal), ~1e-7 with split-K (f32 output).
W8A8_VS_ORACLE: dict[jnp.dtype, float] = {
    F32: 1e-4,
    # Loose: the output is rounded to f16 (unit roundoff 4.9e-4).
    F16: 2e-3,
    # Loose: the output is rounded to bf16 (unit roundoff 3.9e-3).
    BF16: 1e-2,
}
# The 'xla' oracle against float64 numpy that quantizes in numpy f32: the second quantization
# sees f32 (oracle) vs float64 (numpy) activations, so an element may flip one step, which
# moves the output by ~1e-3 of its norm. Observed ~1e-7 (f32 output, no flip) over 6 seeds; the
# tolerance admits one flip. 16-bit outputs add their own rounding (helpers.TOLERANCES).
ORACLE_VS_NUMPY = 2e-3
# W8A8 against W8A16 on the same weights: this is the activation quantization error itself;
# observed 1.7-1.9e-2 (6 seeds) on random normal activations.
W8A8_VS_W8A16 = 5e-2
ELEMENT_SLACK = 5.0


def assert_moe_close(out, ref, tol: float, what: str) -> None:
    """out is finite everywhere and matches ref (norm-wise tol, element-wise with slack)."""
    helpers.assert_finite_and_close(out, ref, tol, what, slack=ELEMENT_SLACK, require_signal=True)


# ---- numpy oracles --------------------------------------------------------------------------


def numpy_quantize_per_token(x) -> tuple[np.ndarray, np.ndarray]:
    """scale = max|x_t| * (1/127), q = clip(round(x * (1/scale)), -127, 127), in numpy f32."""
    x = np.asarray(x, np.float32)
    scale = np.max(np.abs(x), axis=-1) * np.float32(1 / 127)
    inv = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(x * inv[:, None]), -127, 127)
    return q.astype(np.int8), scale.astype(np.float32)


def assert_same_rounding(q, want_q, x, scale) -> None:
    """q equals numpy's, except by one step where x / scale sits on a rounding tie.

    On the CPU XLA reproduces numpy bitwise. On the H200 XLA's f32 reciprocal 1/scale may
    differ from IEEE's in the last place (measured: 2 of 3552 values moved by one step), which
    matters only where x * (1/scale) is within that of a half-way point.
    """
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(q, want_q)
        return
    diff = np.abs(q.astype(np.int32) - want_q.astype(np.int32))
    assert diff.max() <= 1, f"q differs from numpy by up to {diff.max()} steps"
    y = np.abs(x / np.where(scale > 0, scale, 1)[:, None])
    tie_distance = np.abs(y - np.floor(y) - 0.5)
    assert np.all(tie_distance[diff > 0] < 1e-5 * np.maximum(y[diff > 0], 1)), (
        "q differs from numpy away from a rounding tie"
    )


def numpy_quantize_static(x, scale: float) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float32)
    q = np.clip(np.round(x * (np.float32(1) / np.float32(scale))), -127, 127)
    return q.astype(np.int8), np.full(x.shape[0], scale, np.float32)


def numpy_quantize(x, aq: wj.ActivationQuant, gemm: int):
    if aq.scheme == "int8_per_token":
        return numpy_quantize_per_token(x)
    return numpy_quantize_static(x, aq.gemm1_scale if gemm == 1 else aq.gemm2_scale)


def numpy_fused_moe_a8(x, w13, w2, topk_weights, topk_ids, aq, expert_map=None) -> np.ndarray:
    """The W8A8 MoE layer in float64 on the dequantized weights, quantizing like the oracle."""
    w13d, w2d = helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2)
    wts = np.asarray(topk_weights, np.float64)
    ids = np.asarray(topk_ids).astype(np.int64)
    e_local, two_i, _ = w13d.shape
    e_global = e_local if expert_map is None else len(expert_map)
    q1, s1 = numpy_quantize(np.asarray(x, np.float32), aq, 1)
    xq = q1.astype(np.float64) * s1[:, None].astype(np.float64)
    out = np.zeros((x.shape[0], w2d.shape[1]), np.float64)
    for t, j in np.ndindex(*ids.shape):
        g = ids[t, j]
        if g < 0 or g >= e_global:
            continue
        e = g if expert_map is None else int(np.asarray(expert_map)[g])
        if e < 0:
            continue
        h = w13d[e] @ xq[t]  # [2I]
        act = h[: two_i // 2] / (1.0 + np.exp(-h[: two_i // 2])) * h[two_i // 2 :]
        q2, s2 = numpy_quantize(act[None, :], aq, 2)
        out[t] += wts[t, j] * (w2d[e] @ (q2[0].astype(np.float64) * np.float64(s2[0])))
    return out


# ---- inputs ---------------------------------------------------------------------------------


def w8a8_inputs(rng, *, T, H, I, E, k, dtype=BF16, distinct=True):
    """(x, w13, w2, topk_weights, topk_ids) with int8 per-channel symmetric weights."""
    return helpers.random_moe_inputs(
        rng,
        T=T,
        H=H,
        I=I,
        E=E,
        k=k,
        bits=8,
        group_size=-1,
        has_zp=False,
        dtype=dtype,
        distinct=distinct,
    )


def static_scales(x) -> wj.ActivationQuant:
    """Static scales a calibration would pick: max|x| / 127 for GEMM1, a rough bound for GEMM2."""
    s1 = float(np.max(np.abs(np.asarray(x, np.float32)))) / 127
    return wj.ActivationQuant("int8_static", gemm1_scale=s1, gemm2_scale=4.0 / 127)


def run_both(x, w13, w2, tw, ti, **kwargs):
    """(kernel backend output, 'xla' oracle output) of the public API."""
    out = wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION, **kwargs)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla", **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype, (out.shape, out.dtype)
    return out, ref


def _no_kernel(*args, **kwargs):
    raise AssertionError("pallas_call was reached: the problem should have been rejected first")


# ---- activation quantization ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_quantize_per_token_matches_numpy(rng, dtype):
    x = rng.normal(size=(37, 96)) * rng.uniform(0.01, 100, size=(37, 1))
    x[3] = 0.0  # an all-zero token: scale 0, q 0
    x[5, 7] = -np.abs(x[5]).max() * 2  # a negative row maximum
    x = jnp.asarray(x, dtype)
    q, s = _activations.quantize_activations_per_token(x)
    assert q.dtype == jnp.int8 and q.shape == x.shape and s.dtype == jnp.float32
    want_q, want_s = numpy_quantize_per_token(np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(s), want_s)
    assert_same_rounding(np.asarray(q), want_q, np.asarray(x, np.float32), want_s)
    assert np.asarray(s)[3] == 0 and not np.asarray(q)[3].any()
    assert np.asarray(q)[5, 7] == -127
    # Each row's largest |x| maps to 127, and q * scale is within half a step of x (plus the
    # f32 rounding of the scale and of x * (1/scale): observed 1 + 8e-7 half steps).
    qa = np.asarray(q, np.int64)
    nonzero = np.asarray(s) > 0
    np.testing.assert_array_equal(np.abs(qa).max(axis=1)[nonzero], 127)
    err = np.abs(qa * np.asarray(s)[:, None] - np.asarray(x, np.float64))
    assert np.all(err <= 0.5 * np.asarray(s, np.float64)[:, None] * (1 + 1e-5))


def test_quantize_static_matches_numpy_and_clips(rng):
    x = jnp.asarray(rng.normal(size=(9, 64)) * 3, jnp.float32)
    q, s = _activations.quantize_activations_static(x, 0.01)
    want_q, want_s = numpy_quantize_static(np.asarray(x), 0.01)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    assert np.abs(np.asarray(q, np.int64)).max() == 127  # |x| / 0.01 far over 127: clipped


def test_activation_quant_type():
    aq = wj.ActivationQuant("int8_static", gemm1_scale=np.float32(0.5), gemm2_scale=2)
    assert aq.gemm1_scale == 0.5 and type(aq.gemm1_scale) is float
    assert hash(aq) == hash(wj.ActivationQuant("int8_static", 0.5, 2.0))
    assert wj.ActivationQuant() == PER_TOKEN and PER_TOKEN.has_scales
    assert not wj.ActivationQuant("int8_static").has_scales
    with pytest.raises(ValueError, match="scheme='fp8' is not one of"):
        wj.ActivationQuant("fp8")
    with pytest.raises(ValueError, match="belong to scheme='int8_static'"):
        wj.ActivationQuant("int8_per_token", gemm1_scale=1.0)
    with pytest.raises(ValueError, match="gemm2_scale=-1.0 must be a positive finite"):
        wj.ActivationQuant("int8_static", 1.0, -1.0)


@pytest.mark.parametrize(
    "value, message",
    [
        ("int8", r"activation_quant='int8' is not supported; accepted: None .*'int8_per_token'"),
        ("int8_static", r"static scales: pass wj.ActivationQuant\('int8_static'"),
        (8, "activation_quant=8 is not supported"),
        (wj.ActivationQuant("int8_static", 1.0), "needs both gemm1_scale and gemm2_scale"),
    ],
)
def test_bad_activation_quant_raises(rng, monkeypatch, value, message):
    x, w13, w2, tw, ti = w8a8_inputs(rng, T=3, H=64, I=32, E=4, k=2)
    monkeypatch.setattr(pl, "pallas_call", _no_kernel)
    with pytest.raises(ValueError, match=message):
        wj.fused_moe(x, w13, w2, tw, ti, activation_quant=value)


# ---- the oracle ('xla') ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bits, group, has_zp",
    [(8, -1, False), (8, 32, True), (4, 32, True), (4, -1, False)],
    ids=["int8-channel-sym", "int8-g32-zp", "int4-g32-zp", "int4-channel-sym"],
)
def test_grouped_matmul_int8_is_exact(rng, bits, group, has_zp):
    """Integer dots per group exact, scales in f32: matches float64 numpy to f32 rounding."""
    r, kdim, n, e, top_k = 11, 128, 48, 4, 2
    qw = helpers.random_quantized_experts(rng, e, n, kdim, bits, group, has_zp, F32)
    a_q = rng.integers(-127, 128, size=(r, kdim)).astype(np.int8)
    a_s = rng.uniform(0.5, 2.0, size=r).astype(np.float32)
    rw = rng.uniform(0.1, 1.0, size=r * top_k).astype(np.float32)
    _, ids = helpers.random_routing(rng, r, top_k, 6)  # experts 4, 5: dropped
    routing = _reference.moe_align_block_size(jnp.asarray(ids), num_experts=e, block_m=16)
    out = _reference.grouped_matmul_int8(
        jnp.asarray(a_q), jnp.asarray(a_s), qw, routing, top_k=top_k, routed_weights=jnp.asarray(rw)
    )
    w = helpers.numpy_dequantize(qw)  # [E, N, K] float64, exact
    flat = ids.reshape(-1)
    placed = flat < e
    want = np.zeros((r * top_k, n))
    for s in np.nonzero(placed)[0]:
        want[s] = (w[flat[s]] @ a_q[s // top_k].astype(np.float64)) * a_s[s // top_k] * rw[s]
    got = np.asarray(out)[placed]
    np.testing.assert_allclose(got, want[placed], rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize(
    "scheme, bits, group, has_zp, dtype",
    [
        ("per_token", 8, -1, False, BF16),
        ("static", 8, -1, False, F32),
        ("per_token", 4, 32, True, F16),  # W4A8: the oracle takes any weights
    ],
)
def test_oracle_matches_numpy(rng, scheme, bits, group, has_zp, dtype):
    t, h, i, e, k = 13, 128, 64, 8, 3
    x, w13, w2, tw, ti = helpers.random_moe_inputs(
        rng, T=t, H=h, I=i, E=e, k=k, bits=bits, group_size=group, has_zp=has_zp, dtype=dtype
    )
    ids = np.asarray(ti).copy()
    ids[0, 1] = -1  # a dropped slot
    expert_map = jnp.asarray(np.r_[rng.permutation(e), -1, -1].astype(np.int32))  # 10 global
    ids[1, 0] = 9  # an off-shard expert
    ti = jnp.asarray(ids)
    aq = PER_TOKEN if scheme == "per_token" else static_scales(x)
    out = wj.fused_moe(
        x, w13, w2, tw, ti, expert_map=expert_map, activation_quant=aq, implementation="xla"
    )
    want = numpy_fused_moe_a8(x, w13, w2, tw, ti, aq, expert_map=np.asarray(expert_map))
    tol = max(ORACLE_VS_NUMPY, helpers.tolerance(dtype))  # plus the output's own rounding
    assert_moe_close(out, want, tol, f"xla W8A8 ({scheme}) vs float64 numpy")


def test_w8a8_is_close_to_w8a16(rng):
    """Sanity: int8 activations change a random layer by about the int8 quantization step."""
    x, w13, w2, tw, ti = w8a8_inputs(rng, T=16, H=256, I=128, E=8, k=2, dtype=F32)
    a8 = wj.fused_moe(x, w13, w2, tw, ti, activation_quant="int8_per_token", implementation="xla")
    a16 = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla")
    rel = helpers.relative_error(a8, a16)
    assert 1e-4 < rel < W8A8_VS_W8A16, rel  # quantized (not equal), but close


# ---- kernels against the oracle -------------------------------------------------------------

# The fused_moe checks of every backend (tests/backend_cases.py) with int8 activations: int8
# per-channel symmetric weights. H=128: "slices" block_k=128; I=64: "tile" block_k=64 (a slice
# would contract 16 < 32).
W8A8_CASES = (
    MoeCase(9, 8, 2, 128, 64, 8, -1, False, "bfloat16", act_quant="int8_per_token"),
    MoeCase(5, 16, 4, 256, 128, 8, -1, False, "float16", act_quant="int8_static"),
    MoeCase(12, 8, 3, 128, 128, 8, -1, False, "float32", False, act_quant="int8_per_token"),
)


class TestW8A8Interpreted(FusedMoeCases):
    IMPLEMENTATION = "pallas_interpret"
    BACKEND_FUSED_MOE = staticmethod(helpers.pipeline_fused_moe(pallas_moe.stages, interpret=True))
    ACTIVATION_QUANTS = ("int8_per_token", "int8_static")
    CASES = W8A8_CASES
    SMALL = MoeCase(9, 8, 2, 128, 128, 8, -1, False, act_quant="int8_per_token")

    def tolerance(self, dtype) -> float:
        return W8A8_VS_ORACLE[jnp.dtype(dtype)]

    def assert_close(self, out, ref, dtype, what: str) -> None:
        super().assert_close(out, ref, dtype, what)
        # The interpreter runs the oracle's f32 operations in the oracle's order.
        np.testing.assert_array_equal(
            np.asarray(out, np.float32), np.asarray(ref, np.float32), err_msg=what
        )


@pytest.mark.gpu
class TestW8A8Compiled(TestW8A8Interpreted):
    IMPLEMENTATION = "pallas"
    BACKEND_FUSED_MOE = staticmethod(helpers.pipeline_fused_moe(pallas_moe.stages))

    def assert_close(self, out, ref, dtype, what: str) -> None:
        FusedMoeCases.assert_close(self, out, ref, dtype, what)


class TestW8A8MosaicGpu(FusedMoeCases):
    """W8A8 on the Mosaic GPU GEMM (int8 x int8 wgmma, weights in the mgpu_int8 layout): in its
    interpreter on CPU, compiled on an sm_90 GPU. Its f32 sums are scaled per k-step (the
    oracle's once per row), so only the tolerance, not bitwise equality, holds."""

    IMPLEMENTATION = "mgpu" if ON_GPU else "mgpu_interpret"
    BACKEND_FUSED_MOE = staticmethod(
        helpers.pipeline_fused_moe(mgpu_moe.stages, interpret=INTERPRET)
    )
    LAYOUT = "mgpu_int8"
    ACTIVATION_QUANTS = ("int8_per_token", "int8_static")
    CASES = W8A8_CASES
    SMALL = MoeCase(9, 8, 2, 128, 128, 8, -1, False, act_quant="int8_per_token")

    def tolerance(self, dtype) -> float:
        return W8A8_VS_ORACLE[jnp.dtype(dtype)]


@pytest.mark.parametrize("split_k", [1, 2])
def test_w8a8_gemm_matches_reference_gemm(rng, split_k):
    """The GEMM alone: bitwise equal to the oracle's GEMM without split-K, f32-close with it."""
    r, kdim, n, e, top_k = 7, 128, 64, 4, 2
    qw = helpers.random_quantized_experts(rng, e, n, kdim, 8, -1, False, BF16)
    a_q, a_s = _activations.quantize_activations_per_token(jnp.asarray(rng.normal(size=(r, kdim))))
    tw, ti = helpers.random_routing(rng, r, top_k, e)
    rw = jnp.asarray(tw).reshape(-1)
    routing = _reference.moe_align_block_size(jnp.asarray(ti), num_experts=e, block_m=16)
    ref = _reference.grouped_matmul_int8(a_q, a_s, qw, routing, top_k=top_k, routed_weights=rw)
    # "slices" over one k-tile of 128; "tile" over two k-tiles of 64, one per split.
    config = {
        1: BlockConfig(block_m=16, block_n=32, block_k=128),
        2: BlockConfig(block_m=16, block_n=32, block_k=64, split_k=2, unpack="tile"),
    }[split_k]
    out = w8a8_module.w8a8_gemm(
        a_q, a_s, qw, routing, rw, top_k=top_k, config=config, interpret=INTERPRET
    )
    assert out.shape == (r * top_k, n) and out.dtype == jnp.float32
    if split_k == 1 and INTERPRET:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_w8a8_expert_map_dropped_ids_and_split_k(rng):
    """A quarter of the experts local, dropped ids, split-K in both GEMMs: off-shard tokens
    give exactly 0 and the rest matches the oracle with the same map."""
    t, k, e, h, i = 10, 2, 16, 128, 128
    local = rng.permutation(e)[: e // 4]
    emap = np.full(e, -1, np.int32)
    emap[local] = rng.permutation(len(local))
    remote = np.nonzero(emap < 0)[0]
    x, w13, w2, tw, _ = w8a8_inputs(rng, T=t, H=h, I=i, E=len(local), k=k)
    _, ids = helpers.random_routing(rng, t, k, e)
    ids[:3] = rng.choice(remote, size=(3, k), replace=False)  # tokens 0-2: only off-shard
    ids[3] = rng.choice(local, size=k, replace=False)
    ids[4, 0] = -1
    ids[5, 1] = e + 3
    ti = jnp.asarray(ids)
    config = BlockConfig(block_m=16, block_n=32, block_k=64, split_k=2, unpack="tile")
    out, ref = run_both(
        x,
        w13,
        w2,
        tw,
        ti,
        expert_map=jnp.asarray(emap),
        config=config,
        activation_quant=PER_TOKEN,
    )
    np.testing.assert_array_equal(np.asarray(out[:3], np.float32), 0.0, err_msg="off-shard")
    assert_moe_close(out, ref, W8A8_VS_ORACLE[BF16], "W8A8 split-K + expert_map vs oracle")


@pytest.mark.parametrize(
    "dtype, config",
    [(BF16, None), (F16, BlockConfig(block_m=16, block_n=32, block_k=64, split_k=2))],
    ids=["bf16-heuristic", "f16-split2"],
)
def test_w8a16_kernels_match_oracle(rng, dtype, config):
    """int8 per-channel weights with 16-bit activations (the WNA16 kernels, activation_quant
    None) against the 'xla' reference and the float64 oracle on the dequantized weights."""
    x, w13, w2, tw, ti = w8a8_inputs(rng, T=7, H=128, I=128, E=8, k=2, dtype=dtype)
    out, ref = run_both(x, w13, w2, tw, ti, config=config)
    oracle = helpers.numpy_fused_moe(
        x, helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2), tw, ti
    )
    assert_moe_close(out, ref, helpers.tolerance(dtype), "W8A16 vs xla backend")
    assert_moe_close(out, oracle, helpers.tolerance(dtype), "W8A16 vs float64 oracle")


# ---- configs --------------------------------------------------------------------------------


def test_w8a8_heuristic_configs_obey_the_int8_dot_rule():
    for n, kdim in [(64, 32), (128, 64), (128, 128), (4096, 7168), (7168, 2048), (512, 7168)]:
        shape = _configs_shape(n, kdim)
        config = w8a8_module.heuristic_config(shape)
        assert not w8a8_module.config_problems(config, shape), (n, kdim, config)


def _configs_shape(n, kdim, m=64):
    qw = QuantizedExperts(
        qweight=jax.ShapeDtypeStruct((4, n, kdim // 4), jnp.uint32),
        scales=jax.ShapeDtypeStruct((4, n, 1), jnp.bfloat16),
        zeros=None,
        bits=8,
        group_size=-1,
    )
    return w8a8_module.gemm_shape(qw, m)


def test_w8a8_config_too_narrow_for_int8_dot_raises_before_any_kernel(rng, monkeypatch):
    x, w13, w2, tw, ti = w8a8_inputs(rng, T=3, H=128, I=128, E=8, k=2)
    monkeypatch.setattr(pl, "pallas_call", _no_kernel)
    config = BlockConfig(block_m=16, block_n=32, block_k=64)  # "slices": 16 features per dot
    with pytest.raises(ValueError, match="contracts 16 features per int8 dot, below 32"):
        wj.fused_moe(
            x,
            w13,
            w2,
            tw,
            ti,
            activation_quant=PER_TOKEN,
            config=config,
            implementation=IMPLEMENTATION,
        )


def test_w8a8_gemm_refuses_other_weights(rng):
    qw = helpers.random_quantized_experts(rng, 2, 32, 128, 4, 32, True, BF16)
    a_q, a_s = _activations.quantize_activations_per_token(jnp.ones((3, 128)))
    routing = _reference.moe_align_block_size(
        jnp.zeros((3, 1), jnp.int32), num_experts=2, block_m=16
    )
    with pytest.raises(ValueError, match=r"bits=4 \(needs 8\), group_size=32 .*zero points"):
        w8a8_module.w8a8_gemm(a_q, a_s, qw, routing, top_k=1, config=BlockConfig(16, 32, 128))


# ---- online quantization and checkpoints ----------------------------------------------------


def test_quantize_experts_gives_w8a8_weights(rng):
    """quantize_experts(w, bits=8, group_size=-1, has_zp=False) is per-channel symmetric int8
    with the implicit zero 128: signed q - 128 in [-128, 127], one scale per output row."""
    w = jnp.asarray(rng.normal(size=(3, 32, 128)), jnp.float32)
    qw = wj.quantize_experts(w, bits=8, group_size=-1, has_zp=False)
    assert qw.bits == 8 and qw.group_size == -1 and qw.zeros is None
    assert qw.scales.shape == (3, 32, 1)
    assert not w8a8_module.weight_problems(qw)
    signed = helpers.numpy_unpack_k(qw.qweight, 8) - 128
    assert signed.min() >= -128 and signed.max() <= 127
    step = np.asarray(qw.scales, np.float64)
    err = np.abs(helpers.numpy_dequantize(qw) - np.asarray(w, np.float64))
    # Half a step, plus the f32 rounding of scale = absmax / 127.5 (observed 1 + 1.4e-5).
    assert np.all(err <= 0.5 * step * (1 + 1e-4))


def test_compressed_tensors_int8_tensor_strategy(rng):
    """int-quantized per-tensor int8 loads as per-channel weights with the scale repeated."""
    n, kdim = 48, 64
    w = rng.integers(-128, 128, size=(n, kdim)).astype(np.int8)
    scale = np.array([0.02], np.float32)
    kw = dict(num_bits=8, group_size=None, symmetric=True)
    qw = formats.from_compressed_tensors_int(w, scale, strategy="tensor", **kw)
    ch = formats.from_compressed_tensors_int(
        w, np.full((n, 1), 0.02, np.float32), strategy="channel", **kw
    )
    assert (qw.bits, qw.group_size, qw.zeros) == (8, -1, None)
    np.testing.assert_array_equal(np.asarray(qw.qweight), np.asarray(ch.qweight))
    np.testing.assert_array_equal(np.asarray(qw.scales), np.asarray(ch.scales))
    np.testing.assert_array_equal(
        helpers.numpy_dequantize(qw)[0], w.astype(np.float64) * np.float64(np.float32(0.02))
    )
    with pytest.raises(ValueError, match=r"strategy='tensor' needs one weight_scale value"):
        formats.from_compressed_tensors_int(w, np.ones((n, 1), np.float32), strategy="tensor", **kw)
    # A W8A8 config with per-tensor weights, through from_quantization_config.
    prefix = "model.layers.0.mlp.experts.0.up_proj"
    config = _w8a8_config(weights_strategy="tensor", acts=dict(strategy="token", dynamic=True))
    tensors = {f"{prefix}.weight": w, f"{prefix}.weight_scale": scale}
    loaded = formats.from_quantization_config(tensors, config, prefix)
    np.testing.assert_array_equal(np.asarray(loaded.scales), np.asarray(qw.scales))


def _w8a8_config(*, weights_strategy="channel", acts=None) -> dict:
    weights = dict(num_bits=8, type="int", symmetric=True, strategy=weights_strategy)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    if acts is not None:
        group["input_activations"] = dict(num_bits=8, type="int", symmetric=True, **acts)
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": group},
    }


@pytest.mark.parametrize(
    "acts, want",
    [
        (None, None),
        (dict(strategy="token", dynamic=True), wj.ActivationQuant("int8_per_token")),
        (dict(strategy="tensor", dynamic=False), wj.ActivationQuant("int8_static")),
    ],
    ids=["weight-only", "dynamic-token", "static-tensor"],
)
def test_activation_quant_from_config(acts, want):
    prefix = "model.layers.3.mlp.experts.7.up_proj"
    assert formats.activation_quant_from_config(_w8a8_config(acts=acts), prefix) == want
    assert formats.activation_quant_from_config({"quant_method": "awq"}, prefix) is None


@pytest.mark.parametrize(
    "acts, message",
    [
        (dict(strategy="tensor", dynamic=True), "strategy='tensor' with dynamic=True"),
        (dict(strategy="token", dynamic=True, symmetric=False), "symmetric=False"),
        (dict(strategy="token", dynamic=True, num_bits=4), "num_bits=4"),
        (dict(strategy="token", dynamic=True, type="float"), "type='float'"),
    ],
)
def test_activation_quant_from_config_refuses(acts, message):
    config = _w8a8_config(acts={k: v for k, v in acts.items() if k in ("strategy", "dynamic")})
    config["config_groups"]["group_0"]["input_activations"].update(acts)
    with pytest.raises(ValueError, match=message):
        formats.activation_quant_from_config(config, "model.layers.0.mlp.experts.0.up_proj")
    with pytest.raises(ValueError, match="quant_method='exl2'"):
        formats.activation_quant_from_config({"quant_method": "exl2"}, "x")


def test_static_input_scale():
    tensors = {f"e{i}.input_scale": np.array([0.1 * (i + 1)], np.float32) for i in range(3)}
    assert formats.static_input_scale(tensors, ["e0", "e2"]) == pytest.approx(0.3)
    aq = dataclasses.replace(
        wj.ActivationQuant("int8_static"),
        gemm1_scale=formats.static_input_scale(tensors, ["e0", "e1"]),
        gemm2_scale=formats.static_input_scale(tensors, ["e2"]),
    )
    assert aq.has_scales and aq.gemm1_scale == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"missing tensors \['e9.input_scale'\]"):
        formats.static_input_scale(tensors, ["e0", "e9"])
    with pytest.raises(ValueError, match="one positive finite value"):
        formats.static_input_scale({"a.input_scale": np.ones(4, np.float32)}, ["a"])


# ---- the backend oracle ---------------------------------------------------------------------


def _problem(**changes) -> _dispatch.MoEProblem:
    base = dict(
        platform="cpu",
        num_tokens=3,
        hidden=128,
        intermediate=64,
        num_experts=4,
        num_global_experts=4,
        top_k=2,
        bits=8,
        group_size=-1,
        w13_group=128,
        w2_group=64,
        has_zeros=False,
        dtype="bfloat16",
        activation="silu",
        w2_bits=8,
        w2_group_size=-1,
        w2_has_zeros=False,
        activation_quant="int8_per_token",
    )
    return _dispatch.MoEProblem(**(base | changes))


def test_backend_reasons_for_w8a8():
    interp = _dispatch.get_backend("pallas_interpret").unsupported_reason
    xla = _dispatch.XLA_BACKEND.unsupported_reason
    assert _problem().gemm_input_dtype == "int8"
    assert _problem(activation_quant=None).gemm_input_dtype == "bfloat16"
    assert interp(_problem()) is None and xla(_problem()) is None
    # W4A8, grouped or asymmetric int8 weights: the kernels refuse, the oracle runs them.
    for bad, words in [
        (dict(bits=4, group_size=128, w13_group=128), "w13 is int4 group_size=128 symmetric"),
        (dict(w2_group_size=32, w2_group=32), "w2 is int8 group_size=32"),
        (dict(has_zeros=True), "w13 is int8 group_size=-1 with zero points"),
        (dict(activation_quant="int8_static", w2_has_zeros=True), "(int8_static)"),
    ]:
        reason = interp(_problem(**bad))
        assert reason is not None and words in reason, (bad, reason)
        assert "bits=8, group_size=-1, zeros=None" in reason
        assert xla(_problem(**bad)) is None
    assert "I=48 is not a multiple of 32" in interp(_problem(intermediate=48, w2_group=48))
    # group_size equal to K is per-channel too.
    assert interp(_problem(group_size=128, w2_group_size=64)) is None


def test_mgpu_w8a8_from_64_rows_per_expert(rng):
    """From 64 rows per expert, per-channel W8A8 on mgpu takes 128-row blocks (halved down to 16
    rows) whose int32 sums are carried over all k-steps and scaled once."""
    x, w13, w2, tw, ti = w8a8_inputs(rng, T=264, H=128, I=64, E=8, k=2)
    mgpu = [wj.layouts.to_kernel_layout(w, "mgpu_int8") for w in (w13, w2)]
    cfg = mgpu_config.layer_config(None, 264 * 2, 8, *mgpu, int8_rows=True)
    assert (cfg.block_m, cfg.consumers, cfg.bf16_weights) == (128, 2, False)
    out = wj.fused_moe(x, *mgpu, tw, ti, activation_quant=PER_TOKEN,
                       implementation=TestW8A8MosaicGpu.IMPLEMENTATION)  # fmt: skip
    ref = wj.fused_moe(x, w13, w2, tw, ti, activation_quant=PER_TOKEN, implementation="xla")
    assert_moe_close(out, ref, W8A8_VS_ORACLE[BF16], "128-row W8A8 layer")


def test_mgpu_reasons_for_w8a8():
    """The Mosaic GPU backend runs W8A8 on symmetric int8 weights, per channel or in groups of
    whole k-tiles, whatever x's dtype; int4 weights or zero points are refused by name."""
    mgpu = _dispatch.get_backend("mgpu_interpret").unsupported_reason
    ok = dict(layout="mgpu_int8")
    assert mgpu(_problem(**ok)) is None
    assert mgpu(_problem(**ok, dtype="float32")) is None
    assert mgpu(_problem(**ok, group_size=64, w13_group=64, w2_group=64)) is None
    assert mgpu(_problem(**ok, activation_quant=None, dtype="float32")) is not None  # WNA16 f32
    reason = mgpu(_problem(**ok, has_zeros=True))
    assert "need symmetric int8 weights" in reason and "w13 is int8 with zero points" in reason
    reason = mgpu(_problem(layout="mgpu_int4", bits=4, w2_bits=4, group_size=64, w13_group=64,
                           w2_group_size=64, w2_group=64))  # fmt: skip
    assert "w13 is int4" in reason and "w2 is int4" in reason
    assert "not a multiple of 64" in mgpu(_problem(**ok, group_size=32, w13_group=32))


def test_w8a8_with_int4_weights_names_every_reason(rng, monkeypatch):
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=3, H=128, I=128, E=4, k=2)
    monkeypatch.setattr(pl, "pallas_call", _no_kernel)
    with pytest.raises(NotImplementedError) as err:
        wj.fused_moe(
            x, w13, w2, tw, ti, activation_quant=PER_TOKEN, implementation="pallas_interpret"
        )
    msg = str(err.value)
    assert "backend 'pallas_interpret' cannot run this fused_moe" in msg
    assert "need int8 per-channel symmetric weights" in msg and "w13 is int4 group_size=32" in msg
    with pytest.raises(NotImplementedError) as err:
        wj.fused_moe(
            x,
            w13,
            w2,
            tw,
            ti,
            activation_quant=PER_TOKEN,
            implementation=["pallas", "pallas_interpret"],
        )
    msg = str(err.value)
    assert msg.startswith("no fused_moe backend can run this problem")
    assert "pallas:" in msg and "pallas_interpret: int8 activations" in msg, msg


def test_automatic_choice_for_w4a8_is_the_oracle(rng, caplog, monkeypatch):
    if _dispatch.current_platform() != "cpu":
        pytest.skip("checks the CPU priority list")
    monkeypatch.setattr(_configs, "_logged", set())
    caplog.set_level(logging.INFO, logger="wna16_jax")
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=3, H=128, I=64, E=4, k=2)
    out = wj.fused_moe(x, w13, w2, tw, ti, activation_quant="int8_per_token")
    ref = wj.fused_moe(x, w13, w2, tw, ti, activation_quant=PER_TOKEN, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert "wna16_jax: fused_moe uses 'xla' (candidates: xla)" in [
        r.getMessage() for r in caplog.records
    ]


def test_pipeline_logs_w8a8_configs(rng, caplog, monkeypatch):
    """The W8A8 GEMM configs are resolved by their own rules and logged (no kernel runs)."""
    monkeypatch.setattr(_configs, "_logged", set())
    caplog.set_level(logging.INFO, logger="wna16_jax")
    _, w13, w2, _, _ = w8a8_inputs(rng, T=3, H=128, I=64, E=4, k=2)
    c1, c2 = pallas_moe.gemm_configs(6, w13, w2, None, activation_quant=PER_TOKEN)
    assert c1.block_m == c2.block_m
    assert (c2.unpack, c2.block_k) == ("tile", 64)  # I=64: a slice would contract 16
    assert any("W8A8 (int8_per_token)" in r.getMessage() for r in caplog.records)


# ---- example ---------------------------------------------------------------------------------


def test_benchmark_w8a8_smoke(tmp_path, monkeypatch):
    path = Path(__file__).resolve().parents[1] / "examples" / "benchmark.py"
    # load_script registers the module (its dataclass looks itself up); monkeypatch puts
    # sys.modules back afterwards (setitem, unlike delitem, also undoes a name that was absent)
    monkeypatch.setitem(sys.modules, "example_benchmark", None)
    benchmark = helpers.load_script(path, "example_benchmark", [path.parent])
    result = benchmark.main(
        [
            "--activation-quant",
            "int8_per_token",
            "--implementations",
            "xla",
            "--m",
            "2",
            "--repeats",
            "1",
            "--iters",
            "1",
            "--sets",
            "1",
            "--json",
            str(tmp_path / "b.json"),
        ]
    )
    assert result["problem"]["activation_quant"] == "int8_per_token"
    assert result["problem"]["bits"] == 8 and result["problem"]["group_size"] == -1
    assert [r["M"] for r in result["rows"]] == [2]
    assert (tmp_path / "b.json").exists()


# ---- GPU only: DeepSeek-V3 ------------------------------------------------------------------

DSV3_E, DSV3_TOP_K, DSV3_H, DSV3_I = 256, 8, 7168, 2048
# Compiled kernels against the 'xla' oracle at DeepSeek-V3 sizes (bf16 output).
DSV3_TOL = 1e-2


def device_int8_experts(key, e: int, n: int, k: int) -> QuantizedExperts:
    """Random int8 per-channel symmetric weights generated on the device; a dequantized weight is
    ~1/sqrt(K), as in helpers.random_quantized_experts."""
    kq, ks = jax.random.split(key)
    qweight = jax.random.bits(kq, (e, n, k // 4), jnp.uint32)
    scales = jax.random.uniform(ks, (e, n, 1), jnp.float32, 0.5, 1.5) / (128 * math.sqrt(k))
    return QuantizedExperts(qweight, scales.astype(BF16), None, bits=8, group_size=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("activation_quant", [None, "int8_per_token"], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("m", [1, 256, 4096])
def test_deepseek_v3_int8(rng, m, activation_quant):
    """DeepSeek-V3 at TP=1 with int8 per-channel experts: w13's qweight is uint32
    [256, 4096, 1792] (1.88e9 elements, under 2^31; 7.5e9 bytes)."""
    key = jax.random.key(int(rng.integers(2**31)))
    k13, k2, kx = jax.random.split(key, 3)
    w13 = device_int8_experts(k13, DSV3_E, 2 * DSV3_I, DSV3_H)
    w2 = device_int8_experts(k2, DSV3_E, DSV3_H, DSV3_I)
    assert w13.qweight.shape == (256, 4096, 1792) and w13.qweight.size < 2**31 - 1
    x = jax.random.normal(kx, (m, DSV3_H), BF16)
    tw, ti = helpers.random_routing(rng, m, DSV3_TOP_K, DSV3_E)
    out, ref = run_both(
        x, w13, w2, jnp.asarray(tw), jnp.asarray(ti), activation_quant=activation_quant
    )
    assert_moe_close(out, ref, DSV3_TOL, f"pallas vs xla at DeepSeek-V3 ({activation_quant})")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 256, 4096])
def test_deepseek_v3_w8a8_mgpu(rng, m):
    """W8A8 on the Mosaic GPU GEMM (mgpu_int8 weights) at DeepSeek-V3 TP=1 against the 'xla'
    oracle on the same weights."""
    key = jax.random.key(int(rng.integers(2**31)))
    k13, k2, kx = jax.random.split(key, 3)
    w13 = device_int8_experts(k13, DSV3_E, 2 * DSV3_I, DSV3_H)
    w2 = device_int8_experts(k2, DSV3_E, DSV3_H, DSV3_I)
    x = jax.random.normal(kx, (m, DSV3_H), BF16)
    tw, ti = (jnp.asarray(a) for a in helpers.random_routing(rng, m, DSV3_TOP_K, DSV3_E))
    ref = wj.fused_moe(x, w13, w2, tw, ti, activation_quant=PER_TOKEN, implementation="xla")
    mgpu = [wj.layouts.to_kernel_layout(w, "mgpu_int8") for w in (w13, w2)]
    del w13, w2
    out = wj.fused_moe(x, *mgpu, tw, ti, activation_quant=PER_TOKEN, implementation="mgpu")
    assert_moe_close(out, ref, DSV3_TOL, "mgpu vs xla at DeepSeek-V3 (int8_per_token)")


@pytest.mark.gpu
def test_deepseek_v3_w8a8_static(rng):
    key = jax.random.key(int(rng.integers(2**31)))
    k13, k2, kx = jax.random.split(key, 3)
    w13 = device_int8_experts(k13, DSV3_E, 2 * DSV3_I, DSV3_H)
    w2 = device_int8_experts(k2, DSV3_E, DSV3_H, DSV3_I)
    x = jax.random.normal(kx, (256, DSV3_H), BF16)
    tw, ti = helpers.random_routing(rng, 256, DSV3_TOP_K, DSV3_E)
    aq = static_scales(x)
    out, ref = run_both(x, w13, w2, jnp.asarray(tw), jnp.asarray(ti), activation_quant=aq)
    assert_moe_close(out, ref, DSV3_TOL, "pallas vs xla at DeepSeek-V3 (int8_static)")
