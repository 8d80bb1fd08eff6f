"""Tests of the quantized linear layer (wna16_jax.linear): the one-expert grouped GEMM.

The Pallas path (interpreted on CPU, compiled on a GPU) and the xla path against a float64
numpy product on the same dequantized weights; shapes (leading dims, rows not a multiple of
block_m, no rows), the identity routing, the backend selection, and the errors.
"""

from __future__ import annotations

import dataclasses

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from wna16_jax import linear
from wna16_jax._configs import GemmShape

ON_GPU = jax.default_backend() == "gpu"
KERNEL = "pallas" if ON_GPU else "pallas_interpret"


def numpy_linear(x, w) -> np.ndarray:
    wd = helpers.numpy_dequantize(w)[0]  # [N, K] float64
    return np.einsum("...k,nk->...n", np.asarray(x, np.float64), wd)


@pytest.mark.parametrize("implementation", ["xla", KERNEL])
@pytest.mark.parametrize(
    "bits, group, has_zp, dtype",
    [
        (4, 128, True, jnp.bfloat16),
        (4, 64, False, jnp.float16),
        (8, -1, False, jnp.bfloat16),
        (4, 32, True, jnp.float32),
    ],
)
def test_matches_numpy(rng, implementation, bits, group, has_zp, dtype):
    w = helpers.random_quantized_experts(rng, 1, 96, 256, bits, group, has_zp, dtype)
    x = jnp.asarray(rng.normal(size=(2, 3, 256)), dtype)  # 6 rows: not a multiple of block_m
    out = linear.quantized_matmul(x, w, implementation=implementation)
    assert out.shape == (2, 3, 96) and out.dtype == dtype
    helpers.assert_close(out, numpy_linear(x, w), dtype, f"{implementation} linear")


@pytest.mark.parametrize("implementation", ["xla", KERNEL, "mgpu_interpret"])
def test_act_order_weight(rng, implementation):
    """A weight with an input permutation (a GPTQ act-order linear): x's features are taken in
    its order, on every path (the mgpu GEMM: weight in its layout)."""
    w = helpers.with_random_perm(
        rng, helpers.random_quantized_experts(rng, 1, 128, 256, 4, 64, True, jnp.bfloat16)
    )
    layout = "mgpu_int4" if implementation.startswith("mgpu") else "canonical"
    x = jnp.asarray(rng.normal(size=(3, 256)), jnp.bfloat16)
    out = linear.quantized_matmul(
        x, wj.layouts.to_kernel_layout(w, layout), implementation=implementation
    )
    helpers.assert_close(out, numpy_linear(x, w), jnp.bfloat16, f"{implementation} act-order")


def test_kernel_with_fma_config_and_zero_rows(rng):
    w = helpers.random_quantized_experts(rng, 1, 64, 256, 4, 128, True, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(3, 256)), jnp.bfloat16)
    cfg = wj.BlockConfig(block_m=1, block_n=32, block_k=128, dot="fma")
    out = linear.quantized_matmul(x, w, implementation=KERNEL, config=cfg)
    helpers.assert_close(out, numpy_linear(x, w), jnp.bfloat16, "fma linear")
    empty = linear.quantized_matmul(x[:0], w, implementation=KERNEL)
    assert empty.shape == (0, 64)


def test_identity_routing():
    r = linear.identity_routing(5, 4)
    np.testing.assert_array_equal(r.sorted_token_ids, [0, 1, 2, 3, 4, 5, 5, 5])
    np.testing.assert_array_equal(r.expert_ids, [0, 0])
    assert int(r.num_tokens_post_padded) == 8 and r.block_m == 4


def test_default_is_xla_off_gpu(rng):
    w = helpers.random_quantized_experts(rng, 1, 64, 128, 4, 128, True, jnp.bfloat16)
    assert linear.select_implementation(w) == ("pallas" if ON_GPU else "xla")


def test_names_are_tried_in_order(rng):
    """The selection of fused_moe: names tried in order, the first that runs this weight; a
    shape the kernel cannot tile (N=24: no block_n >= 16 divides it) falls through to 'xla'."""
    w = helpers.random_quantized_experts(rng, 1, 64, 128, 4, 128, True, jnp.bfloat16)
    odd = helpers.random_quantized_experts(rng, 1, 24, 128, 4, 128, True, jnp.bfloat16)
    both = [KERNEL, "xla"]  # a list: made hashable for the jitted call
    assert linear.select_implementation(w, implementation=both) == KERNEL
    assert linear.select_implementation(odd, implementation=both) == "xla"
    x = jnp.asarray(rng.normal(size=(3, 128)), jnp.bfloat16)
    out = linear.quantized_matmul(x, odd, implementation=both)
    helpers.assert_close(out, numpy_linear(x, odd), jnp.bfloat16, "fallen-through linear")
    with pytest.raises(NotImplementedError, match="no block config fits"):
        linear.quantized_matmul(x, odd, implementation=KERNEL)


MGPU = "mgpu" if ON_GPU else "mgpu_interpret"


@pytest.mark.parametrize(
    "rows, n, k, group, has_zp, bits",
    [
        (1, 576, 512, 128, True, 4),  # kv_a_proj's N; 8-row blocks, k-steps of two groups, split
        (9, 128, 256, 64, False, 4),  # 16-row blocks, one partly used
        (70, 576, 256, 128, True, 4),  # 128-row blocks (bf16 weights), halved, one consumer
        (3, 128, 256, -1, True, 4),  # per-channel scales
        (1, 576, 512, -1, False, 8),  # int8 per channel (W8A16): k-steps of 256, split K
        (70, 576, 256, 128, True, 8),  # int8 on 128-row blocks (bf16 weights), one consumer
    ],
)
def test_mgpu_matches_numpy(rng, rows, n, k, group, has_zp, bits):
    """The Mosaic GPU GEMM with one expert on weights in its layout (int4 or int8), at the
    heuristic's configs for decode and prefill row counts, against float64 numpy on the same
    weights."""
    w = helpers.random_quantized_experts(rng, 1, n, k, bits, group, has_zp, jnp.bfloat16)
    mgpu = wj.layouts.to_kernel_layout(w, f"mgpu_int{bits}")
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
    assert linear.select_implementation(mgpu, implementation=[MGPU, "xla"]) == MGPU
    out = linear.quantized_matmul(x, mgpu, implementation=MGPU)
    assert out.shape == (rows, n) and out.dtype == jnp.bfloat16
    helpers.assert_close(out, numpy_linear(x, w), jnp.bfloat16, "mgpu linear")
    xla = linear.quantized_matmul(x, mgpu, implementation="xla")  # reads the layout back
    helpers.assert_close(xla, numpy_linear(x, w), jnp.bfloat16, f"xla linear on {mgpu.layout}")


def numpy_silu_and_mul(h) -> np.ndarray:
    i = h.shape[-1] // 2
    gate, up = h[..., :i], h[..., i:]
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize(
    "implementation, layout, rows, n, k, group",
    [
        ("xla", "canonical", 3, 192, 256, 128),
        (KERNEL, "canonical", 5, 192, 256, 64),
        (MGPU, "mgpu_int4", 1, 256, 2048, 128),  # decode: 8-row blocks, K split (2)
        (MGPU, "mgpu_int4", 9, 1024, 256, 64),  # 16-row blocks, silu in the epilogue
        (MGPU, "mgpu_int4", 70, 256, 256, 128),  # 128-row blocks
        (MGPU, "mgpu_int4", 128, 512, 256, 128),  # one program's tile: bf16_weights
    ],
)
def test_gated_linear(rng, implementation, layout, rows, n, k, group):
    """activation="silu": a gated MLP's [gate; up] weight in one GEMM, silu(gate) * up from
    the f32 sums, against float64 numpy on the weights the path multiplies (rounded to bf16
    where it rounds them: near silu's zero, a weight's rounding moves the product more than
    bf16's tolerance of it); also with an f32 output."""
    w = helpers.random_quantized_experts(rng, 1, n, k, 4, group, True, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
    kw = wj.layouts.to_kernel_layout(w, layout)
    w_deq = weights_multiplied(implementation, w, kw, rows)[0]  # [N, K] float64
    ref = numpy_silu_and_mul(np.einsum("rk,nk->rn", np.asarray(x, np.float64), w_deq))
    out = linear.quantized_matmul(x, kw, activation="silu", implementation=implementation)
    assert out.shape == (rows, n // 2) and out.dtype == jnp.bfloat16
    helpers.assert_close(out, ref, jnp.bfloat16, f"{implementation} gated linear")
    out32 = linear.quantized_matmul(
        x, kw, activation="silu", out_dtype=jnp.float32, implementation=implementation
    )
    assert out32.dtype == jnp.float32
    helpers.assert_close(out32, ref, jnp.float32, f"{implementation} gated linear, f32 out")


def weights_multiplied(implementation, w, kw, rows) -> np.ndarray:
    """float64 weights a gated linear multiplies (w converted to kw, its kernel layout): xla and
    the Pallas GEMM dequantize to the activations' dtype (bf16); the Mosaic GPU GEMM those of
    its bf16_weights path where its plan runs it (helpers.bf16_weights_of), else the exact ones
    (f32 sums per group, or per-channel sums scaled at the end)."""
    if implementation != MGPU:
        return helpers.bf16_rounded(helpers.numpy_dequantize(w))
    from pallas_kernels.mgpu.config import gemm_plan
    from pallas_kernels.mgpu.grouped_matmul import linear_config

    cfg = linear_config(GemmShape.of_weights(kw, m=rows))
    blocks = -(-rows // cfg.block_m)
    if gemm_plan(cfg, kw, blocks, activation_dtype=jnp.bfloat16)[3]["bf16_weights"]:
        return helpers.bf16_weights_of(w)
    return helpers.numpy_dequantize(w)


def test_linear_splits(monkeypatch):
    """A decode linear (8-row blocks) splits K for 4 programs per SM of 132, counting a gated
    weight's programs as it runs them unsplit (one per gate and up tile pair), each split
    keeping 4 k-steps of 256; larger blocks leave it to the layer's rule (None)."""
    from pallas_kernels.mgpu import config as mgpu_config
    from pallas_kernels.mgpu.grouped_matmul import linear_config

    monkeypatch.setattr(mgpu_config, "_num_sms", lambda: 132)

    def splits(n, k, gated, m=1):
        w = jax.eval_shape(
            lambda: wj.layouts.to_kernel_layout(
                wj.random_quantized_experts(
                    jax.random.key(0), (1, n, k), bits=4, group_size=128, has_zeros=True
                ),
                "mgpu_int4",
            )
        )
        return mgpu_config.linear_splits(linear_config(GemmShape.of_weights(w, m=m)), w, gated)

    assert splits(36864, 7168, gated=True) == 2  # 288 gated programs: 528 / 288 -> 2
    assert splits(36864, 7168, gated=False) == 1  # 576 programs
    assert splits(7168, 16384, gated=False) == 4  # 112 programs -> 5: 4 divides 64 steps
    assert splits(24576, 1536, gated=False) == 1  # 2 splits would leave 3 of 6 k-steps
    assert splits(2112, 7168, gated=False) == 7  # at most 8: 7 divides 28 steps
    assert splits(7168, 16384, gated=False, m=8) is None  # 16-row blocks


def test_mgpu_linear_configs():
    """The heuristic narrows a program's features until they tile N (576 = 9 x 64), and keeps
    more k-steps in flight for a decode row's long K."""
    from pallas_kernels.mgpu.config import default_config, tile_n
    from pallas_kernels.mgpu.grouped_matmul import linear_config

    for m in (1, 8, 64, 4096):
        shape = GemmShape(m=m, n=576, k=7168, num_experts=1, bits=4, group=128, group_size=128)
        cfg = linear_config(shape)
        assert 576 % tile_n(cfg) == 0, (m, cfg)
    wide = linear_config(dataclasses.replace(shape, n=7168))
    assert wide.block_m == 128 and wide.consumers == 2
    # Decode rows: a long K keeps 4 k-steps in flight (int4 and int8), a short one the layer's.
    from pallas_kernels.mgpu.grouped_matmul import DEEP_PIPELINE_STAGES

    for bits in (4, 8):
        long_k = dataclasses.replace(shape, m=1, n=7168, k=16384, bits=bits)
        assert linear_config(long_k).stages == DEEP_PIPELINE_STAGES, bits
    short_k = dataclasses.replace(shape, m=1, n=24576, k=1536)
    assert linear_config(short_k).stages == default_config(1, 1, 128).stages


def test_preferred_layout(rng, monkeypatch):
    """The layout a linear's weight is converted to once: canonical on CPU unless a backend
    that reads another is named (its layout where it holds the weight: mgpu_int8 for int8);
    shapes not in 64 x 64 tiles stay canonical; with the interpreter standing in for 'mgpu',
    the automatic choice is mgpu_int4 (mgpu_int8) for bf16 and canonical for f32
    activations."""
    w = helpers.random_quantized_experts(rng, 1, 128, 256, 4, 128, True, jnp.bfloat16)
    w8 = helpers.random_quantized_experts(rng, 1, 128, 256, 8, 128, True, jnp.bfloat16)
    odd = helpers.random_quantized_experts(rng, 1, 96, 256, 4, 128, True, jnp.bfloat16)
    assert linear.preferred_layout(w, implementation="mgpu_interpret") == "mgpu_int4"
    assert linear.preferred_layout(w, implementation="pallas_interpret") == "canonical"
    assert linear.preferred_layout(w8, implementation="mgpu_interpret") == "mgpu_int8"
    assert linear.preferred_layout(odd, implementation="mgpu_interpret") == "canonical"
    f32 = linear.preferred_layout(w, dtype=jnp.float32, implementation="mgpu_interpret")
    assert f32 == "canonical"
    if not ON_GPU:
        assert linear.preferred_layout(w) == "canonical"
        preferred = (("mgpu_int4", "mgpu_interpret"), ("mgpu_int8", "mgpu_interpret"))
        monkeypatch.setattr(wj._dispatch, "preferred_layouts", lambda: preferred)
        assert linear.preferred_layout(w) == "mgpu_int4"
        assert linear.preferred_layout(w8) == "mgpu_int8"
        assert linear.preferred_layout(w, dtype=jnp.float32) == "canonical"
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        linear.preferred_layout(w, implementation="nope")


@pytest.mark.parametrize(
    "e, k_x, implementation, error, message",
    [
        (2, 128, "xla", ValueError, r"a quantized linear weight is \[1, N, K\]"),
        (1, 64, "xla", ValueError, "x has 64 input features, the weight K=128"),
        (1, 128, "no_such", ValueError, "unknown implementation 'no_such'"),
        (1, 128, "mgpu_interpret", NotImplementedError, "reads weights in the 'mgpu_int4' layout"),
        (1, 128, "mgpu_interpret", NotImplementedError, "reads weights in the 'mgpu_int8' layout"),
    ],
)
def test_errors(rng, e, k_x, implementation, error, message):
    bits = 8 if "int8" in message else 4
    w = helpers.random_quantized_experts(rng, e, 64, 128, bits, 128, True, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(2, k_x)), jnp.bfloat16)
    with pytest.raises(error, match=message):
        linear.quantized_matmul(x, w, implementation=implementation)


def test_gated_errors(rng):
    w = helpers.random_quantized_experts(rng, 1, 96, 128, 4, 128, True, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(2, 128)), jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"activation='gelu' is not one of \['silu', 'swiglu_oai'\]"
    ):
        linear.quantized_matmul(x, w, activation="gelu")
    odd = helpers.random_quantized_experts(rng, 1, 95, 128, 4, 128, False, jnp.bfloat16)
    with pytest.raises(ValueError, match="N=95 is not even"):
        linear.quantized_matmul(x, odd, activation="silu")
