"""Tests of the grouped GEMM's layout and epilogue options: the slice_major column order, the
int4/int8 -> 16-bit conversions (jnp and PTX), and GEMM1 with silu(gate) * up fused.

CPU (CI): kernels in the Pallas interpreter (the jnp conversion). GPU: compiled, where the PTX
conversion (asm) is the default; the gpu-marked test compares the two bit for bit.
"""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.pallas import _dequant
from pallas_kernels.pallas._common import slice_major, slice_major_columns
from pallas_kernels.pallas.wna16_gemm import scales_per_group, wna16_gemm
from wna16_jax import _activations, _reference
from wna16_jax._types import BlockConfig

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)

_ref_align = jax.jit(_reference.moe_align_block_size, static_argnames=("num_experts", "block_m"))
_ref_gemm = jax.jit(_reference.grouped_matmul, static_argnames=("top_k",))


@pytest.mark.parametrize("bits, block_k", [(4, 128), (4, 256), (8, 64), (8, 128)])
def test_slice_major_columns_locates_every_column(rng, bits, block_k):
    a = jnp.asarray(rng.normal(size=(3, 4 * block_k)), jnp.float32)
    moved = slice_major(a, block_k=block_k, bits=bits)
    c = jnp.arange(a.shape[1], dtype=jnp.int32)
    where = slice_major_columns(c, block_k=block_k, bits=bits)
    assert sorted(np.asarray(where).tolist()) == list(range(a.shape[1]))  # a permutation
    np.testing.assert_array_equal(np.asarray(moved)[:, np.asarray(where)], np.asarray(a))
    # Value slice i of word j of a tile meets column k0 + W*i + j.
    per_word, w = 32 // bits, block_k // (32 // bits)
    assert int(where[per_word * 5 + 3]) == w * 3 + 5


@pytest.mark.parametrize("bits, dtype", [(4, BF16), (4, F16), (8, F16)])
def test_half_value_slices_are_offset_plus_value(rng, bits, dtype):
    words = jnp.asarray(rng.integers(0, 2**32, size=(16, 8), dtype=np.uint64).astype(np.uint32))
    halves = _dequant.half_value_slices(words, bits=bits, dtype=dtype, asm=False)
    offset = _dequant.half_magic_offset(bits, dtype)
    w = np.asarray(words)
    for i, h in enumerate(halves):
        assert h.dtype == dtype and h.shape == words.shape
        expected = (w >> (bits * i)) & ((1 << bits) - 1)
        np.testing.assert_array_equal(np.asarray(h, np.float64) - offset, expected)


def test_half_value_slices_refuses_inexact():
    words = jnp.zeros((16, 8), jnp.uint32)
    with pytest.raises(ValueError, match="int8 does not convert exactly into bfloat16"):
        _dequant.half_value_slices(words, bits=8, dtype=BF16, asm=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bits, dtype", [(4, BF16), (4, F16), (8, F16)])
def test_asm_conversion_equals_jnp(rng, bits, dtype):
    """The PTX conversion returns the jnp conversion's bits, for every value slice."""
    from jax.experimental.pallas import triton as plgpu

    per_word = 32 // bits
    shape = (64, 16)
    words = jnp.asarray(rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32))

    def kernel(w_ref, *out_refs):
        w = plgpu.load(w_ref.at[:, :])
        asm = _dequant.half_value_slices(w, bits=bits, dtype=dtype, asm=True)
        ref = _dequant.half_value_slices(w, bits=bits, dtype=dtype, asm=False)
        for o, v in zip(out_refs, (*asm, *ref), strict=True):
            plgpu.store(o.at[:, :], v)

    outs = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct(shape, dtype)] * (2 * per_word))(
        words
    )
    for i in range(per_word):
        np.testing.assert_array_equal(
            np.asarray(outs[i]).view(np.uint16),
            np.asarray(outs[per_word + i]).view(np.uint16),
            err_msg=f"value slice {i}",
        )


# ---- GEMM1 with the activation fused -------------------------------------------------------

GATED_CASES = [
    # (bits, group, has_zp, dtype, block_k, unpack)
    (4, 128, True, BF16, 128, "slices"),
    (4, 64, False, F16, 128, "slices"),  # several groups per tile
    (8, 128, True, BF16, 128, "slices"),  # int8 into bf16: the exact f32 path
    (8, -1, False, F16, 64, "slices"),
    (4, 128, True, BF16, 64, "tile"),
]


@pytest.mark.parametrize("bits, group, has_zp, dtype, block_k, unpack", GATED_CASES)
def test_gated_gemm_is_silu_gate_times_up(rng, bits, group, has_zp, dtype, block_k, unpack):
    t, top_k, e, i, h = 11, 3, 8, 128, 256
    w13 = helpers.random_quantized_experts(rng, e, 2 * i, h, bits, group, has_zp, dtype)
    _, ids = helpers.random_routing(rng, t, top_k, e)
    routing = _ref_align(jnp.asarray(ids, jnp.int32), num_experts=e, block_m=16)
    x = jnp.asarray(rng.normal(size=(t, h)), dtype)
    config = BlockConfig(block_m=16, block_n=32, block_k=block_k, unpack=unpack)
    out = wna16_gemm(
        x,
        w13,
        routing,
        top_k=top_k,
        config=config,
        out_dtype=jnp.float32,
        interpret=INTERPRET,
        activation="silu",
    )
    ref = _activations.silu_and_mul(_ref_gemm(x, w13, routing, top_k=top_k))
    assert out.shape == (t * top_k, i)
    # The gate and up sums carry the plain GEMM's error (1e-5 in one group, ~u/2 across
    # groups); silu(g) * u keeps its relative size.
    tol = 1e-4 if block_k <= w13.group else 5e-3
    helpers.assert_finite_and_close(
        np.asarray(out), np.asarray(ref), tol, f"gated {config}", require_signal=True
    )


@pytest.mark.parametrize("out_block_k, out_bits", [(128, 4), (64, 8)])
def test_gated_output_in_the_next_gemms_order(rng, out_block_k, out_bits):
    """out_slice_major stores exactly slice_major(natural output)."""
    t, top_k, e, i, h = 5, 2, 4, 256, 128
    w13 = helpers.random_quantized_experts(rng, e, 2 * i, h, 4, 128, True, BF16)
    _, ids = helpers.random_routing(rng, t, top_k, e)
    routing = _ref_align(jnp.asarray(ids, jnp.int32), num_experts=e, block_m=16)
    x = jnp.asarray(rng.normal(size=(t, h)), BF16)
    config = BlockConfig(block_m=16, block_n=64, block_k=128)
    run = dict(top_k=top_k, config=config, interpret=INTERPRET, activation="silu")
    natural = wna16_gemm(x, w13, routing, **run)
    moved = wna16_gemm(x, w13, routing, out_slice_major=(out_block_k, out_bits), **run)
    np.testing.assert_array_equal(
        np.asarray(moved, np.float32),
        np.asarray(slice_major(natural, block_k=out_block_k, bits=out_bits), np.float32),
    )


def test_gated_gemm_rejects_split_k(rng):
    w13 = helpers.random_quantized_experts(rng, 4, 256, 256, 4, 128, True, BF16)
    routing = _ref_align(jnp.zeros((2, 1), jnp.int32), num_experts=4, block_m=16)
    x = jnp.asarray(rng.normal(size=(2, 256)), BF16)
    config = BlockConfig(block_m=16, block_n=64, block_k=128, split_k=2)
    with pytest.raises(ValueError, match="split_k=1"):
        wna16_gemm(x, w13, routing, top_k=1, config=config, activation="silu", interpret=True)


# ---- dot="fma": CUDA-core products for few rows per expert ---------------------------------


def routed_gemm_and_reference(rng, config, *, t, bits, group, has_zp, dtype):
    """One routed GEMM (t tokens, top-3 of 8 experts, N=64, K=256, routed weights) through the
    kernel with `config` and through the reference: (out f32, ref, the quantized weights)."""
    top_k, e, n, k = 3, 8, 64, 256
    qw = helpers.random_quantized_experts(rng, e, n, k, bits, group, has_zp, dtype)
    _, ids = helpers.random_routing(rng, t, top_k, e)
    routing = _ref_align(jnp.asarray(ids, jnp.int32), num_experts=e, block_m=config.block_m)
    a = jnp.asarray(rng.normal(size=(t, k)), dtype)
    rw = jnp.asarray(rng.uniform(0.1, 1.0, size=t * top_k), jnp.float32)
    out = wna16_gemm(
        a, qw, routing, rw, top_k=top_k, config=config, out_dtype=jnp.float32, interpret=INTERPRET
    )
    ref = _ref_gemm(a, qw, routing, top_k=top_k, routed_weights=rw)
    return np.asarray(out), np.asarray(ref), qw


FMA_CASES = [
    # (bits, group, has_zp, dtype, block_m, block_k, unpack, split_k)
    (4, 128, True, BF16, 1, 128, "slices", 1),
    (4, 64, False, F16, 2, 128, "slices", 2),  # several groups per tile, each scaled exactly
    (4, 128, True, BF16, 1, 256, "slices", 1),
    (8, 128, True, BF16, 4, 64, "slices", 1),  # int8 into bf16: the exact f32 path
    (4, -1, True, BF16, 8, 64, "tile", 2),
    (8, 32, False, F16, 16, 32, "tile", 1),
]


@pytest.mark.parametrize("bits, group, has_zp, dtype, block_m, block_k, unpack, split_k", FMA_CASES)
def test_fma_gemm_matches_reference(
    rng, bits, group, has_zp, dtype, block_m, block_k, unpack, split_k
):
    config = BlockConfig(
        block_m=block_m, block_n=32, block_k=block_k, unpack=unpack, split_k=split_k, dot="fma"
    )
    out, ref, qw = routed_gemm_and_reference(
        rng, config, t=7, bits=bits, group=group, has_zp=has_zp, dtype=dtype
    )
    # f32 products of the same 16-bit operands as the tensor-core path: the same tolerances
    # (1e-5 inside one group, ~u/2 across groups; f16 in-group 1e-4, as test_wna16_gemm.py).
    in_group = block_k <= qw.group or scales_per_group(
        block_k=block_k, unpack=unpack, dot="fma", bits=bits, group=qw.group, dtype=dtype
    )
    tol = (1e-4 if dtype == F16 else 1e-5) if in_group else 5e-3
    helpers.assert_finite_and_close(out, ref, tol, f"fma {config}", require_signal=True)


# ---- unpack="join": converted value slices joined back into feature order, one dot per group

JOIN_CASES = [
    # (bits, group, has_zp, dtype, block_m, block_k, split_k)
    (4, 128, True, BF16, 16, 128, 1),
    (4, 128, False, F16, 32, 256, 1),  # two groups per tile, each scaled exactly
    (4, 32, True, BF16, 16, 128, 1),  # four small groups per tile
    (8, 64, True, F16, 16, 64, 1),  # int8 exact in fp16
    (8, 128, False, BF16, 16, 128, 2),  # int8 into bf16: the general path, run as "tile"
    (4, -1, True, F32, 16, 64, 1),  # f32 activations: the general path
]


@pytest.mark.parametrize("bits, group, has_zp, dtype, block_m, block_k, split_k", JOIN_CASES)
def test_join_gemm_matches_reference(rng, bits, group, has_zp, dtype, block_m, block_k, split_k):
    config = BlockConfig(
        block_m=block_m, block_n=32, block_k=block_k, unpack="join", split_k=split_k
    )
    out, ref, qw = routed_gemm_and_reference(
        rng, config, t=9, bits=bits, group=group, has_zp=has_zp, dtype=dtype
    )
    exact = scales_per_group(
        block_k=block_k, unpack="join", dot="mma", bits=bits, group=qw.group, dtype=dtype
    )
    # The tolerances of test_wna16_gemm.py: the exact path 1e-5 (f16 1e-4); the general path
    # in one group the same, across groups ~u/2 of the activation dtype.
    if exact or block_k <= qw.group:
        tol = 1e-4 if dtype == F16 else 1e-5
    else:
        tol = 5e-3 if dtype == BF16 else 1e-3
    helpers.assert_finite_and_close(
        out,
        ref,
        tol,
        f"join {config}",
        require_signal=True,
        slack=5.0,  # test_wna16_gemm.py's ELEMENT_SLACK: tol is a norm-wise bound
    )
    assert exact == (dtype != F32 and not (bits == 8 and dtype == BF16))


@pytest.mark.parametrize(
    "config, message",
    [
        (BlockConfig(block_m=8, block_n=32, block_k=128), "must be >= 16 for tensor-core dots"),
        (BlockConfig(block_m=32, block_n=32, block_k=128, dot="fma"), "must be <= 16"),
    ],
)
def test_dot_mode_rules(rng, config, message):
    qw = helpers.random_quantized_experts(rng, 2, 64, 256, 4, 128, True, BF16)
    routing = _ref_align(jnp.zeros((1, 1), jnp.int32), num_experts=2, block_m=config.block_m)
    a = jnp.asarray(rng.normal(size=(1, 256)), BF16)
    with pytest.raises(ValueError, match=message):
        wna16_gemm(a, qw, routing, top_k=1, config=config, interpret=True)


def test_unknown_dot_mode_is_refused():
    with pytest.raises(ValueError, match="BlockConfig.dot='wmma' is not one of"):
        BlockConfig(dot="wmma")
