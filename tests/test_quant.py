"""Tests of packing, unpacking, round-to-nearest quantization and dequantization."""

from __future__ import annotations

import functools
import sys

import helpers
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wna16_jax as wj
from wna16_jax import _quant

BITS = (4, 8)
# Each new shape compiles; a dozen derandomized examples keep the file fast and reproducible.
HYPOTHESIS = settings(max_examples=12, deadline=None, derandomize=True)


@st.composite
def _values_and_bits(draw):
    """(bits, uint8 [..., K] values in [0, 2**bits)) with K a multiple of the pack factor."""
    bits = draw(st.sampled_from(BITS))
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    words = draw(st.integers(1, 4))
    shape = (*lead, words * (32 // bits))
    q = draw(hnp.arrays(np.uint8, shape, elements=st.integers(0, 2**bits - 1)))
    return bits, q


@st.composite
def _words_and_bits(draw):
    bits = draw(st.sampled_from(BITS))
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    shape = (*lead, draw(st.integers(1, 4)))
    return bits, draw(hnp.arrays(np.uint32, shape))


# Jitted copies for the big grids: one compile per case is far cheaper on CPU than compiling
# every eager op; the eager paths are exercised by the smaller tests.
_quantize = jax.jit(
    wj.quantize_experts, static_argnames=("bits", "group_size", "has_zp", "scale_dtype")
)
_dequantize = jax.jit(wj.dequantize_experts, static_argnames=("dtype",))


# ---- pack / unpack --------------------------------------------------------------------------


@HYPOTHESIS
@given(_values_and_bits())
def test_pack_unpack_round_trip(case):
    bits, q = case
    packed = _quant.pack_k(q, bits)
    assert packed.dtype == jnp.uint32
    assert packed.shape == (*q.shape[:-1], q.shape[-1] * bits // 32)
    np.testing.assert_array_equal(np.asarray(_quant.unpack_k(packed, bits)), q)


@HYPOTHESIS
@given(_words_and_bits())
def test_unpack_pack_round_trip(case):
    bits, words = case
    q = _quant.unpack_k(words, bits)
    assert q.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(_quant.pack_k(q, bits)), words)


@pytest.mark.parametrize("bits", BITS)
def test_pack_k_bit_positions(rng, bits):
    """int4: k = 8j+i in bits 4i..4i+3 of word j; int8: k = 4j+i in byte i of word j."""
    per_word = 32 // bits
    q = rng.integers(0, 2**bits, size=(3, 5, 4 * per_word))
    words = np.asarray(_quant.pack_k(q, bits)).astype(np.int64)
    mask = (1 << bits) - 1
    for k in range(q.shape[-1]):
        j, i = divmod(k, per_word)
        np.testing.assert_array_equal((words[..., j] >> (bits * i)) & mask, q[..., k], f"k={k}")
    np.testing.assert_array_equal(
        np.asarray(_quant.unpack_k(words.astype(np.uint32), bits)),
        helpers.numpy_unpack_k(words.astype(np.uint32), bits),
    )


@pytest.mark.parametrize("bits", BITS)
def test_pack_k_matches_vllm_bytes(rng, bits):
    """qweight bytes read little-endian are vLLM's layout: uint8 [E, N, K*bits/8]."""
    e, n, k = 2, 6, 64
    q = rng.integers(0, 2**bits, size=(e, n, k))
    words = np.asarray(_quant.pack_k(q, bits)).astype("<u4")
    raw = words.view(np.uint8)
    if bits == 4:
        assert raw.shape == (e, n, k // 2)
        np.testing.assert_array_equal(raw & 0xF, q[..., 0::2], "even k in the low nibble")
        np.testing.assert_array_equal(raw >> 4, q[..., 1::2], "odd k in the high nibble")
    else:
        assert raw.shape == (e, n, k)
        np.testing.assert_array_equal(raw, q)


def test_host_is_little_endian():
    # The vLLM byte check above reads words as '<u4'; jax arrays are host-endian.
    assert sys.byteorder == "little"


@pytest.mark.parametrize("bits", BITS)
def test_zeros_packing(rng, bits):
    z = rng.integers(0, 2**bits, size=(3, 8, 5))
    packed = np.asarray(_quant.pack_zeros(z, bits))
    assert packed.dtype == np.uint8
    if bits == 4:
        assert packed.shape == (3, 4, 5)
        np.testing.assert_array_equal(packed & 0xF, z[:, 0::2], "even n in the low nibble")
        np.testing.assert_array_equal(packed >> 4, z[:, 1::2], "odd n in the high nibble")
    else:
        np.testing.assert_array_equal(packed, z)
    np.testing.assert_array_equal(np.asarray(_quant.unpack_zeros(packed, bits)), z)
    np.testing.assert_array_equal(helpers.numpy_unpack_zeros(packed, bits), z)


@pytest.mark.parametrize("bits", BITS)
def test_unpack_zeros_every_byte(rng, bits):
    zeros = rng.integers(0, 256, size=(2, 6, 3), dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(_quant.unpack_zeros(zeros, bits)), helpers.numpy_unpack_zeros(zeros, bits)
    )
    np.testing.assert_array_equal(
        np.asarray(_quant.pack_zeros(_quant.unpack_zeros(zeros, bits), bits)), zeros
    )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("word", [np.uint32, np.uint8], ids=["u32", "u8"])
def test_pack_along_any_axis(rng, bits, axis, word):
    """pack / unpack along any axis into uint32 or uint8 words: field i of word j along the
    axis holds value j * w + i (low bits first); numpy stays numpy, jax stays jax."""
    per_word = np.dtype(word).itemsize * 8 // bits
    shape = [3, 2, 5]
    shape[axis] = 2 * per_word
    v = rng.integers(0, 2**bits, size=shape).astype(np.uint8)
    words = _quant.pack(v, bits, axis=axis, dtype=word)
    assert isinstance(words, np.ndarray) and words.dtype == word
    moved = np.moveaxis(words, axis, -1).astype(np.int64)
    for j in range(moved.shape[-1]):
        for i in range(per_word):
            np.testing.assert_array_equal(
                (moved[..., j] >> (bits * i)) & (2**bits - 1),
                np.moveaxis(v, axis, -1)[..., j * per_word + i],
                f"word {j} field {i}",
            )
    on_device = _quant.pack(jnp.asarray(v), bits, axis=axis, dtype=word)
    assert isinstance(on_device, jax.Array)
    np.testing.assert_array_equal(np.asarray(on_device), words)
    np.testing.assert_array_equal(_quant.unpack(words, bits, axis=axis), v)
    np.testing.assert_array_equal(np.asarray(_quant.unpack(on_device, bits, axis=axis)), v)


def test_pack_errors():
    with pytest.raises(ValueError, match=r"6 values along axis 1 are not a multiple of 8"):
        _quant.pack(np.zeros((2, 6), np.uint8), 4, axis=1)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        _quant.pack(np.zeros((2, 8), np.uint8), 4, axis=2)
    with pytest.raises(ValueError, match="words must be unsigned integers, got dtype int32"):
        _quant.unpack(np.zeros((2, 8), np.int32), 4)


# ---- quantize_experts -----------------------------------------------------------------------


def _half_step_bound(scales, bits: int, group: int) -> np.ndarray:
    """Per-element bound on |w - dequant(quant(w))| for f32 weights and f32 scales.

    Exact round-to-nearest gives 0.5 * s. Slack: w / s and + zero are evaluated in f32, each
    off by at most 2^-24 of a value of magnitude < 2^bits steps, so a w within ~2^-23 * 2^bits
    steps of a rounding midpoint may round the other way; the f32 dequant (q - z) * s adds
    another 2^-24 * 2^bits steps. Hence 0.5 * (1 + 1e-6) + 2 * eps32 * 2^bits, in steps.
    """
    eps = float(np.finfo(np.float32).eps)
    steps = 0.5 * (1 + 1e-6) + 2 * eps * 2**bits
    return np.repeat(np.asarray(scales, np.float64), group, axis=-1) * steps


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
def test_quantize_within_half_step(rng, bits, group_size, has_zp):
    e, n, k = 3, 10, 256
    w = rng.normal(size=(e, n, k)) * rng.uniform(0.01, 10.0, size=(e, n, 1))
    w[0] += 2.0  # whole rows of one sign: the grid's zero must still be representable
    w[1, :2] = -np.abs(w[1, :2])
    w = w.astype(np.float32)
    qw = _quantize(jnp.asarray(w), bits=bits, group_size=group_size, has_zp=has_zp)
    qw.validate()
    g = k if group_size == -1 else group_size
    assert (qw.bits, qw.group_size, qw.shape) == (bits, group_size, (e, n, k))
    assert qw.scales.dtype == jnp.float32 and qw.scales.shape == (e, n, k // g)
    assert qw.has_zeros == has_zp
    deq = helpers.numpy_dequantize(qw)
    err = np.abs(deq - w.astype(np.float64))
    bound = _half_step_bound(qw.scales, bits, g)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (
        f"worst at {worst}: |w - deq| = {err[worst]:.6g} > bound {bound[worst]:.6g} "
        f"(w={w[worst]}, deq={deq[worst]})"
    )
    # Round-to-nearest uses its grid: the largest error is close to half a step somewhere.
    assert np.max(err / bound) > 0.4


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
def test_quantize_constant_groups(bits, has_zp):
    """Constant groups (including all-zero ones, where the scale falls back to 1) stay exact-ish."""
    w = np.stack([np.zeros((4, 32)), np.full((4, 32), 0.75), np.full((4, 32), -3.0)])
    w = w.astype(np.float32)
    qw = wj.quantize_experts(jnp.asarray(w), bits=bits, group_size=32, has_zp=has_zp)
    deq = helpers.numpy_dequantize(qw)
    assert np.all(np.isfinite(deq))
    np.testing.assert_array_equal(deq[0], 0.0)
    bound = _half_step_bound(qw.scales, bits, 32)
    assert np.all(np.abs(deq - w) <= bound)


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_scale_dtype(rng, scale_dtype):
    w = rng.normal(size=(2, 4, 64)).astype(np.float32)
    qw = wj.quantize_experts(jnp.asarray(w), group_size=32, scale_dtype=scale_dtype)
    assert qw.scales.dtype == scale_dtype
    assert qw.dtype == scale_dtype


# ---- dequantize_experts ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dequantize_matches_numpy(rng, bits, group_size, has_zp, scale_dtype):
    qw = helpers.random_quantized_experts(rng, 3, 6, 256, bits, group_size, has_zp, scale_dtype)
    want = helpers.numpy_dequantize(qw)
    got = _dequantize(qw)
    assert got.dtype == jnp.float32 and got.shape == (3, 6, 256)
    # (q - z) is an exact small integer and the scale exact in f32: one f32 rounding.
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-24, atol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_output_dtype(rng, dtype):
    qw = helpers.random_quantized_experts(rng, 2, 4, 64, 4, 32, True, jnp.float32)
    got = wj.dequantize_experts(qw, dtype=dtype)
    assert got.dtype == dtype
    # One rounding to the output dtype (unit roundoff 2^-8 for bf16, 2^-11 for f16).
    rtol = 2**-8 if dtype == jnp.bfloat16 else 2**-11
    np.testing.assert_allclose(
        np.asarray(got, np.float64), helpers.numpy_dequantize(qw), rtol=rtol, atol=0
    )


@pytest.mark.parametrize("bits", BITS)
def test_quantize_is_idempotent_with_zero_points(rng, bits):
    """Asymmetric: a group's min and max land on q = 0 and q = qmax, so re-quantizing the
    dequantized weights reproduces them. (Symmetric quantization is not idempotent: absmax
    maps to +-(2**(bits-1) - 0.5) steps and the grid is [-2**(bits-1), 2**(bits-1) - 1].)"""
    w = rng.normal(size=(2, 4, 64)).astype(np.float32)
    qw = wj.quantize_experts(jnp.asarray(w), bits=bits, group_size=32, has_zp=True)
    qw2 = wj.quantize_experts(wj.dequantize_experts(qw), bits=bits, group_size=32, has_zp=True)
    np.testing.assert_allclose(
        helpers.numpy_dequantize(qw2), helpers.numpy_dequantize(qw), rtol=1e-6, atol=1e-7
    )


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 16])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
        _quant.pack_k(np.zeros((4, 32), np.uint8) + 1, bits)
    with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
        _quant.unpack_k(np.ones((4, 4), np.uint32), bits)
    with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
        _quant.pack_zeros(np.ones((1, 4, 2), np.uint8), bits)
    with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
        wj.quantize_experts(jnp.ones((1, 4, 64)), bits=bits)
    qw = wj.QuantizedExperts(
        qweight=jnp.ones((1, 4, 8), jnp.uint32),
        scales=jnp.ones((1, 4, 1)),
        zeros=None,
        bits=bits,
        group_size=-1,
    )
    with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
        wj.dequantize_experts(qw)


@pytest.mark.parametrize("k, group_size", [(64, 48), (96, 64), (128, 0)])
def test_k_not_multiple_of_group(k, group_size):
    with pytest.raises(ValueError, match=f"K={k} is not a multiple of group_size={group_size}"):
        wj.quantize_experts(jnp.ones((1, 4, k)), group_size=group_size)


@pytest.mark.parametrize("bits, k", [(4, 12), (4, 20), (8, 6)])
def test_k_not_multiple_of_pack_factor(bits, k):
    per_word = 32 // bits
    with pytest.raises(ValueError, match=f"K={k} is not a multiple of {per_word}"):
        wj.quantize_experts(jnp.ones((1, 4, k)), bits=bits, group_size=-1)
    with pytest.raises(ValueError, match=f"K={k} is not a multiple of {per_word}"):
        _quant.pack_k(np.ones((2, k), np.uint8), bits)


def test_odd_n_with_zero_points():
    with pytest.raises(ValueError, match="even N, got N=5"):
        wj.quantize_experts(jnp.ones((1, 5, 64)), bits=4, group_size=32, has_zp=True)
    with pytest.raises(ValueError, match="even N, got N=5"):
        _quant.pack_zeros(np.ones((1, 5, 2), np.uint8), 4)
    # Symmetric int4 and any int8 are fine with odd N.
    assert wj.quantize_experts(jnp.ones((1, 5, 64)), bits=4, group_size=32, has_zp=False).n == 5
    assert wj.quantize_experts(jnp.ones((1, 5, 64)), bits=8, group_size=32, has_zp=True).n == 5


def test_quantize_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\], got shape \(4, 64\)"):
        wj.quantize_experts(jnp.ones((4, 64)))


# ---- QuantizedExperts: concatenate, slice, astype -------------------------------------------


def _assert_same(a: wj.QuantizedExperts, b: wj.QuantizedExperts) -> None:
    assert (a.bits, a.group_size, a.layout, a.has_zeros) == (
        b.bits,
        b.group_size,
        b.layout,
        b.has_zeros,
    )
    for field in ("qweight", "scales", "zeros"):
        if getattr(a, field) is not None:
            np.testing.assert_array_equal(
                np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
            )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
def test_slice_and_concatenate(rng, bits, has_zp):
    """Slices along E and N dequantize to the slices of the dequantized weights; concatenating
    them back gives the packed arrays bit for bit."""
    qw = helpers.random_quantized_experts(rng, 3, 12, 64, bits, 32, has_zp, jnp.float32)
    deq = helpers.numpy_dequantize(qw)
    rows = [qw.slice(0, 4, axis=1), qw.slice(4, 10, axis=1), qw.slice(10, 12, axis=1)]
    for part, (lo, hi) in zip(rows, [(0, 4), (4, 10), (10, 12)], strict=True):
        part.validate()
        np.testing.assert_array_equal(helpers.numpy_dequantize(part), deq[:, lo:hi])
    _assert_same(wj.QuantizedExperts.concatenate(rows, axis=1), qw)
    experts = [qw.slice(e, e + 1, axis=0) for e in range(3)]
    np.testing.assert_array_equal(helpers.numpy_dequantize(experts[1]), deq[1:2])
    _assert_same(
        wj.QuantizedExperts.concatenate(experts[::-1], axis=0).slice(2, 3, axis=0), experts[0]
    )
    _assert_same(wj.QuantizedExperts.concatenate(experts, axis=0), qw)


def test_concatenate_keeps_host_arrays_on_the_host(rng):
    qw = helpers.random_quantized_experts(rng, 2, 8, 64, 4, 32, True, jnp.float16)
    host = jax.tree.map(np.asarray, qw)
    both = wj.QuantizedExperts.concatenate([host, host], axis=0)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(both))
    assert isinstance(wj.QuantizedExperts.concatenate([qw, host], axis=1).qweight, jax.Array)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(bits=8), r"parts\[1\] has bits=8, parts\[0\] has bits=4"),
        (dict(group_size=16), r"parts\[1\] has group_size=16"),
        (dict(has_zp=False), r"parts\[1\] has has_zeros=False"),
        (dict(dtype=jnp.bfloat16), r"parts\[1\] has scales dtype=bfloat16"),
        (dict(K=32), r"along N: parts\[1\] has \(E, K\)=\(2, 32\)"),
    ],
)
def test_concatenate_errors(rng, change, match):
    base = dict(E=2, N=8, K=64, bits=4, group_size=32, has_zp=True, dtype=jnp.float32)
    first = helpers.random_quantized_experts(rng, **base)
    other = helpers.random_quantized_experts(rng, **{**base, **change})
    with pytest.raises(ValueError, match=match):
        wj.QuantizedExperts.concatenate([first, other], axis=1)


def test_slice_and_concatenate_errors(rng):
    qw = helpers.random_quantized_experts(rng, 2, 8, 64, 4, 32, True, jnp.float32)
    with pytest.raises(ValueError, match=r"rows \[1, 4\) of N=8 cut a byte of int4 zero points"):
        qw.slice(1, 4, axis=1)
    # int8 zero points and symmetric int4 weights cut anywhere.
    assert (
        helpers.random_quantized_experts(rng, 2, 8, 64, 8, 32, True, jnp.float32)
        .slice(1, 4, axis=1)
        .n
        == 3
    )
    assert (
        helpers.random_quantized_experts(rng, 2, 8, 64, 4, 32, False, jnp.float32)
        .slice(3, 8, axis=1)
        .n
        == 5
    )
    with pytest.raises(ValueError, match=r"\[4, 9\) is not a non-empty range inside N=8"):
        qw.slice(4, 9, axis=1)
    with pytest.raises(ValueError, match=r"axis=2 must be 0 \(E\) or 1 \(N\); K is packed"):
        qw.slice(0, 8, axis=2)
    with pytest.raises(ValueError, match="axis=2 must be 0"):
        wj.QuantizedExperts.concatenate([qw, qw], axis=2)
    with pytest.raises(ValueError, match="needs at least one part"):
        wj.QuantizedExperts.concatenate([], axis=0)
    with pytest.raises(ValueError, match=r"parts\[1\] is a dict, not a QuantizedExperts"):
        wj.QuantizedExperts.concatenate([qw, {}], axis=0)
    tiled = wj.layouts.to_kernel_layout(
        helpers.random_quantized_experts(rng, 2, 64, 64, 4, 32, True, jnp.float32), "mgpu_int4"
    )
    with pytest.raises(ValueError, match="'mgpu_int4' layout; concatenating and slicing take"):
        tiled.slice(0, 1, axis=0)
    with pytest.raises(ValueError, match=r"parts\[0\]: the weights are in the 'mgpu_int4'"):
        wj.QuantizedExperts.concatenate([tiled], axis=0)


@pytest.mark.parametrize("layout", ["canonical", "mgpu_int4"])
def test_astype(rng, layout):
    """astype casts the scales; canonical zero points stay uint8, the kernel layout's (8 - z,
    small integers in the scales' dtype) follow the scales exactly."""
    qw = helpers.random_quantized_experts(rng, 2, 64, 64, 4, 32, True, jnp.float32)
    qw = wj.layouts.to_kernel_layout(qw, layout)
    half = qw.astype(jnp.bfloat16)
    assert half.scales.dtype == jnp.bfloat16 and half.layout == layout
    np.testing.assert_array_equal(
        np.asarray(half.scales, np.float32), np.asarray(qw.scales.astype(jnp.bfloat16), np.float32)
    )
    want_zeros = jnp.uint8 if layout == "canonical" else jnp.bfloat16
    assert half.zeros.dtype == want_zeros
    np.testing.assert_array_equal(
        np.asarray(half.zeros, np.float32), np.asarray(qw.zeros, np.float32)
    )
    assert qw.astype(jnp.float32) is qw
    with pytest.raises(ValueError, match="scales must be floating point, got dtype int32"):
        qw.astype(jnp.int32)


# ---- random_quantized_experts ---------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("zero_range", ["middle", "full"])
@pytest.mark.parametrize("source", ["numpy", "jax"])
def test_random_quantized_experts(bits, zero_range, source):
    """Canonical, every code value drawn, zero points in their range, scales exact in float16,
    codes times scales of about the asked std."""
    e, n, k, g = 4, 32, 512, 128
    key = np.random.default_rng(0) if source == "numpy" else jax.random.key(0)
    qw = wj.random_quantized_experts(
        key, (e, n, k), bits=bits, group_size=g, dtype=jnp.float32, zero_range=zero_range
    )
    qw.validate()
    assert qw.shape == (e, n, k) and qw.layout == "canonical" and qw.scales.dtype == jnp.float32
    codes = helpers.numpy_unpack_k(qw.qweight, bits)
    assert set(np.unique(codes)) == set(range(2**bits))
    zeros = helpers.numpy_unpack_zeros(qw.zeros, bits)
    mid = 2 ** (bits - 1)
    lo, hi = (mid - 2, mid + 1) if zero_range == "middle" else (0, 2**bits - 1)
    assert zeros.min() >= lo and zeros.max() <= hi, (zeros.min(), zeros.max())
    scales = np.asarray(qw.scales)
    np.testing.assert_array_equal(scales.astype(np.float16).astype(np.float32), scales)
    code_std = np.sqrt(((2**bits) ** 2 - 1) / 12)
    ratio = scales * code_std * np.sqrt(k)  # U(0.75, 1.25) up to the float16 rounding
    assert 0.749 < ratio.min() and ratio.max() < 1.251 and abs(ratio.mean() - 1) < 0.05


def test_random_quantized_experts_draws(rng):
    """The same Generator state or key gives the same weights; a symmetric int8 draw has no
    zeros; under jit the draw is the same as eager."""
    a = wj.random_quantized_experts(np.random.default_rng(3), (2, 8, 64), group_size=32)
    b = wj.random_quantized_experts(np.random.default_rng(3), (2, 8, 64), group_size=32)
    _assert_same(a, b)
    assert a.scales.dtype == jnp.bfloat16
    sym = wj.random_quantized_experts(rng, (2, 7, 64), bits=8, group_size=-1, has_zeros=False)
    assert sym.zeros is None and sym.group_size == -1 and sym.scales.shape == (2, 7, 1)
    key = jax.random.key(1)
    make = functools.partial(wj.random_quantized_experts, shape=(2, 8, 64), group_size=32)
    _assert_same(jax.jit(make)(key), make(key))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shape=(1, 8, 60)), r"K=60 is not a multiple of 8 \(bits=4\)"),
        (dict(shape=(1, 8, 64), group_size=48), "K=64 is not a multiple of group_size=48"),
        (dict(shape=(1, 7, 64)), "int4 zero points need an even N, got N=7"),
        (dict(shape=(1, 8, 64), zero_range="wide"), "zero_range='wide' is not one of"),
        (dict(shape=(1, 8, 64), bits=2), "bits=2 is not supported"),
    ],
)
def test_random_quantized_experts_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        wj.random_quantized_experts(np.random.default_rng(0), **{"group_size": 32, **kwargs})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_refuses_non_finite_weights(rng, bad):
    """NaN or inf in a group would become a meaningless scale and finite codes: refused, with
    the count and the first index; inside jit nothing can be checked (the caller checks)."""
    w = rng.normal(size=(2, 8, 64)).astype(np.float32)
    w[1, 3, 17] = bad
    w[1, 5, 2] = bad
    with pytest.raises(ValueError, match=r"w holds 2 non-finite value\(s\).*index \(1, 3, 17\)"):
        wj.quantize_experts(jnp.asarray(w), group_size=32)
    with pytest.raises(ValueError, match=r"'experts.0' holds 2 non-finite"):
        _quant.check_finite(w, "'experts.0'")
    traced = jax.jit(functools.partial(wj.quantize_experts, group_size=32))(jnp.asarray(w))
    assert traced.shape == (2, 8, 64)
    w[np.isinf(w) | np.isnan(w)] = 0.5
    wj.quantize_experts(jnp.asarray(w), group_size=32)  # finite again: accepted
