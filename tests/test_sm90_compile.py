"""The Pallas kernels build for an H200 (sm_90) without a GPU: lowering, Triton, PTX, ptxas.

Each case lowers the whole fused_moe at DeepSeek-V3 shapes for the "cuda" platform and compiles
every kernel with the `triton` package (tests/sm90.py), then checks what a GPU would reject at
launch: shared memory over the H200's 227 KiB. Skipped when triton is not installed (CI); with
it (`pip install triton==3.6.0`) a GPU-free machine catches build failures before any GPU run.
"""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import pytest
import sm90

import wna16_jax as wj
from pallas_kernels.pallas import fused_moe as pallas_moe

pytestmark = pytest.mark.skipif(sm90.available() is not None, reason=str(sm90.available()))

E, TOP_K, H, I = 256, 8, 7168, 2048


def abstract_experts(n, k, bits, group_size, has_zeros, dtype=jnp.bfloat16, *, e=E):
    g = k if group_size == -1 else group_size
    zn = n // 2 if bits == 4 else n
    return wj.QuantizedExperts(
        jax.ShapeDtypeStruct((e, n, k * bits // 32), jnp.uint32),
        jax.ShapeDtypeStruct((e, n, k // g), dtype),
        jax.ShapeDtypeStruct((e, zn, k // g), jnp.uint8) if has_zeros else None,
        bits=bits,
        group_size=group_size,
    )


@pytest.mark.parametrize("m", [1, 16, 256, 4096])
@pytest.mark.parametrize(
    "bits, group_size, has_zeros, dtype, scale_dtype",
    [
        (4, 128, True, jnp.bfloat16, jnp.bfloat16),
        (4, 128, False, jnp.float16, jnp.float16),
        (8, -1, False, jnp.bfloat16, jnp.bfloat16),
        # the schemes of other checkpoints: Kimi-K2's g32 symmetric, GPTQ's float16 scales
        # beside bf16 activations, float32 scales, int8 in groups of 32
        (4, 32, False, jnp.bfloat16, jnp.bfloat16),
        (4, 128, False, jnp.bfloat16, jnp.float16),
        (4, 64, True, jnp.bfloat16, jnp.float32),
        (8, 32, True, jnp.bfloat16, jnp.float16),
    ],
    ids=[
        "int4-g128-zp-bf16", "int4-g128-sym-f16", "int8-channel-bf16", "int4-g32-sym-bf16",
        "int4-g128-sym-bf16-f16-scales", "int4-g64-zp-bf16-f32-scales",
        "int8-g32-zp-bf16-f16-scales",
    ],
)  # fmt: skip
def test_deepseek_v3_kernels_build_for_sm90(m, bits, group_size, has_zeros, dtype, scale_dtype):
    w13 = abstract_experts(2 * I, H, bits, group_size, has_zeros, scale_dtype)
    w2 = abstract_experts(H, I, bits, group_size, has_zeros, scale_dtype)
    args = (
        jax.ShapeDtypeStruct((m, H), dtype),
        w13,
        w2,
        jax.ShapeDtypeStruct((m, TOP_K), jnp.float32),
        jax.ShapeDtypeStruct((m, TOP_K), jnp.int32),
    )
    kernels = sm90.compile_for_sm90(
        lambda *a: helpers.pipeline_fused_moe(pallas_moe.stages)(*a), *args
    )
    gemms = [k for k in kernels if k.name.startswith("wna16_gemm")]
    assert len(gemms) == 2, [k.name for k in kernels]
    for k in kernels:
        assert k.shared_bytes <= sm90.H200_SHARED_MEMORY_BYTES, (
            f"{k.name} (warps {k.num_warps}, stages {k.num_stages}) needs {k.shared_bytes} "
            f"bytes of shared memory"
        )
    if bits == 4 and group_size >= 128 and jnp.dtype(scale_dtype).itemsize == 2:
        # the in-group 16-bit path (k-tiles inside a group, 16-bit scales) converts with PTX
        # prmt + lop3
        assert all("prmt.b32" in k.ptx and "lop3.b32" in k.ptx for k in gemms)


def deepseek_gemm_kernels(m: int, config) -> list:
    """The two GEMM kernels of DeepSeek-V3's MoE layer (TP=1, int4 g128 zp, bf16) at m tokens
    with `config`, built for sm_90."""
    args = (
        jax.ShapeDtypeStruct((m, H), jnp.bfloat16),
        abstract_experts(2 * I, H, 4, 128, True),
        abstract_experts(H, I, 4, 128, True),
        jax.ShapeDtypeStruct((m, TOP_K), jnp.float32),
        jax.ShapeDtypeStruct((m, TOP_K), jnp.int32),
    )
    kernels = sm90.compile_for_sm90(
        lambda *a: helpers.pipeline_fused_moe(pallas_moe.stages)(*a, config=config), *args
    )
    gemms = [k for k in kernels if k.name.startswith("wna16_gemm")]
    assert len(gemms) == 2, [k.name for k in kernels]
    return gemms


@pytest.mark.parametrize(
    "m, config",
    [
        (1, wj.BlockConfig(block_m=1, block_n=64, block_k=128, dot="fma")),
        (1, wj.BlockConfig(block_m=1, block_n=64, block_k=128, split_k=4, dot="fma")),
        (16, wj.BlockConfig(block_m=2, block_n=128, block_k=128, dot="fma")),
    ],
    ids=["m1-bm1", "m1-bm1-split4", "m16-bm2"],
)
def test_fma_kernels_build_for_sm90(m, config):
    """The CUDA-core product (no tensor cores) builds, converts with PTX and uses real FMAs."""
    gemms = deepseek_gemm_kernels(m, config)
    for k in gemms:
        assert k.shared_bytes <= sm90.H200_SHARED_MEMORY_BYTES
        assert "fma.rn.f32" in k.ptx and "prmt.b32" in k.ptx
        assert "mma.sync" not in k.ptx and "wgmma" not in k.ptx


# DeepSeek-V3's quantized non-expert linears (N, K): MLA projections, dense MLP.
DSV3_LINEARS = {
    "q_a": (1536, 7168),
    "q_b": (24576, 1536),
    "kv_a": (576, 7168),
    "kv_b": (32768, 512),
    "o": (7168, 16384),
    "dense_gate": (18432, 7168),
    "dense_down": (7168, 18432),
}


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("name", sorted(DSV3_LINEARS))
def test_deepseek_v3_linears_build_for_sm90(name, rows):
    """A quantized linear's kernel: the 'pallas' backend's grouped GEMM with one expert at the
    config it resolves (wna16_jax.linear runs the same; its backend selection needs a GPU)."""
    from wna16_jax import _dispatch, linear
    from wna16_jax._configs import GemmShape

    n, k = DSV3_LINEARS[name]
    w = abstract_experts(n, k, 4, 128, True)
    w = wj.QuantizedExperts(
        *(jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype) for a in (w.qweight, w.scales, w.zeros)),
        bits=4,
        group_size=128,
    )
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    gemm = _dispatch.get_backend("pallas").grouped_matmul
    config, _ = gemm.config(GemmShape.of_weights(w, m=rows), None)

    def run(x, w):
        routing = linear.identity_routing(rows, config.block_m)
        return gemm.run(x, w, routing, top_k=1, config=config, out_dtype=jnp.float32)

    kernels = sm90.compile_for_sm90(run, x, w)
    assert [k.name for k in kernels] == ["wna16_gemm_int4"]
    assert kernels[0].shared_bytes <= sm90.H200_SHARED_MEMORY_BYTES


@pytest.mark.parametrize(
    "m, config",
    [
        (1, wj.BlockConfig(block_m=16, block_n=128, block_k=128, unpack="join")),
        (4096, wj.BlockConfig(block_m=64, block_n=128, block_k=256, num_stages=3, unpack="join")),
    ],
    ids=["m1-bm16", "m4096-bm64-bk256"],
)
def test_join_kernels_build_for_sm90(m, config):
    """unpack="join": the joined slices meet one tensor-core dot per group (wgmma at 64 rows)."""
    gemms = deepseek_gemm_kernels(m, config)
    for k in gemms:
        assert k.shared_bytes <= sm90.H200_SHARED_MEMORY_BYTES
        assert "prmt.b32" in k.ptx
        assert ("wgmma" in k.ptx) if config.block_m >= 64 else ("mma.sync" in k.ptx)


def test_gather_rows_builds_for_sm90():
    """The mgpu layer's rows in block order (pallas_kernels/gather_rows.py) at DeepSeek-V3
    M=4096's shapes: 16-byte loads and stores, no shared memory."""
    from pallas_kernels.common.gather_rows import gather_rows

    args = (
        jax.ShapeDtypeStruct((4096, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((48896,), jnp.int32),
    )
    (kernel,) = sm90.compile_for_sm90(gather_rows, *args)
    assert kernel.name == "gather_rows"
    assert "ld.global.v4.b32" in kernel.ptx and "st.global.v4.b32" in kernel.ptx


def mxfp4_layer_args(m: int) -> tuple:
    """fused_moe's arguments (shapes) at DeepSeek-V3 shapes with MXFP4 experts, m tokens."""
    return (
        jax.ShapeDtypeStruct((m, H), jnp.bfloat16),
        abstract_mxfp4_experts(2 * I, H),
        abstract_mxfp4_experts(H, I),
        jax.ShapeDtypeStruct((m, TOP_K), jnp.float32),
        jax.ShapeDtypeStruct((m, TOP_K), jnp.int32),
    )


def abstract_mxfp4_experts(n, k, *, e=E):
    """[e, N, K] MXFP4 experts: E2M1 codes in uint32 words, uint8 E8M0 scales per 32 inputs."""
    return wj.QuantizedExperts(
        jax.ShapeDtypeStruct((e, n, k // 8), jnp.uint32),
        jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8),
        None,
        bits=4,
        group_size=32,
        codes="e2m1",
    )


@pytest.mark.parametrize(
    "m, config",
    [
        (1, None),
        (4096, None),
        (1, wj.BlockConfig(block_m=1, block_n=64, block_k=128, dot="fma")),
        (16, wj.BlockConfig(block_m=16, block_n=128, block_k=128, unpack="join")),
        (256, wj.BlockConfig(block_m=16, block_n=64, block_k=128, unpack="tile")),
    ],
    ids=["m1", "m4096", "m1-fma", "m16-join", "m256-tile-4-groups"],
)
def test_mxfp4_kernels_build_for_sm90(m, config):
    """MXFP4 experts at DeepSeek-V3 shapes: the GEMMs decode E2M1 and E8M0 and build for
    sm_90, within its shared memory."""
    args = mxfp4_layer_args(m)
    layer = helpers.pipeline_fused_moe(pallas_moe.stages)
    kernels = sm90.compile_for_sm90(lambda *a: layer(*a, config=config), *args)
    gemms = [k for k in kernels if k.name.startswith("wna16_gemm")]
    assert [k.name for k in gemms] == ["wna16_gemm_mxfp4"] * 2, [k.name for k in kernels]
    for k in kernels:
        assert k.shared_bytes <= sm90.H200_SHARED_MEMORY_BYTES, (
            f"{k.name} (warps {k.num_warps}, stages {k.num_stages}) needs {k.shared_bytes} "
            f"bytes of shared memory"
        )


# gpt-oss-120b's experts: E = 128, top-4, H = I = 2880 (45 k-tiles of 64, none of 128).
GPT_OSS_E, GPT_OSS_TOP_K, GPT_OSS_H = 128, 4, 2880


def gpt_oss_layer_args(m: int, *, e=E, top_k=TOP_K, h=H, i=I) -> tuple:
    """fused_moe's arguments (shapes) with MXFP4 experts [e, 2i, h] and [e, h, i] and both
    biases (f32 [e, 2i], [e, h]), m tokens."""
    return (
        jax.ShapeDtypeStruct((m, h), jnp.bfloat16),
        abstract_mxfp4_experts(2 * i, h, e=e),
        abstract_mxfp4_experts(h, i, e=e),
        jax.ShapeDtypeStruct((m, top_k), jnp.float32),
        jax.ShapeDtypeStruct((m, top_k), jnp.int32),
        jax.ShapeDtypeStruct((e, 2 * i), jnp.float32),
        jax.ShapeDtypeStruct((e, h), jnp.float32),
    )


# (m, experts' shapes): DeepSeek-V3's (128-wide k-tiles) and gpt-oss-120b's (E = 128, top-4,
# H = I = 2880: 64-wide k-tiles, "join" on the tensor cores, "slices" on the CUDA cores).
GPT_OSS_BUILDS = [
    (1, dict()),
    (256, dict()),
    *((m, dict(e=GPT_OSS_E, top_k=GPT_OSS_TOP_K, h=GPT_OSS_H, i=GPT_OSS_H)) for m in (1, 64, 4096)),
]


@pytest.mark.parametrize(
    "m, shapes", GPT_OSS_BUILDS, ids=["dsv3-m1", "dsv3-m256", "120b-m1", "120b-m64", "120b-m4096"]
)
def test_mxfp4_gpt_oss_epilogue_builds_for_sm90(m, shapes):
    """gpt-oss's expert math on MXFP4 experts (both biases and the clamped SwiGLU in the GEMMs'
    epilogues) at the heuristic's configs builds for sm_90 within its shared memory."""
    args = gpt_oss_layer_args(m, **shapes)
    top_k, h = args[3].shape[1], args[0].shape[1]
    configs = pallas_moe.gemm_configs(m * top_k, args[1], args[2], None)
    assert all((c.block_k == 64) == (h % 128 != 0) for c in configs), configs

    def layer(x, w13, w2, tw, ids, b13, b2):
        return helpers.pipeline_fused_moe(pallas_moe.stages)(
            x, w13, w2, tw, ids, activation=wj.ClampedSwiGLU(), w13_bias=b13, w2_bias=b2
        )

    kernels = sm90.compile_for_sm90(layer, *args)
    gemms = [k for k in kernels if k.name.startswith("wna16_gemm")]
    assert [k.name for k in gemms] == ["wna16_gemm_mxfp4"] * 2, [k.name for k in kernels]
    for k in kernels:
        assert k.shared_bytes <= sm90.H200_SHARED_MEMORY_BYTES, (
            f"{k.name} (warps {k.num_warps}, stages {k.num_stages}) needs {k.shared_bytes} "
            f"bytes of shared memory"
        )


@pytest.mark.parametrize(
    "group_size, has_zeros", [(32, True), (-1, False)], ids=["g32-zp", "channel-sym"]
)
@pytest.mark.parametrize("m", [1, 256])
def test_int4_64_wide_k_tiles_build_for_sm90(m, group_size, has_zeros):
    """int4 at gpt-oss-120b's expert shapes (H = I = 2880): the 64-wide "join" tiles convert
    with PTX (prmt + lop3) on the tensor cores, "slices" on the CUDA cores at decode."""
    h, e = GPT_OSS_H, GPT_OSS_E
    w13 = abstract_experts(2 * h, h, 4, group_size, has_zeros, e=e)
    w2 = abstract_experts(h, h, 4, group_size, has_zeros, e=e)
    args = (
        jax.ShapeDtypeStruct((m, h), jnp.bfloat16),
        w13,
        w2,
        jax.ShapeDtypeStruct((m, GPT_OSS_TOP_K), jnp.float32),
        jax.ShapeDtypeStruct((m, GPT_OSS_TOP_K), jnp.int32),
    )
    configs = pallas_moe.gemm_configs(m * GPT_OSS_TOP_K, w13, w2, None)
    assert [(c.block_k, c.unpack) for c in configs] == [(64, "join" if m > 1 else "slices")] * 2
    kernels = sm90.compile_for_sm90(
        lambda *a: helpers.pipeline_fused_moe(pallas_moe.stages)(*a), *args
    )
    gemms = [k for k in kernels if k.name.startswith("wna16_gemm")]
    assert [k.name for k in gemms] == ["wna16_gemm_int4"] * 2, [k.name for k in kernels]
    for k in kernels:
        assert k.shared_bytes <= sm90.H200_SHARED_MEMORY_BYTES, (k.name, k.shared_bytes)
    assert all("prmt.b32" in k.ptx and "lop3.b32" in k.ptx for k in gemms)
