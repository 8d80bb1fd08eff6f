"""Tests for wna16_jax.formats: checkpoint tensors <-> QuantizedExperts."""

from __future__ import annotations

import dataclasses
import re
import zlib

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_cases import ELEMENT_SLACK
from hypothesis import given, settings
from hypothesis import strategies as st

import wna16_jax as wj
from wna16_jax import formats
from wna16_jax._quant import pack_k, pack_zeros

HYPOTHESIS = settings(max_examples=25, deadline=None, derandomize=True)

# One tolerance table. (q - z) is an exact small integer; the library multiplies by the scale
# in f32, the reference in float64: one f32 rounding apart.
TOL = {"dequant": dict(rtol=2e-7, atol=0.0)}

SCALE_DTYPES = (np.float16, jnp.bfloat16, np.float32)
AWQ_ORDER_DOC = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds feature 8c + this[i]


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# --- independent float64 references, written from the documented bit layouts -------------


def fields(words, bits):
    """[..., W] 32-bit words -> int64 [..., W * 32/bits]; field i of a word = bits b*i.."""
    w = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    per = 32 // bits
    out = np.empty(w.shape[:-1] + (w.shape[-1] * per,), np.int64)
    for i in range(per):
        out[..., i::per] = (w >> (bits * i)) & ((1 << bits) - 1)
    return out


def awq_fields(words):
    """AWQ words [R, C] -> int64 [R, 8C] in feature order."""
    w = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    out = np.empty((w.shape[0], w.shape[1] * 8), np.int64)
    for i, feature in enumerate(AWQ_ORDER_DOC):
        out[:, feature::8] = (w >> (4 * i)) & 0xF
    return out


def group_of(k, group_size):
    return np.arange(k) // (k if group_size == -1 else group_size)


def ref_awq(qweight, qzeros, scales, group_size):
    q = awq_fields(qweight)  # [K, N]
    z = awq_fields(qzeros)  # [G, N]
    gi = group_of(q.shape[0], group_size)
    s = np.asarray(scales).astype(np.float64)
    return ((q - z[gi]) * s[gi]).T  # [N, K]


def ref_gptq(qweight, qzeros, scales, g_idx, bits, checkpoint_format):
    q = fields(np.asarray(qweight).T, bits)  # [N, K]
    z = fields(qzeros, bits)  # [G, N]
    if checkpoint_format == "gptq":
        z = (z + 1) % (1 << bits)
    s = np.asarray(scales).astype(np.float64)
    return q - z[g_idx].T, s[g_idx].T  # ([N, K], [N, K])


def ref_ct_packed(weight_packed, weight_scale, weight_zero_point, bits, group_size):
    off = 1 << (bits - 1)
    q_s = fields(weight_packed, bits) - off  # [N, K] signed
    gi = group_of(q_s.shape[1], group_size)
    zp_s = 0
    if weight_zero_point is not None:  # [N/per, G] packed along N
        zp_s = (fields(np.asarray(weight_zero_point).T, bits).T - off)[:, gi]  # [N, K] signed
    return (q_s - zp_s) * np.asarray(weight_scale).astype(np.float64)[:, gi]


def ref_ct_int(weight, weight_scale, weight_zero_point, group_size):
    w = np.asarray(weight).astype(np.int64)
    gi = group_of(w.shape[1], group_size)
    zp = 0 if weight_zero_point is None else np.asarray(weight_zero_point).astype(np.int64)[:, gi]
    return (w - zp) * np.asarray(weight_scale).astype(np.float64)[:, gi]


def dequant(qw):
    return np.asarray(wj.dequantize_experts(qw))[0].astype(np.float64)


# --- helpers --------------------------------------------------------------------------------


def random_words(rng, shape):
    return rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32).view(np.int32)


def random_scales(rng, shape, dtype):
    return (rng.uniform(0.25, 2.0, shape) * rng.choice([1e-3, 1.0], shape)).astype(dtype)


def random_qw(seed, *, bits, group_size, n, k, has_zeros, dtype):
    rng = np.random.default_rng(seed)
    g = 1 if group_size == -1 else k // group_size
    q = rng.integers(0, 1 << bits, (1, n, k))
    z = rng.integers(0, 1 << bits, (1, n, g)) if has_zeros else None
    return wj.QuantizedExperts(
        qweight=jnp.asarray(pack_k(q, bits)),
        scales=jnp.asarray(random_scales(rng, (1, n, g), dtype)),
        zeros=None if z is None else jnp.asarray(pack_zeros(z, bits)),
        bits=bits,
        group_size=group_size,
    )


def assert_same(a, b):
    """Exact equality of two QuantizedExperts (integers and scales)."""
    assert (a.bits, a.group_size) == (b.bits, b.group_size)
    assert isinstance(a.qweight, jax.Array) and a.qweight.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(a.qweight), np.asarray(b.qweight))
    assert a.scales.dtype == b.scales.dtype
    np.testing.assert_array_equal(
        np.asarray(a.scales.astype(jnp.float32)), np.asarray(b.scales.astype(jnp.float32))
    )
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert a.zeros.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(a.zeros), np.asarray(b.zeros))
    assert (a.perm is None) == (b.perm is None)
    if a.perm is not None:
        np.testing.assert_array_equal(np.asarray(a.perm), np.asarray(b.perm))


def canonical_q(qw):
    return fields(np.asarray(qw.qweight)[0], qw.bits)  # [N, K], from the documented layout


@st.composite
def layer_shapes(draw, bits_options=(4, 8), group_options=(32, 64, 128, -1)):
    bits = draw(st.sampled_from(bits_options))
    group_size = draw(st.sampled_from(group_options))
    k = draw(st.integers(1, 3)) * (8 if group_size == -1 else group_size)
    n = 8 * draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(SCALE_DTYPES))
    return dict(bits=bits, group_size=group_size, n=n, k=k, dtype=dtype)


def as_int32(word):
    return np.array([word], np.uint32).view(np.int32)


# --- the three worked examples (pinned) ------------------------------------------------------


def test_awq_worked_example():
    # Features 1..8 of every row k pack to 0x86427531.
    qweight = np.tile(as_int32(0x86427531), (8, 1))  # [K=8, N/8=1]
    qzeros = as_int32(0x00000000)[None]  # [1, 1]
    qw = formats.from_awq(qweight, qzeros, np.ones((1, 8), np.float32), group_size=-1)
    np.testing.assert_array_equal(canonical_q(qw), np.tile(np.arange(1, 9)[:, None], (1, 8)))
    out = formats.to_awq(qw)
    assert out["qweight"].dtype == np.int32
    assert int(out["qweight"].view(np.uint32)[0, 0]) == 0x86427531


def test_gptq_worked_example():
    # k = 1..8 of every column n pack to 0x87654321.
    qweight = np.tile(as_int32(0x87654321), (1, 8))  # [K/8=1, N=8]
    qzeros = as_int32(0x77777777)[None]  # v1 stored 7 -> true 8 (symmetric)
    qw = formats.from_gptq(
        qweight, qzeros, np.ones((1, 8), np.float16), bits=4, group_size=-1, sym=True
    )
    assert qw.zeros is None
    np.testing.assert_array_equal(canonical_q(qw), np.tile(np.arange(1, 9), (8, 1)))
    out = formats.to_gptq(qw)
    assert out["qweight"].dtype == np.int32
    assert int(out["qweight"].view(np.uint32)[0, 0]) == 0x87654321
    assert int(out["qzeros"].view(np.uint32)[0, 0]) == 0x77777777


def test_compressed_tensors_worked_example():
    signed = np.array([-8, -3, 0, 1, 7, -1, 2, -5])
    packed = np.tile(as_int32(0x3A7F9850), (8, 1))  # [N=8, K/8=1]
    qw = formats.from_compressed_tensors(
        packed,
        np.ones((8, 1), np.float32),
        weight_shape=np.array([8, 8]),
        num_bits=4,
        group_size=None,
        symmetric=True,
        strategy="channel",
    )
    np.testing.assert_array_equal(dequant(qw), np.tile(signed, (8, 1)))
    out = formats.to_compressed_tensors(qw)
    assert out["weight_packed"].dtype == np.int32
    assert int(out["weight_packed"].view(np.uint32)[0, 0]) == 0x3A7F9850
    np.testing.assert_array_equal(out["weight_shape"], [8, 8])


# --- round trips --------------------------------------------------------------------------


@HYPOTHESIS
@given(shape=layer_shapes(bits_options=(4,)), seed=st.integers(0, 2**31))
def test_awq_round_trip(shape, seed):
    qw = random_qw(seed, has_zeros=True, **shape)
    out = formats.to_awq(qw)
    assert out["qzeros"].dtype == np.int32 and out["scales"].dtype == np.dtype(shape["dtype"])
    assert_same(formats.from_awq(**out, group_size=shape["group_size"]), qw)


@HYPOTHESIS
@given(
    shape=layer_shapes(),
    has_zeros=st.booleans(),
    checkpoint_format=st.sampled_from(["gptq", "gptq_v2"]),
    seed=st.integers(0, 2**31),
)
def test_gptq_round_trip(shape, has_zeros, checkpoint_format, seed):
    qw = random_qw(seed, has_zeros=has_zeros, **shape)
    out = formats.to_gptq(qw, checkpoint_format=checkpoint_format)
    assert out["g_idx"].dtype == np.int32 and out["qzeros"].dtype == np.int32
    back = formats.from_gptq(
        **out,
        bits=shape["bits"],
        group_size=shape["group_size"],
        sym=not has_zeros,
        checkpoint_format=checkpoint_format,
    )
    assert_same(back, qw)


@HYPOTHESIS
@given(shape=layer_shapes(), has_zeros=st.booleans(), seed=st.integers(0, 2**31))
def test_compressed_tensors_round_trip(shape, has_zeros, seed):
    qw = random_qw(seed, has_zeros=has_zeros, **shape)
    out = formats.to_compressed_tensors(qw)
    assert ("weight_zero_point" in out) == has_zeros
    assert out["weight_shape"].dtype == np.int64
    channel = shape["group_size"] == -1
    back = formats.from_compressed_tensors(
        **out,
        num_bits=shape["bits"],
        group_size=None if channel else shape["group_size"],
        symmetric=not has_zeros,
        strategy="channel" if channel else "group",
    )
    assert_same(back, qw)


@HYPOTHESIS
@given(shape=layer_shapes(), has_zeros=st.booleans(), seed=st.integers(0, 2**31))
def test_compressed_tensors_int_round_trip(shape, has_zeros, seed):
    qw = random_qw(seed, has_zeros=has_zeros, **shape)
    out = formats.to_compressed_tensors_int(qw)
    assert out["weight"].dtype == np.int8
    back = formats.from_compressed_tensors_int(
        **out,
        num_bits=shape["bits"],
        group_size=shape["group_size"],
        symmetric=not has_zeros,
        strategy="channel" if shape["group_size"] == -1 else "group",
    )
    assert_same(back, qw)


# --- checkpoint tensors -> canonical == an independent float64 dequantization ----------------

N, K = 24, 256


@pytest.mark.parametrize("dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_matches_reference(rng, group_size, dtype):
    g = 1 if group_size == -1 else K // group_size
    qweight, qzeros = random_words(rng, (K, N // 8)), random_words(rng, (g, N // 8))
    scales = random_scales(rng, (g, N), dtype)
    qw = formats.from_awq(qweight, qzeros, scales, group_size=group_size)
    assert qw.shape == (1, N, K) and qw.scales.dtype == dtype
    np.testing.assert_allclose(
        dequant(qw), ref_awq(qweight, qzeros, scales, group_size), **TOL["dequant"]
    )


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_matches_reference(rng, bits, group_size, sym, checkpoint_format):
    per = 32 // bits
    g = 1 if group_size == -1 else K // group_size
    qweight, qzeros = random_words(rng, (K // per, N)), random_words(rng, (g, N // per))
    scales = random_scales(rng, (g, N), np.float16)
    g_idx = group_of(K, group_size).astype(np.int32)
    # Random zeros under sym=True are kept (never silently replaced by the implicit zero).
    qw = formats.from_gptq(
        qweight,
        qzeros,
        scales,
        g_idx,
        bits=bits,
        group_size=group_size,
        sym=sym,
        checkpoint_format=checkpoint_format,
    )
    assert qw.zeros is not None
    qz, s = ref_gptq(qweight, qzeros, scales, g_idx, bits, checkpoint_format)
    np.testing.assert_allclose(dequant(qw), qz * s, **TOL["dequant"])


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_matches_reference(rng, bits, group_size, symmetric):
    per = 32 // bits
    g = 1 if group_size == -1 else K // group_size
    packed = random_words(rng, (N, K // per))
    scale = random_scales(rng, (N, g), jnp.bfloat16)
    zp = None if symmetric else random_words(rng, (N // per, g))
    qw = formats.from_compressed_tensors(
        packed,
        scale,
        zp,
        np.array([N, K], np.int64),
        num_bits=bits,
        group_size=None if group_size == -1 else group_size,
        symmetric=symmetric,
        strategy="channel" if group_size == -1 else "group",
    )
    assert (qw.zeros is None) == symmetric
    np.testing.assert_allclose(
        dequant(qw), ref_ct_packed(packed, scale, zp, bits, group_size), **TOL["dequant"]
    )


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_int_matches_reference(rng, bits, group_size, symmetric):
    off = 1 << (bits - 1)
    g = 1 if group_size == -1 else K // group_size
    weight = rng.integers(-off, off, (N, K)).astype(np.int8)
    scale = random_scales(rng, (N, g), np.float32)
    zp = None if symmetric else rng.integers(-off, off, (N, g)).astype(np.int8)
    qw = formats.from_compressed_tensors_int(
        weight,
        scale,
        zp,
        num_bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        strategy="channel" if group_size == -1 else "group",
    )
    np.testing.assert_allclose(
        dequant(qw), ref_ct_int(weight, scale, zp, group_size), **TOL["dequant"]
    )


def test_accepts_jax_arrays(rng):
    qweight, qzeros = random_words(rng, (K // 8, N)), random_words(rng, (K // 128, N // 8))
    scales = random_scales(rng, (K // 128, N), np.float32)
    kw = dict(bits=4, group_size=128, sym=False)
    from_np = formats.from_gptq(qweight, qzeros, scales, **kw)
    from_jax = formats.from_gptq(
        jnp.asarray(qweight), jnp.asarray(qzeros), jnp.asarray(scales), **kw
    )
    assert_same(from_jax, from_np)


# --- GPTQ zero-point conventions, sym, act-order ------------------------------------------


@pytest.mark.parametrize(
    "bits, stored, checkpoint_format, true_zero",
    [
        (4, 6, "gptq", 7),
        (4, 15, "gptq", 0),  # the wrapped -1 of a true zero 0
        (4, 15, "gptq_v2", 15),
        (4, 0, "gptq_v2", 0),
        (8, 254, "gptq", 255),
        (8, 255, "gptq", 0),
        (8, 255, "gptq_v2", 255),
    ],
)
def test_gptq_zero_convention(bits, stored, checkpoint_format, true_zero):
    per = 32 // bits
    word = sum(stored << (bits * i) for i in range(per))
    n, k = 8, 32
    qw = formats.from_gptq(
        np.zeros((k // per, n), np.int32),
        np.tile(as_int32(word), (1, n // per)),
        np.ones((1, n), np.float32),
        bits=bits,
        group_size=-1,
        sym=False,
        checkpoint_format=checkpoint_format,
    )
    np.testing.assert_array_equal(wj._quant.zero_points(qw), true_zero)
    out = formats.to_gptq(qw, checkpoint_format=checkpoint_format)
    assert int(out["qzeros"].view(np.uint32)[0, 0]) == word


@pytest.mark.parametrize(
    "bits, checkpoint_format, word",
    [
        (4, "gptq", 0x77777777),
        (4, "gptq_v2", 0x88888888),
        (8, "gptq", 0x7F7F7F7F),
        (8, "gptq_v2", 0x80808080),
    ],
)
def test_gptq_sym_implicit_zeros_dropped(rng, bits, checkpoint_format, word):
    per = 32 // bits
    qweight = random_words(rng, (64 // per, 16))
    qzeros = np.tile(as_int32(word), (2, 16 // per))
    scales = random_scales(rng, (2, 16), np.float16)
    kw = dict(bits=bits, group_size=32, checkpoint_format=checkpoint_format)
    sym = formats.from_gptq(qweight, qzeros, scales, sym=True, **kw)
    assert sym.zeros is None
    asym = formats.from_gptq(qweight, qzeros, scales, sym=False, **kw)
    assert asym.zeros is not None
    np.testing.assert_array_equal(dequant(sym), dequant(asym))
    # One zero off the implicit value: sym=True keeps every zero point.
    qzeros[1, 0] ^= 1
    kept = formats.from_gptq(qweight, qzeros, scales, sym=True, **kw)
    assert kept.zeros is not None
    qz, s = ref_gptq(qweight, qzeros, scales, group_of(64, 32), bits, checkpoint_format)
    np.testing.assert_allclose(dequant(kept), qz * s, **TOL["dequant"])


def test_compressed_tensors_symmetric_zero_point_dropped(rng):
    packed = random_words(rng, (16, 8))
    scale = random_scales(rng, (16, 2), np.float16)
    zp = np.tile(as_int32(0x88888888), (2, 2))  # signed zero points 0
    kw = dict(num_bits=4, group_size=32, strategy="group")
    assert formats.from_compressed_tensors(packed, scale, zp, symmetric=True, **kw).zeros is None
    assert (
        formats.from_compressed_tensors(packed, scale, zp, symmetric=False, **kw).zeros is not None
    )


def act_order_g_idx(rng, k, group_size):
    """An AutoGPTQ act-order g_idx: groups formed in a random order of the inputs, G each."""
    perm0 = rng.permutation(k)
    g_idx = np.empty(k, np.int32)
    g_idx[perm0] = np.arange(k) // group_size
    return g_idx


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_act_order(rng, bits, checkpoint_format):
    """A non-trivial g_idx loads on K sorted by group, that order kept as perm [1, K]: the
    stored weight is the checkpoint's W[:, perm], dequantize_experts gives W itself; the g_idx
    decides, not desc_act; to_gptq writes the same tensors back."""
    per, g = 32 // bits, 64
    qweight, qzeros = random_words(rng, (K // per, N)), random_words(rng, (K // g, N // per))
    scales = random_scales(rng, (K // g, N), np.float32)
    g_idx = act_order_g_idx(rng, K, g)
    kw = dict(bits=bits, group_size=g, sym=False, checkpoint_format=checkpoint_format)
    qw = formats.from_gptq(qweight, qzeros, scales, g_idx, desc_act=True, **kw)
    assert qw.perm.dtype == jnp.int32 and qw.perm.shape == (1, K)
    perm = np.asarray(qw.perm[0])
    np.testing.assert_array_equal(perm, formats.gptq_act_order_permutation(g_idx, group_size=g))
    np.testing.assert_array_equal(g_idx[perm], np.arange(K) // g)
    qz, s = ref_gptq(qweight, qzeros, scales, g_idx, bits, checkpoint_format)
    w = qz * s  # [N, K] in the checkpoint's K order
    np.testing.assert_allclose(dequant(qw), w, **TOL["dequant"])
    stored = dequant(dataclasses.replace(qw, perm=None))
    np.testing.assert_allclose(stored, w[:, perm], **TOL["dequant"])
    assert_same(formats.from_gptq(qweight, qzeros, scales, g_idx, desc_act=False, **kw), qw)
    out = formats.to_gptq(qw, checkpoint_format=checkpoint_format)
    for name, want in dict(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx).items():
        np.testing.assert_array_equal(out[name], want, err_msg=name)


def test_gptq_g_idx_errors(rng):
    """desc_act needs a g_idx; a trivial one (static groups) loads without perm; groups of
    unequal sizes are refused, naming the g_idx."""
    qweight, qzeros = random_words(rng, (K // 8, N)), random_words(rng, (K // 64, N // 8))
    scales = random_scales(rng, (K // 64, N), np.float16)
    kw = dict(bits=4, group_size=64, sym=False)
    with pytest.raises(ValueError, match="desc_act=True needs g_idx"):
        formats.from_gptq(qweight, qzeros, scales, None, desc_act=True, **kw)
    trivial = group_of(K, 64).astype(np.int32)
    assert formats.from_gptq(qweight, qzeros, scales, trivial, desc_act=True, **kw).perm is None
    unequal = act_order_g_idx(rng, K, 64)
    unequal[unequal == 0] = 1  # group 0 empty, group 1 twice its size
    with pytest.raises(ValueError, match=r"from_gptq: g_idx must assign exactly 64 features"):
        formats.from_gptq(qweight, qzeros, scales, unequal, desc_act=True, **kw)


@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors", "compressed-tensors-int"])
def test_act_order_weights_refused_by_formats_without_it(rng, fmt):
    qweight, qzeros = random_words(rng, (K // 8, N)), random_words(rng, (K // 64, N // 8))
    scales = random_scales(rng, (K // 64, N), np.float16)
    g_idx = act_order_g_idx(rng, K, 64)
    qw = formats.from_gptq(qweight, qzeros, scales, g_idx, bits=4, group_size=64, sym=False)
    write = {
        "awq": formats.to_awq,
        "compressed-tensors": formats.to_compressed_tensors,
        "compressed-tensors-int": formats.to_compressed_tensors_int,
    }[fmt]
    with pytest.raises(ValueError, match=r"input permutation \(GPTQ act-order\).*to_gptq"):
        write(qw)


@pytest.mark.parametrize(
    "g_idx, match",
    [
        (np.r_[np.zeros(40), np.ones(24)].astype(np.int32), "exactly 32 features"),
        (np.r_[np.zeros(32), np.full(32, 2)].astype(np.int32), "exactly 32 features"),
        (np.zeros(64, np.float32), "integer"),
    ],
)
def test_gptq_act_order_permutation_errors(g_idx, match):
    with pytest.raises(ValueError, match=match):
        formats.gptq_act_order_permutation(g_idx, group_size=32)


# --- act-order experts through fused_moe -----------------------------------------------------

# E experts of int4 g64 act-order layers: H, I multiples of 128 and of 64 (the Pallas int4
# k-tile, the Mosaic GPU tiles), two groups per row.
AO_E, AO_H, AO_I, AO_G = 4, 128, 128, 64


def autogptq_layer(rng, n, k, g_idx):
    """AutoGPTQ (v1) tensors of one int4 layer W [N, K] with this g_idx (bf16 scales about
    1/(8 sqrt(K)): the layer's outputs stay O(1)), and W float64 [N, K] straight from them."""
    qweight, qzeros = random_words(rng, (k // 8, n)), random_words(rng, (k // AO_G, n // 8))
    scales = (rng.uniform(0.5, 1.5, (k // AO_G, n)) / (8 * np.sqrt(k))).astype(jnp.bfloat16)
    qz, s = ref_gptq(qweight, qzeros, scales, g_idx, 4, "gptq")
    return dict(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx), qz * s


def act_order_experts(rng, which):
    """E experts' AutoGPTQ gate / up / down tensors, act-order where `which` says (w13: gate
    and up, which share an expert's g_idx as they share its input; w2: down), each expert its
    own g_idx; loaded by from_gptq, stacked, w2's order folded into w13's rows. Returns (w13
    [E, 2I, H], w2 [E, H, I], their float64 weights from the tensors)."""
    loaded, dense = {p: [] for p in ("gate", "up", "down")}, {p: [] for p in ("gate", "up", "down")}
    for _ in range(AO_E):
        g13 = act_order_g_idx(rng, AO_H, AO_G) if "w13" in which else group_of(AO_H, AO_G)
        g2 = act_order_g_idx(rng, AO_I, AO_G) if "w2" in which else group_of(AO_I, AO_G)
        for proj, n, k, g_idx in (
            ("gate", AO_I, AO_H, g13), ("up", AO_I, AO_H, g13), ("down", AO_H, AO_I, g2)
        ):  # fmt: skip
            tensors, w = autogptq_layer(rng, n, k, g_idx.astype(np.int32))
            loaded[proj].append(
                formats.from_gptq(**tensors, bits=4, group_size=AO_G, sym=False, desc_act=True)
            )
            dense[proj].append(w)
    gate, up, down = (formats.stack(loaded[p]) for p in ("gate", "up", "down"))
    w13, w2 = formats.fold_w2_act_order(wj.QuantizedExperts.concatenate([gate, up], axis=1), down)
    w13_f = np.concatenate([np.stack(dense["gate"]), np.stack(dense["up"])], axis=1)
    return w13, w2, w13_f, np.stack(dense["down"])


@pytest.mark.parametrize("which", ["w13", "w2", "w13+w2"])
@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret", "mgpu_interpret"])
def test_act_order_experts_in_fused_moe(rng, implementation, which):
    """AutoGPTQ act-order experts (w13's, w2's or both) through fused_moe on each backend the
    tests interpret on CPU, with an expert_map (-1 experts) and a dropped id, against the
    float64 layer on the weights dequantized straight from the checkpoint tensors."""
    w13, w2, w13_f, w2_f = act_order_experts(rng, which)
    assert w13.has_perm == ("w13" in which) and not w2.has_perm  # w2's folded into w13
    t, k, e_global = 5, 2, 2 * AO_E
    expert_map = np.full(e_global, -1, np.int32)
    local = rng.choice(e_global, AO_E, replace=False)
    expert_map[local] = rng.permutation(AO_E)
    tw, ids = helpers.random_routing(rng, t, k, e_global)
    ids[0] = rng.choice(local, k, replace=False)  # a token only on this shard
    ids[1, 1] = -1
    x = jnp.asarray(rng.standard_normal((t, AO_H)), jnp.bfloat16)
    layout = "mgpu_int4" if implementation.startswith("mgpu") else "canonical"
    w13k, w2k = (wj.layouts.to_kernel_layout(w, layout) for w in (w13, w2))
    out = wj.fused_moe(
        x, w13k, w2k, jnp.asarray(tw), jnp.asarray(ids), expert_map=jnp.asarray(expert_map),
        implementation=implementation,
    )  # fmt: skip
    # The kernels read GEMM2's input in x's dtype (their contract); the reference in f32.
    act_dtype = None if implementation == "xla" else jnp.bfloat16
    ref = helpers.numpy_fused_moe(
        np.asarray(x, np.float64), w13_f, w2_f, tw, ids, expert_map=expert_map,
        activation_dtype=act_dtype,
    )  # fmt: skip
    helpers.assert_finite_and_close(
        np.asarray(out, np.float32), ref, helpers.tolerance(jnp.bfloat16),
        f"{implementation} act-order {which}", slack=ELEMENT_SLACK, require_signal=True,
    )  # fmt: skip


# --- validation errors quote the values ------------------------------------------------------


def test_shape_and_dtype_errors(rng):
    qweight = random_words(rng, (64, 2))  # AWQ: K=64, N=16
    qzeros = random_words(rng, (2, 2))
    scales = random_scales(rng, (2, 16), np.float16)
    with pytest.raises(ValueError, match=r"qzeros shape \(3, 2\) != expected \(2, 2\)"):
        formats.from_awq(qweight, random_words(rng, (3, 2)), scales, group_size=32)
    with pytest.raises(ValueError, match="K=64 is not a multiple of group_size=48"):
        formats.from_awq(qweight, qzeros, scales, group_size=48)
    with pytest.raises(ValueError, match="int32 packed words, got dtype float32"):
        formats.from_awq(qweight.astype(np.float32), qzeros, scales, group_size=32)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32, got int32"):
        formats.from_awq(qweight, qzeros, qzeros, group_size=32)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        formats.from_gptq(qweight, qzeros, scales, bits=3, group_size=32, sym=True)
    with pytest.raises(ValueError, match="checkpoint_format='marlin'"):
        formats.from_gptq(
            qweight, qzeros, scales, bits=4, group_size=32, sym=True, checkpoint_format="marlin"
        )
    ct = dict(num_bits=4, group_size=32, symmetric=True)
    packed, ct_scale = random_words(rng, (16, 8)), random_scales(rng, (16, 2), np.float16)
    with pytest.raises(ValueError, match=r"weight_shape \(16, 60\) != \(N, K\) = \(16, 64\)"):
        formats.from_compressed_tensors(packed, ct_scale, None, np.array([16, 60]), **ct)
    with pytest.raises(ValueError, match="symmetric=False needs weight_zero_point"):
        formats.from_compressed_tensors(packed, ct_scale, **{**ct, "symmetric": False})
    with pytest.raises(ValueError, match="strategy='tensor' is not supported"):
        formats.from_compressed_tensors(packed, ct_scale, **ct, strategy="tensor")
    with pytest.raises(ValueError, match=r"weight_scale shape \(16, 2\) != expected \(16, 1\)"):
        formats.from_compressed_tensors(
            packed, ct_scale, num_bits=4, group_size=None, symmetric=True, strategy="channel"
        )
    with pytest.raises(ValueError, match=r"span \[-9, 7\], outside the int4 range"):
        w = np.full((16, 64), 7, np.int8)
        w[0, 0] = -9
        formats.from_compressed_tensors_int(w, ct_scale, **ct)


def test_to_checkpoint_errors():
    sym4 = random_qw(0, bits=4, group_size=32, n=16, k=64, has_zeros=False, dtype=np.float16)
    with pytest.raises(ValueError, match="AWQ checkpoints always carry zero points"):
        formats.to_awq(sym4)
    int8 = random_qw(1, bits=8, group_size=32, n=16, k=64, has_zeros=True, dtype=np.float16)
    with pytest.raises(ValueError, match="AWQ is 4-bit only, got bits=8"):
        formats.to_awq(int8)
    with pytest.raises(ValueError, match="E=2"):
        formats.to_gptq(formats.stack([sym4, sym4]))


# --- from_quantization_config -----------------------------------------------------------

PREFIX = "model.layers.3.mlp.experts.7.up_proj"


def named(tensors, prefix=PREFIX):
    return {f"{prefix}.{name}": value for name, value in tensors.items()}


def config_case(method, qw):
    """(tensors, quantization_config) as an HF checkpoint of `method` would hold them."""
    g = qw.group_size
    if method == "awq":
        cfg = dict(quant_method="awq", version="gemm", bits=4, group_size=g, zero_point=True)
        return named(formats.to_awq(qw)), cfg
    if method in ("gptq", "gptq_v2"):
        cfg = dict(
            quant_method="gptq",
            bits=qw.bits,
            group_size=g,
            sym=not qw.has_zeros,
            desc_act=False,
            checkpoint_format=method,
        )
        return named(formats.to_gptq(qw, checkpoint_format=method)), cfg
    strategy = "channel" if g == -1 else "group"
    weights = dict(
        num_bits=qw.bits,
        type="int",
        symmetric=not qw.has_zeros,
        strategy=strategy,
        group_size=None if g == -1 else g,
        actorder=None,
    )
    if method == "pack-quantized":
        tensors = formats.to_compressed_tensors(qw)
    else:
        tensors = formats.to_compressed_tensors_int(qw)
    cfg = dict(
        quant_method="compressed-tensors",
        format=method,
        config_groups={"group_0": dict(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
    )
    return named(tensors), cfg


@pytest.mark.parametrize(
    "method, bits, group_size, has_zeros",
    [
        ("awq", 4, 128, True),
        ("awq", 4, -1, True),
        ("gptq", 4, 128, False),
        ("gptq", 8, 32, True),
        ("gptq_v2", 4, 64, True),
        ("pack-quantized", 4, 128, False),
        ("pack-quantized", 4, 32, True),
        ("pack-quantized", 8, -1, True),
        ("int-quantized", 8, -1, False),
        ("int-quantized", 8, 64, True),
    ],
)
def test_from_quantization_config(request, method, bits, group_size, has_zeros):
    seed = zlib.crc32(request.node.nodeid.encode())
    qw = random_qw(
        seed, bits=bits, group_size=group_size, n=16, k=256, has_zeros=has_zeros, dtype=np.float16
    )
    tensors, cfg = config_case(method, qw)
    tensors["model.layers.3.mlp.experts.8.up_proj.qweight"] = np.zeros(1)  # a neighbour
    assert_same(formats.from_quantization_config(tensors, cfg, PREFIX), qw)


def test_from_quantization_config_picks_the_matching_group():
    qw = random_qw(3, bits=4, group_size=32, n=16, k=64, has_zeros=True, dtype=np.float16)
    tensors, cfg = config_case("pack-quantized", qw)
    other = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
    cfg["config_groups"] = {
        "attn": dict(targets=[r"re:.*self_attn.*"], weights=other),
        "experts": {**cfg["config_groups"]["group_0"], "targets": [r"re:.*mlp\.experts.*"]},
    }
    assert_same(formats.from_quantization_config(tensors, cfg, PREFIX), qw)
    with pytest.raises(ValueError, match="cannot tell which of config_groups"):
        formats.from_quantization_config(tensors, cfg, "model.layers.3.mlp.gate")


def test_from_quantization_config_gptq_dynamic():
    qw = random_qw(4, bits=8, group_size=32, n=16, k=64, has_zeros=False, dtype=np.float16)
    tensors, cfg = config_case("gptq", qw)
    cfg["bits"] = 4
    cfg["dynamic"] = {r"+:.*experts\.7\..*": {"bits": 8}, r"-:.*experts\.9\..*": {}}
    assert_same(formats.from_quantization_config(tensors, cfg, PREFIX), qw)
    other = PREFIX.replace("experts.7", "experts.9")
    with pytest.raises(ValueError, match="dynamic exclusion"):
        formats.from_quantization_config(named(formats.to_gptq(qw), other), cfg, other)


@pytest.mark.parametrize("rule", ["+:experts.(7", "-:[z-a]", "experts.*)"])
def test_an_invalid_gptq_dynamic_regex_names_its_rule(rule):
    qw = random_qw(5, bits=4, group_size=32, n=16, k=64, has_zeros=False, dtype=np.float16)
    tensors, cfg = config_case("gptq", qw)
    cfg["dynamic"] = {rule: {"bits": 8}}
    with pytest.raises(ValueError, match=re.escape(f"GPTQ dynamic rule {rule!r} is not a valid")):
        formats.from_quantization_config(tensors, cfg, PREFIX)


def test_an_invalid_compressed_tensors_target_regex_names_its_target():
    qw = random_qw(6, bits=4, group_size=32, n=16, k=64, has_zeros=True, dtype=np.float16)
    tensors, cfg = config_case("pack-quantized", qw)
    group = cfg["config_groups"]["group_0"]
    cfg["config_groups"] = {
        "attn": dict(group, targets=["re:.*self_attn(.*"]),
        "experts": dict(group, targets=[r"re:.*mlp\.experts.*"]),
    }
    says = "compressed-tensors target 're:.*self_attn(.*' of 'attn' is not a valid regular"
    with pytest.raises(ValueError, match=re.escape(says)):
        formats.from_quantization_config(tensors, cfg, PREFIX)


def _drop(tensors, suffix):
    return {name: v for name, v in tensors.items() if not name.endswith(suffix)}


def _unequal_groups(tensors, key):
    g_idx = np.asarray(tensors[key]).copy()
    g_idx[0] = g_idx[-1]  # one input moved from the first group to the last
    return {**tensors, key: g_idx}


@pytest.mark.parametrize(
    "method, edit, match",
    [
        ("awq", lambda t, c: (_drop(t, ".qzeros"), c), rf"missing tensors \['{PREFIX}.qzeros'\]"),
        ("awq", lambda t, c: (t, {**c, "version": "gemv"}), "version='gemv' is not supported"),
        ("awq", lambda t, c: (t, {**c, "bits": 8}), "AWQ bits=8 is not supported"),
        ("awq", lambda t, c: (t, {**c, "zero_point": False}), "zero_point=False"),
        ("awq", lambda t, c: (t, _without(c, "group_size")), "no 'group_size' / 'q_group_size'"),
        (
            "awq",
            lambda t, c: (t, {**c, "modules_to_not_convert": ["experts.7"]}),
            "modules_to_not_convert",
        ),
        ("gptq", lambda t, c: (t, {**c, "bits": 3}), "GPTQ bits=3 is not supported"),
        ("gptq", lambda t, c: (_drop(t, ".scales"), c), rf"missing tensors \['{PREFIX}.scales'\]"),
        (
            "gptq",
            lambda t, c: (t, {**c, "checkpoint_format": "marlin"}),
            "checkpoint_format='marlin' is not supported",
        ),
        (
            "gptq",
            lambda t, c: (_unequal_groups(t, f"{PREFIX}.g_idx"), {**c, "desc_act": True}),
            "g_idx must assign exactly 128 features",
        ),
        ("gptq", lambda t, c: (t, {**c, "quant_method": "exl2"}), "quant_method='exl2'"),
        (
            "pack-quantized",
            lambda t, c: (_drop(t, ".weight_packed"), c),
            rf"missing tensors \['{PREFIX}.weight_packed'\]",
        ),
        (
            "pack-quantized",
            lambda t, c: (t, {**c, "format": "float-quantized"}),
            "format='float-quantized' is not supported",
        ),
        (
            "pack-quantized",
            lambda t, c: (t, _set_weights(c, type="float")),
            "type='float' is not supported",
        ),
        (
            "pack-quantized",
            lambda t, c: (t, _set_weights(c, num_bits=2)),
            "num_bits=2 is not supported",
        ),
        (
            "pack-quantized",
            lambda t, c: (t, _set_weights(c, strategy="tensor")),
            "strategy='tensor' is not supported",
        ),
        (
            "pack-quantized",
            lambda t, c: (
                {**t, f"{PREFIX}.weight_g_idx": np.arange(256, dtype=np.int32)[::-1] // 128},
                c,
            ),
            "non-trivial .*weight_g_idx",
        ),
        (
            "int-quantized",
            lambda t, c: (_drop(t, ".weight"), c),
            rf"missing tensors \['{PREFIX}.weight'\]",
        ),
    ],
)
def test_from_quantization_config_errors(method, edit, match):
    qw = random_qw(5, bits=4, group_size=128, n=16, k=256, has_zeros=True, dtype=np.float16)
    tensors, cfg = edit(*config_case(method, qw))
    with pytest.raises(ValueError, match=match):
        formats.from_quantization_config(tensors, cfg, PREFIX)


def _without(cfg, key):
    return {k: v for k, v in cfg.items() if k != key}


def _set_weights(cfg, **kw):
    ((name, grp),) = cfg["config_groups"].items()
    return {**cfg, "config_groups": {name: {**grp, "weights": {**grp["weights"], **kw}}}}


# --- stack --------------------------------------------------------------------------------


def test_stack(rng):
    seeds = rng.integers(0, 2**31, 3)
    layers = [
        random_qw(int(s), bits=4, group_size=32, n=16, k=64, has_zeros=True, dtype=np.float16)
        for s in seeds
    ]
    qw = formats.stack(layers)
    assert qw.shape == (3, 16, 64) and qw.zeros.shape == (3, 8, 2)
    got = np.asarray(wj.dequantize_experts(qw))
    for e, layer in enumerate(layers):
        np.testing.assert_array_equal(got[e], np.asarray(wj.dequantize_experts(layer))[0])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(bits=8), r"parts\[2\] has bits=8, parts\[0\] has bits=4"),
        (dict(group_size=64), r"parts\[2\] has group_size=64"),
        (dict(n=24), r"parts\[2\] has \(N, K\)=\(24, 64\)"),
        (dict(has_zeros=False), r"parts\[2\] has has_zeros=False"),
        (dict(dtype=np.float32), r"parts\[2\] has scales dtype=float32"),
    ],
)
def test_stack_errors(change, match):
    base = dict(bits=4, group_size=32, n=16, k=64, has_zeros=True, dtype=np.float16)
    layers = [random_qw(i, **base) for i in range(2)] + [random_qw(2, **{**base, **change})]
    with pytest.raises(ValueError, match=match):
        formats.stack(layers)


def test_stack_and_join_act_order_layers(rng):
    """Layers with and without an input permutation stack along E (None is the identity) and
    slice back; rows join along N only under one permutation."""
    base = dict(bits=4, group_size=32, n=16, k=64, has_zeros=True, dtype=np.float16)
    plain = random_qw(1, **base)
    ordered = dataclasses.replace(random_qw(2, **base), perm=rng.permutation(64)[None])
    ordered = dataclasses.replace(ordered, perm=ordered.perm.astype(np.int32))
    qw = formats.stack([ordered, plain])
    np.testing.assert_array_equal(np.asarray(qw.perm), [ordered.perm[0], np.arange(64)])
    for e, layer in enumerate((ordered, plain)):
        np.testing.assert_array_equal(
            np.asarray(wj.dequantize_experts(qw))[e], np.asarray(wj.dequantize_experts(layer))[0]
        )
        back = qw.slice(e, e + 1, axis=0)  # the plain layer's order made explicit
        np.testing.assert_array_equal(np.asarray(back.perm), qw.perm[e : e + 1])
        assert_same(dataclasses.replace(back, perm=layer.perm), layer)
    rows = wj.QuantizedExperts.concatenate([ordered, ordered], axis=1)
    np.testing.assert_array_equal(np.asarray(rows.perm), ordered.perm)
    with pytest.raises(ValueError, match=r"parts\[1\] has another input permutation"):
        wj.QuantizedExperts.concatenate([ordered, plain], axis=1)


def test_stack_empty():
    with pytest.raises(ValueError, match="at least one part"):
        formats.stack([])
