"""Tests of the 'xla' reference: block alignment and fused_moe against float64 numpy."""

from __future__ import annotations

import dataclasses

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_cases import SchemeCases

from pallas_kernels.common.block_configs import block_configs
from pallas_kernels.pallas import fused_moe as pallas_moe
from wna16_jax import _activations, _configs, _pipeline, _reference, _routing
from wna16_jax._types import BlockConfig

# ---- moe_align_block_size -------------------------------------------------------------------

# Jitted once per shape: one compile is far cheaper on CPU than compiling each eager op.
_align = jax.jit(_reference.moe_align_block_size, static_argnames=("num_experts", "block_m"))


def _routing_ids(rng, pattern: str, T: int, k: int, E: int) -> np.ndarray:
    """int32 [T, k] global ids of one routing pattern."""
    if pattern == "random":
        return helpers.random_routing(rng, T, k, E)[1]
    if pattern == "duplicates":  # with replacement: a token may pick one expert twice
        return helpers.random_routing(rng, T, k, E, distinct=False)[1]
    if pattern == "one_expert":
        return np.full((T, k), rng.integers(0, E), np.int32)
    if pattern == "every_expert":  # k == E: every token uses every expert, in a random order
        return helpers.random_routing(rng, T, E, E)[1]
    if pattern == "out_of_range":
        ids = helpers.random_routing(rng, T, k, E)[1]
        bad = rng.random(ids.shape) < 0.3
        ids[bad] = rng.choice([-1, -7, E, E + 3, 2**30], size=int(bad.sum()))
        return ids
    raise AssertionError(pattern)


# Cases of one (T, k, E) share a compile of the jitted align; each block_m is another compile.
ALIGN_CASES = [
    # (pattern, T, k, E)
    ("random", 37, 4, 8),
    ("duplicates", 37, 4, 8),
    ("one_expert", 37, 4, 8),
    ("out_of_range", 37, 4, 8),
    ("random", 64, 8, 16),
    ("random", 21, 3, 6),  # E not a power of two
    ("one_expert", 21, 3, 6),
    ("out_of_range", 21, 3, 6),
    ("duplicates", 9, 4, 5),
    ("every_expert", 11, 6, 6),
    ("every_expert", 3, 8, 8),
    ("random", 1, 1, 4),  # T = 1
    ("random", 1, 4, 12),
    ("random", 0, 2, 8),  # T = 0
]


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("pattern, T, k, E", ALIGN_CASES)
def test_align_matches_numpy(rng, pattern, T, k, E, block_m):
    ids = _routing_ids(rng, pattern, T, k, E)
    routing = _align(jnp.asarray(ids), num_experts=E, block_m=block_m)
    helpers.assert_alignment_matches(routing, ids, num_experts=E, block_m=block_m)


@pytest.mark.parametrize("pattern", ["random", "one_expert", "out_of_range"])
def test_align_block_m_32(rng, pattern):
    ids = _routing_ids(rng, pattern, 37, 4, 8)
    routing = _align(jnp.asarray(ids), num_experts=8, block_m=32)
    helpers.assert_alignment_matches(routing, ids, num_experts=8, block_m=32)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    "pattern, T, k, E", [c for c in ALIGN_CASES if c[1] > 0 and c[:2] != ("random", 64)]
)
def test_align_with_expert_map(rng, pattern, T, k, E, block_m):
    """Off-shard experts keep their runs but their blocks say -1; local ids are remapped."""
    ids = _routing_ids(rng, pattern, T, k, E)
    num_local = max(1, E // 4)
    local_globals = rng.choice(E, size=num_local, replace=False)
    expert_map = np.full(E, -1, np.int32)
    expert_map[local_globals] = rng.permutation(num_local)
    routing = _align(
        jnp.asarray(ids), num_experts=E, block_m=block_m, expert_map=jnp.asarray(expert_map)
    )
    helpers.assert_alignment_matches(
        routing, ids, num_experts=E, block_m=block_m, expert_map=expert_map
    )


def test_align_all_ids_dropped(rng):
    ids = rng.choice([-1, 8, 9], size=(6, 2)).astype(np.int32)
    routing = _align(jnp.asarray(ids), num_experts=8, block_m=16)
    assert int(routing.num_tokens_post_padded) == 0
    np.testing.assert_array_equal(np.asarray(routing.sorted_token_ids), 12)
    np.testing.assert_array_equal(np.asarray(routing.expert_ids), -1)


def test_max_padded_len():
    # T*k + E*(block_m - 1), rounded up to block_m.
    assert _routing.max_padded_len(0, 8, 16) == 128
    assert _routing.max_padded_len(37 * 2, 8, 16) == 208  # 74 + 120 = 194 -> 208
    assert _routing.max_padded_len(1, 1, 64) == 64
    assert _routing.max_padded_len(5, 3, 1) == 5


# ---- fused_moe ------------------------------------------------------------------------------


def _oracle(x, w13, w2, topk_weights, topk_ids, expert_map=None):
    return helpers.numpy_fused_moe(
        x,
        helpers.numpy_dequantize(w13),
        helpers.numpy_dequantize(w2),
        topk_weights,
        topk_ids,
        expert_map=expert_map,
    )


def _check_fused(rng, *, T, H, I, E, k, bits, group_size, has_zp, dtype):
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng, T=T, H=H, I=I, E=E, k=k, bits=bits, group_size=group_size, has_zp=has_zp, dtype=dtype
    )
    out = _reference.fused_moe(x, w13, w2, wts, ids)
    assert out.dtype == dtype and out.shape == (T, H)
    helpers.assert_close(out, _oracle(x, w13, w2, wts, ids), dtype)


@pytest.mark.parametrize(
    "dtype, bits, has_zp",
    [
        (jnp.bfloat16, 4, True),
        (jnp.bfloat16, 4, False),
        (jnp.bfloat16, 8, True),
        (jnp.bfloat16, 8, False),
        (jnp.float16, 4, True),
        (jnp.float16, 8, False),
        (jnp.float32, 4, False),
        (jnp.float32, 8, True),
    ],
)
def test_fused_moe_dtypes_and_formats(rng, dtype, bits, has_zp):
    _check_fused(
        rng, T=13, H=64, I=32, E=4, k=2, bits=bits, group_size=32, has_zp=has_zp, dtype=dtype
    )


@pytest.mark.parametrize(
    "T, H, I, E, k, group_size",
    [
        (29, 128, 64, 6, 2, 64),  # E not a power of two
        (16, 64, 96, 5, 3, -1),  # per-channel, I not a power of two
        (40, 256, 32, 8, 4, 128),  # group spans w13's K=256 in two, w2's K=32: G=128 > I
        (1, 64, 32, 4, 1, 32),  # T = 1, k = 1
        (1, 64, 32, 8, 8, 32),  # T = 1, every expert
    ],
)
def test_fused_moe_shapes(rng, T, H, I, E, k, group_size):
    if group_size != -1 and I % group_size:
        group_size = -1  # w2's K = I must hold whole groups
    _check_fused(
        rng,
        T=T,
        H=H,
        I=I,
        E=E,
        k=k,
        bits=4,
        group_size=group_size,
        has_zp=True,
        dtype=jnp.float32,
    )


def test_fused_moe_zero_tokens(rng):
    x, w13, w2, wts, ids = helpers.random_moe_inputs(rng, T=0, H=64, I=32, E=4, k=2)
    out = _reference.fused_moe(x, w13, w2, wts, ids)
    assert out.shape == (0, 64) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("k", [1, 3])
def test_fused_moe_all_tokens_on_one_expert(rng, k):
    x, w13, w2, wts, _ = helpers.random_moe_inputs(
        rng, T=24, H=64, I=32, E=6, k=k, dtype=jnp.float32
    )
    ids = jnp.full((24, k), 4, jnp.int32)  # k > 1: the same expert in every slot
    out = _reference.fused_moe(x, w13, w2, wts, ids)
    helpers.assert_close(out, _oracle(x, w13, w2, wts, ids), jnp.float32)


@pytest.mark.parametrize("E", [4, 6])
def test_fused_moe_every_expert_distinct(rng, E):
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng, T=9, H=64, I=32, E=E, k=E, dtype=jnp.float32
    )
    assert all(sorted(row) == list(range(E)) for row in np.asarray(ids).tolist())
    out = _reference.fused_moe(x, w13, w2, wts, ids)
    helpers.assert_close(out, _oracle(x, w13, w2, wts, ids), jnp.float32)


def test_fused_moe_out_of_range_ids_dropped(rng):
    E = 6
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng, T=24, H=64, I=32, E=E, k=3, dtype=jnp.float32
    )
    ids = np.asarray(ids).copy()
    ids[::3, 0] = -1
    ids[1::4, 1] = E
    ids[2::5, 2] = 1000
    out = _reference.fused_moe(x, w13, w2, wts, jnp.asarray(ids))
    helpers.assert_close(out, _oracle(x, w13, w2, wts, ids), jnp.float32)
    # A token whose every slot is dropped gets exactly zero.
    ids[0] = [-1, E, -5]
    out = _reference.fused_moe(x, w13, w2, wts, jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("E_global", [8, 12])
def test_fused_moe_expert_map(rng, dtype, E_global):
    """A quarter of the experts local: off-shard slots contribute exactly zero."""
    num_local = E_global // 4
    x, w13, w2, _, _ = helpers.random_moe_inputs(
        rng, T=31, H=64, I=32, E=num_local, k=1, dtype=dtype
    )
    wts, ids = helpers.random_routing(rng, 31, 4, E_global)
    ids[0, 0] = -1
    ids[1, 1] = E_global  # out of range globally
    expert_map = np.full(E_global, -1, np.int32)
    expert_map[rng.choice(E_global, num_local, replace=False)] = rng.permutation(num_local)
    out = _reference.fused_moe(
        x, w13, w2, jnp.asarray(wts), jnp.asarray(ids), expert_map=jnp.asarray(expert_map)
    )
    want = _oracle(x, w13, w2, wts, ids, expert_map=expert_map)
    helpers.assert_close(out, want, dtype)
    # Tokens with no local expert get exactly zero.
    off = np.all(expert_map[np.clip(ids, 0, E_global - 1)] < 0, axis=1)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[off], 0.0)


@pytest.mark.parametrize("T, chunk_tokens", [(37, 8), (20, 5)])
def test_fused_moe_chunking(rng, T, chunk_tokens):
    """The layer on chunks of chunk_tokens tokens gives the layer on all T, bit for bit: a
    token's sums do not depend on the other tokens of its call (every GEMM of the reference has
    TOKEN_BLOCK rows)."""
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng, T=T, H=64, I=32, E=6, k=2, dtype=jnp.float32
    )
    ids = np.asarray(ids).copy()
    ids[-1, 0] = -1  # a dropped slot near the padded tail
    ids = jnp.asarray(ids)
    parts = [slice(start, start + chunk_tokens) for start in range(0, T, chunk_tokens)]
    chunked = jnp.concatenate([_reference.fused_moe(x[c], w13, w2, wts[c], ids[c]) for c in parts])
    whole = _reference.fused_moe(x, w13, w2, wts, ids)
    np.testing.assert_array_equal(np.asarray(chunked), np.asarray(whole))
    helpers.assert_close(chunked, _oracle(x, w13, w2, wts, ids), jnp.float32)


def test_grouped_matmul_matches_numpy(rng):
    """One GEMM of the reference: rows of `a` by slot, off-shard blocks and padding zero."""
    E, N, K, T, k = 5, 24, 64, 19, 2
    a = rng.normal(size=(T, K)).astype(np.float32)
    wts, ids = helpers.random_routing(rng, T, k, E)
    expert_map = np.array([0, -1, 1, 2, -1], np.int32)  # experts 1 and 4 off-shard
    routing = _align(
        jnp.asarray(ids), num_experts=E, block_m=16, expert_map=jnp.asarray(expert_map)
    )
    local_w = helpers.random_quantized_experts(rng, 3, N, K, 4, 32, True, jnp.float32)
    out = _reference.grouped_matmul(
        jnp.asarray(a), local_w, routing, top_k=k, routed_weights=jnp.asarray(wts.reshape(-1))
    )
    w = helpers.numpy_dequantize(local_w)  # [3, N, K]
    want = np.zeros((T * k, N))
    for s, g in enumerate(ids.reshape(-1)):
        if expert_map[g] >= 0:
            want[s] = (w[expert_map[g]] @ a[s // k].astype(np.float64)) * wts.reshape(-1)[s]
    helpers.assert_close(out, want, jnp.float32)


# ---- the pipeline (wna16_jax._pipeline) -----------------------------------------------------


def _reference_stages(block_m: int = 16) -> _pipeline.MoeStages:
    """MoeStages from the reference's align and grouped GEMM (f32, the activation unrounded)."""

    def route(a, topk_ids, plan, *, num_experts, expert_map, distinct_experts):
        return _pipeline.slots_in_blocks(
            _reference.moe_align_block_size, a, topk_ids, block_m=block_m,
            num_experts=num_experts, expert_map=expert_map,
        )  # fmt: skip

    def gemm1(a, w13, routed, plan):
        h = _reference.grouped_matmul(a, w13, routed.blocks, top_k=routed.top_k)  # [T*k, 2I]
        return _activations.ACTIVATIONS["silu"](h)

    def gemm2(act, w2, routed, plan, routed_weights):
        return _reference.grouped_matmul(
            act, w2, routed.blocks, top_k=1, routed_weights=routed_weights
        )

    return _pipeline.MoeStages(plan=lambda *args: None, route=route, gemm1=gemm1, gemm2=gemm2)


def test_routed_weights_in_the_sum_equal_gemm2s(rng):
    """The pipeline on stages of the reference's align and grouped GEMM, with the routed weights
    applied by the top-k sum (as the Mosaic GPU layer does) instead of GEMM2: the same layer, to
    f32 rounding."""
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng, T=11, H=64, I=32, E=6, k=3, dtype=jnp.float32
    )
    ids = np.asarray(ids).copy()
    ids[0, 1] = -1  # dropped: its row is not kept
    in_gemm2 = _reference_stages()
    in_sum = dataclasses.replace(in_gemm2, routed_weights="sum")
    want = jax.jit(lambda ids: _pipeline.fused_moe(in_gemm2, x, w13, w2, wts, ids))(ids)
    got = jax.jit(lambda ids: _pipeline.fused_moe(in_sum, x, w13, w2, wts, ids))(ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    helpers.assert_close(got, _oracle(x, w13, w2, wts, ids), jnp.float32)


def test_sum_over_top_k_reads_each_slots_row(rng):
    """Rows in block order: slot s's row is y[slot_rows[s]]; slots not kept count zero; the
    weights multiply each row before the f32 sum over a token's k slots."""
    t, k, h, rows = 5, 3, 4, 20
    y = rng.normal(size=(rows, h)).astype(np.float32)
    slot_rows = rng.permutation(rows)[: t * k].astype(np.int32)
    keep = rng.random(t * k) < 0.7
    wts = rng.uniform(0.1, 1.0, size=(t, k)).astype(np.float32)
    routed = _pipeline.Routed(None, k, jnp.asarray(keep), jnp.asarray(slot_rows))
    got = _pipeline.sum_over_top_k(jnp.asarray(y), routed, jnp.asarray(wts))
    want = np.where(keep[:, None], y[slot_rows], 0.0).reshape(t, k, h) * wts[..., None]
    np.testing.assert_allclose(np.asarray(got), want.sum(axis=1), rtol=1e-6, atol=1e-6)
    per_slot = _pipeline.Routed(None, k, jnp.asarray(keep))  # row s is slot s, weights applied
    got = _pipeline.sum_over_top_k(jnp.asarray(y[: t * k]), per_slot)
    want = np.where(keep[:, None], y[: t * k], 0.0).reshape(t, k, h).sum(axis=1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_block_configs_share_gemm1s_block_m(monkeypatch):
    """GEMM2 takes GEMM1's block_m (one alignment) and, below a tensor-core tile, dot="fma"."""
    w13 = helpers.random_quantized_experts(np.random.default_rng(0), 4, 256, 128, 4, 64, True)
    w2 = helpers.random_quantized_experts(np.random.default_rng(1), 4, 128, 128, 4, 64, True)
    c1, c2 = block_configs(64, w13, w2, None, rules=pallas_moe.RULES)
    assert c2.block_m == c1.block_m
    rules = _configs.ConfigRules(
        config_type=BlockConfig,
        heuristic=lambda shape: BlockConfig(block_m=8 if shape.n == 256 else 32),
    )
    c1, c2 = block_configs(64, w13, w2, None, rules=rules)
    assert (c1.block_m, c2.block_m, c1.dot, c2.dot) == (8, 8, "mma", "fma")


class TestXlaSchemes(SchemeCases):
    """Every weight scheme on the 'xla' reference (fused_moe, the grouped GEMM, the linear)
    against float64 numpy."""

    IMPLEMENTATION = "xla"
