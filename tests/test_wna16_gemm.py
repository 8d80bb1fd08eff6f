"""Tests of the dequant-fused grouped GEMM (pallas_kernels.pallas.wna16_gemm) against the reference.

Every kernel output is compared with `wna16_jax._reference.grouped_matmul` on the *same*
QuantizedExperts: the reference dequantizes exactly (f32) and multiplies at Precision.HIGHEST, so
quantization error never hides inside a tolerance. Inputs are random (never zeros), fresh per case,
seeded from the test id (the `rng` fixture of conftest.py).

How to run:
    CPU (CI): `pytest tests/test_wna16_gemm.py` runs the kernels in the Pallas interpreter
        (interpret=True) on a covering subset of the grid (every axis value at least once);
        tests marked `gpu` are skipped with a reason.
    GPU: `pytest -m gpu tests/test_wna16_gemm.py` compiles the kernels (interpret=False) and runs
        the full cross-product at vLLM's shapes; plain `pytest tests/test_wna16_gemm.py` on a GPU
        runs every test compiled. The full product has 1536 cases, each compiling two kernels and
        two references; to spread the compiles over CPU cores:
        `XLA_PYTHON_CLIENT_PREALLOCATE=false pytest -m gpu -n 8 tests/test_wna16_gemm.py`.
"""

from __future__ import annotations

import itertools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common.block_configs import min_block_k
from pallas_kernels.pallas import wna16_gemm as gemm_module
from pallas_kernels.pallas.wna16_gemm import check_gemm_config, scales_per_group, wna16_gemm
from wna16_jax import _reference
from wna16_jax._types import BlockConfig, QuantizedExperts

# Compiled on a GPU, the Pallas interpreter elsewhere: the same tests run both ways.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)

# ---- tolerances -----------------------------------------------------------------------------

# Relative error ||out - ref|| / ||ref|| of one GEMM (f32 output) against the reference on the
# same quantized weights, keyed by (activation dtype, k-tile kind):
#   "in_group": block_k <= group, one scale per k-tile, factored out of the dot. For 16-bit
#       activations the kernel converts values with the exponent trick to (2^p + v) (bf16 p = 7,
#       f16 p = 10), dots them exactly in f32 and subtracts (2^p + z) * rowsum(a) afterwards: the
#       cancellation of the 2^p terms costs about p - 4 bits of the f32 sum.
#       Measured in the interpreter: ~1e-6 (bf16), ~1.7e-5 (f16), ~1e-7 (f32).
#   "multi_group": block_k > group, several groups per k-tile. The kernel scales each value
#       slice in f32 and rounds it to the activation dtype before the dot: each weight picks up
#       one rounding of unit roundoff u (bf16 2^-8, f16 2^-11), about u / 2 rms relative error
#       in the sum. Measured 1.6e-3 (bf16), 2.2e-4 (f16), 3e-7 (f32).
GEMM_TOLERANCES: dict[tuple[jnp.dtype, str], float] = {
    (BF16, "in_group"): 1e-5,
    # Loose: the f16 offset 2^10 cancels ~3 more bits of the f32 sum than bf16's 2^7; measured
    # 4e-5 compiled on the H200 at K=2048.
    (F16, "in_group"): 1e-4,
    # f32 activations: the dot must be IEEE f32 (not TF32, which keeps 10 mantissa bits: ~1e-3).
    (F32, "in_group"): 1e-5,
    # Loose: bf16 rounding of the scaled weight tile (u = 3.9e-3), ~2x margin over u / 2.
    (BF16, "multi_group"): 5e-3,
    # Loose: f16 rounding of the scaled weight tile (u = 4.9e-4), ~2x margin over u / 2.
    (F16, "multi_group"): 1e-3,
    (F32, "multi_group"): 1e-5,
}
# Element-wise, |out - ref| <= tol * |ref| + ELEMENT_SLACK * tol * rms(ref): a wrong row, column
# or tile (an error of order rms) fails it, while single elements of a sum of rounded terms may
# stray several standard deviations (tol is a norm-wise bound).
ELEMENT_SLACK = 5.0


def tile_kind(config: BlockConfig, qw: QuantizedExperts, dtype) -> str:
    """ "in_group" when the kernel scales each group's product (its exact path, any block_k),
    or block_k <= group; "multi_group" when it scales each value before the dot."""
    per_group = scales_per_group(
        block_k=config.block_k, unpack=config.unpack, dot=config.dot, bits=qw.bits,
        group=qw.group, dtype=dtype,
    )  # fmt: skip
    return "in_group" if per_group or config.block_k <= qw.group else "multi_group"


def gemm_tolerance(dtype, config: BlockConfig, qw: QuantizedExperts) -> float:
    return GEMM_TOLERANCES[(jnp.dtype(dtype), tile_kind(config, qw, dtype))]


def assert_gemm_close(out, ref, rows, tol: float, what: str) -> None:
    """Rows `rows` of `out` are finite and match `ref` (norm-wise tol, element-wise with slack)."""
    # Select before converting: rows outside `rows` may hold uninitialized memory on a GPU.
    helpers.assert_finite_and_close(
        np.asarray(out)[rows],
        np.asarray(ref)[rows],
        tol,
        what,
        slack=ELEMENT_SLACK,
        require_signal=True,
        nonfinite_hint=" (a slot placed in a block was not written)",
    )


# ---- inputs ---------------------------------------------------------------------------------

_ref_align = jax.jit(_reference.moe_align_block_size, static_argnames=("num_experts", "block_m"))
_ref_gemm = jax.jit(_reference.grouped_matmul, static_argnames=("top_k",))

# Out-of-range ids that the alignment drops (E itself is added per case).
INVALID_IDS = (-1, -(2**31), 2**30)


def quarter_local_map(rng: np.random.Generator, num_experts: int) -> jax.Array:
    """int32 [E]: a random quarter of the experts local (random local ids), the rest -1."""
    local = rng.permutation(num_experts)[: num_experts // 4]
    m = np.full(num_experts, -1, np.int32)
    m[local] = rng.permutation(len(local))
    return jnp.asarray(m)


def routing_ids(rng: np.random.Generator, t: int, k: int, e: int, *, drop: bool) -> np.ndarray:
    """int32 [T, k] distinct ids per token; with `drop`, ~1/8 of the slots out of range (the
    first slot always, the last never: every case has a dropped and a placed slot)."""
    _, ids = helpers.random_routing(rng, t, k, e)
    if drop and t * k > 1:
        mask = rng.random(ids.shape) < 0.125
        mask.flat[0] = True
        mask.flat[-1] = False
        ids = np.where(mask, rng.choice(np.array((*INVALID_IDS, e)), size=ids.shape), ids)
    return ids.astype(np.int32)


def gemm_config(qw: QuantizedExperts, *, block_m: int, block_k: int, split_k: int) -> BlockConfig:
    """A valid config for qw: block_k clamped so split_k divides the k-tiles, and split_k
    lowered where K holds fewer than split_k of the smallest k-tile (16 values per slice)."""
    lo = min_block_k(qw.bits)
    split_k = max(1, min(split_k, qw.k // lo))
    bk = max(lo, min(block_k, qw.k // split_k))
    config = BlockConfig(block_m=block_m, block_n=min(64, qw.n), block_k=bk, split_k=split_k)
    check_gemm_config(config, qw)
    return config


def block_m_for(t: int) -> int:
    return 16 if t < 32 else 32 if t < 128 else 64


def run_layer_gemms(
    rng, *, T, I, H, E, top_k, bits, group, has_zp, dtype, ep, split_k, block_k, weights
):
    """Both GEMMs of one MoE layer through wna16_gemm and the reference, checked.

    GEMM1: x [T, H] (row t shared by its top_k slots) @ w13 [E, 2I, H]; GEMM2: [T*k, I] rows,
    one per slot, @ w2 [E, H, I] times the routed weights. ~1/8 of the slots carry out-of-range
    ids (dropped: only the placed rows are compared); with `ep`, expert_map keeps a quarter of
    the experts local and the weights hold only those.
    """
    dtype = jnp.dtype(dtype)
    e_local = E // 4 if ep else E
    expert_map = quarter_local_map(rng, E) if ep else None
    w13 = weights(rng, e_local, 2 * I, H, bits, group, has_zp, dtype)
    w2 = weights(rng, e_local, H, I, bits, group, has_zp, dtype)
    ids = routing_ids(rng, T, top_k, E, drop=True)
    placed = ((ids >= 0) & (ids < E)).reshape(-1)
    off_shard = np.zeros_like(placed)
    if ep:
        emap = np.asarray(expert_map)
        # The last slot of token 0 goes to a local expert, so some rows are not zero.
        free = [x for x in np.nonzero(emap >= 0)[0] if x not in ids[0]]
        if free:
            ids[0, -1] = rng.choice(free)
        placed = ((ids >= 0) & (ids < E)).reshape(-1)
        off_shard = placed & (emap[np.clip(ids, 0, E - 1)] < 0).reshape(-1)
    block_m = block_m_for(T)
    routing = _ref_align(jnp.asarray(ids), num_experts=E, block_m=block_m, expert_map=expert_map)
    x = jnp.asarray(rng.normal(size=(T, H)), dtype)
    act = jnp.asarray(rng.normal(size=(T * top_k, I)), dtype)
    rw = jnp.asarray(rng.uniform(0.1, 1.0, size=T * top_k), jnp.float32)
    for what, a, qw, k, routed in (("GEMM1", x, w13, top_k, None), ("GEMM2", act, w2, 1, rw)):
        config = gemm_config(qw, block_m=block_m, block_k=block_k, split_k=split_k)
        out = wna16_gemm(
            a,
            qw,
            routing,
            routed,
            top_k=k,
            config=config,
            out_dtype=jnp.float32,
            interpret=INTERPRET,
        )
        ref = _ref_gemm(a, qw, routing, top_k=k, routed_weights=routed)
        assert out.shape == (T * top_k, qw.n) and out.dtype == jnp.float32
        tol = gemm_tolerance(dtype, config, qw)
        np.testing.assert_array_equal(np.asarray(out)[off_shard], 0.0, err_msg="off-shard slots")
        assert_gemm_close(
            out, ref, placed, tol, f"{what} {config} ({tile_kind(config, qw, dtype)})"
        )


def host_weights(rng, e, n, k, bits, group, has_zp, dtype):
    return helpers.random_quantized_experts(rng, e, n, k, bits, group, has_zp, dtype)


def device_weights(rng, e, n, k, bits, group, has_zp, dtype):
    key = jax.random.key(int(rng.integers(2**31)))
    return helpers.device_quantized_experts(key, e, n, k, bits, group, has_zp, dtype)


# ---- the grid -------------------------------------------------------------------------------

# (T, I, H, E, top_k, bits, group, has_zp, expert-parallel, split_k, dtype, block_k): a covering
# subset for the interpreter. Each axis value appears at least once, most pairs of values do;
# block_k > group gives the multi-group tile path, block_k <= group the in-group path.
COVERING_CASES = [
    (1, 128, 128, 8, 2, 4, 64, True, False, 1, BF16, 128),
    (1, 128, 128, 64, 6, 8, 128, False, True, 2, F16, 64),
    (7, 128, 256, 192, 2, 8, 64, True, False, 1, BF16, 128),
    (19, 256, 256, 8, 6, 4, 32, False, True, 2, BF16, 128),
    (7, 256, 256, 64, 2, 8, -1, True, True, 4, F16, 64),
    (19, 256, 128, 192, 6, 4, 128, True, True, 1, F16, 128),
    (1, 128, 128, 192, 6, 4, 32, True, False, 1, F16, 128),
    (7, 128, 256, 8, 2, 8, -1, False, False, 2, BF16, 64),
    (19, 256, 128, 64, 2, 8, 32, True, True, 1, F16, 128),
    (7, 256, 256, 8, 6, 4, 128, False, False, 2, BF16, 128),
    (33, 128, 128, 8, 2, 4, 64, True, False, 1, F32, 128),
    (19, 256, 128, 64, 6, 8, 64, False, False, 1, BF16, 64),
    # Tiles of several whole groups on the exact path (each group's product scaled).
    (7, 256, 512, 8, 2, 4, 128, True, False, 2, BF16, 256),
    (19, 512, 512, 8, 6, 4, 128, False, True, 1, F16, 512),
    (7, 128, 256, 8, 2, 8, 64, True, False, 1, F16, 128),
]


def case_id(T, I, H, E, k, bits, group, zp, ep, split_k, dtype, block_k) -> str:
    return (
        f"T{T}-I{I}-H{H}-E{E}-k{k}-int{bits}-g{group}-{'zp' if zp else 'sym'}-"
        f"{'ep4' if ep else 'ep1'}-sk{split_k}-{jnp.dtype(dtype).name}-bk{block_k}"
    )


@pytest.mark.parametrize(
    "T, I, H, E, top_k, bits, group, has_zp, ep, split_k, dtype, block_k",
    COVERING_CASES,
    ids=[case_id(*c) for c in COVERING_CASES],
)
def test_gemm_matches_reference(
    rng, T, I, H, E, top_k, bits, group, has_zp, ep, split_k, dtype, block_k
):
    run_layer_gemms(
        rng,
        T=T,
        I=I,
        H=H,
        E=E,
        top_k=top_k,
        bits=bits,
        group=group,
        has_zp=has_zp,
        dtype=dtype,
        ep=ep,
        split_k=split_k,
        block_k=block_k,
        weights=host_weights,
    )


# vLLM's test of this path (tests/kernels/moe/test_moe.py::test_fused_moe_wn16) crossed with
# top-k, group, zero points, bits, expert parallelism, split-K and dtype. block_k = 128 makes
# group 64 take the multi-group path and group 128 the in-group one. gemm_config clamps block_k
# to K // split_k and lowers split_k where K is too short (int4 at K=128 has one 128-wide tile).
VLLM_SHAPES = [(1, 128, 128), (1, 1024, 1024), (32, 2048, 128), (222, 2048, 1024)]
FULL_GRID = [
    (t, i, h, e, k, bits, g, zp, ep, sk, dt, 128)
    for (t, i, h), e, k, g, zp, bits, ep, sk, dt in itertools.product(
        VLLM_SHAPES,
        (8, 64, 192),
        (2, 6),
        (64, 128),
        (True, False),
        (4, 8),
        (False, True),
        (1, 2),
        (BF16, F16),
    )
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T, I, H, E, top_k, bits, group, has_zp, ep, split_k, dtype, block_k",
    FULL_GRID,
    ids=[case_id(*c) for c in FULL_GRID],
)
def test_gemm_full_grid(rng, T, I, H, E, top_k, bits, group, has_zp, ep, split_k, dtype, block_k):
    run_layer_gemms(
        rng,
        T=T,
        I=I,
        H=H,
        E=E,
        top_k=top_k,
        bits=bits,
        group=group,
        has_zp=has_zp,
        dtype=dtype,
        ep=ep,
        split_k=split_k,
        block_k=block_k,
        weights=device_weights,
    )


# ---- coverage of rows, output dtype ---------------------------------------------------------


def _small_problem(rng, *, t=9, e=8, n=128, kdim=256, bits=4, group=128):
    """(int4/int8 experts [e, n, kdim] with zero points, bf16 activations [t, kdim])."""
    qw = helpers.random_quantized_experts(rng, e, n, kdim, bits, group, True, BF16)
    a = jnp.asarray(rng.normal(size=(t, kdim)), BF16)
    return qw, a


@pytest.mark.parametrize("split_k", [1, 2])
def test_unplaced_rows(rng, split_k):
    """Every row of a placed slot is written; dropped slots' rows are as documented.

    split_k == 1: rows of dropped slots are not written (the interpreter fills fresh outputs
    with NaN, so there they must be NaN: that proves the finiteness check of placed rows sees
    unwritten rows). split_k > 1: they are exactly zero (the zeroed f32 buffer).
    """
    t, k, e = 9, 2, 8
    qw, a = _small_problem(rng, t=t, e=e)
    ids = routing_ids(rng, t, k, e, drop=True)
    placed = ((ids >= 0) & (ids < e)).reshape(-1)
    assert placed.any() and not placed.all()
    routing = _ref_align(jnp.asarray(ids), num_experts=e, block_m=16)
    config = BlockConfig(block_m=16, block_n=64, block_k=128, split_k=split_k)
    out = np.asarray(wna16_gemm(a, qw, routing, top_k=k, config=config, interpret=INTERPRET))
    ref = _ref_gemm(a, qw, routing, top_k=k)
    assert out.dtype == BF16  # out_dtype defaults to the activation dtype
    # The bf16 output adds one rounding (u = 2^-8, ~2e-3 rms) to the in-group path's ~1e-6.
    assert tile_kind(config, qw, a.dtype) == "in_group"
    assert_gemm_close(out, ref, placed, 5e-3, "placed rows")
    if split_k > 1:
        np.testing.assert_array_equal(out[~placed], 0, err_msg="dropped rows with split-K")
    elif INTERPRET:
        assert np.isnan(out[~placed].astype(np.float32)).all(), (
            "the interpreter no longer poisons fresh outputs with NaN: the check that placed "
            "rows are finite no longer proves they were written"
        )


def test_default_out_dtype_is_rounded_f32(rng):
    """out_dtype=None gives a.dtype: the same f32 accumulator rounded once (bitwise)."""
    t, k, e = 9, 2, 8
    qw, a = _small_problem(rng, t=t, e=e)
    ids = routing_ids(rng, t, k, e, drop=False)
    routing = _ref_align(jnp.asarray(ids), num_experts=e, block_m=16)
    config = BlockConfig(block_m=16, block_n=64, block_k=128)
    out16 = wna16_gemm(a, qw, routing, top_k=k, config=config, interpret=INTERPRET)
    out32 = wna16_gemm(
        a, qw, routing, top_k=k, config=config, out_dtype=jnp.float32, interpret=INTERPRET
    )
    assert out16.dtype == BF16 and out32.dtype == F32
    assert np.isfinite(np.asarray(out32)).all()
    np.testing.assert_array_equal(np.asarray(out16), np.asarray(out32.astype(BF16)))


# ---- split-K and determinism ----------------------------------------------------------------


@pytest.mark.parametrize(
    "bits, group, has_zp, dtype",
    [(4, 128, True, BF16), (8, 64, False, F16)],
    ids=["int4-g128-zp-bf16", "int8-g64-sym-f16"],
)
def test_split_k_matches_unsplit(rng, bits, group, has_zp, dtype):
    """split_k 2 and 4 (atomic f32 accumulation) equal split_k 1 (a small-N, larger-K GEMM,
    like DeepSeek-V3's N=512, K=7168 at TP=8), routed weights applied."""
    t, k, e, n, kdim = 6, 2, 8, 64, 512
    qw = helpers.random_quantized_experts(rng, e, n, kdim, bits, group, has_zp, dtype)
    a = jnp.asarray(rng.normal(size=(t * k, kdim)), dtype)
    rw = jnp.asarray(rng.uniform(0.1, 1.0, size=t * k), jnp.float32)
    ids = routing_ids(rng, t, k, e, drop=False)
    routing = _ref_align(jnp.asarray(ids), num_experts=e, block_m=16)
    outs = {}
    for split_k in (1, 2, 4):
        config = BlockConfig(block_m=16, block_n=64, block_k=min_block_k(bits), split_k=split_k)
        outs[split_k] = wna16_gemm(
            a, qw, routing, rw, top_k=1, config=config, out_dtype=F32, interpret=INTERPRET
        )
    ref = _ref_gemm(a, qw, routing, top_k=1, routed_weights=rw)
    rows = np.ones(t * k, bool)
    tol = gemm_tolerance(dtype, config, qw)
    for split_k, out in outs.items():
        assert_gemm_close(out, ref, rows, tol, f"split_k={split_k} vs reference")
        assert_gemm_close(out, outs[1], rows, tol, f"split_k={split_k} vs split_k=1")


def test_split_1_is_bitwise_deterministic(rng):
    """split_k == 1 (no atomics) gives bitwise identical outputs on repeated calls."""
    t, k, e = 17, 6, 64
    qw, a = _small_problem(rng, t=t, e=e, bits=8, group=128)
    ids = routing_ids(rng, t, k, e, drop=False)
    routing = _ref_align(jnp.asarray(ids), num_experts=e, block_m=16)
    config = BlockConfig(block_m=16, block_n=64, block_k=128, split_k=1)
    run = lambda: np.asarray(  # noqa: E731
        wna16_gemm(a, qw, routing, top_k=k, config=config, out_dtype=F32, interpret=INTERPRET)
    )
    first, second = run(), run()
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(first, second)


# ---- expert parallelism: blocks of expert -1 ------------------------------------------------


@pytest.mark.parametrize("split_k", [1, 2])
def test_off_shard_blocks_are_exact_zero(rng, split_k):
    """With a quarter of the experts local, slots of off-shard experts (blocks of expert -1)
    are exactly zero, including every slot of the tokens routed only off-shard; the rest
    matches the reference run with the same expert_map."""
    t, k, e = 12, 2, 16
    expert_map = quarter_local_map(rng, e)
    emap = np.asarray(expert_map)
    local, remote = np.nonzero(emap >= 0)[0], np.nonzero(emap < 0)[0]
    ids = routing_ids(rng, t, k, e, drop=False)
    ids[:3] = rng.choice(remote, size=(3, k), replace=False)  # tokens 0-2: only off-shard
    ids[3, 0] = rng.choice(local)  # at least one local slot
    qw = helpers.random_quantized_experts(rng, len(local), 128, 256, 4, 128, True, BF16)
    a = jnp.asarray(rng.normal(size=(t, 256)), BF16)
    routing = _ref_align(jnp.asarray(ids), num_experts=e, block_m=16, expert_map=expert_map)
    assert (np.asarray(routing.expert_ids) == -1).any()
    config = BlockConfig(block_m=16, block_n=64, block_k=128, split_k=split_k)
    out = np.asarray(
        wna16_gemm(a, qw, routing, top_k=k, config=config, out_dtype=F32, interpret=INTERPRET)
    )
    ref = _ref_gemm(a, qw, routing, top_k=k)
    off = (emap[ids] < 0).reshape(-1)
    np.testing.assert_array_equal(out[off], 0.0, err_msg="rows of off-shard slots")
    np.testing.assert_array_equal(out.reshape(t, k, -1)[:3], 0.0, err_msg="off-shard tokens")
    assert_gemm_close(out, ref, ~off, gemm_tolerance(BF16, config, qw), "on-shard rows")


# ---- config validation ----------------------------------------------------------------------


def _no_kernel(*args, **kwargs):
    raise AssertionError("pallas_call was reached: the config should have been rejected first")


BAD_CONFIGS = [
    # (bits, K, group, config, expected message fragment)
    (4, 384, 96, BlockConfig(16, 64, 128), "block_k=128 is incompatible with group_size=96"),
    (4, 256, 64, BlockConfig(16, 64, 512), "K=256 is not a multiple of block_k=512"),
    (4, 512, 64, BlockConfig(16, 64, 128, split_k=3), "split_k=3 does not divide the 4 k-tiles"),
    (4, 256, 64, BlockConfig(16, 256, 128), "N=128 is not a multiple of block_n=256"),
    (4, 256, 64, BlockConfig(8, 64, 128), "block_m=8 and block_n=64 must be >= 16"),
    (4, 256, 64, BlockConfig(16, 8, 128), "block_m=16 and block_n=8 must be >= 16"),
    # Each dot contracts block_k // per_word values: below 16 the H200 returned garbage.
    (4, 256, 64, BlockConfig(16, 64, 64), "block_k=64 is below 128 for int4"),
    (8, 256, 64, BlockConfig(16, 64, 32), "block_k=32 is below 64 for int8"),
]


@pytest.mark.parametrize(
    "bits, kdim, group, config, message",
    BAD_CONFIGS,
    ids=[
        "bk-vs-group",
        "bk-over-K",
        "split-vs-tiles",
        "N-vs-bn",
        "bm8",
        "bn8",
        "int4-bk64",
        "int8-bk32",
    ],
)
def test_bad_config_raises_before_any_kernel(rng, monkeypatch, bits, kdim, group, config, message):
    qw = helpers.random_quantized_experts(rng, 4, 128, kdim, bits, group, True, BF16)
    a = jnp.asarray(rng.normal(size=(3, kdim)), BF16)
    ids = routing_ids(rng, 3, 2, 4, drop=False)
    routing = _ref_align(jnp.asarray(ids), num_experts=4, block_m=config.block_m)
    monkeypatch.setattr(gemm_module.pl, "pallas_call", _no_kernel)
    with pytest.raises(ValueError, match=message):
        check_gemm_config(config, qw)
    with pytest.raises(ValueError, match=message):
        wna16_gemm(a, qw, routing, top_k=2, config=config, interpret=INTERPRET)


def test_routing_block_m_mismatch_raises(rng, monkeypatch):
    qw = helpers.random_quantized_experts(rng, 4, 128, 256, 4, 64, True, BF16)
    a = jnp.asarray(rng.normal(size=(3, 256)), BF16)
    ids = routing_ids(rng, 3, 2, 4, drop=False)
    routing = _ref_align(jnp.asarray(ids), num_experts=4, block_m=32)
    monkeypatch.setattr(gemm_module.pl, "pallas_call", _no_kernel)
    config = BlockConfig(block_m=16, block_n=64, block_k=128)
    with pytest.raises(ValueError, match="block_m=32 but config.block_m=16"):
        wna16_gemm(a, qw, routing, top_k=2, config=config, interpret=INTERPRET)
    routing = _ref_align(jnp.asarray(ids), num_experts=4, block_m=16)
    with pytest.raises(ValueError, match="activations have K=128 but the weights have K=256"):
        wna16_gemm(a[:, :128], qw, routing, top_k=2, config=config, interpret=INTERPRET)
