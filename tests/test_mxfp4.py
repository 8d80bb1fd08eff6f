"""MXFP4 weights (E2M1 codes, E8M0 scales): decode, quantization, the Hub layout, gpt-oss's math."""

from __future__ import annotations

import dataclasses

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from pallas_kernels.common.block_configs import config_problems
from pallas_kernels.mgpu import convert as mgpu_convert
from pallas_kernels.pallas.wna16_gemm import wna16_gemm
from wna16_jax._configs import GemmShape
from wna16_jax._types import BlockConfig
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


# (implementation, config): 'xla'; the Pallas layer (interpreted) with its own configs (the
# activation and the biases in GEMM1's epilogue) and with split-K (GEMM1's biases added by the
# first split, the activation after the sum); the Mosaic GPU layer (interpreted, mgpu_int4
# weights) with its own configs (both in the epilogues of 8-row blocks; its other paths:
# tests/test_mgpu_gemm.py).
GPT_OSS_CASES = [
    ("xla", None),
    ("pallas_interpret", None),
    ("pallas_interpret", BlockConfig(block_m=16, block_n=64, block_k=64, split_k=2, unpack="tile")),
    ("mgpu_interpret", None),
]


@pytest.mark.parametrize("activation", ["swiglu_oai", wj.ClampedSwiGLU(alpha=1.5, limit=3.0)])
@pytest.mark.parametrize(
    "implementation, config",
    GPT_OSS_CASES,
    ids=["xla", "pallas", "pallas-split-k", "mgpu"],
)
def test_gpt_oss_layer(rng, activation, implementation, config):
    """MXFP4 experts with both biases and the clamped SwiGLU match the float64 layer; the
    clamps are reached (gate above the limit, up on both sides). 'xla' keeps the activation in
    f32 (tolerance of f32 sums); the kernels round it to bf16 before GEMM2 (bf16's)."""
    t, e, k, h, i = 6, 8, 4, 256, 128
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w13 = wj.random_quantized_experts(rng, (e, 2 * i, h), scheme="mxfp4", std=0.5)
    w2 = wj.random_quantized_experts(rng, (e, h, i), scheme="mxfp4", std=0.1)
    b13 = rng.normal(size=(e, 2 * i)).astype(np.float32)
    b2 = rng.normal(size=(e, h)).astype(np.float32)
    tw, ids = helpers.random_routing(rng, t, k, e)
    layout = wj.backend_layout(implementation, 4)
    out = wj.fused_moe(
        x, wj.layouts.to_kernel_layout(w13, layout), wj.layouts.to_kernel_layout(w2, layout),
        jnp.asarray(tw), jnp.asarray(ids), activation=activation, w13_bias=jnp.asarray(b13),
        w2_bias=jnp.asarray(b2), out_dtype=jnp.float32, implementation=implementation,
        config=config,
    )  # fmt: skip
    fn = activation if isinstance(activation, wj.ClampedSwiGLU) else wj.ClampedSwiGLU()
    w13d, w2d = helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2)
    hid = np.einsum("th,enh->ten", np.asarray(x, np.float64), w13d) + b13  # [T, E, 2I]
    assert (hid[..., :i] > fn.limit).any() and (np.abs(hid[..., i:]) > fn.limit).any()
    want = _numpy_gpt_oss_moe(x, w13d, w2d, b13, b2, tw, ids, fn.alpha, fn.limit)
    tol = 1e-5 if implementation == "xla" else helpers.tolerance(jnp.bfloat16)
    helpers.assert_finite_and_close(
        np.asarray(out), want, tol, f"gpt-oss layer on {implementation} vs float64", slack=5.0
    )


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
    s13, s2 = (
        wj.layouts.to_kernel_layout(
            wj.random_quantized_experts(rng, shape, bits=8, group_size=-1, has_zeros=False),
            "mgpu_int8",
        )
        for shape in ((e, 2 * i, h), (e, h, i))
    )
    with pytest.raises(NotImplementedError, match="biases with int8 activations"):
        wj.fused_moe(
            x, s13, s2, tw, ids, w2_bias=jnp.ones((e, h)), implementation="mgpu_interpret",
            activation_quant=wj.ActivationQuant("int8_per_token"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="activation='gelu'"):
        wj.fused_moe(x, w13, w2, tw, ids, activation="gelu")
    with pytest.raises(ValueError, match="alpha"):
        wj.ClampedSwiGLU(alpha=-1.0)


# ---- the Pallas kernel's paths --------------------------------------------------------------


def _pallas_configs() -> list[BlockConfig]:
    """Configs of every decode path of the Pallas GEMM on MXFP4 (K=256): one group per k-tile
    and several, each unpack mode, tensor-core and CUDA-core dots, split-K."""
    shape = GemmShape(m=8, n=64, k=256, num_experts=4, bits=4, group=32, group_size=32,
                      scale_bytes=1, codes="e2m1")  # fmt: skip
    out = []
    for unpack in ("slices", "tile", "join"):
        for dot, block_m in (("mma", 16), ("fma", 4)):
            for block_k in (32, 64, 128, 256):
                for split_k in (1, 2):
                    cfg = BlockConfig(block_m=block_m, block_n=32, block_k=block_k,
                                      split_k=split_k, unpack=unpack, dot=dot)  # fmt: skip
                    if not config_problems(cfg, shape) and 256 // block_k % split_k == 0:
                        out.append(cfg)
    return out


# Every path in bf16; f32 and f16 activations on the one-k-step configs of each unpack mode.
PALLAS_CASES = [(c, jnp.bfloat16) for c in _pallas_configs()] + [
    (c, dtype)
    for c in _pallas_configs()
    if c.block_k == 256 and c.dot == "mma"
    for dtype in (jnp.float16, jnp.float32)
]


@pytest.mark.parametrize(
    "config, dtype", PALLAS_CASES, ids=[f"{c}-{jnp.dtype(d).name}" for c, d in PALLAS_CASES]
)
def test_pallas_gemm_paths(rng, config, dtype):
    """Every path of the Pallas grouped GEMM (interpreted) on MXFP4 weights whose scales lie on
    both sides of 1 matches the f32 reference on the same weights: E2M1 values times powers of
    two are exact in bf16, so each path is exact up to f32 summation order."""
    t, top_k, e, n, k = 4, 2, 4, 64, 256
    w = wj.random_quantized_experts(rng, (e, n, k), scheme="mxfp4", std=18.0)
    scales = np.asarray(w.scales)
    assert scales.min() < 127 < scales.max()
    a = jnp.asarray(rng.normal(size=(t, k)), dtype)
    _, ids = helpers.random_routing(rng, t, top_k, e)
    routing = wj.moe_align_block_size(
        jnp.asarray(ids), num_experts=e, block_m=config.block_m, implementation="xla"
    )
    out = wna16_gemm(
        a, w, routing, top_k=top_k, config=config, interpret=True, out_dtype=jnp.float32
    )
    rows = np.asarray(a, np.float64)[np.arange(t * top_k) // top_k]
    ref = np.einsum("sk,snk->sn", rows, helpers.numpy_dequantize(w)[ids.reshape(-1)])
    helpers.assert_finite_and_close(
        np.asarray(out), ref, 1e-5, f"pallas {config} {jnp.dtype(dtype).name}", slack=5.0,
        require_signal=True,
    )  # fmt: skip


# ---- the Mosaic GPU layout and converter ----------------------------------------------------


def test_mgpu_layout_round_trip(rng):
    """MXFP4 in the mgpu_int4 layout: codes as they are, scales as their bf16 values; back to
    the canonical layout exactly, the E8M0 bytes 0 (2^-127) and 255 (NaN) included."""
    w = wj.random_quantized_experts(rng, (2, 128, 128), scheme="mxfp4")
    scales = np.asarray(w.scales).copy()
    scales[0, 0, :2] = (0, 255)
    scales[1, 5, 1] = 254
    w = dataclasses.replace(w, scales=jnp.asarray(scales))
    kw = wj.layouts.to_kernel_layout(w, "mgpu_int4")
    assert kw.is_mxfp4 and kw.scales.dtype == jnp.bfloat16 and kw.scales.shape == (2, 4, 128)
    assert wj.layouts.to_kernel_layout(w, "mgpu_int4").layout == "mgpu_int4"
    back = wj.layouts.to_canonical_layout(kw)
    np.testing.assert_array_equal(np.asarray(back.qweight), np.asarray(w.qweight))
    np.testing.assert_array_equal(np.asarray(back.scales), scales)
    assert back.is_mxfp4 and back.layout == "canonical"


def test_mgpu_converter_pairs_every_code_pair():
    """The PTX of the converter's MXFP4 pairs (its tables and masks, run in Python as the
    instructions define them) makes the bf16 values of every two codes, other bits set."""
    values = np.asarray(helpers.NUMPY_E2M1, np.float32)
    for lo in range(16):
        for hi in range(16):
            word = lo | (hi << 16) | 0xABC0DEF0  # the word's other nibbles
            pair = mgpu_convert.e2m1_bf16_pair_reference(word)
            got = np.array([pair & 0xFFFF, pair >> 16], np.uint16)
            want = values[[lo, hi]].view(np.uint32) >> 16  # bf16: the f32's top half
            np.testing.assert_array_equal(got, want.astype(np.uint16), err_msg=f"{lo}, {hi}")


# ---- the Triton kernel ----------------------------------------------------------------------

needs_triton = helpers.needs_triton


@needs_triton
@pytest.mark.parametrize(
    "config",
    [
        BlockConfig(block_m=16, block_n=32, block_k=128, unpack="slices"),
        BlockConfig(block_m=16, block_n=32, block_k=32, unpack="tile"),
        BlockConfig(block_m=16, block_n=32, block_k=64, split_k=2, unpack="tile"),
    ],
    ids=str,
)
def test_triton_gemm_interpreted(rng, config):
    """The Triton GEMM in Triton's interpreter on MXFP4 (every code, scales on both sides of
    1): equal to the float64 product on the same weights up to f32 summation order."""
    from pallas_kernels.triton.wna16_gemm import wna16_gemm as triton_gemm

    t, top_k, e, n, k = 3, 2, 4, 64, 256
    w = wj.random_quantized_experts(rng, (e, n, k), scheme="mxfp4", std=18.0)
    assert np.asarray(w.scales).min() < 127 < np.asarray(w.scales).max()
    a = jnp.asarray(rng.normal(size=(t, k)), jnp.bfloat16)
    _, ids = helpers.random_routing(rng, t, top_k, e)
    routing = wj.moe_align_block_size(
        jnp.asarray(ids), num_experts=e, block_m=config.block_m, implementation="xla"
    )
    out = triton_gemm(
        a, w, routing, top_k=top_k, config=config, out_dtype=jnp.float32, interpret=True
    )
    rows = np.asarray(a, np.float64)[np.arange(t * top_k) // top_k]
    ref = np.einsum("sk,snk->sn", rows, helpers.numpy_dequantize(w)[ids.reshape(-1)])
    helpers.assert_finite_and_close(
        np.asarray(out), ref, 1e-5, f"triton {config}", slack=5.0, require_signal=True
    )


@needs_triton
@pytest.mark.parametrize(
    "h, i, config",
    [
        (128, 64, None),
        (192, 192, BlockConfig(block_m=16, block_n=32, block_k=64, split_k=3, unpack="tile")),
    ],
    ids=["heuristic", "h192-i192-split-k"],
)
def test_triton_layer_interpreted_with_gpt_oss_math(rng, h, i, config):
    """The Triton layer (interpreted) on MXFP4 experts with both biases and the clamped SwiGLU
    matches 'xla' (the clamps reached); split-K adds GEMM1's and GEMM2's biases once."""
    from pallas_kernels.triton import fused_moe as triton_moe

    t, e, k = 3, 4, 2
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w13 = wj.random_quantized_experts(rng, (e, 2 * i, h), scheme="mxfp4", std=0.5)
    w2 = wj.random_quantized_experts(rng, (e, h, i), scheme="mxfp4", std=0.1)
    b13 = jnp.asarray(rng.normal(size=(e, 2 * i)), jnp.float32)
    b2 = jnp.asarray(rng.normal(size=(e, h)), jnp.bfloat16)
    tw, ids = (jnp.asarray(a) for a in helpers.random_routing(rng, t, k, e))
    act = wj.ClampedSwiGLU()
    hid = np.einsum("th,enh->ten", np.asarray(x, np.float64), helpers.numpy_dequantize(w13))
    hid += np.asarray(b13, np.float64)
    assert (hid[..., :i] > act.limit).any() and (np.abs(hid[..., i:]) > act.limit).any()
    layer = helpers.pipeline_fused_moe(triton_moe.stages, interpret=True)
    biases = dict(w13_bias=b13, w2_bias=b2)
    out = layer(x, w13, w2, tw, ids, activation=act, config=config, **biases)
    ref = wj.fused_moe(x, w13, w2, tw, ids, activation="swiglu_oai", implementation="xla", **biases)
    helpers.assert_close(out, np.asarray(ref, np.float64), jnp.bfloat16, "triton vs xla")


# ---- a DeepSeek-V3-shaped layer -------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret", "mgpu_interpret"])
def test_deepseek_v3_routing_with_mxfp4_experts(rng, implementation):
    """A DeepSeek-V3-shaped layer (256 routed experts, DeepSeek-V3's routing: sigmoid scores
    with the correction bias, 8 groups, top-4 groups, top-8, scaling 2.5; H and I scaled down)
    with random MXFP4 experts through fused_moe on each backend equals the float64 layer on
    the dequantized experts."""
    from models.deepseek_v3.config import DeepseekV3Config
    from models.deepseek_v3.modeling import route

    cfg = DeepseekV3Config.tiny(
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, dtype="bfloat16"
    )
    t, e, h, i = 6, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    logits = jnp.asarray(rng.normal(size=(t, e)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(e,)) * 0.1, jnp.float32)
    tw, ids = route(logits, bias, cfg=cfg)
    assert ids.shape == (t, 8) and len(np.unique(np.asarray(ids))) > 8
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w13 = wj.random_quantized_experts(rng, (e, 2 * i, h), scheme="mxfp4")
    w2 = wj.random_quantized_experts(rng, (e, h, i), scheme="mxfp4")
    layout = wj.backend_layout(implementation, 4)
    out = wj.fused_moe(
        x, wj.layouts.to_kernel_layout(w13, layout), wj.layouts.to_kernel_layout(w2, layout),
        tw, ids, implementation=implementation,
    )  # fmt: skip
    want = helpers.numpy_fused_moe(
        x, helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2), tw, ids,
        activation_dtype=jnp.dtype(jnp.bfloat16),
    )  # fmt: skip
    helpers.assert_close(out, want, jnp.bfloat16, f"{implementation} vs float64")
