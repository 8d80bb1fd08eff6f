"""Bad values at every public boundary of the library and the model config: drawn with
hypothesis, each must give a clear error (naming the argument or field and the value) or a
result equal to the reference; then the known cases as named regression tests.

Small shapes and the 'xla' backend only, so the whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import wna16_jax as wj
from models.deepseek_v3.config import _INT_MINIMUM, _POSITIVE_FLOATS, DeepseekV3Config
from models.qwen_moe import config as qwen_config
from models.qwen_moe.config import QwenMoeConfig

E, H, I, T, K = 4, 64, 32, 3, 2
SETTINGS = hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
INT_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


@pytest.fixture(scope="module")
def layer():
    """(x, w13, w2, topk_weights) of a tiny MoE layer, random."""
    rng = np.random.default_rng(7)
    w13 = wj.random_quantized_experts(rng, (E, 2 * I, H), bits=4, group_size=32)
    w2 = wj.random_quantized_experts(rng, (E, H, I), bits=4, group_size=32)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    return x, w13, w2, weights


def _moe(layer, ids, **kwargs):
    x, w13, w2, weights = layer
    return np.asarray(wj.fused_moe(x, w13, w2, weights, ids, implementation="xla", **kwargs))


def _dropped(ids, num_ids: int) -> np.ndarray:
    """The reference meaning of routing ids: those outside [0, num_ids) dropped (-1), int32."""
    wide = ids.astype(object)  # Python ints: no dtype wraps the comparison
    return np.where((wide >= 0) & (wide < num_ids), wide, -1).astype(np.int32)


def _ids(dtype) -> st.SearchStrategy:
    """[T, K] ids of `dtype` over its whole range, in-range experts often."""
    info = np.iinfo(dtype)
    edge = [v for v in (-1, E, 2**31, 2**32, 2**32 + 1, 2**63 - 1) if info.min <= v <= info.max]
    value = st.one_of(
        st.integers(0, E - 1),
        st.sampled_from(edge),
        st.integers(int(info.min), int(info.max)),
    )
    return st.lists(value, min_size=T * K, max_size=T * K).map(
        lambda v: np.array(v, dtype=dtype).reshape(T, K)
    )


# ---- routing ids and expert_map --------------------------------------------------------------


@SETTINGS
@hypothesis.given(data=st.data(), dtype=st.sampled_from(INT_DTYPES))
def test_fused_moe_drops_out_of_range_ids_of_any_dtype(layer, data, dtype):
    """Ids of any integer dtype give the layer of the same ids with those outside [0, E)
    dropped: a wide id never wraps onto a real expert."""
    ids = data.draw(_ids(dtype))
    np.testing.assert_array_equal(_moe(layer, ids), _moe(layer, _dropped(ids, E)))


@SETTINGS
@hypothesis.given(data=st.data(), dtype=st.sampled_from(INT_DTYPES))
def test_align_drops_out_of_range_ids_of_any_dtype(data, dtype):
    ids = data.draw(_ids(dtype))
    got = wj.moe_align_block_size(ids, num_experts=E, block_m=4, implementation="xla")
    want = wj.moe_align_block_size(_dropped(ids, E), num_experts=E, block_m=4)
    for field in ("sorted_token_ids", "expert_ids", "num_tokens_post_padded"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


@SETTINGS
@hypothesis.given(
    entry=st.one_of(st.integers(E, 2**40), st.integers(-(2**40), -2)),
    at=st.integers(0, E - 1),
    dtype=st.sampled_from((np.int32, np.int64)),
    on_host=st.booleans(),
)
def test_an_expert_map_entry_out_of_range_is_refused(layer, entry, at, dtype, on_host):
    """An entry outside [-1, E_local) is an error naming the entry and its value (never clamped
    onto the last expert), for a numpy map and a concrete jax one."""
    hypothesis.assume(np.iinfo(dtype).min <= entry <= np.iinfo(dtype).max)
    emap = np.arange(E, dtype=dtype)
    emap[at] = entry
    emap = emap if on_host else jnp.asarray(emap)  # int64 -> int32 on device: still out of range
    value = int(np.asarray(emap)[at])
    with pytest.raises(ValueError, match=rf"expert_map\[{at}\]={value} is outside \[-1, {E}\)"):
        _moe(layer, np.zeros((T, K), np.int32), expert_map=emap)


def test_a_traced_expert_map_is_checked_under_checkify(layer):
    """Inside jit the values are not read (no host sync): checkify reports the bad entry, and
    without it the entry's slots are dropped rather than clamped onto an expert."""
    x, w13, w2, weights = layer
    ids = np.array([[3, 0]] * T, np.int32)

    def run(emap):
        return wj.fused_moe(x, w13, w2, weights, ids, expert_map=emap, implementation="xla")

    bad = jnp.array([0, 1, 2, 9], jnp.int32)
    err, _ = checkify.checkify(jax.jit(run))(bad)
    assert "expert_map holds entries outside [-1, 4)" in err.get()
    dropped = jnp.array([0, 1, 2, -1], jnp.int32)
    np.testing.assert_array_equal(jax.jit(run)(bad), run(dropped))
    err, _ = checkify.checkify(jax.jit(run))(dropped)
    assert err.get() is None


def test_an_expert_map_captured_by_jit_is_checked_when_traced(layer):
    """A concrete map closed over by a jitted function is read at trace time (a constant, not a
    traced argument): a good one runs, a bad one is refused naming the entry."""
    x, w13, w2, weights = layer
    ids = np.array([[3, 0]] * T, np.int32)

    def run_with(emap):
        return jax.jit(
            lambda x: wj.fused_moe(x, w13, w2, weights, ids, expert_map=emap, implementation="xla")
        )(x)

    good = jnp.array([0, 1, 2, -1], jnp.int32)
    np.testing.assert_array_equal(run_with(good), _moe(layer, ids, expert_map=good))
    with pytest.raises(ValueError, match=r"expert_map\[1\]=5 is outside"):
        run_with(jnp.array([0, 5, 2, -1], jnp.int32))


def test_a_block_of_an_expert_past_w_is_refused(layer):
    x, w13, _, _ = layer
    routing = wj.moe_align_block_size(np.zeros((T, K), np.int32), num_experts=E, block_m=4)
    bad = dataclasses.replace(routing, expert_ids=routing.expert_ids.at[0].set(E))
    with pytest.raises(ValueError, match=rf"routing.expert_ids\[0\]={E} is outside"):
        wj.grouped_matmul(x, w13, bad, top_k=K, implementation="xla")


# ---- integer and array arguments -------------------------------------------------------------

NOT_INTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=3),
    st.just(None),
    st.just(np.float32(4.0)),
)
NOT_ARRAYS = st.one_of(
    st.lists(st.floats(-1, 1), min_size=1, max_size=4),
    st.tuples(st.integers(0, 3), st.integers(0, 3)),
    st.floats(-1, 1),
    st.integers(0, 3),
)


@SETTINGS
@hypothesis.given(value=NOT_INTS, name=st.sampled_from(("num_experts", "block_m")))
def test_align_counts_refuse_non_integers(value, name):
    kwargs = dict(num_experts=E, block_m=4) | {name: value}
    with pytest.raises(TypeError, match=f"{name}=.* must be an int"):
        wj.moe_align_block_size(np.zeros((T, K), np.int32), **kwargs)


@SETTINGS
@hypothesis.given(
    scalar=st.sampled_from((np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint64)),
    block_m=st.sampled_from((1, 2, 4, 16)),
)
def test_numpy_integer_counts_act_as_python_ints(scalar, block_m):
    ids = np.array([[0, 3], [1, 1], [2, 0]], np.int32)
    got = wj.moe_align_block_size(ids, num_experts=scalar(E), block_m=scalar(block_m))
    want = wj.moe_align_block_size(ids, num_experts=E, block_m=block_m)
    assert got.block_m == block_m and type(got.block_m) is int
    np.testing.assert_array_equal(got.sorted_token_ids, want.sorted_token_ids)


@SETTINGS
@hypothesis.given(value=NOT_INTS)
def test_grouped_matmul_top_k_refuses_non_integers(layer, value):
    x, w13, _, _ = layer
    routing = wj.moe_align_block_size(np.zeros((T, K), np.int32), num_experts=E, block_m=4)
    with pytest.raises(TypeError, match="top_k=.* must be an int"):
        wj.grouped_matmul(x, w13, routing, top_k=value, implementation="xla")


@SETTINGS
@hypothesis.given(value=NOT_ARRAYS, name=st.sampled_from(("x", "topk_weights", "topk_ids")))
def test_fused_moe_refuses_non_arrays(layer, value, name):
    x, w13, w2, weights = layer
    args = dict(x=x, topk_weights=weights, topk_ids=np.zeros((T, K), np.int32)) | {name: value}
    with pytest.raises(TypeError, match=f"{name} must be an array .* got {type(value).__name__}"):
        wj.fused_moe(args["x"], w13, w2, args["topk_weights"], args["topk_ids"])


@SETTINGS
@hypothesis.given(dtype=st.sampled_from(("float32", "float16", "bfloat16", "float64")))
def test_float_ids_are_refused(layer, dtype):
    ids = np.zeros((T, K), dtype=np.float32).astype(dtype if dtype != "bfloat16" else np.float32)
    ids = jnp.asarray(ids, dtype) if dtype == "bfloat16" else ids
    with pytest.raises(ValueError, match="topk_ids must be an integer array"):
        _moe(layer, ids)


@SETTINGS
@hypothesis.given(
    x_dtype=st.sampled_from((jnp.int8, jnp.int32, jnp.uint8, jnp.bool_)),
    out_dtype=st.sampled_from((None, jnp.int32, jnp.int8)),
)
def test_quantized_matmul_refuses_integer_x_and_outputs(x_dtype, out_dtype):
    w = wj.random_quantized_experts(np.random.default_rng(1), (1, 64, 64), bits=4, group_size=32)
    x = jnp.ones((2, 64), x_dtype)
    with pytest.raises(ValueError, match="x must be floating point"):
        wj.linear.quantized_matmul(x, w, out_dtype=out_dtype)
    if out_dtype is not None:
        with pytest.raises(ValueError, match="out_dtype=int.* must be a floating dtype"):
            wj.linear.quantized_matmul(jnp.ones((2, 64), jnp.float32), w, out_dtype=out_dtype)


@SETTINGS
@hypothesis.given(
    value=NOT_INTS.filter(lambda v: v is not None), name=st.sampled_from(("bits", "group_size"))
)
def test_quantize_experts_refuses_non_integers(value, name):
    """None is the default (4 bits, group 128); any other non-integer is refused."""
    w = np.random.default_rng(2).standard_normal((1, 8, 64)).astype(np.float32)
    with pytest.raises(TypeError, match=f"{name}=.* must be an int"):
        wj.quantize_experts(w, **({"bits": 4, "group_size": 32} | {name: value}))


@SETTINGS
@hypothesis.given(
    value=NOT_INTS, name=st.sampled_from(("num_experts", "num_shards", "shard_index"))
)
def test_expert_map_for_shard_refuses_non_integers(value, name):
    kwargs = dict(num_experts=8, num_shards=2, shard_index=1) | {name: value}
    with pytest.raises(TypeError, match=f"{name}=.* must be an int"):
        wj.sharding.expert_map_for_shard(**kwargs)


@SETTINGS
@hypothesis.given(value=NOT_INTS, which=st.sampled_from(("interleave", "tensor_shard")))
def test_tensor_parallel_helpers_refuse_non_integer_shard_counts(value, which):
    w13 = wj.random_quantized_experts(np.random.default_rng(4), (2, 128, 64), group_size=32)
    with pytest.raises(TypeError, match="num_shards=.* must be an int"):
        if which == "interleave":
            wj.sharding.tp_interleave_w13(w13, value)
        else:
            wj.sharding.tensor_shard(w13, value, "n")


@SETTINGS
@hypothesis.given(value=st.one_of(NOT_INTS, st.integers(max_value=0)), at=st.integers(0, 2))
def test_random_experts_refuse_bad_shapes(value, at):
    shape = [2, 64, 64]
    shape[at] = value
    error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
    with pytest.raises(error, match=re.escape(f"shape[{at}]=")):
        wj.random_quantized_experts(np.random.default_rng(0), tuple(shape), group_size=32)


@SETTINGS
@hypothesis.given(data=st.data(), dtype=st.sampled_from(INT_DTYPES))
def test_local_expert_ids_drop_wide_ids(data, dtype):
    ids = data.draw(_ids(dtype))
    got = wj.sharding.local_expert_ids(ids, E, None)
    np.testing.assert_array_equal(got, _dropped(ids, E))


# ---- the model config ------------------------------------------------------------------------

BAD_FLOATS = st.one_of(
    st.sampled_from((math.nan, math.inf, -math.inf, 0.0)), st.floats(max_value=0.0)
)


@SETTINGS
@hypothesis.given(name=st.sampled_from(sorted(_INT_MINIMUM)), below=st.integers(1, 2**40))
def test_config_counts_below_their_least_value_are_refused(name, below):
    value = _INT_MINIMUM[name] - below
    with pytest.raises(ValueError, match=rf"{name}={value} must be >= {_INT_MINIMUM[name]}"):
        DeepseekV3Config.tiny(**{name: value})


@SETTINGS
@hypothesis.given(name=st.sampled_from(_POSITIVE_FLOATS), value=BAD_FLOATS)
def test_config_floats_must_be_finite_and_positive(name, value):
    with pytest.raises(ValueError, match=re.escape(f"{name}={value} must be a finite number")):
        DeepseekV3Config.from_hf_dict(DeepseekV3Config.tiny().to_hf_dict() | {name: value})


@SETTINGS
@hypothesis.given(
    name=st.sampled_from(("bos_token_id", "pad_token_id", "eos_token_id")),
    value=st.one_of(st.integers(max_value=-1), st.integers(512, 2**40)),
)
def test_config_token_ids_lie_in_the_vocabulary(name, value):
    shown = f"{name}[0]" if name == "eos_token_id" else name
    with pytest.raises(ValueError, match=re.escape(f"{shown}={value} is not a token id")):
        DeepseekV3Config.from_hf_dict(DeepseekV3Config.tiny().to_hf_dict() | {name: value})


@SETTINGS
@hypothesis.given(
    field=st.sampled_from(("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")),
    value=st.sampled_from((math.nan, math.inf, -math.inf)),
)
def test_config_yarn_settings_are_finite(field, value):
    rope = DeepseekV3Config.tiny().rope_scaling.to_hf_dict() | {field: value}
    hf = DeepseekV3Config.tiny().to_hf_dict() | {"rope_scaling": rope}
    with pytest.raises(ValueError, match=re.escape(f"rope_scaling.{field}={value} must be")):
        DeepseekV3Config.from_hf_dict(hf)


@SETTINGS
@hypothesis.given(top_k=st.integers(17, 2**20))
def test_config_top_k_past_the_experts_is_refused(top_k):
    with pytest.raises(ValueError, match=f"num_experts_per_tok={top_k} exceeds n_routed_exp"):
        DeepseekV3Config.tiny(num_experts_per_tok=top_k)


@SETTINGS
@hypothesis.given(
    name=st.sampled_from(sorted(qwen_config._INT_MINIMUM)),
    below=st.integers(1, 2**40),
    float_name=st.sampled_from(qwen_config._POSITIVE_FLOATS),
    bad_float=BAD_FLOATS,
)
def test_qwen_config_fields_out_of_range_are_refused(name, below, float_name, bad_float):
    value = qwen_config._INT_MINIMUM[name] - below
    with pytest.raises(ValueError, match=re.escape(f"{name}={value} must be >= ")):
        QwenMoeConfig.tiny(**{name: value})
    with pytest.raises(ValueError, match=re.escape(f"{float_name}={bad_float} must be a finite")):
        QwenMoeConfig.tiny(**{float_name: bad_float})


def test_config_collects_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        DeepseekV3Config.tiny(num_hidden_layers=-2, rms_norm_eps=math.nan, vocab_size=0)
    for part in ("num_hidden_layers=-2", "rms_norm_eps=nan", "vocab_size=0"):
        assert part in str(err.value)


# ---- the known cases, by name ----------------------------------------------------------------


def test_int64_id_2_pow_32_does_not_route_to_expert_0(layer):
    ids = np.array([[2**32, 1]] * T, np.int64)
    np.testing.assert_array_equal(_moe(layer, ids), _moe(layer, np.array([[-1, 1]] * T, np.int32)))
    assert np.any(_moe(layer, ids) != _moe(layer, np.array([[0, 1]] * T, np.int32)))


def test_expert_map_entry_past_the_local_experts_is_an_error_not_a_clamp(layer):
    with pytest.raises(ValueError, match=r"expert_map\[3\]=4 is outside \[-1, 4\)"):
        _moe(layer, np.zeros((T, K), np.int32), expert_map=np.array([0, 1, 2, 4], np.int32))


def test_quantized_matmul_with_integer_x_is_refused():
    w = wj.random_quantized_experts(np.random.default_rng(3), (1, 64, 64), bits=4, group_size=32)
    with pytest.raises(ValueError, match="x must be floating point .* got int32"):
        wj.linear.quantized_matmul(jnp.arange(128, dtype=jnp.int32).reshape(2, 64), w)


def test_a_python_list_as_x_is_refused(layer):
    _, w13, w2, weights = layer
    with pytest.raises(TypeError, match=r"x must be an array .* got list; convert it"):
        wj.fused_moe([[0.5] * H] * T, w13, w2, weights, np.zeros((T, K), np.int32))


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("num_hidden_layers", -1, "num_hidden_layers=-1 must be >= 1"),
        ("rms_norm_eps", math.nan, "rms_norm_eps=nan must be a finite number > 0"),
        ("routed_scaling_factor", math.inf, "routed_scaling_factor=inf must be a finite"),
        ("num_experts_per_tok", 0, "num_experts_per_tok=0 must be >= 1"),
        ("eos_token_id", 2.7, "eos_token_id=2.7 must be an integer or a list of integers"),
    ],
)
def test_config_json_out_of_range_values(tmp_path, field, value, says):
    """The file is named along with the field and value (json writes NaN and Infinity)."""
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(DeepseekV3Config.tiny().to_hf_dict() | {field: value}))
    with pytest.raises(ValueError) as err:
        DeepseekV3Config.from_json(path)
    assert str(path) in str(err.value) and says in str(err.value), str(err.value)
