"""MXFP4 weights (E2M1 codes, E8M0 scales): decode, quantization, the Hub layout, gpt-oss's math."""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from wna16_jax.formats import mxfp4

# ---- decode ---------------------------------------------------------------------------------


def test_dequantize_is_the_ocp_definition_for_every_code_and_scale():
    """Every one of the 16 codes times every E8M0 byte (subnormal and overflowing products
    included) equals the float64 definition rounded once to f32, bit for bit; -0 stays -0 and
    the byte 255 is NaN."""
    codes = np.tile(np.arange(16, dtype=np.uint8), (256, 2))  # [256, 32]: two of each code
    x = np.arange(256, dtype=np.uint8)[:, None]  # [256, 1] every E8M0 byte
    words = wj._quant.pack_k(codes[None], 4)  # [1, 256, 4]
    qw = wj.QuantizedExperts(
        qweight=jnp.asarray(words), scales=jnp.asarray(x[None]), zeros=None, bits=4,
        group_size=32, codes="e2m1",
    )  # fmt: skip
    out = np.asarray(wj.dequantize_experts(qw))[0]  # [256, 32] f32
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in f32
        want = helpers.numpy_dequantize(qw)[0].astype(np.float32)
    nan = x[:, 0] == 255
    assert np.isnan(out[nan]).all()
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.signbit(out[127, 8]) and out[127, 8] == 0  # code 8 is -0
    assert out[127].tolist()[:16] == helpers.NUMPY_E2M1.tolist()  # scale 1: the values
    host = wj._quant.dequantize_mxfp4_codes(codes, x)  # numpy in, numpy out
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host.view(np.uint32), out.view(np.uint32))


# ---- quantization ---------------------------------------------------------------------------


def _openai_downcast(w: np.ndarray):
    """A numpy port of the bit operations of OpenAI's downcast_to_mxfp (triton_kernels,
    e2m1 with DequantScaleRoundingMode.ROUND_UP) on f32 w [N, K]: (codes [N, K], E8M0 [N, K/32])."""
    n, k = w.shape
    wg = w.astype(np.float32).reshape(n, k // 32, 32)
    amax = np.abs(wg).max(-1)
    scale = (amax / np.float32(6.0)).astype(np.float32).view(np.uint32)
    scale = (scale + np.uint32(0x7FFFFF)) & np.uint32(0x7F800000)  # rounded up to 2^e
    x = (scale >> np.uint32(23)).astype(np.uint8)
    s = scale.view(np.float32)
    quant = np.where(s[..., None] == 0, 0, wg / np.where(s == 0, 1, s)[..., None])
    b = quant.astype(np.float32).view(np.uint32)
    signs = b & np.uint32(0x80000000)
    exps = ((b >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int64)
    mant = (b & np.uint32(0x7FFFFF)).astype(np.int64)
    adj = np.clip(127 - (exps + 1), 0, 31)
    mant = np.where(exps < 127, (0x400000 | (mant >> 1)) >> adj, mant)
    exps = np.maximum(exps, 126) - 126
    e2m1 = np.minimum((((exps << 2) | (mant >> 21)) + 1) >> 1, 7)
    codes = ((signs >> np.uint32(28)).astype(np.int64) | e2m1).astype(np.uint8)
    return codes.reshape(n, k), x


def test_quantize_matches_openai_downcast(rng):
    """quantize_experts(scheme="mxfp4") gives OpenAI's codes and scales: random weights with
    blocks of very different magnitudes, exact ties (0.25, 0.75, 1.25, ..., 5 times the scale),
    values past 6 times the scale, -0 and an all-zero block."""
    n, k = 8, 256
    w = rng.normal(size=(n, k)) * np.exp2(rng.integers(-20, 20, size=(n, k // 32, 1))).repeat(
        32, -1
    ).reshape(n, k)
    w = w.astype(np.float32)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    w[0, :32] = rng.uniform(-1, 1, size=32)
    w[0, :8], w[0, 8:16] = ties, -ties  # amax 6: scale 1
    w[0, 16:18] = (-0.0, 0.1)
    w[1, 32:64] = 0.0  # an all-zero block
    qw = wj.quantize_experts(w[None], scheme="mxfp4")
    codes, x = _openai_downcast(w)
    np.testing.assert_array_equal(helpers.numpy_unpack_k(qw.qweight, 4)[0], codes)
    np.testing.assert_array_equal(np.asarray(qw.scales)[0], x)
    assert np.asarray(qw.scales)[0, 0, 0] == 127 and np.asarray(qw.scales)[0, 1, 1] == 0
    deq = np.asarray(wj.dequantize_experts(qw))[0]
    np.testing.assert_array_equal(deq[0, :8], [0.5, 1, 1.5, 2, 3, 4, 6, 6])  # ties away from 0
    assert np.signbit(deq[0, 16]) and deq[0, 17] == 0
    # Every value within half a step of its block's grid (steps of 2 * scale at most).
    step = np.repeat(helpers.numpy_e8m0(np.asarray(qw.scales)[0]), 32, -1) * 2
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-6))


def test_quantize_grid_values_round_trip(rng):
    """Weights that are MXFP4 values already quantize to themselves."""
    w = wj.random_quantized_experts(rng, (2, 16, 64), scheme="mxfp4")
    deq = wj.dequantize_experts(w)
    again = wj.quantize_experts(deq, scheme="mxfp4")
    np.testing.assert_array_equal(np.asarray(wj.dequantize_experts(again)), np.asarray(deq))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(scheme="mxfp4", group_size=64), "group_size=32"),
        (dict(scheme="mxfp4", has_zp=True), "has_zp=False"),
        (dict(scheme="mxfp4", bits=8), "bits=4"),
        (dict(scheme="mxfp4", scale_dtype=jnp.bfloat16), "uint8 E8M0"),
        (dict(scheme="nvfp4"), "is not one of"),
    ],
)
def test_quantize_refuses_other_mxfp4_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        wj.quantize_experts(jnp.ones((1, 4, 64)), **kwargs)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(group_size=64), "group_size=32"),
        (dict(bits=8), "bits=4"),
        (dict(scales=jnp.ones((1, 4, 2), jnp.bfloat16)), "uint8 E8M0"),
        (dict(zeros=jnp.zeros((1, 2, 2), jnp.uint8)), "zeros=None"),
        (dict(codes="fp8"), "codes='fp8'"),
    ],
)
def test_validate_names_what_mxfp4_needs(changes, message):
    import dataclasses

    w = wj.random_quantized_experts(np.random.default_rng(0), (1, 4, 64), scheme="mxfp4")
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(w, **changes).validate("w13")


# ---- the Hub layout -------------------------------------------------------------------------


def _transformers_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [E, N, K] as transformers' convert_moe_packed_tensors reads the Hub's tensors
    (before its final transpose): low nibble = even input, high nibble = odd input."""
    lo, hi = blocks & 0xF, blocks >> 4
    vals = np.stack([helpers.NUMPY_E2M1[lo], helpers.NUMPY_E2M1[hi]], axis=-1)  # [E,N,G,16,2]
    vals = vals.reshape(*blocks.shape[:3], 32) * helpers.numpy_e8m0(scales)[..., None]
    return vals.reshape(*blocks.shape[:2], -1)


def test_from_blocks_reads_the_hub_layout_and_round_trips(rng):
    e, n, k = 3, 8, 96
    blocks = rng.integers(0, 256, size=(e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, size=(e, n, k // 32), dtype=np.uint8)
    qw = mxfp4.from_blocks(blocks, scales)
    assert qw.shape == (e, n, k) and qw.is_mxfp4 and qw.scales.dtype == jnp.uint8
    np.testing.assert_array_equal(
        np.asarray(wj.dequantize_experts(qw)), _transformers_dequantize(blocks, scales)
    )
    back_blocks, back_scales = mxfp4.to_blocks(qw)
    np.testing.assert_array_equal(back_blocks, blocks)
    np.testing.assert_array_equal(back_scales, scales)
    one = mxfp4.from_blocks(blocks[1], scales[1])  # one layer: E = 1
    np.testing.assert_array_equal(np.asarray(one.qweight)[0], np.asarray(qw.qweight)[1])


@pytest.mark.parametrize(
    "blocks, scales, message",
    [
        (np.zeros((1, 4, 2, 16), np.int8), np.zeros((1, 4, 2), np.uint8), "blocks must be uint8"),
        (np.zeros((1, 4, 2, 8), np.uint8), np.zeros((1, 4, 2), np.uint8), r"\[E, N, K/32, 16\]"),
        (np.zeros((1, 4, 2, 16), np.uint8), np.zeros((1, 4, 3), np.uint8), "scales shape"),
    ],
)
def test_from_blocks_refuses_bad_tensors(blocks, scales, message):
    with pytest.raises(ValueError, match=message):
        mxfp4.from_blocks(blocks, scales)


def test_deinterleave_gate_up(rng):
    """Even rows are gate, odd rows up -> [gate; up]; the inverse restores the order; blocks,
    scales and the bias of one checkpoint give one w13 whose rows match."""
    e, i, h = 2, 4, 64
    inter = rng.integers(0, 256, size=(e, 2 * i, h // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, size=(e, 2 * i, h // 32), dtype=np.uint8)
    bias = rng.normal(size=(e, 2 * i)).astype(np.float32)
    w13 = mxfp4.from_blocks(mxfp4.deinterleave_gate_up(inter), mxfp4.deinterleave_gate_up(scales))
    b13 = mxfp4.deinterleave_gate_up(bias)
    dense = _transformers_dequantize(inter, scales)  # [E, 2I, H] interleaved
    np.testing.assert_array_equal(np.asarray(wj.dequantize_experts(w13))[:, :i], dense[:, 0::2])
    np.testing.assert_array_equal(np.asarray(wj.dequantize_experts(w13))[:, i:], dense[:, 1::2])
    np.testing.assert_array_equal(b13, np.concatenate([bias[:, 0::2], bias[:, 1::2]], axis=1))
    np.testing.assert_array_equal(mxfp4.interleave_gate_up(b13), bias)
    assert isinstance(mxfp4.deinterleave_gate_up(jnp.asarray(bias)), jax.Array)
    with pytest.raises(ValueError, match="odd"):
        mxfp4.deinterleave_gate_up(bias[:, :3])


# ---- gpt-oss's expert math ------------------------------------------------------------------


def _numpy_gpt_oss_moe(x, w13, w2, b13, b2, tw, ids, alpha=1.702, limit=7.0):
    """float64, as transformers' GptOssExperts computes it on [gate; up] rows."""
    x = np.asarray(x, np.float64)
    t, _ = x.shape
    i = w13.shape[1] // 2
    out = np.zeros((t, w2.shape[1]))
    for s in range(t):
        for j in range(ids.shape[1]):
            e = int(ids[s, j])
            h = w13[e] @ x[s] + b13[e]
            gate, up = np.minimum(h[:i], limit), np.clip(h[i:], -limit, limit)
            act = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[s] += tw[s, j] * (w2[e] @ act + b2[e])
    return out


@pytest.mark.parametrize("activation", ["swiglu_oai", wj.ClampedSwiGLU(alpha=1.5, limit=3.0)])
def test_gpt_oss_layer_on_xla(rng, activation):
    """MXFP4 experts with both biases and the clamped SwiGLU match the float64 layer; the
    clamps are reached (gate above the limit, up on both sides)."""
    t, e, k, h, i = 6, 8, 4, 128, 64
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w13 = wj.random_quantized_experts(rng, (e, 2 * i, h), scheme="mxfp4", std=0.5)
    w2 = wj.random_quantized_experts(rng, (e, h, i), scheme="mxfp4", std=0.1)
    b13 = rng.normal(size=(e, 2 * i)).astype(np.float32)
    b2 = rng.normal(size=(e, h)).astype(np.float32)
    tw, ids = helpers.random_routing(rng, t, k, e)
    out = wj.fused_moe(
        x, w13, w2, jnp.asarray(tw), jnp.asarray(ids), activation=activation,
        w13_bias=jnp.asarray(b13), w2_bias=jnp.asarray(b2), out_dtype=jnp.float32,
        implementation="xla",
    )  # fmt: skip
    fn = activation if isinstance(activation, wj.ClampedSwiGLU) else wj.ClampedSwiGLU()
    w13d, w2d = helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2)
    hid = np.einsum("th,enh->ten", np.asarray(x, np.float64), w13d) + b13  # [T, E, 2I]
    assert (hid[..., :i] > fn.limit).any() and (np.abs(hid[..., i:]) > fn.limit).any()
    want = _numpy_gpt_oss_moe(x, w13d, w2d, b13, b2, tw, ids, fn.alpha, fn.limit)
    helpers.assert_finite_and_close(np.asarray(out), want, 1e-5, "gpt-oss layer vs float64")


def test_biases_are_checked_and_refused_by_backends_without_them(rng):
    t, e, k, h, i = 3, 4, 2, 64, 64
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w13 = wj.random_quantized_experts(rng, (e, 2 * i, h), bits=4, group_size=32)
    w2 = wj.random_quantized_experts(rng, (e, h, i), bits=4, group_size=32)
    tw, ids = (jnp.asarray(a) for a in helpers.random_routing(rng, t, k, e))
    with pytest.raises(ValueError, match=r"w13_bias must be \[E, N\] = \[4, 128\]"):
        wj.fused_moe(x, w13, w2, tw, ids, w13_bias=jnp.zeros((e, i)))
    with pytest.raises(ValueError, match="w2_bias dtype"):
        wj.fused_moe(x, w13, w2, tw, ids, w2_bias=jnp.zeros((e, h), jnp.int32))
    with pytest.raises(NotImplementedError, match="no per-expert biases"):
        wj.fused_moe(
            x, w13, w2, tw, ids, w2_bias=jnp.ones((e, h)), implementation="pallas_interpret"
        )
    with pytest.raises(ValueError, match="activation='gelu'"):
        wj.fused_moe(x, w13, w2, tw, ids, activation="gelu")
    with pytest.raises(ValueError, match="alpha"):
        wj.ClampedSwiGLU(alpha=-1.0)
