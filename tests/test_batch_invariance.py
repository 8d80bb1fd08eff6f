"""batch_invariant=True: configs fixed per weight shape, the checks failing without the flag."""

from __future__ import annotations

import dataclasses
import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_cases import SAMPLED_SCHEMES, SCHEME_PROBLEM, SchemeCases, assert_rows_batch_invariant

import wna16_jax as wj
from pallas_kernels.pallas import fused_moe as pallas_moe
from wna16_jax import _dispatch
from wna16_jax._configs import BATCH_INVARIANT_M, GemmShape, batch_invariant_config, resolve

SHAPE = GemmShape(m=1, n=256, k=2048, num_experts=256, bits=4, group=128, group_size=128)
# The Pallas grouped GEMM's (GemmShape, config) -> (config, source).
PALLAS_CONFIG = functools.partial(resolve, pallas_moe.RULES)


def test_configs_do_not_depend_on_m():
    """Without the flag the Pallas GEMM's heuristic picks a one-row split-K config at decode
    and tensor-core tiles for many rows; with it, one config without a K split for every M."""
    rules = PALLAS_CONFIG
    plain = {m: rules(dataclasses.replace(SHAPE, m=m), None)[0] for m in (1, 64, 4096)}
    assert len(set(plain.values())) > 1 and plain[1].split_k > 1  # the flag has work to do
    fixed = {
        m: batch_invariant_config(rules, dataclasses.replace(SHAPE, m=m), None)[0]
        for m in (1, 64, 4096)
    }
    assert len(set(fixed.values())) == 1
    (config,) = set(fixed.values())
    assert config.split_k == 1
    at_fixed_m = rules(dataclasses.replace(SHAPE, m=BATCH_INVARIANT_M), None)[0]
    assert config == dataclasses.replace(at_fixed_m, split_k=1)


def test_caller_split_k_refused():
    config = wj.BlockConfig(block_m=16, block_n=64, block_k=128, split_k=2)
    with pytest.raises(ValueError, match="split_k=2"):
        batch_invariant_config(PALLAS_CONFIG, SHAPE, config)
    same = dataclasses.replace(config, split_k=1)
    assert batch_invariant_config(PALLAS_CONFIG, SHAPE, same) == (same, "caller")


def test_flag_must_be_a_bool(rng):
    x, w13, w2, (tw, ti) = SchemeCases().invariant_inputs(rng, SAMPLED_SCHEMES[0])
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        wj.fused_moe(x[:2], w13, w2, jnp.asarray(tw[:2]), jnp.asarray(ti[:2]), batch_invariant=1)
    w = SchemeCases.scheme_weights(rng, SAMPLED_SCHEMES[0], 1, 64, SCHEME_PROBLEM["H"])
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        wj.linear.quantized_matmul(x[:2], w, batch_invariant="yes")


def test_pallas_rows_differ_without_the_flag(rng):
    """The check can fail: without the flag the interpreted Pallas layer's configs follow M
    (one-row split-K blocks for one token, 16-row tensor-core tiles for more), and a row's
    bits change with the rows beside it."""
    e, k, h, i = 8, 2, 128, 128  # one token's 2 slots over 8 experts: a quarter row each
    x = jnp.asarray(rng.normal(size=(7, h)), jnp.bfloat16)
    w13 = helpers.random_quantized_experts(rng, e, 2 * i, h, 4, 64, True, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, e, h, i, 4, 64, True, jnp.bfloat16)
    tw, ti = helpers.random_routing(rng, 7, k, e)

    def call(rows, **kwargs):
        return wj.fused_moe(
            x[rows], w13, w2, jnp.asarray(tw[rows]), jnp.asarray(ti[rows]),
            implementation="pallas_interpret", **kwargs,
        )  # fmt: skip

    with pytest.raises(AssertionError, match="differs from the row alone"):
        assert_rows_batch_invariant(call, 7, "pallas_interpret fused_moe without the flag")
    assert_rows_batch_invariant(
        functools.partial(call, batch_invariant=True), 7, "pallas_interpret fused_moe"
    )


def test_xla_linear_rows_differ_without_the_flag(rng):
    """The check can fail: XLA's CPU dot blocks K differently for one row and for several."""
    w = helpers.random_quantized_experts(rng, 1, 256, 512, 4, 64, True, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(64, 512)), jnp.float32)

    def call(rows, **kwargs):
        return wj.linear.quantized_matmul(x[rows], w, implementation="xla", **kwargs)

    with pytest.raises(AssertionError, match="differs from the row alone"):
        assert_rows_batch_invariant(call, 64, "xla linear without the flag")
    assert_rows_batch_invariant(
        lambda rows: call(rows, batch_invariant=True), 64, "xla linear, f32 rows"
    )


def test_same_bits_every_run(rng):
    """Run-to-run: the same call twice (a fresh compile the second time) gives the same bits."""
    x, w13, w2, (tw, ti) = SchemeCases().invariant_inputs(rng, SAMPLED_SCHEMES[1])
    args = (x[:64], w13, w2, jnp.asarray(tw[:64]), jnp.asarray(ti[:64]))
    outs = []
    for _ in range(2):
        out = wj.fused_moe(*args, implementation="pallas_interpret", batch_invariant=True)
        outs.append(np.asarray(out, np.float32))
        jax.clear_caches()
    np.testing.assert_array_equal(outs[0], outs[1])


def test_backends_that_guarantee_it():
    """'mgpu' says why it cannot (its refusal and the fall-through: test_mgpu_gemm's
    test_batch_invariant_refused); the others run batch_invariant=True."""
    reason = _dispatch.get_backend("mgpu").batch_invariant_reason
    assert reason is not None and "K splits" in reason
    for name in ("xla", "pallas", "pallas_interpret", "triton"):
        assert _dispatch.get_backend(name).batch_invariant_reason is None, name


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_w8a8_rows_batch_invariant(rng, implementation):
    """int8 activations (a scale per token) on int8 per-channel symmetric experts: each row
    alone and among M in {1, 2, 7, 64} rows, bit for bit."""
    e, k, h, i = 8, 2, 128, 128
    x = jnp.asarray(rng.normal(size=(64, h)), jnp.bfloat16)
    w13 = helpers.random_quantized_experts(rng, e, 2 * i, h, 8, -1, False, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, e, h, i, 8, -1, False, jnp.bfloat16)
    tw, ti = helpers.random_routing(rng, 64, k, e)

    def call(rows):
        return wj.fused_moe(
            x[rows], w13, w2, jnp.asarray(tw[rows]), jnp.asarray(ti[rows]),
            implementation=implementation, activation_quant="int8_per_token",
            batch_invariant=True,
        )  # fmt: skip

    assert_rows_batch_invariant(call, 64, f"{implementation} W8A8 fused_moe")


@helpers.needs_triton
def test_triton_rows_batch_invariant(rng):
    """The jax-triton layer in Triton's interpreter (it claims the guarantee: no refusal
    above): each row alone and among M in {1, 2, 7} rows, bit for bit."""
    from pallas_kernels.triton import fused_moe as triton_moe

    e, k, h, i, t = 8, 2, 128, 128, 7
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w13 = helpers.random_quantized_experts(rng, e, 2 * i, h, 4, 32, True, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, e, h, i, 4, 32, True, jnp.bfloat16)
    tw, ti = helpers.random_routing(rng, t, k, e)
    layer = helpers.pipeline_fused_moe(triton_moe.stages, interpret=True, batch_invariant=True)

    def call(rows):
        args = (x[rows], w13, w2, jnp.asarray(tw[rows]), jnp.asarray(ti[rows]))
        return layer(*args, batch_invariant=True)

    assert_rows_batch_invariant(call, t, "triton (interpreted) fused_moe")
