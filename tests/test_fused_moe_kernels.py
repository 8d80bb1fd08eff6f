"""Tests of the MoE layer from the Pallas-Triton kernels (pallas_kernels.triton.fused_moe).

Through the public API `wj.fused_moe(..., implementation=...)` the Pallas backend is compared with
the 'xla' reference backend and with the float64 numpy oracle (tests/helpers.py), both on the
*dequantized* weights, so quantization error never hides inside a tolerance. Every output
element must be finite. Inputs are random (never zeros), fresh per case, seeded from the test id.

How to run:
    CPU (CI): `pytest tests/test_fused_moe_kernels.py` runs the kernels in the Pallas interpreter
        (implementation "pallas_interpret") on small shapes; tests marked `gpu` are skipped.
    GPU: `pytest -m gpu tests/test_fused_moe_kernels.py` runs the DeepSeek-V3 shapes compiled
        (implementation "pallas": E=256, top-8, H=7168, I=2048, int4 G=128, w13's qweight over
        2^31 bytes, M up to 4096, and the TP=8 slice I=256 with and without split-K; needs ~30 GB
        of GPU memory); plain `pytest tests/test_fused_moe_kernels.py` on a GPU runs every test
        compiled.
"""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from pallas_kernels.triton import fused_moe as pallas_moe
from pallas_kernels.triton import wna16_gemm as gemm_module
from wna16_jax._types import BlockConfig

# Compiled on a GPU, the Pallas interpreter elsewhere: the same tests run both ways.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
IMPLEMENTATION = "pallas" if ON_GPU else "pallas_interpret"

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)

# Tolerances: helpers.TOLERANCES, the one table for a fused MoE output in each activation dtype
# (norm-wise relative error, reasons beside its entries). The Pallas pipeline rounds GEMM1's
# output and the activation to the activation dtype before GEMM2 (as vLLM does), and rounds the
# weight tile when a k-tile holds several groups: measured 4-5e-3 (bf16) and 6e-4 (f16) against
# the oracle, and the same against the 'xla' backend (whose own output rounding adds ~1.6e-3).
#
# Element-wise, |out - ref| <= tol * |ref| + ELEMENT_SLACK * tol * rms(ref): a wrong row or
# column (an error of order rms) fails it, while single elements of sums of rounded terms may
# stray several standard deviations (measured up to ~2.5 tol * rms for bf16).
ELEMENT_SLACK = 5.0


def assert_moe_close(out, ref, dtype, what: str, tol: float | None = None) -> None:
    """out is finite everywhere and matches ref (norm-wise tol, element-wise with slack)."""
    tol = helpers.tolerance(dtype) if tol is None else tol
    helpers.assert_finite_and_close(out, ref, tol, what, slack=ELEMENT_SLACK, require_signal=True)


def oracle(x, w13, w2, topk_weights, topk_ids, expert_map=None) -> np.ndarray:
    """The float64 numpy MoE layer on the dequantized weights."""
    return helpers.numpy_fused_moe(
        x,
        helpers.numpy_dequantize(w13),
        helpers.numpy_dequantize(w2),
        topk_weights,
        topk_ids,
        expert_map=None if expert_map is None else np.asarray(expert_map),
    )


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


# ---- the MoE layer against the references ---------------------------------------------------

# (T, H, I, E, top_k, bits, group, has_zp, dtype, distinct experts per token)
CASES = [
    (1, 128, 128, 8, 2, 4, 32, True, BF16, True),
    (7, 128, 128, 16, 4, 8, 64, False, F16, True),
    (33, 256, 128, 8, 2, 4, -1, True, BF16, False),
    (5, 128, 64, 8, 6, 8, 32, True, F32, True),
    (12, 128, 128, 64, 6, 4, 64, False, BF16, True),
]


def _case_id(T, H, I, E, k, bits, g, zp, dtype, distinct) -> str:
    return (
        f"T{T}-H{H}-I{I}-E{E}-k{k}-int{bits}-g{g}-{'zp' if zp else 'sym'}-"
        f"{jnp.dtype(dtype).name}{'' if distinct else '-dup'}"
    )


@pytest.mark.parametrize(
    "T, H, I, E, top_k, bits, group, has_zp, dtype, distinct",
    CASES,
    ids=[_case_id(*c) for c in CASES],
)
def test_matches_xla_and_oracle(rng, T, H, I, E, top_k, bits, group, has_zp, dtype, distinct):
    x, w13, w2, tw, ti = helpers.random_moe_inputs(
        rng,
        T=T,
        H=H,
        I=I,
        E=E,
        k=top_k,
        bits=bits,
        group_size=group,
        has_zp=has_zp,
        dtype=dtype,
        distinct=distinct,
    )
    out, ref = run_both(x, w13, w2, tw, ti)
    assert_moe_close(out, ref, dtype, "vs xla backend")
    assert_moe_close(out, oracle(x, w13, w2, tw, ti), dtype, "vs float64 oracle")


def test_zero_tokens(rng):
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=1, H=128, I=128, E=8, k=2)
    out = wj.fused_moe(x[:0], w13, w2, tw[:0], ti[:0], implementation=IMPLEMENTATION)
    assert out.shape == (0, 128) and out.dtype == x.dtype


def test_out_of_range_ids_are_dropped(rng):
    """Ids < 0 or >= E contribute nothing; a token with only such ids gets exactly 0."""
    t, k, e = 9, 3, 8
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=t, H=128, I=128, E=e, k=k)
    ids = np.asarray(ti).copy()
    ids[0] = (-1, e, 2**30)
    ids[1, 1] = -(2**31)
    ids[4, 2] = e + 5
    ti = jnp.asarray(ids)
    out, ref = run_both(x, w13, w2, tw, ti)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0, err_msg="all-dropped token")
    assert_moe_close(out, ref, BF16, "vs xla backend")
    assert_moe_close(out, oracle(x, w13, w2, tw, ti), BF16, "vs float64 oracle")


@pytest.mark.parametrize("split_k", [None, 2], ids=["heuristic", "split2"])
def test_expert_map_quarter_local(rng, split_k):
    """A quarter of the experts local: off-shard experts contribute exactly zero, tokens routed
    only off-shard give exactly 0, and the rest matches the references with the same map."""
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
    config = None if split_k is None else BlockConfig(16, 64, 64, split_k=split_k)
    out, ref = run_both(x, w13, w2, tw, ti, expert_map=expert_map, config=config)
    np.testing.assert_array_equal(
        np.asarray(out[:3], np.float32), 0.0, err_msg="tokens routed only to off-shard experts"
    )
    assert_moe_close(out, ref, BF16, "vs xla backend")
    assert_moe_close(out, oracle(x, w13, w2, tw, ti, expert_map), BF16, "vs float64 oracle")


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


def test_chunked_tokens_match(rng):
    """Token chunks (chunk_tokens=4 over T=10: two full chunks and a padded one) give the
    unchunked result."""
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=10, H=128, I=128, E=8, k=2)
    chunked = pallas_moe.fused_moe(x, w13, w2, tw, ti, interpret=INTERPRET, chunk_tokens=4)
    whole = pallas_moe.fused_moe(x, w13, w2, tw, ti, interpret=INTERPRET)
    ref = wj.fused_moe(x, w13, w2, tw, ti, implementation="xla")
    assert chunked.shape == x.shape and chunked.dtype == x.dtype
    assert_moe_close(chunked, whole, BF16, "chunked vs unchunked")
    assert_moe_close(chunked, ref, BF16, "chunked vs xla backend")


def test_under_jit(rng):
    """The public API traced under jax.jit (expert_map a traced argument) equals eager."""
    t, k, e = 8, 2, 8
    expert_map = jnp.asarray(rng.permutation(e).astype(np.int32))  # all local, permuted
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=t, H=128, I=128, E=e, k=k)

    @jax.jit
    def layer(x, w13, w2, tw, ti, expert_map):
        return wj.fused_moe(
            x, w13, w2, tw, ti, expert_map=expert_map, implementation=IMPLEMENTATION
        )

    jitted = layer(x, w13, w2, tw, ti, expert_map)
    eager, ref = run_both(x, w13, w2, tw, ti, expert_map=expert_map)
    assert jitted.shape == x.shape and jitted.dtype == x.dtype
    assert_moe_close(jitted, eager, BF16, "jit vs eager")
    assert_moe_close(jitted, ref, BF16, "jit vs xla backend")


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
    the align kernel was traced: _configs.config_problems does not hold this rule.
    """
    x, w13, w2, tw, ti = helpers.random_moe_inputs(rng, T=3, H=128, I=128, E=8, k=2)
    config = BlockConfig(block_m=16, block_n=64, block_k=64)
    with pytest.raises(ValueError, match="block_k=64 is below 128 for int4"):
        wj.fused_moe(x, w13, w2, tw, ti, implementation=IMPLEMENTATION, config=config)


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
