"""Tests of the Pallas moe_align_block_size kernels against the pure-jnp reference."""

from __future__ import annotations

import zlib

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import align
from wna16_jax import _reference, _routing

# Compiled on a GPU, the Pallas interpreter elsewhere: the same tests run both ways.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
gpu_only = pytest.mark.skipif(not ON_GPU, reason="compiled Pallas Triton kernels need a GPU")

INVALID_IDS = (-1, -(2**31), 2**30)  # plus E itself, added per case

# The oracle, jitted: eager it would compile each of its ops per shape.
reference_align = jax.jit(
    _reference.moe_align_block_size, static_argnames=("num_experts", "block_m")
)


def _seed(request) -> int:
    return zlib.crc32(request.node.name.encode())


def make_ids(rng, t, k, e, pattern):
    """int32 [T, k] topk ids: 'random' (with dropped ids), 'one_expert' or 'distinct' rows."""
    if pattern == "random":
        ids = rng.integers(0, e, size=(t, k))
        invalid = rng.random((t, k)) < 0.1
        ids = np.where(invalid, rng.choice(np.array((*INVALID_IDS, e)), size=(t, k)), ids)
    elif pattern == "one_expert":
        ids = np.full((t, k), rng.integers(0, e))
    elif pattern == "distinct":  # top-k picks k different experts per token (k <= E)
        ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).reshape(t, k)
    else:
        raise ValueError(pattern)
    return jnp.asarray(ids, jnp.int32)


def make_expert_map(rng, e):
    """int32 [E]: a random quarter of the experts local (random local ids), the rest -1."""
    local = rng.permutation(e)[: max(1, e // 4)]
    m = np.full(e, -1, np.int32)
    m[local] = rng.permutation(len(local))
    return jnp.asarray(m)


def assert_routing_matches(got, want, topk_ids, num_experts, *, exact: bool = True):
    """Checks `got` against the reference `want` per the docs/design.md contract.

    expert_ids and num_tokens_post_padded exactly; sentinel positions exactly; each expert's
    run as a set. With `exact`, also the order inside runs (this kernel keeps slots ascending).
    """
    num_slots = topk_ids.size
    g_ids, w_ids = np.asarray(got.sorted_token_ids), np.asarray(want.sorted_token_ids)
    assert got.block_m == want.block_m
    assert g_ids.shape == w_ids.shape and g_ids.dtype == np.int32
    assert np.asarray(got.expert_ids).dtype == np.int32
    np.testing.assert_array_equal(got.num_tokens_post_padded, want.num_tokens_post_padded)
    np.testing.assert_array_equal(got.expert_ids, want.expert_ids)
    np.testing.assert_array_equal(g_ids == num_slots, w_ids == num_slots, err_msg="sentinels")
    flat = np.asarray(topk_ids).reshape(-1)
    counts = np.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)
    padded = -(-counts // want.block_m) * want.block_m
    run_start = np.cumsum(padded) - padded
    for e in np.flatnonzero(counts):
        run = slice(run_start[e], run_start[e] + padded[e])
        np.testing.assert_array_equal(
            np.sort(g_ids[run]), np.sort(w_ids[run]), err_msg=f"run of expert {e}"
        )
    if exact:
        np.testing.assert_array_equal(g_ids, w_ids, err_msg="order inside runs")


def run_case(rng, t, k, e, block_m, *, with_map, pattern="random", config=None):
    ids = make_ids(rng, t, k, e, pattern)
    expert_map = make_expert_map(rng, e) if with_map else None
    got = align.moe_align_block_size(
        ids,
        num_experts=e,
        block_m=block_m,
        expert_map=expert_map,
        config=config,
        interpret=INTERPRET,
    )
    want = reference_align(ids, num_experts=e, block_m=block_m, expert_map=expert_map)
    assert_routing_matches(got, want, ids, e)
    return got


# (T, k, E, block_m, expert_map, pattern); T*k <= 2048 runs the single fused program.
FUSED_CASES = [
    (0, 8, 256, 16, False, "random"),
    (0, 2, 4, 64, True, "random"),
    (1, 1, 4, 16, False, "random"),
    (1, 8, 256, 64, True, "random"),
    (1, 8, 256, 16, False, "distinct"),
    (7, 2, 1, 16, False, "random"),
    (7, 2, 8, 32, False, "random"),
    (7, 6, 64, 16, True, "random"),
    (7, 8, 512, 64, True, "distinct"),
    (64, 1, 8, 64, False, "one_expert"),
    (64, 8, 256, 16, False, "random"),
    (64, 8, 256, 16, True, "random"),
    (64, 8, 256, 32, False, "distinct"),
    (64, 6, 192, 32, True, "random"),
    (64, 2, 512, 64, True, "random"),
    (64, 8, 4, 48, False, "random"),  # block_m not a power of two
    (64, 8, 64, 256, True, "random"),
    (33, 4, 16, 512, False, "distinct"),
    (333, 8, 64, 16, True, "one_expert"),
    (333, 2, 8, 64, False, "random"),
    (333, 6, 192, 16, True, "distinct"),
    (333, 6, 512, 32, False, "random"),
]


@pytest.mark.parametrize("t, k, e, block_m, with_map, pattern", FUSED_CASES)
def test_fused(request, t, k, e, block_m, with_map, pattern):
    rng = np.random.default_rng(_seed(request))
    run_case(rng, t, k, e, block_m, with_map=with_map, pattern=pattern)


# Small chunks: several programs; fused=False adds the histogram kernel before the scatter.
TWO_PASS = lambda chunk: align.AlignConfig(fused=False, chunk_slots=chunk)  # noqa: E731
MANY_FUSED = align.AlignConfig(fused=True, chunk_slots=16, blocks_per_program=16)
SPLIT_CASES = [
    (333, 8, 256, 16, True, "random", TWO_PASS(256)),
    (333, 6, 64, 64, False, "random", TWO_PASS(128)),
    (64, 8, 512, 16, True, "distinct", TWO_PASS(64)),
    (333, 1, 8, 32, False, "one_expert", TWO_PASS(64)),
    (100, 3, 4, 16, False, "random", TWO_PASS(32)),
    (333, 8, 256, 16, True, "random", MANY_FUSED),
    (64, 6, 512, 64, False, "distinct", MANY_FUSED),
    (333, 1, 8, 32, True, "one_expert", MANY_FUSED),
]


@pytest.mark.parametrize("t, k, e, block_m, with_map, pattern, config", SPLIT_CASES)
def test_split(request, t, k, e, block_m, with_map, pattern, config):
    rng = np.random.default_rng(_seed(request))
    run_case(rng, t, k, e, block_m, with_map=with_map, pattern=pattern, config=config)


@hypothesis.settings(max_examples=10, deadline=None, derandomize=True)
@hypothesis.given(data=st.data())
def test_hypothesis(data):
    t = data.draw(st.sampled_from([1, 5, 40]), label="T")
    k = data.draw(st.sampled_from([1, 4, 8]), label="k")
    e = data.draw(st.sampled_from([3, 16, 256]), label="E")
    block_m = data.draw(st.sampled_from([16, 64]), label="block_m")
    config = data.draw(st.sampled_from([None, TWO_PASS(32), MANY_FUSED]), label="config")
    ids = data.draw(hnp.arrays(np.int32, (t, k), elements=st.integers(-2, e + 1)), label="ids")
    with_map = data.draw(st.booleans(), label="with_map")
    expert_map = None
    if with_map:
        m = data.draw(hnp.arrays(np.int32, (e,), elements=st.integers(-1, e - 1)), label="map")
        expert_map = jnp.asarray(m)
    ids = jnp.asarray(ids)
    got = align.moe_align_block_size(
        ids,
        num_experts=e,
        block_m=block_m,
        expert_map=expert_map,
        config=config,
        interpret=INTERPRET,
    )
    want = reference_align(ids, num_experts=e, block_m=block_m, expert_map=expert_map)
    assert_routing_matches(got, want, ids, e)


def test_under_jit_and_export(request):
    rng = np.random.default_rng(_seed(request))
    ids = make_ids(rng, 64, 8, 256, "random")
    expert_map = make_expert_map(rng, 256)

    def f(ids, expert_map):
        r = align.moe_align_block_size(
            ids, num_experts=256, block_m=16, expert_map=expert_map, interpret=INTERPRET
        )
        return r.sorted_token_ids, r.expert_ids, r.num_tokens_post_padded

    got = jax.jit(f)(ids, expert_map)
    want = reference_align(ids, num_experts=256, block_m=16, expert_map=expert_map)
    np.testing.assert_array_equal(got[0], want.sorted_token_ids)
    np.testing.assert_array_equal(got[1], want.expert_ids)
    np.testing.assert_array_equal(got[2], want.num_tokens_post_padded)
    # Pallas Triton kernels are custom calls: exporting them is opt-in.
    checks = [jax.export.DisabledSafetyCheck.custom_call(plgpu.CUSTOM_CALL_TARGET_NAME)]
    exported = jax.export.export(jax.jit(f), disabled_checks=checks)(ids, expert_map)
    assert exported.out_avals[0].shape == (_routing.max_padded_len(512, 256, 16),)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(topk_ids=jnp.zeros((4, 2), jnp.uint32)), "int32"),
        (dict(topk_ids=jnp.zeros((8,), jnp.int32)), r"int32 \[T, k\]"),
        (dict(num_experts=2048), "num_experts=2048"),
        (dict(num_experts=0), "num_experts=0"),
        (dict(block_m=0), "block_m=0"),
        (dict(expert_map=jnp.zeros((5,), jnp.int32)), r"int32 \[num_experts=8\]"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    args = dict(topk_ids=jnp.zeros((4, 2), jnp.int32), num_experts=8, block_m=16)
    args.update(kwargs)
    topk_ids = args.pop("topk_ids")
    with pytest.raises(ValueError, match=match):
        align.moe_align_block_size(topk_ids, **args, interpret=INTERPRET)


def test_config():
    assert align.default_config(512).fused  # decode: one launch
    assert align.default_config(128).blocks_per_program == align.FUSED_BLOCKS_PER_PROGRAM
    # from 2048 slots (T=256, top-8) two launches (docs/performance.md, 'Backend order, rows
    # gather, alignment')
    assert not align.default_config(2048).fused
    assert not align.default_config(131072).fused
    with pytest.raises(ValueError, match="chunk_slots=1000"):
        align.AlignConfig(chunk_slots=1000)


# Compiled-only sizes: far too slow for the interpreter.
LARGE_CASES = [
    (4096, 8, 256, 16, True, "random"),
    (16384, 8, 256, 16, False, "random"),
    (16384, 8, 256, 64, True, "distinct"),
    (16384, 8, 512, 32, True, "random"),
    (131072, 8, 256, 16, False, "random"),
    (131072, 8, 256, 128, True, "one_expert"),
]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("t, k, e, block_m, with_map, pattern", LARGE_CASES)
def test_large_compiled(request, t, k, e, block_m, with_map, pattern):
    rng = np.random.default_rng(_seed(request))
    run_case(rng, t, k, e, block_m, with_map=with_map, pattern=pattern)
