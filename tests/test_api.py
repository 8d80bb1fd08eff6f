"""Tests of the public API: input validation, jit, export, and agreement with the reference."""

from __future__ import annotations

import dataclasses

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wna16_jax as wj
from wna16_jax import _reference

T, H, I, E, K_TOP = 5, 64, 32, 4, 2


@pytest.fixture
def problem(rng):
    """A small valid fused_moe problem as a dict of keyword arguments."""
    x, w13, w2, wts, ids = helpers.random_moe_inputs(rng, T=T, H=H, I=I, E=E, k=K_TOP)
    return dict(x=x, w13=w13, w2=w2, topk_weights=wts, topk_ids=ids)


def _call(p, **kwargs):
    return wj.fused_moe(
        p["x"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"], **p.get("kw", {}), **kwargs
    )


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _abstract_experts(e, n, k, *, bits=4, group_size=128, has_zp=True, dtype=jnp.bfloat16):
    """A QuantizedExperts of ShapeDtypeStructs: shapes only, nothing allocated."""
    g = k if group_size == -1 else group_size
    zshape = (e, n // 2, k // g) if bits == 4 else (e, n, k // g)
    return wj.QuantizedExperts(
        qweight=_sds((e, n, k * bits // 32), jnp.uint32),
        scales=_sds((e, n, k // g), dtype),
        zeros=_sds(zshape, jnp.uint8) if has_zp else None,
        bits=bits,
        group_size=group_size,
    )


def _replace(qw, **changes):
    return dataclasses.replace(qw, **changes)


def _identity_perm_but(e, j, value):
    """Host int32 [E, H]: every expert's inputs in order, but perm[e, j] = value."""
    perm = np.tile(np.arange(H, dtype=np.int32), (E, 1))
    perm[e, j] = value
    return perm


# Each case: (id, function of the valid problem dict -> the broken one, substrings of the error).
INVALID = [
    ("x_rank3", lambda p: p | {"x": p["x"][..., None]}, ["x must be [T, H]", "(5, 64, 1)"]),
    ("x_rank1", lambda p: p | {"x": p["x"][0]}, ["x must be [T, H]", "(64,)"]),
    ("x_int", lambda p: p | {"x": p["x"].astype(jnp.int32)}, ["x dtype", "int32"]),
    ("x_uint8", lambda p: p | {"x": p["x"].astype(jnp.uint8)}, ["x dtype", "uint8"]),
    (
        "h_mismatch",
        lambda p: p | {"x": jnp.ones((T, 2 * H), jnp.bfloat16)},
        ["w13 has K=64", "x has H=128"],
    ),
    (
        "k_not_multiple_of_group",
        lambda p: (
            p
            | {
                "w13": _replace(
                    p["w13"],
                    group_size=48,
                    scales=jnp.ones((E, 2 * I, 1), jnp.bfloat16),
                    zeros=None,
                )
            }
        ),
        ["w13", "K=64 is not a multiple of group_size=48"],
    ),
    (
        "w13_rows_odd",
        lambda p: (
            p
            | {
                "w13": wj.QuantizedExperts(
                    qweight=jnp.ones((E, 2 * I + 1, H // 8), jnp.uint32),
                    scales=jnp.ones((E, 2 * I + 1, H // 32), jnp.bfloat16),
                    zeros=None,
                    bits=4,
                    group_size=32,
                )
            }
        ),
        ["even number of rows", "N=65"],
    ),
    (
        "w2_wrong_i",
        lambda p: (
            p
            | {
                "w2": helpers.random_quantized_experts(
                    np.random.default_rng(0), E, H, 2 * I, 4, 32, True
                )
            }
        ),
        ["w2 shape (4, 64, 64)", "(E, H, I) = (4, 64, 32)"],
    ),
    (
        "w2_wrong_e",
        lambda p: (
            p
            | {
                "w2": helpers.random_quantized_experts(
                    np.random.default_rng(0), E + 1, H, I, 4, 32, True
                )
            }
        ),
        ["w2 shape (5, 64, 32)", "(4, 64, 32)"],
    ),
    (
        "w2_wrong_h",
        lambda p: (
            p
            | {
                "w2": helpers.random_quantized_experts(
                    np.random.default_rng(0), E, H + 8, I, 4, 32, True
                )
            }
        ),
        ["w2 shape (4, 72, 32)", "(4, 64, 32)"],
    ),
    (
        "weights_shape",
        lambda p: p | {"topk_weights": jnp.ones((T, K_TOP + 1), jnp.float32)},
        ["topk_weights shape (5, 3)", "topk_ids shape (5, 2)"],
    ),
    (
        "ids_rows",
        lambda p: (
            p
            | {
                "topk_ids": jnp.zeros((T + 1, K_TOP), jnp.int32) + 1,
                "topk_weights": jnp.ones((T + 1, K_TOP), jnp.float32),
            }
        ),
        ["topk_ids has 6 rows", "T=5"],
    ),
    (
        "ids_rank",
        lambda p: p | {"topk_ids": p["topk_ids"].reshape(-1)},
        ["topk_ids must be [T, k]", "(10,)"],
    ),
    (
        "ids_float",
        lambda p: p | {"topk_ids": p["topk_ids"].astype(jnp.float32)},
        ["topk_ids must be an integer array", "float32"],
    ),
    (
        "weights_int",
        lambda p: p | {"topk_weights": p["topk_ids"]},
        ["topk_weights must be floating point", "int32"],
    ),
    (
        "bits3",
        lambda p: p | {"w13": _replace(p["w13"], bits=3)},
        ["w13", "bits=3 is not supported"],
    ),
    (
        "w2_bits16",
        lambda p: p | {"w2": _replace(p["w2"], bits=16)},
        ["w2", "bits=16 is not supported"],
    ),
    (
        "qweight_int32",
        lambda p: p | {"w13": _replace(p["w13"], qweight=p["w13"].qweight.astype(jnp.int32))},
        ["w13", "qweight dtype must be uint32", "int32"],
    ),
    (
        "qweight_rank",
        lambda p: p | {"w13": _replace(p["w13"], qweight=p["w13"].qweight[0])},
        ["w13", "qweight must be [E, N, K//8]", "(64, 8)"],
    ),
    (
        "scales_shape",
        lambda p: p | {"w2": _replace(p["w2"], scales=p["w2"].scales[:, :, :0])},
        ["w2", "scales shape (4, 64, 0) != expected (4, 64, 1)"],
    ),
    (
        "scales_int",
        lambda p: p | {"w2": _replace(p["w2"], scales=p["w2"].scales.astype(jnp.int32))},
        ["w2", "scales must be floating point", "int32"],
    ),
    (
        "zeros_shape",
        lambda p: p | {"w13": _replace(p["w13"], zeros=jnp.ones((E, 2 * I, 2), jnp.uint8))},
        ["w13", "zeros shape (4, 64, 2) != expected (4, 32, 2)", "bits=4"],
    ),
    (
        "zeros_dtype",
        lambda p: p | {"w13": _replace(p["w13"], zeros=p["w13"].zeros.astype(jnp.int32))},
        ["w13", "zeros dtype must be uint8", "int32"],
    ),
    (
        "w13_not_quantized",
        lambda p: p | {"w13": jnp.ones((E, 2 * I, H))},
        ["w13 must be a QuantizedExperts"],
    ),
    (
        "expert_map_2d",
        lambda p: p | {"kw": {"expert_map": jnp.zeros((2, E), jnp.int32)}},
        ["expert_map must be a 1-D integer array", "(2, 4)"],
    ),
    (
        "expert_map_float",
        lambda p: p | {"kw": {"expert_map": jnp.zeros((E,), jnp.float32)}},
        ["expert_map must be a 1-D integer array", "float32"],
    ),
    (
        "expert_map_short",
        lambda p: p | {"kw": {"expert_map": jnp.arange(E - 1, dtype=jnp.int32)}},
        ["expert_map has 3 entries", "4 local experts"],
    ),
    (
        "activation",
        lambda p: p | {"kw": {"activation": "gelu"}},
        ["activation='gelu' is not supported", "silu"],
    ),
    (
        "perm_shape",
        lambda p: p | {"w13": _replace(p["w13"], perm=jnp.zeros((E, H + 1), jnp.int32))},
        ["w13", "perm must be int32 [E, K] = (4, 64)", "(4, 65)"],
    ),
    (
        "perm_dtype",
        lambda p: p | {"w13": _replace(p["w13"], perm=np.zeros((E, H), np.int64))},
        ["w13", "perm must be int32", "int64"],
    ),
    (
        "perm_not_a_permutation",
        lambda p: p | {"w13": _replace(p["w13"], perm=_identity_perm_but(2, 5, 7))},
        ["w13", "perm[2] is not a permutation of range(K=64)", "1 of 4 rows"],
    ),
    (
        "w2_perm",
        lambda p: p | {"w2": helpers.with_random_perm(np.random.default_rng(0), p["w2"])},
        ["w2 has an input permutation", "wna16_jax.formats.fold_w2_act_order"],
    ),
]


@pytest.mark.parametrize(
    "mutate, substrings", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_fused_moe_rejects(problem, mutate, substrings):
    bad = mutate(problem)
    with pytest.raises(ValueError) as err:
        _call(bad)
    for s in substrings:
        assert s in str(err.value), f"{s!r} not in {str(err.value)!r}"


@pytest.mark.parametrize("bits, k", [(4, 12), (4, 36), (8, 6), (8, 18)])
def test_k_not_multiple_of_pack_factor(bits, k):
    """A K that is not a whole number of words cannot be quantized (qweight would be ragged)."""
    with pytest.raises(
        ValueError, match=f"K={k} is not a multiple of {32 // bits} \\(bits={bits}\\)"
    ):
        wj.quantize_experts(jnp.ones((1, 4, k)), bits=bits, group_size=-1)


# ---- the 2^31 rule --------------------------------------------------------------------------

# DeepSeek-V3's w13 at TP=1 as one uint8 byte per int4 pair would be [256, 4096, 3584]; even as
# words, E=256 experts of [4 * 4096, 7168] hold 3.76e9 words: over 2^31.
BIG_E, BIG_N, BIG_H = 256, 4 * 4096, 7168


def test_qweight_over_2_31_elements_rejected():
    w13 = _abstract_experts(BIG_E, BIG_N, BIG_H)
    assert int(np.prod(w13.qweight.shape)) == 3_758_096_384 > 2**31
    w2 = _abstract_experts(BIG_E, BIG_H, BIG_N // 2)
    x = _sds((4, BIG_H), jnp.bfloat16)
    ids = _sds((4, 8), jnp.int32)
    wts = _sds((4, 8), jnp.float32)
    with pytest.raises(ValueError) as err:
        wj.fused_moe(x, w13, w2, wts, ids)
    msg = str(err.value)
    for s in ["w13", "qweight has 3758096384 elements", "2^31", "shard the experts"]:
        assert s in msg, msg
    with pytest.raises(ValueError, match="qweight has 3758096384 elements"):
        jax.eval_shape(lambda *a: wj.fused_moe(*a), x, w13, w2, wts, ids)
    with pytest.raises(ValueError, match="qweight has 3758096384 elements"):
        w13.validate()


def test_x_over_2_31_elements_rejected():
    t = 2**31 // 64 + 1
    w13 = _abstract_experts(8, 64, 64, group_size=32)
    w2 = _abstract_experts(8, 64, 32, group_size=32)
    x = _sds((t, 64), jnp.bfloat16)
    ids, wts = _sds((t, 2), jnp.int32), _sds((t, 2), jnp.float32)
    with pytest.raises(ValueError, match=f"x has {t * 64} elements, over the 2\\^31 limit"):
        wj.fused_moe(x, w13, w2, wts, ids)


def test_topk_ids_over_2_31_elements_rejected():
    ids = _sds((2**28, 8), jnp.int32)
    with pytest.raises(ValueError, match="topk_ids has 2147483648 elements"):
        wj.moe_align_block_size(ids, num_experts=256, block_m=16)


def test_deepseek_v3_shapes_trace_under_eval_shape():
    """The largest legal problem (DeepSeek-V3 TP=1, int4) passes validation and traces."""
    w13 = _abstract_experts(256, 2 * 2048, 7168)  # 0.94e9 words
    w2 = _abstract_experts(256, 7168, 2048)
    x = _sds((16, 7168), jnp.bfloat16)
    ids, wts = _sds((16, 8), jnp.int32), _sds((16, 8), jnp.float32)
    out = jax.eval_shape(lambda *a: wj.fused_moe(*a), x, w13, w2, wts, ids)
    assert out.shape == (16, 7168) and out.dtype == jnp.bfloat16


# ---- fused_moe: behaviour -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_moe_equals_reference_and_oracle(rng, dtype):
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng, T=11, H=64, I=32, E=6, k=2, dtype=dtype, group_size=-1
    )
    out = wj.fused_moe(x, w13, w2, wts, ids)
    assert out.dtype == dtype and out.shape == (11, 64)
    ref = _reference.fused_moe(x, w13, w2, wts, ids)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    want = helpers.numpy_fused_moe(
        x, helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2), wts, ids
    )
    helpers.assert_close(out, want, dtype)


def test_out_dtype_float32_is_the_sum_before_rounding(rng):
    """out_dtype=float32 returns the f32 sum every backend rounds once to x.dtype by default,
    so the default output is exactly its rounding (the sharded layer adds shards' partials in
    f32 this way). Here for 'xla'; the kernel backends check it in tests/backend_cases.py."""
    implementation = "xla"
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng, T=5, H=128, I=128, E=4, k=2, group_size=128
    )
    out = wj.fused_moe(x, w13, w2, wts, ids, implementation=implementation)
    full = wj.fused_moe(x, w13, w2, wts, ids, implementation=implementation, out_dtype="float32")
    assert out.dtype == jnp.bfloat16 and full.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(full.astype(jnp.bfloat16), np.float32), np.asarray(out, np.float32)
    )
    assert np.any(np.asarray(full) != np.asarray(out, np.float32))  # not just bf16 values


def test_out_dtype_must_be_a_float_dtype(problem):
    p = problem
    args = (p["x"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    with pytest.raises(ValueError, match="out_dtype=.*int32.* must be a floating dtype"):
        wj.fused_moe(*args, out_dtype=jnp.int32)


def test_fused_moe_under_jit(problem):
    p = problem
    args = (p["x"], p["w13"], p["w2"], p["topk_weights"], p["topk_ids"])
    direct = wj.fused_moe(*args)
    jitted = jax.jit(wj.fused_moe, static_argnames=("activation", "implementation", "config"))
    out = jitted(*args, implementation="xla")
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(direct, np.float32), rtol=1e-6, atol=0
    )


def test_fused_moe_uint_ids_and_expert_map_dtype(problem):
    """Integer ids of another dtype are accepted and mean the same experts."""
    p = problem
    args = (p["x"], p["w13"], p["w2"], p["topk_weights"])
    want = wj.fused_moe(*args, p["topk_ids"])
    out = wj.fused_moe(*args, p["topk_ids"].astype(jnp.uint8))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    out = wj.fused_moe(*args, p["topk_ids"], expert_map=jnp.arange(E, dtype=jnp.int16))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_fused_moe_zero_tokens(problem):
    p = problem
    x = jnp.zeros((0, H), jnp.bfloat16)
    out = wj.fused_moe(
        x, p["w13"], p["w2"], jnp.zeros((0, K_TOP), jnp.float32), jnp.zeros((0, K_TOP), jnp.int32)
    )
    assert out.shape == (0, H) and out.dtype == jnp.bfloat16


def _flat_fused_moe(x, w13q, w13s, w13z, w2q, w2s, w2z, wts, ids):
    """fused_moe over plain arrays: exports serialize without custom pytree registrations."""
    w13 = wj.QuantizedExperts(qweight=w13q, scales=w13s, zeros=w13z, bits=4, group_size=32)
    w2 = wj.QuantizedExperts(qweight=w2q, scales=w2s, zeros=w2z, bits=4, group_size=32)
    return wj.fused_moe(x, w13, w2, wts, ids)


def test_export_round_trip_plain_arrays(problem):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    p = problem
    args = (
        p["x"],
        p["w13"].qweight,
        p["w13"].scales,
        p["w13"].zeros,
        p["w2"].qweight,
        p["w2"].scales,
        p["w2"].zeros,
        p["topk_weights"],
        p["topk_ids"],
    )
    exported = jax.export.export(jax.jit(_flat_fused_moe))(*args)
    restored = jax.export.deserialize(exported.serialize())
    out = restored.call(*args)
    direct = _flat_fused_moe(*args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(direct, np.float32))


@pytest.mark.parametrize("act_order", [False, True], ids=["in_order", "act_order"])
@pytest.mark.parametrize("has_zp", [True, False], ids=["zp", "sym"])
def test_export_round_trip_quantized_experts(rng, has_zp, act_order):
    """DESIGN: everything works with jax.export, QuantizedExperts arguments included (an
    act-order w13's input permutation too)."""
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    args = helpers.random_moe_inputs(rng, T=T, H=H, I=I, E=E, k=K_TOP, has_zp=has_zp)
    if act_order:
        w13 = helpers.with_random_perm(rng, args[1])
        args = (args[0], dataclasses.replace(w13, perm=jnp.asarray(w13.perm)), *args[2:])
    f = jax.jit(lambda *a: wj.fused_moe(*a))
    exported = jax.export.export(f)(*args)
    restored = jax.export.deserialize(exported.serialize())
    out = restored.call(*args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(f(*args), np.float32))


# ---- moe_align_block_size -------------------------------------------------------------------


@pytest.mark.parametrize("T, k, E, block_m", [(37, 2, 8, 16), (5, 3, 6, 32), (0, 2, 8, 16)])
@pytest.mark.parametrize("with_map", [False, True], ids=["global", "expert_map"])
def test_align_equals_reference(rng, T, k, E, block_m, with_map):
    _, ids = helpers.random_routing(rng, T, k, E)
    ids[:, 0] = np.where(rng.random(T) < 0.2, -1, ids[:, 0])  # some dropped slots
    expert_map = None
    if with_map:
        expert_map = np.full(E, -1, np.int32)
        expert_map[: E // 2] = np.arange(E // 2)
        expert_map = jnp.asarray(rng.permutation(expert_map))
    got = wj.moe_align_block_size(
        jnp.asarray(ids), num_experts=E, block_m=block_m, expert_map=expert_map
    )
    ref = _reference.moe_align_block_size(
        jnp.asarray(ids), num_experts=E, block_m=block_m, expert_map=expert_map
    )
    assert isinstance(got, wj.AlignedRouting) and got.block_m == block_m
    np.testing.assert_array_equal(np.asarray(got.expert_ids), np.asarray(ref.expert_ids))
    assert int(got.num_tokens_post_padded) == int(ref.num_tokens_post_padded)
    helpers.assert_alignment_matches(
        got,
        ids,
        num_experts=E,
        block_m=block_m,
        expert_map=None if expert_map is None else np.asarray(expert_map),
    )


@pytest.mark.parametrize(
    "kwargs, substrings",
    [
        (dict(num_experts=0, block_m=16), ["num_experts=0 must be positive"]),
        (dict(num_experts=8, block_m=24), ["block_m=24 must be a power of two"]),
        (dict(num_experts=8, block_m=0), ["block_m=0 must be a power of two"]),
        (
            dict(num_experts=8, block_m=16, expert_map=jnp.zeros(6, jnp.int32)),
            ["expert_map has 6 entries but num_experts=8"],
        ),
        (
            dict(num_experts=8, block_m=16, expert_map=jnp.zeros((8, 1), jnp.int32)),
            ["expert_map must be a 1-D integer array", "(8, 1)"],
        ),
    ],
)
def test_align_rejects(kwargs, substrings):
    with pytest.raises(ValueError) as err:
        wj.moe_align_block_size(jnp.ones((4, 2), jnp.int32), **kwargs)
    for s in substrings:
        assert s in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "ids, substrings",
    [
        (jnp.ones((4, 2), jnp.float32), ["topk_ids must be an integer array", "float32"]),
        (jnp.ones((8,), jnp.int32), ["topk_ids must be [T, k]", "(8,)"]),
    ],
)
def test_align_rejects_ids(ids, substrings):
    with pytest.raises(ValueError) as err:
        wj.moe_align_block_size(ids, num_experts=8, block_m=16)
    for s in substrings:
        assert s in str(err.value), str(err.value)


def test_no_gradients_and_k_of_zero_refused(rng):
    """The library is inference-only: a derivative through fused_moe, grouped_matmul or a
    kernel linear raises a TypeError saying so (not an error from deep inside a kernel);
    the 'xla' linear is plain JAX and differentiates. k = 0 experts per token is refused."""
    from wna16_jax import linear

    w13 = helpers.random_quantized_experts(rng, 4, 256, 128, 4, 64, True, jnp.float32)
    w2 = helpers.random_quantized_experts(rng, 4, 128, 128, 4, 64, True, jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 128)), jnp.float32)
    tw, ids = helpers.random_routing(rng, 3, 2, 4)
    tw, ids = jnp.asarray(tw, jnp.float32), jnp.asarray(ids)
    for impl in ("xla", "pallas_interpret"):
        with pytest.raises(TypeError, match="wna16_jax is inference-only"):
            jax.grad(lambda x, i=impl: wj.fused_moe(x, w13, w2, tw, ids, implementation=i).sum())(x)
    with pytest.raises(TypeError, match="wna16_jax is inference-only"):
        jax.grad(lambda tw: wj.fused_moe(x, w13, w2, tw, ids).sum())(tw)
    w = w13.slice(0, 1, axis=0)
    with pytest.raises(TypeError, match="wna16_jax is inference-only"):
        jax.grad(lambda x: linear.quantized_matmul(x, w, implementation="pallas_interpret").sum())(
            x
        )
    g = jax.grad(lambda x: linear.quantized_matmul(x, w, implementation="xla").sum())(x)
    np.testing.assert_allclose(g[0], np.asarray(wj.dequantize_experts(w)[0]).sum(0), rtol=1e-5)
    with pytest.raises(ValueError, match=r"topk_ids has shape \(3, 0\): each token needs k >= 1"):
        wj.fused_moe(x, w13, w2, tw[:, :0], ids[:, :0])
