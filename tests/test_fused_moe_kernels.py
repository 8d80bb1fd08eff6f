"""Tests of the MoE layer from the Pallas-Triton kernels (pallas_kernels.pallas.fused_moe).

The checks every backend passes (tests/backend_cases.py: against the 'xla' reference on the same
quantized weights and the float64 numpy layer) run twice: interpreted (the Pallas interpreter,
any platform) and compiled (`gpu`). Below them, this backend's own paths: explicit split-K and
CUDA-core ("fma") configs, configs refused before any kernel runs, and DeepSeek-V3 shapes.

How to run:
    CPU (CI): `pytest tests/test_fused_moe_kernels.py` runs the kernels in the Pallas interpreter
        ("pallas_interpret") on small shapes; tests marked `gpu` are skipped.
    GPU: `pytest -m gpu tests/test_fused_moe_kernels.py` runs them compiled ("pallas"), with the
        DeepSeek-V3 shapes (E=256, top-8, H=7168, I=2048, int4 G=128, w13's qweight over 2^31
        bytes, M up to 4096, and the TP=8 slice I=256 with and without split-K; needs ~30 GB of
        GPU memory).
"""

from __future__ import annotations

import os

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_cases import (
    ALL_SCHEMES_ENV,
    ELEMENT_SLACK,
    MXFP4,
    FusedMoeCases,
    Scheme,
    SchemeCases,
)

import wna16_jax as wj
from pallas_kernels.pallas import fused_moe as pallas_moe
from pallas_kernels.pallas import wna16_gemm as gemm_module
from wna16_jax._types import BlockConfig
from wna16_jax.backend_api import GemmShape

# Compiled on a GPU, the Pallas interpreter elsewhere (the special paths below).
ON_GPU = jax.default_backend() == "gpu"
IMPLEMENTATION = "pallas" if ON_GPU else "pallas_interpret"

BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)


class TestPallasInterpreted(FusedMoeCases):
    IMPLEMENTATION = "pallas_interpret"
    BACKEND_FUSED_MOE = staticmethod(helpers.pipeline_fused_moe(pallas_moe.stages, interpret=True))


@pytest.mark.gpu
class TestPallasCompiled(FusedMoeCases):
    IMPLEMENTATION = "pallas"
    BACKEND_FUSED_MOE = staticmethod(helpers.pipeline_fused_moe(pallas_moe.stages))


def assert_moe_close(out, ref, dtype, what: str, tol: float | None = None) -> None:
    """out is finite everywhere and matches ref (norm-wise tol, element-wise with slack)."""
    tol = helpers.tolerance(dtype) if tol is None else tol
    helpers.assert_finite_and_close(out, ref, tol, what, slack=ELEMENT_SLACK, require_signal=True)


def run_both(x, w13, w2, tw, ti, **kwargs):
    """(Pallas backend output, 'xla' backend output) of the public API."""
    out = wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION, **kwargs)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla", **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype, (out.shape, out.dtype)
    return out, ref


def quarter_local_map(rng: np.random.Generator, num_experts: int) -> jax.Array:
    """int32 [E]: a random quarter of the experts local (random local ids), the rest -1."""
    local = rng.permutation(num_experts)[: num_experts // 4]
    m = np.full(num_experts, -1, np.int32)
    m[local] = rng.permutation(len(local))
    return jnp.asarray(m)


def _no_kernel(*args, **kwargs):
    raise AssertionError("pallas_call was reached: the config should have been rejected first")


# ---- explicit configs -----------------------------------------------------------------------


def test_split_k_with_expert_map(rng):
    """split_k=2 in both GEMMs (atomic accumulation) with a quarter of the experts local:
    tokens routed only off-shard give exactly 0, the rest matches 'xla' with the same map."""
    t, k, e, h, i = 10, 2, 16, 128, 128
    expert_map = quarter_local_map(rng, e)
    emap = np.asarray(expert_map)
    local, remote = np.nonzero(emap >= 0)[0], np.nonzero(emap < 0)[0]
    # int8: block_k = 64 gives two k-tiles per GEMM, so split_k=2 runs (int4 needs 128).
    x, w13, w2, tw, _ = helpers.random_moe_inputs(
        rng, T=t, H=h, I=i, E=len(local), k=k, bits=8, group_size=32
    )
    _, ids = helpers.random_routing(rng, t, k, e)
    ids[:3] = rng.choice(remote, size=(3, k), replace=False)  # tokens 0-2: only off-shard
    ids[3] = rng.choice(local, size=k, replace=False)  # token 3: only local
    ids[4, 0] = -1  # and a dropped slot
    ti = jnp.asarray(ids)
    config = BlockConfig(16, 64, 64, split_k=2)
    out, ref = run_both(x, w13, w2, tw, ti, expert_map=expert_map, config=config)
    np.testing.assert_array_equal(
        np.asarray(out[:3], np.float32), 0.0, err_msg="tokens routed only to off-shard experts"
    )
    assert_moe_close(out, ref, BF16, "vs xla backend")


def test_explicit_split_k_config(rng):
    """A caller's BlockConfig with split_k=2 (both GEMMs accumulate with atomics)."""
    x, w13, w2, tw, ti = helpers.random_moe_inputs(
        rng, T=6, H=128, I=128, E=8, k=2, bits=8, group_size=32, dtype=F16
    )
    config = BlockConfig(block_m=16, block_n=32, block_k=64, split_k=2)
    out, ref = run_both(x, w13, w2, tw, ti, config=config)
    assert_moe_close(out, ref, F16, "vs xla backend")


@pytest.mark.parametrize("block_m, split_k", [(1, 1), (4, 2)])
def test_fma_config_with_expert_map(rng, block_m, split_k):
    """dot="fma" with block_m below a tensor-core tile: both GEMMs (GEMM2 follows GEMM1's
    block_m), a quarter of the experts local, dropped ids."""
    e = 16
    x, w13, w2, tw, ti = helpers.random_moe_inputs(
        rng, T=5, H=256, I=256, E=e, k=4, bits=4, group_size=128
    )
    ti = np.asarray(ti).copy()
    ti[0, 0] = -1
    expert_map = quarter_local_map(rng, e)
    local = int((np.asarray(expert_map) >= 0).sum())
    w13 = jax.tree.map(lambda a: a[:local], w13)
    w2 = jax.tree.map(lambda a: a[:local], w2)
    config = BlockConfig(block_m=block_m, block_n=32, block_k=128, split_k=split_k, dot="fma")
    out, ref = run_both(x, w13, w2, tw, jnp.asarray(ti), config=config, expert_map=expert_map)
    assert_moe_close(out, ref, BF16, f"{config} vs xla backend")


@pytest.mark.parametrize(
    "config, message",
    [
        (BlockConfig(block_m=16, block_n=64, block_k=256), "K=128 is not a multiple of"),
        (BlockConfig(block_m=16, block_n=64, block_k=128, split_k=3), "split_k=3 does not divide"),
    ],
    ids=["bk-over-K", "split-vs-tiles"],
)
def test_bad_config_raises_before_any_kernel(rng, monkeypatch, config, message):
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=3, H=128, I=128, E=8, k=2)
    monkeypatch.setattr(gemm_module.pl, "pallas_call", _no_kernel)
    with pytest.raises(ValueError, match=message):
        wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION, config=config)


def test_block_k_below_kernel_minimum_raises(rng):
    """int4 block_k=64 (8 values per dot: garbage on the H200) is refused with a ValueError.

    Raised while tracing, so no kernel runs; but it comes from wna16_gemm's own check, after
    the align kernel was traced: block_configs.config_problems does not hold this rule.
    """
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=3, H=128, I=128, E=8, k=2)
    config = BlockConfig(block_m=16, block_n=64, block_k=64)
    with pytest.raises(ValueError, match="block_k=64 is below 128 for int4"):
        wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION, config=config)


# ---- 64-wide k-tiles: K a multiple of 64, not of 128 (gpt-oss's H = I = 2880 = 45 x 64) -------

# The 4-bit schemes of the 64-wide k-tiles in CI (groups of 32, 64 and per channel, each scale
# dtype, with and without zero points, and MXFP4); WNA16_TEST_ALL_SCHEMES=1 runs every scheme
# whose group tiles H and I.
K64_SAMPLED = (
    Scheme(4, 32, True, "bfloat16"),
    Scheme(4, 64, False, "float16"),
    Scheme(4, -1, True, "float32"),
    MXFP4,
)
# H = 5 x 64, I = 3 x 64: no 128-wide k-tile fits either GEMM.
K64_PROBLEM = dict(T=5, E=4, k=2, H=320, I=192)


def k64_schemes() -> tuple[Scheme, ...]:
    """K64_SAMPLED, or under WNA16_TEST_ALL_SCHEMES=1 every scheme of SCHEMES whose group
    divides K64_PROBLEM's H and I."""
    if os.environ.get(ALL_SCHEMES_ENV) != "1":
        return K64_SAMPLED
    from backend_cases import SCHEMES

    p = K64_PROBLEM
    return tuple(s for s in SCHEMES if s.group_size == -1 or p["I"] % s.group_size == 0)


class TestPallasInterpretedK64Schemes(SchemeCases):
    """The scheme matrix's grouped GEMM and quantized linear against float64 on K = 320, which
    the heuristic tiles 64 wide."""

    IMPLEMENTATION = "pallas_interpret"
    PROBLEM = K64_PROBLEM
    BATCH_INVARIANT = None  # the batch-invariance checks run at the 128-wide problem
    test_scheme_fused_moe = None  # the layer's checks at this K: test_k64_gpt_oss_layer

    def supports_scheme(self, scheme: Scheme) -> bool:
        return scheme in k64_schemes() and super().supports_scheme(scheme)


def test_k64_heuristic_configs():
    """Where 128 does not tile K, the heuristic takes a 64-wide "join" k-tile on the tensor
    cores and "slices" on the CUDA cores; where it does (K = 7168, 2048), its 128-wide choice
    is unchanged."""
    from pallas_kernels.common.block_configs import heuristic_config

    def shape(m, k, bits=4, group=32):
        return GemmShape(m=m, n=384, k=k, num_experts=8, bits=bits, group=group,
                            group_size=group, scale_bytes=2)  # fmt: skip

    assert heuristic_config(shape(64, 320)).block_k == 64
    assert heuristic_config(shape(64, 320)).unpack == "join"
    decode = heuristic_config(shape(1, 2880))
    assert (decode.block_k, decode.unpack, decode.dot) == (64, "slices", "fma")
    assert heuristic_config(shape(64, 2880, group=2880)).unpack == "join"
    for k, group in ((7168, 128), (2048, 128), (256, 32)):
        config = heuristic_config(shape(64, k, group=group))
        assert (config.block_k, config.unpack) == (128, "slices"), (k, group, config)
    # int8's smallest "slices" tile is 64 already.
    assert heuristic_config(shape(64, 320, bits=8)).unpack == "slices"


def gpt_oss_inputs(rng, scheme: Scheme, *, t: int, e: int, k: int, h: int, i: int):
    """x, w13, w2 ([E, 2I, H], [E, H, I] in `scheme`), both biases, the routing; x scaled so
    that GEMM1's sums reach past the clamped SwiGLU's limit and stay inside it."""
    w13 = SchemeCases.scheme_weights(rng, scheme, e, 2 * i, h)
    w2 = SchemeCases.scheme_weights(rng, scheme, e, h, i)
    w13d, w2d = helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2)
    x = rng.normal(size=(t, h)) * 4.0 / (np.sqrt(h) * np.sqrt(np.mean(w13d**2)))
    b13 = rng.normal(size=(e, 2 * i))
    b2 = rng.normal(size=(e, h)) * np.sqrt(i * np.mean(w2d**2)) * 4.0
    tw, ti = helpers.random_routing(rng, t, k, e)
    hid = np.einsum("th,enh->ten", x, w13d) + b13  # [T, E, 2I]
    limit = wj.ClampedSwiGLU().limit
    assert (hid[..., :i] > limit).any() and (np.abs(hid[..., i:]) < limit).any()
    return (
        jnp.asarray(x, BF16), w13, w2, jnp.asarray(b13, jnp.float32), jnp.asarray(b2, BF16),
        jnp.asarray(tw), jnp.asarray(ti),
    )  # fmt: skip


def check_gpt_oss_layer(rng, scheme, *, t, e, config=None, h=320, i=192, k=2):
    """gpt-oss's expert math (both biases, the clamped SwiGLU) on `scheme`'s experts through
    the Pallas kernels (interpreted) against 'xla' on the same weights, f32 out."""
    x, w13, w2, b13, b2, tw, ti = gpt_oss_inputs(rng, scheme, t=t, e=e, k=k, h=h, i=i)
    kwargs = dict(
        activation=wj.ClampedSwiGLU(), w13_bias=b13, w2_bias=b2, out_dtype=jnp.float32,
        config=config,
    )  # fmt: skip
    out = wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION, **kwargs)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla", **kwargs)
    # The kernels round the activation to bf16 before GEMM2; 'xla' keeps it in f32.
    assert_moe_close(np.asarray(out), np.asarray(ref), BF16, f"{scheme} {config} vs xla")


def _k64_layer_cases():
    """(scheme, T, E): 24 tokens over 4 experts (tensor-core "join" tiles, GEMM1's epilogue
    adding its bias before the fused activation) for each scheme; one token over 8 experts
    (CUDA-core "slices" tiles) for MXFP4 (every scheme under WNA16_TEST_ALL_SCHEMES; int4's
    in test_k64_explicit_configs)."""
    everything = os.environ.get(ALL_SCHEMES_ENV) == "1"
    cases = [pytest.param(s, 24, 4, id=f"prefill-mma-join-{s}") for s in k64_schemes()]
    decode = k64_schemes() if everything else (MXFP4,)
    return cases + [pytest.param(s, 1, 8, id=f"decode-fma-slices-{s}") for s in decode]


@pytest.mark.parametrize("scheme, t, e", _k64_layer_cases())
def test_k64_gpt_oss_layer(rng, scheme, t, e):
    """H = 320, I = 192 at the heuristic's configs."""
    check_gpt_oss_layer(rng, scheme, t=t, e=e)


K64_CONFIGS = [
    # split-K over 3 k-tiles of both GEMMs (H = I = 192): the biases added by split 0 alone
    BlockConfig(block_m=16, block_n=32, block_k=64, split_k=3, unpack="join"),
    # CUDA-core "slices": GEMM1's fused epilogue writes GEMM2's 64-wide slice_major order
    BlockConfig(block_m=1, block_n=32, block_k=64, dot="fma"),
    # the general path: each value scaled in f32 before one dot over the tile
    BlockConfig(block_m=16, block_n=32, block_k=64, unpack="tile"),
]


def _k64_config_cases():
    """Each of K64_CONFIGS once, MXFP4 and int4 alternating (both with each under
    WNA16_TEST_ALL_SCHEMES=1)."""
    names = ["join-split3", "fma-slices", "tile"]
    pair = (MXFP4, K64_SAMPLED[0])
    both = os.environ.get(ALL_SCHEMES_ENV) == "1"
    return [
        pytest.param(s, c, id=f"{name}-{s}")
        for j, (c, name) in enumerate(zip(K64_CONFIGS, names, strict=True))
        for s in (pair if both else (pair[j % 2],))
    ]


@pytest.mark.parametrize("scheme, config", _k64_config_cases())
def test_k64_explicit_configs(rng, scheme, config):
    """A caller's 64-wide configs on H = I = 192 (3 k-tiles per GEMM)."""
    check_gpt_oss_layer(rng, scheme, t=3, e=4, config=config, h=192, i=192)


def test_k_not_a_multiple_of_64_is_refused(rng):
    """H = 96 (a multiple of 32, not of 64): the backend says why, naming the k-tile."""
    x, w13, w2, tw, ti = helpers.random_moe_inputs(
        rng, T=3, H=96, I=128, E=4, k=2, bits=4, group_size=32
    )
    message = (
        r"H=96 is not a multiple of 64, the smallest k-tile for int4 \(each dot contracts at "
        r"least 16 features per value slice\)"
    )
    with pytest.raises(NotImplementedError, match=message):
        wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION)


# ---- GPU only: DeepSeek-V3 ------------------------------------------------------------------

DSV3_E, DSV3_TOP_K, DSV3_H, DSV3_G = 256, 8, 7168, 128
# Compiled-kernel outputs against the 'xla' reference at DeepSeek-V3 sizes (bf16).
DSV3_TOL = 1e-2


def deepseek_layer(rng, *, m: int, intermediate: int, has_zp: bool):
    """(x, w13, w2, topk_weights, topk_ids) of one DeepSeek-V3 MoE layer, int4 G=128, bf16."""
    key = jax.random.key(int(rng.integers(2**31)))
    k13, k2, kx = jax.random.split(key, 3)
    e, h, i = DSV3_E, DSV3_H, intermediate
    w13 = helpers.device_quantized_experts(k13, e, 2 * i, h, 4, DSV3_G, has_zp, BF16)
    w2 = helpers.device_quantized_experts(k2, e, h, i, 4, DSV3_G, has_zp, BF16)
    x = jax.random.normal(kx, (m, h), BF16)
    tw, ti = helpers.random_routing(rng, m, DSV3_TOP_K, e)
    return x, w13, w2, jnp.asarray(tw), jnp.asarray(ti)


def check_deepseek(x, w13, w2, tw, ti, config=None):
    out, ref = run_both(x, w13, w2, tw, ti, config=config)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), f"{np.sum(~np.isfinite(out))} non-finite outputs"
    assert not np.isnan(out).any()
    assert_moe_close(out, ref, BF16, "pallas vs xla at DeepSeek-V3 shapes", tol=DSV3_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_deepseek_v3_tp1(rng, m, has_zp):
    """DeepSeek-V3 at TP=1: w13's qweight is uint32 [256, 4096, 896], 3.76e9 bytes (over 2^31,
    the size where int32 byte offsets broke; 0.94e9 elements, under 2^31)."""
    x, w13, w2, tw, ti = deepseek_layer(rng, m=m, intermediate=2048, has_zp=has_zp)
    assert w13.qweight.dtype == jnp.uint32 and w13.qweight.shape == (256, 4096, 896)
    nbytes = w13.qweight.size * w13.qweight.dtype.itemsize
    assert nbytes == 3_758_096_384 > 2**31, nbytes
    assert w13.qweight.size < 2**31 - 1
    check_deepseek(x, w13, w2, tw, ti)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [None, 1, 2], ids=["heuristic", "split1", "split2"])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
def test_deepseek_v3_tp8(rng, has_zp, m, split_k):
    """The TP=8 slice (I=256): GEMM1 is N=512, K=7168, where split-K matters. One config
    serves both GEMMs: block_k=128 (the int4 minimum) leaves GEMM2 (K=256) two k-tiles, so
    split_k is at most 2."""
    x, w13, w2, tw, ti = deepseek_layer(rng, m=m, intermediate=256, has_zp=has_zp)
    config = None
    if split_k is not None:
        config = BlockConfig(block_m=16, block_n=64, block_k=128, split_k=split_k)
    check_deepseek(x, w13, w2, tw, ti, config=config)


# ---- GPU only: gpt-oss-120b -----------------------------------------------------------------

GPT_OSS_E, GPT_OSS_TOP_K, GPT_OSS_H = 128, 4, 2880


def check_gpt_oss_shapes(rng, *, m: int, e: int, top_k: int, h: int, i: int, tol: float):
    """gpt-oss's MoE layer (MXFP4 experts drawn on the device, both biases, the clamped SwiGLU)
    at the heuristic's configs against 'xla' on the same weights, f32 out."""
    k13, k2, kx = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    w13 = wj.random_quantized_experts(k13, (e, 2 * i, h), scheme="mxfp4", std=4.0 / np.sqrt(h))
    w2 = wj.random_quantized_experts(k2, (e, h, i), scheme="mxfp4")
    x = jax.random.normal(kx, (m, h), BF16)
    b13 = jnp.asarray(rng.normal(size=(e, 2 * i)), jnp.float32)
    b2 = jnp.asarray(rng.normal(size=(e, h)), BF16)
    tw, ti = (jnp.asarray(a) for a in helpers.random_routing(rng, m, top_k, e))
    kwargs = dict(
        activation=wj.ClampedSwiGLU(), w13_bias=b13, w2_bias=b2, out_dtype=jnp.float32
    )  # fmt: skip
    out = wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION, **kwargs)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla", **kwargs)
    what = f"{IMPLEMENTATION} vs xla at E={e}, top-{top_k}, H={h}, I={i}, M={m}"
    assert_moe_close(np.asarray(out), np.asarray(ref), BF16, what, tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 512])
def test_gpt_oss_120b(rng, m):
    """gpt-oss-120b's shapes (45 k-tiles of 64 per GEMM), compiled."""
    check_gpt_oss_shapes(
        rng, m=m, e=GPT_OSS_E, top_k=GPT_OSS_TOP_K, h=GPT_OSS_H, i=GPT_OSS_H, tol=DSV3_TOL
    )
