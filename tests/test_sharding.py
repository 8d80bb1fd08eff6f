"""Tests of wna16_jax.sharding: expert maps, weight placement, EP / TP / EP x TP fused_moe.

How the 8-device tests run: they need 8 JAX devices, and on CPU that takes
XLA_FLAGS=--xla_force_host_platform_device_count=8 set before JAX starts its backend. In a full
pytest run other test files start it first (with one device), so this file cannot set the flag
itself. Instead every test that needs devices takes the `devices8` fixture, which skips it when
fewer than 8 are present, and `test_run_this_file_with_8_cpu_devices` then runs this same file
in a fresh `python -m pytest` subprocess with the flag set (JAX_PLATFORMS=cpu), failing with the
subprocess's output when any test there fails. With 8 devices already (the flag set by the
caller, or an 8-GPU host) the tests run in-process and that test skips itself.

Sharded results are compared with the unsharded 'xla' result on the same weights (f32
activations, so only the summation order differs) and with the float64 numpy oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import wna16_jax as wj
from wna16_jax import sharding as sh

NUM_DEVICES = 8

H, I, E, K_TOP = 64, 32, 8, 3


@pytest.fixture
def devices8():
    """The 8 devices, or a skip (the test below then re-runs this file with 8 CPU devices)."""
    return helpers.require_devices(NUM_DEVICES)


def test_run_this_file_with_8_cpu_devices():
    print(helpers.run_file_with_cpu_devices(__file__, NUM_DEVICES)[-3000:])


# ---- layouts --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """One mesh and weight format: mesh axes ("e" experts, "t" tensor) and (bits, G, zeros)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    bits: int
    group_size: int
    has_zp: bool

    @property
    def expert_axis(self):
        return "e" if "e" in self.axes else None

    @property
    def tensor_axis(self):
        return "t" if "t" in self.axes else None


# I = 32 and G = 16 let TP 2 split w2's K into whole words and groups; formats vary by layout.
LAYOUTS = {
    "ep2": Layout((2,), ("e",), bits=4, group_size=16, has_zp=True),
    "ep4": Layout((4,), ("e",), bits=8, group_size=16, has_zp=False),
    "ep8": Layout((8,), ("e",), bits=4, group_size=16, has_zp=False),
    "tp2": Layout((2,), ("t",), bits=8, group_size=16, has_zp=True),
    "ep2xtp2": Layout((2, 2), ("e", "t"), bits=4, group_size=16, has_zp=True),
    # group_size=-1: w2's per-row scales and zeros stay replicated over "t".
    "ep4xtp2": Layout((4, 2), ("e", "t"), bits=4, group_size=-1, has_zp=True),
}


def make_mesh(layout: Layout, devices, axis_type=AxisType.Explicit):
    n = int(np.prod(layout.shape))
    return jax.make_mesh(
        layout.shape, layout.axes, axis_types=(axis_type,) * len(layout.axes), devices=devices[:n]
    )


def make_problem(rng, layout: Layout, T: int, dtype=jnp.float32, h=H, i=I):
    """(x, w13, w2, topk_weights, topk_ids) with some ids out of range (dropped)."""
    x, w13, w2, wts, ids = helpers.random_moe_inputs(
        rng,
        T=T,
        H=h,
        I=i,
        E=E,
        k=K_TOP,
        bits=layout.bits,
        group_size=layout.group_size,
        has_zp=layout.has_zp,
        dtype=dtype,
    )
    ids = np.array(ids)
    bad = rng.random(ids.shape) < 0.1
    ids[bad] = rng.choice([-1, -7, E, E + 5], size=int(bad.sum()))
    return x, w13, w2, wts, jnp.asarray(ids)


def place(layout: Layout, mesh, w13, w2):
    if layout.tensor_axis is None:
        return sh.shard_experts(w13, mesh, "e"), sh.shard_experts(w2, mesh, "e")
    ea = layout.expert_axis
    return (
        sh.shard_w13_for_tp(w13, mesh, "t", expert_axis=ea),
        sh.shard_w2_for_tp(w2, mesh, "t", expert_axis=ea),
    )


def sharded_fn(layout: Layout, mesh, **kwargs):
    """jax.jit of the EP (or, without an expert axis, TP) entry point for this layout."""
    if layout.expert_axis is None:
        f = functools.partial(sh.fused_moe_tp, mesh=mesh, tensor_axis="t", **kwargs)
    else:
        f = functools.partial(
            sh.fused_moe_ep, mesh=mesh, expert_axis="e", tensor_axis=layout.tensor_axis, **kwargs
        )
    return jax.jit(f)


@functools.cache
def _unsharded(implementation):
    return jax.jit(functools.partial(wj.fused_moe, implementation=implementation))


def check_against_unsharded(out, x, w13, w2, wts, ids):
    ref = _unsharded("xla")(x, w13, w2, wts, ids)
    helpers.assert_close(out, ref, x.dtype, "sharded vs unsharded xla")
    oracle = helpers.numpy_fused_moe(
        x, helpers.numpy_dequantize(w13), helpers.numpy_dequantize(w2), wts, ids
    )
    helpers.assert_close(out, oracle, x.dtype, "sharded vs float64 oracle")


# ---- expert maps (no devices needed) --------------------------------------------------------


@pytest.mark.parametrize("num_experts,num_shards", [(8, 1), (8, 2), (8, 8), (256, 8), (6, 3)])
def test_expert_map_for_shard(num_experts, num_shards):
    per = num_experts // num_shards
    owners = np.zeros(num_experts, np.int64)
    for s in range(num_shards):
        m = sh.expert_map_for_shard(num_experts, num_shards, s)
        assert m.dtype == np.int32 and m.shape == (num_experts,)
        want = np.full(num_experts, -1, np.int32)
        want[s * per : (s + 1) * per] = np.arange(per)
        np.testing.assert_array_equal(m, want)
        owners += m >= 0
    np.testing.assert_array_equal(owners, 1)  # every expert lives on exactly one shard


@pytest.mark.parametrize(
    "args,match",
    [
        ((10, 4, 0), "num_experts=10 is not divisible by num_shards=4"),
        ((8, 0, 0), "num_shards=0 must be positive"),
        ((8, 4, 4), r"shard_index=4 is not in \[0, num_shards=4\)"),
        ((8, 4, -1), r"shard_index=-1 is not in"),
    ],
)
def test_expert_map_for_shard_errors(args, match):
    with pytest.raises(ValueError, match=match):
        sh.expert_map_for_shard(*args)


def test_expert_map_for_axis_matches_per_shard_maps(devices8):
    mesh = jax.make_mesh((8,), ("e",), devices=devices8)
    f = jax.shard_map(
        lambda: sh.expert_map_for_axis(256, "e")[None], mesh=mesh, in_specs=(), out_specs=P("e")
    )
    got = np.asarray(jax.jit(f)())
    want = np.stack([sh.expert_map_for_shard(256, 8, s) for s in range(8)])
    np.testing.assert_array_equal(got, want)


# ---- tensor-parallel row order (no devices needed) ------------------------------------------


@pytest.mark.parametrize("bits,has_zp", [(4, True), (8, True), (4, False)])
@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_tp_interleave_w13(rng, bits, has_zp, num_shards):
    i = 32
    w13 = helpers.random_quantized_experts(rng, 3, 2 * i, H, bits, 16, has_zp, jnp.float32)
    inter = sh.tp_interleave_w13(w13, num_shards)
    deq = helpers.numpy_dequantize(w13)
    deq_inter = helpers.numpy_dequantize(inter)
    r = i // num_shards
    for s in range(num_shards):
        block = deq_inter[:, 2 * r * s : 2 * r * (s + 1)]
        gate = deq[:, r * s : r * (s + 1)]
        up = deq[:, i + r * s : i + r * (s + 1)]
        np.testing.assert_array_equal(block, np.concatenate([gate, up], axis=1), f"shard {s}")
    back = sh.tp_deinterleave_w13(inter, num_shards)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w13), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Host (numpy) arrays are reordered on the host, to the same values.
    host = sh.tp_interleave_w13(jax.tree.map(np.asarray, w13), num_shards)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(host))
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(inter), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_interleave_w13_rows_of_float_weights(rng, num_shards):
    """Float w13 [E, 2I, H] (the model's unquantized experts): shard s's block of rows is
    [gate_s; up_s], on numpy and jax alike, and the inverse restores [gate; up]."""
    i = 8
    w13 = rng.standard_normal((3, 2 * i, 5)).astype(np.float32)
    inter = sh.interleave_w13_rows(w13, num_shards)
    r = i // num_shards
    for s in range(num_shards):
        want = np.concatenate([w13[:, r * s : r * (s + 1)], w13[:, i + r * s : i + r * (s + 1)]], 1)
        np.testing.assert_array_equal(inter[:, 2 * r * s : 2 * r * (s + 1)], want, f"shard {s}")
    np.testing.assert_array_equal(sh.interleave_w13_rows(inter, num_shards, inverse=True), w13)
    np.testing.assert_array_equal(
        np.asarray(sh.interleave_w13_rows(jnp.asarray(w13), num_shards)), inter
    )


def test_tp_interleave_rejects_bad_split(rng):
    w13 = helpers.random_quantized_experts(rng, 2, 2 * 12, H, 4, 16, True, jnp.float32)
    with pytest.raises(ValueError, match=r"I=12 \(N=24\) is not divisible by the 8 tensor"):
        sh.tp_interleave_w13(w13, 8)
    with pytest.raises(ValueError, match="I/n = 3 is odd"):
        sh.tp_interleave_w13(w13, 4)


# ---- placement ------------------------------------------------------------------------------


def test_shard_experts_specs(rng, devices8):
    mesh = jax.make_mesh((4, 2), ("e", "t"), devices=devices8)
    w = helpers.random_quantized_experts(rng, E, 64, H, 4, 16, True, jnp.float32)
    for src in (w, jax.tree.map(np.asarray, w)):
        placed = sh.shard_experts(src, mesh, "e")
        for name in ("qweight", "scales", "zeros"):
            arr = getattr(placed, name)
            assert arr.sharding.spec == P("e", None, None), name
            assert arr.addressable_shards[0].data.shape[0] == E // 4, name
            np.testing.assert_array_equal(np.asarray(arr), np.asarray(getattr(w, name)))


@pytest.mark.parametrize("group_size", [16, -1])
def test_tp_placement_specs(rng, devices8, group_size):
    mesh = jax.make_mesh((4, 2), ("e", "t"), devices=devices8)
    w13 = helpers.random_quantized_experts(rng, E, 2 * I, H, 4, group_size, True, jnp.float32)
    w2 = helpers.random_quantized_experts(rng, E, H, I, 4, group_size, True, jnp.float32)
    g_spec = None if group_size == -1 else "t"
    want13 = P("e", "t", None)
    placed13 = {
        "jax": sh.shard_w13_for_tp(w13, mesh, "t", expert_axis="e"),
        "numpy": sh.shard_w13_for_tp(jax.tree.map(np.asarray, w13), mesh, "t", expert_axis="e"),
    }
    inter = sh.tp_interleave_w13(w13, 2)
    for src, p13 in placed13.items():
        for name in ("qweight", "scales", "zeros"):
            assert getattr(p13, name).sharding.spec == want13, (src, name)
            np.testing.assert_array_equal(
                np.asarray(getattr(p13, name)), np.asarray(getattr(inter, name)), (src, name)
            )
    p2 = sh.shard_w2_for_tp(w2, mesh, "t", expert_axis="e")
    assert p2.qweight.sharding.spec == P("e", None, "t")
    assert p2.scales.sharding.spec == P("e", None, g_spec)
    assert p2.zeros.sharding.spec == P("e", None, g_spec)
    # A shard of the second half of I holds E/4 experts and I/2 of the K columns.
    shard = next(s for s in p2.qweight.addressable_shards if s.index[2].start)
    assert shard.data.shape == (E // 4, H, I // 8 // 2)


def test_random_sharded_experts(devices8):
    mesh = jax.make_mesh((4, 2), ("e", "t"), devices=devices8)
    kwargs = dict(bits=4, group_size=32, has_zeros=True, dtype=jnp.bfloat16)
    key = jax.random.key(7)
    got = sh.random_sharded_experts(
        key, 8, 16, 64, mesh=mesh, expert_axis="e", n_axis="t", **kwargs
    )
    got.validate("random")
    for name in ("qweight", "scales", "zeros"):
        arr = getattr(got, name)
        assert arr.sharding.spec == P("e", "t", None), name
        # Every device holds only its slice.
        assert arr.addressable_shards[0].data.shape[:2] == (2, arr.shape[1] // 2), name
    # Partitioned generation: the shards hold different bits, not copies of one slice.
    words = [np.asarray(s.data) for s in got.qweight.addressable_shards]
    assert all(words[0].shape == w.shape for w in words)
    assert len({w.tobytes() for w in words}) == len(words)
    assert float(np.std(np.concatenate(words).astype(np.float64))) > 1e8  # not constant
    # The values are those of the unsharded generator with the same key.
    want = wj.random_quantized_experts(key, (8, 16, 64), **kwargs)
    for name in ("qweight", "scales", "zeros"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        )


# ---- sharded fused_moe equals unsharded -----------------------------------------------------

# Every layout at T = 13 (not a multiple of the shards); T = 1 and 64 on the two widest.
CASES = [(name, 13) for name in LAYOUTS] + [
    (name, t) for name in ("ep8", "ep4xtp2") for t in (1, 64)
]


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
@pytest.mark.parametrize("layout_name,T", CASES)
def test_sharded_matches_unsharded(rng, devices8, layout_name, T, mode):
    layout = LAYOUTS[layout_name]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, T)
    w13s, w2s = place(layout, mesh, w13, w2)
    out = sharded_fn(layout, mesh, mode=mode, implementation="xla")(x, w13s, w2s, wts, ids)
    check_against_unsharded(out, x, w13, w2, wts, ids)
    token_axis = layout.expert_axis or layout.tensor_axis
    n_tok = mesh.shape[token_axis]
    sharded_out = mode == "all_to_all" and T % n_tok == 0
    assert out.sharding.spec == (P(token_axis, None) if sharded_out else P(None, None))


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_mxfp4_experts_sharded(rng, devices8, mode):
    """MXFP4 experts (codes "e2m1", which the weights' specs carry) over 4 expert shards equal
    the unsharded layer and the float64 one."""
    layout = LAYOUTS["ep4"]
    mesh = make_mesh(layout, devices8)
    x, _, _, wts, ids = make_problem(rng, layout, 13)
    w13 = wj.random_quantized_experts(rng, (E, 2 * I, H), scheme="mxfp4")
    w2 = wj.random_quantized_experts(rng, (E, H, I), scheme="mxfp4")
    assert sh.expert_specs(w13, expert_axis="e").codes == "e2m1"
    w13s, w2s = place(layout, mesh, w13, w2)
    out = sharded_fn(layout, mesh, mode=mode, implementation="xla")(x, w13s, w2s, wts, ids)
    check_against_unsharded(out, x, w13, w2, wts, ids)


@pytest.mark.parametrize("layout_name", ["ep2", "ep2xtp2"])
def test_act_order_w13(rng, devices8, layout_name):
    """w13 with an input permutation (act-order): perm [E, H] is split on E only (a tensor
    shard holds every input), and the sharded layer equals the unsharded one. w2's cannot be
    split on K."""
    layout = LAYOUTS[layout_name]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 13)
    w13 = helpers.with_random_perm(rng, w13)
    w13s, w2s = place(layout, mesh, w13, w2)
    assert w13s.perm.sharding.spec == P("e", None)
    out = sharded_fn(layout, mesh, mode="replicated", implementation="xla")(x, w13s, w2s, wts, ids)
    check_against_unsharded(out, x, w13, w2, wts, ids)
    if layout.tensor_axis is not None:
        with pytest.raises(ValueError, match="K cannot be split over k_axis='t'"):
            sh.shard_w2_for_tp(helpers.with_random_perm(rng, w2), mesh, "t", expert_axis="e")


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
@pytest.mark.parametrize(
    "shape,axes", [((2, 2), ("d", "e")), ((2, 2, 2), ("d", "e", "t")), ((2,), ("d",))]
)
def test_data_axis_splits_the_tokens(rng, devices8, shape, axes, mode):
    """A data axis splits the tokens first (T = 13 is padded to a whole number per shard), the
    experts split over "e" / "t" or, without them, whole on every device: the unsharded layer."""
    layout = Layout(shape, axes, bits=4, group_size=16, has_zp=True)
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 13)
    ea, ta = layout.expert_axis, layout.tensor_axis
    w13s, w2s = (w13, w2) if ea is None and ta is None else place(layout, mesh, w13, w2)
    f = jax.jit(
        functools.partial(
            sh.fused_moe_ep, mesh=mesh, expert_axis=ea, tensor_axis=ta, data_axis="d", mode=mode
        )
    )
    check_against_unsharded(f(x, w13s, w2s, wts, ids), x, w13, w2, wts, ids)
    with pytest.raises(ValueError, match="the mesh axes must differ"):
        sh.fused_moe_ep(x, w13s, w2s, wts, ids, mesh=mesh, expert_axis="d", data_axis="d")


@pytest.mark.parametrize("layout_name,T", [("ep8", 13), ("ep8", 64), ("ep2xtp2", 13)])
def test_ragged_dispatch_matches_unsharded(rng, devices8, monkeypatch, layout_name, T):
    """The ragged dispatch logic, with the exchange emulated (XLA:CPU has no ragged-all-to-all)."""
    monkeypatch.setattr(sh, "_ragged_all_to_all", sh.emulated_ragged_all_to_all)
    layout = LAYOUTS[layout_name]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, T)
    w13s, w2s = place(layout, mesh, w13, w2)
    f = sharded_fn(layout, mesh, mode="all_to_all", dispatch="ragged", implementation="xla")
    check_against_unsharded(f(x, w13s, w2s, wts, ids), x, w13, w2, wts, ids)


def test_ragged_dispatch_is_refused_on_cpu(rng, devices8):
    layout = LAYOUTS["ep8"]
    mesh = make_mesh(layout, devices8)
    if mesh.devices.flat[0].platform != "cpu":
        pytest.skip("the real ragged_all_to_all runs on this platform")
    x, w13, w2, wts, ids = make_problem(rng, layout, 8)
    w13s, w2s = place(layout, mesh, w13, w2)
    with pytest.raises(NotImplementedError, match="XLA:CPU does not implement"):
        sh.fused_moe_ep(
            x, w13s, w2s, wts, ids, mesh=mesh, expert_axis="e", mode="all_to_all", dispatch="ragged"
        )


def test_ragged_dispatch_lowers_with_the_real_collective(rng, devices8):
    """The real jax.lax.ragged_all_to_all type-checks and lowers (XLA:CPU cannot compile it)."""
    layout = LAYOUTS["ep8"]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 16)
    w13s, w2s = place(layout, mesh, w13, w2)
    body = functools.partial(
        sh.fused_moe_local_shard,
        num_experts=E,
        expert_axis="e",
        mode="all_to_all",
        dispatch="ragged",
        implementation="xla",
    )
    specs = (P("e"), sh.expert_specs(w13, expert_axis="e"), sh.expert_specs(w2, expert_axis="e"))
    f = jax.shard_map(
        body, mesh=mesh, in_specs=specs + (P("e"), P("e")), out_specs=P("e"), check_vma=False
    )
    args = [jax.device_put(a, NamedSharding(mesh, P("e"))) for a in (x, wts, ids)]
    text = jax.jit(f).lower(args[0], w13s, w2s, args[1], args[2]).as_text()
    assert text.count("ragged_all_to_all") >= 3, "dispatch x, dispatch routing, return y"


def test_pallas_interpret_ep_x_tp(rng, devices8):
    """The Pallas kernels (interpreted) per shard: EP 2 x TP 2 (H, I/n multiples of 128)."""
    layout = Layout((2, 2), ("e", "t"), bits=4, group_size=128, has_zp=True)
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 5, h=128, i=256)
    w13s, w2s = place(layout, mesh, w13, w2)
    f = sharded_fn(layout, mesh, mode="replicated", implementation="pallas_interpret")
    check_against_unsharded(f(x, w13s, w2s, wts, ids), x, w13, w2, wts, ids)


# W8A8 (int8 activations) needs int8 per-channel symmetric weights on the kernels; I = 64 keeps
# the TP 2 slice (32) a whole int8 k-tile of the Pallas W8A8 GEMM.
W8A8_LAYOUTS = {
    "ep4": Layout((4,), ("e",), bits=8, group_size=-1, has_zp=False),
    "ep2xtp2": Layout((2, 2), ("e", "t"), bits=8, group_size=-1, has_zp=False),
}
STATIC = wj.ActivationQuant("int8_static", gemm1_scale=0.03, gemm2_scale=0.002)


@pytest.mark.parametrize(
    "layout_name,aq,implementation",
    [
        ("ep4", "int8_per_token", "xla"),
        ("ep4", "int8_per_token", "pallas_interpret"),
        ("ep4", STATIC, "xla"),
        ("ep2xtp2", STATIC, "xla"),
    ],
    ids=["ep4-token-xla", "ep4-token-pallas", "ep4-static-xla", "ep2xtp2-static-xla"],
)
def test_activation_quant_reaches_every_shard(rng, devices8, layout_name, aq, implementation):
    """activation_quant is forwarded to each shard's fused_moe: the sharded W8A8 layer equals
    the unsharded one (the same int8 rows on every shard: per token, the rows of x are whole on
    each shard; static scales are one value), and differs from the W8A16 layer."""
    layout = W8A8_LAYOUTS[layout_name]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 13, h=128, i=64)
    w13s, w2s = place(layout, mesh, w13, w2)
    f = sharded_fn(
        layout, mesh, mode="replicated", implementation=implementation, activation_quant=aq
    )
    out = f(x, w13s, w2s, wts, ids)
    want = wj.fused_moe(x, w13, w2, wts, ids, implementation="xla", activation_quant=aq)
    helpers.assert_close(out, want, x.dtype, "sharded W8A8 vs unsharded W8A8 xla")
    w8a16 = wj.fused_moe(x, w13, w2, wts, ids, implementation="xla")
    assert helpers.relative_error(out, w8a16) > 1e-4  # the activations were quantized


def test_tensor_parallel_per_token_scales_per_shard(rng, devices8):
    """Under a tensor axis "int8_per_token" quantizes GEMM2's rows with each shard's own maximum
    (over its I/n slice): not the unsharded layer's rounding, but W8A8 all the same (as close
    to the unsharded W8A8 layer as W8A8 is to W8A16)."""
    layout = W8A8_LAYOUTS["ep2xtp2"]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 13, h=128, i=64)
    w13s, w2s = place(layout, mesh, w13, w2)
    f = sharded_fn(
        layout, mesh, mode="replicated", implementation="xla", activation_quant="int8_per_token"
    )
    out = f(x, w13s, w2s, wts, ids)
    want = wj.fused_moe(
        x, w13, w2, wts, ids, implementation="xla", activation_quant="int8_per_token"
    )
    w8a16 = wj.fused_moe(x, w13, w2, wts, ids, implementation="xla")
    rel, quant_error = helpers.relative_error(out, want), helpers.relative_error(want, w8a16)
    assert rel < quant_error, (rel, quant_error)


def test_sharded_activation_quant_is_validated(rng, devices8):
    layout = W8A8_LAYOUTS["ep4"]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 4, h=128, i=64)
    w13s, w2s = place(layout, mesh, w13, w2)
    with pytest.raises(ValueError, match="needs both gemm1_scale and gemm2_scale"):
        sh.fused_moe_ep(
            x,
            w13s,
            w2s,
            wts,
            ids,
            mesh=mesh,
            expert_axis="e",
            activation_quant=wj.ActivationQuant("int8_static"),
        )


def test_bf16_ep(rng, devices8):
    """bf16: the shards' f32 partial outputs are summed, then rounded once to bf16."""
    layout = LAYOUTS["ep4"]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 16, dtype=jnp.bfloat16)
    w13s, w2s = place(layout, mesh, w13, w2)
    out = sharded_fn(layout, mesh, mode="all_to_all", implementation="xla")(x, w13s, w2s, wts, ids)
    assert out.dtype == jnp.bfloat16
    check_against_unsharded(out, x, w13, w2, wts, ids)


def test_auto_mesh_axes(rng, devices8):
    """Meshes with Auto axes (shard_map reshards the inputs itself) give the same result."""
    layout = LAYOUTS["ep2xtp2"]
    mesh = make_mesh(layout, devices8, axis_type=AxisType.Auto)
    x, w13, w2, wts, ids = make_problem(rng, layout, 13)
    w13s, w2s = place(layout, mesh, w13, w2)
    out = sharded_fn(layout, mesh, mode="all_to_all", implementation="xla")(x, w13s, w2s, wts, ids)
    check_against_unsharded(out, x, w13, w2, wts, ids)


def test_auto_mode_threshold_and_log(rng, devices8, caplog, monkeypatch):
    monkeypatch.setattr(sh, "_logged", set())
    layout = LAYOUTS["ep8"]
    mesh = make_mesh(layout, devices8)
    _, w13, w2, _, _ = make_problem(rng, layout, 1)
    w13s, w2s = place(layout, mesh, w13, w2)
    f = sharded_fn(layout, mesh, mode="auto", token_threshold=16, implementation="xla")
    with caplog.at_level(logging.INFO, logger="wna16_jax"):
        for T, want in ((13, "replicated"), (32, "all_to_all")):
            x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
            wts, ids = map(jnp.asarray, helpers.random_routing(rng, T, K_TOP, E))
            out = f(x, w13s, w2s, wts, ids)
            check_against_unsharded(out, x, w13, w2, wts, ids)
            token_sharded = out.sharding.spec == P("e", None)
            assert token_sharded == (want == "all_to_all"), (T, out.sharding)
        # Another all_to_all size: traced (the choice is made at trace time), not logged again.
        x = jnp.zeros((40, H), jnp.float32)
        f.lower(x, w13s, w2s, jnp.ones((40, K_TOP)), jnp.zeros((40, K_TOP), jnp.int32))
    lines = [r.getMessage() for r in caplog.records if "sharded fused_moe" in r.getMessage()]
    assert lines == [
        "wna16_jax: sharded fused_moe uses mode='replicated' (T=13, token_threshold=16)",
        "wna16_jax: sharded fused_moe uses mode='all_to_all' (T=32, token_threshold=16)",
    ]  # once per choice


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_local_shard_body_in_user_shard_map(rng, devices8, mode):
    """fused_moe_local_shard inside the caller's own shard_map (EP 4 x TP 2)."""
    layout = LAYOUTS["ep4xtp2"]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 16)
    w13s, w2s = place(layout, mesh, w13, w2)
    tok = P("e") if mode == "all_to_all" else P()
    body = functools.partial(
        sh.fused_moe_local_shard,
        num_experts=E,
        expert_axis="e",
        tensor_axis="t",
        mode=mode,
        implementation="xla",
    )
    specs = (
        tok,
        sh.expert_specs(w13, expert_axis="e", n_axis="t"),
        sh.expert_specs(w2, expert_axis="e", k_axis="t"),
        tok,
        tok,
    )
    # check_vma=False: the backends' loops do not yet annotate varying values.
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=tok, check_vma=False))
    args = [jax.device_put(a, NamedSharding(mesh, tok)) for a in (x, wts, ids)]
    out = f(args[0], w13s, w2s, args[1], args[2])
    check_against_unsharded(out, x, w13, w2, wts, ids)


# ---- no expert weight moves -----------------------------------------------------------------

COLLECTIVE = re.compile(
    r"=\s*(\w+)\[([\d,]*)\]\S*\s+"
    r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all)"
    r"(?:-start)?\("
)


@pytest.mark.parametrize(
    "layout_name,mode,dispatch",
    [
        ("ep8", "replicated", None),
        ("ep8", "all_to_all", "all_gather"),
        ("ep8", "all_to_all", "ragged"),
        ("tp2", "all_to_all", None),
        ("ep4xtp2", "replicated", None),
        ("ep4xtp2", "all_to_all", "all_gather"),
    ],
)
def test_no_weight_collectives_in_hlo(rng, devices8, monkeypatch, layout_name, mode, dispatch):
    monkeypatch.setattr(sh, "_ragged_all_to_all", sh.emulated_ragged_all_to_all)
    layout = LAYOUTS[layout_name]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 16)
    w13s, w2s = place(layout, mesh, w13, w2)
    kwargs = dict(mode=mode, implementation="xla")
    if dispatch is not None:
        kwargs["dispatch"] = dispatch
    hlo = sharded_fn(layout, mesh, **kwargs).lower(x, w13s, w2s, wts, ids).compile().as_text()
    collectives = COLLECTIVE.findall(hlo)
    assert collectives, "no collective at all: the partial outputs were never combined"
    weight_shapes = set()
    for w in (w13s, w2s):
        for arr in jax.tree.leaves(w):
            weight_shapes.add(tuple(arr.shape))
            weight_shapes.add(tuple(arr.addressable_shards[0].data.shape))
    for dtype, dims, op in collectives:
        shape = tuple(int(d) for d in dims.split(",") if d)
        assert dtype not in ("u32", "u8"), f"{op} moves packed weights or zeros: {dtype}{shape}"
        assert shape not in weight_shapes, f"{op} of a weight-shaped array {dtype}{shape}"
    ops = {op for _, _, op in collectives}
    if mode == "replicated":
        assert "all-reduce" in ops, ops
    else:
        assert "all-gather" in ops, ops  # tokens (or, for ragged, the emulated exchange)


# ---- errors ---------------------------------------------------------------------------------


def test_errors(rng, devices8):
    layout = LAYOUTS["ep4"]
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 4)
    # E=8 over 3 shards.
    mesh3 = jax.make_mesh((3,), ("e",), devices=devices8[:3])
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by num_shards=3"):
        sh.shard_experts(w13, mesh3, "e")
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by num_shards=3"):
        sh.fused_moe_ep(x, w13, w2, wts, ids, mesh=mesh3, expert_axis="e")
    with pytest.raises(ValueError, match=r"expert_axis='x' is not an axis of the mesh \{'e': 4\}"):
        sh.fused_moe_ep(x, w13, w2, wts, ids, mesh=mesh, expert_axis="x")
    with pytest.raises(ValueError, match="mode='bad' must be one of"):
        sh.fused_moe_ep(x, w13, w2, wts, ids, mesh=mesh, expert_axis="e", mode="bad")
    with pytest.raises(ValueError, match="dispatch='bad' must be one of"):
        sh.fused_moe_ep(x, w13, w2, wts, ids, mesh=mesh, expert_axis="e", dispatch="bad")
    with pytest.raises(ValueError, match=r"K=60 is not a multiple of 8 \(bits=4\)"):
        sh.random_sharded_experts(jax.random.key(0), 8, 16, 60, mesh=mesh, expert_axis="e")
    with pytest.raises(ValueError, match="w2 shape"):  # the global inputs are validated
        sh.fused_moe_ep(x, w13, w13, wts, ids, mesh=mesh, expert_axis="e")


@pytest.mark.parametrize(
    "bits,group_size,n_t,match",
    [
        # I=32 over 2 shards = 16 per shard, not whole groups of 32.
        (4, 32, 2, r"I/n = 32/2 = 16 is not a multiple of group_size=32"),
        # I=32 over 8 shards = 4 per shard, not whole int4 words of 8.
        (4, -1, 8, r"I/n = 32/8 = 4 is not a multiple of the 8 4-bit values packed"),
        (8, 16, 4, r"I/n = 32/4 = 8 is not a multiple of group_size=16"),
    ],
)
def test_tp_errors(rng, devices8, bits, group_size, n_t, match):
    mesh = jax.make_mesh((n_t,), ("t",), devices=devices8[:n_t])
    layout = Layout((n_t,), ("t",), bits=bits, group_size=group_size, has_zp=True)
    x, w13, w2, wts, ids = make_problem(rng, layout, 4)
    with pytest.raises(ValueError, match=match):
        sh.shard_w2_for_tp(w2, mesh, "t")
    with pytest.raises(ValueError, match=match):
        sh.fused_moe_tp(x, w13, w2, wts, ids, mesh=mesh, tensor_axis="t")


@pytest.mark.parametrize("mode", ["replicated", "all_to_all"])
def test_kernel_layout_ep2(rng, devices8, mode):
    """Expert shards of weights in the mgpu_int4 layout: the shard specs follow the layout
    (per-group arrays are [E, K//G, N]) and each shard's layer is right. The shards run 'xla'
    (which reads the layout by converting back): the Mosaic GPU interpreter fails under
    shard_map on several CPU devices (its shared-memory simulation reports a barrier left
    allocated on device 1), so 'mgpu' itself is checked on one device here and on the GPU."""
    layout = Layout((2,), ("e",), bits=4, group_size=64, has_zp=True)
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 5, dtype=jnp.bfloat16, h=128, i=64)
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    w13s, w2s = sh.shard_experts(to_mgpu(w13), mesh, "e"), sh.shard_experts(to_mgpu(w2), mesh, "e")
    assert w13s.layout == "mgpu_int4"
    assert w13s.scales.sharding.spec == P("e", None, None)
    f = sharded_fn(layout, mesh, mode=mode, implementation="xla")
    check_against_unsharded(f(x, w13s, w2s, wts, ids), x, w13, w2, wts, ids)


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_layout_tensor_shards_hold_whole_tiles(rng, bits):
    """The mgpu_int4 / mgpu_int8 layout's 64x64 tiles cannot be cut: I/n = 32 is refused with
    the way out (shard canonical weights, then convert), in the row interleave and in the TP
    check; the canonical layout takes it."""
    layout = f"mgpu_int{bits}"
    w13 = helpers.random_quantized_experts(rng, 2, 128, 128, bits, 32, True, jnp.bfloat16)
    sh.tp_interleave_w13(w13, 2)  # canonical: I/n = 32 is whole packed words and groups
    tiled = wj.layouts.to_kernel_layout(w13, layout)
    with pytest.raises(ValueError, match=f"32 is not a multiple of 64.*{layout}.*convert each"):
        sh.tp_interleave_w13(tiled, 2)
    w2 = wj.layouts.to_kernel_layout(
        helpers.random_quantized_experts(rng, 2, 128, 64, bits, 32, True, jnp.bfloat16), layout
    )
    with pytest.raises(ValueError, match="w2: I/n = 64/2 = 32 is not a multiple of 64"):
        sh._check_tp(w2.k, 2, w2, "w2")
    # Whole tiles interleave as the canonical rows do.
    w13 = helpers.random_quantized_experts(rng, 2, 256, 128, bits, 64, True, jnp.bfloat16)
    got = sh.tp_interleave_w13(wj.layouts.to_kernel_layout(w13, layout), 2)
    want = wj.layouts.to_kernel_layout(sh.tp_interleave_w13(w13, 2), layout)
    for field in ("qweight", "scales", "zeros"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        )


@pytest.mark.parametrize("layout", ["canonical", "mgpu_int4"])
@pytest.mark.parametrize("group_size", [64, -1])
def test_tensor_shard_is_what_the_first_tensor_shard_holds(rng, devices8, layout, group_size):
    """sh.tensor_shard(w, n, "n" | "k") equals device 0's shard of the tensor-parallel
    placement (w13 after the row interleave; w2 as is), in either layout."""
    mesh = jax.make_mesh((4,), ("t",), devices=devices8[:4])
    w13 = helpers.random_quantized_experts(rng, 2, 512, 128, 4, group_size, True, jnp.bfloat16)
    w2 = helpers.random_quantized_experts(rng, 2, 128, 256, 4, group_size, True, jnp.bfloat16)
    w13, w2 = (wj.layouts.to_kernel_layout(w, layout) for w in (w13, w2))
    for placed, local in (
        (
            sh.shard_w13_for_tp(w13, mesh, "t"),
            sh.tensor_shard(sh.tp_interleave_w13(w13, 4), 4, "n"),
        ),
        (sh.shard_w2_for_tp(w2, mesh, "t"), sh.tensor_shard(w2, 4, "k")),
    ):
        for field in ("qweight", "scales", "zeros"):
            shard = getattr(placed, field).addressable_shards[0]
            assert shard.device == devices8[0]
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(getattr(local, field)))
    assert sh.tensor_shard(w13, 4, "n").shape == (2, 128, 128)
    assert sh.tensor_shard(w2, 4, "k").shape == (2, 128, 64)
    with pytest.raises(ValueError, match="split='x'"):
        sh.tensor_shard(w2, 4, "x")


@pytest.mark.parametrize("shape,axes", [((2,), ("t",)), ((4,), ("t",)), ((2, 2), ("e", "t"))])
def test_kernel_layout_tp(rng, devices8, shape, axes):
    """Tensor-parallel placement of mgpu_int4 weights: w13's rows are interleaved in the layout
    (its per-group arrays hold the rows last), which equals converting the canonical
    interleave; the shard specs follow the layout; the shards' layers ('xla', which reads the
    layout by converting back) sum to the unsharded result."""
    layout = Layout(shape, axes, bits=4, group_size=64, has_zp=True)
    mesh = make_mesh(layout, devices8)
    x, w13, w2, wts, ids = make_problem(rng, layout, 5, dtype=jnp.bfloat16, h=128, i=256)
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    n_t = mesh.shape["t"]
    in_layout = sh.tp_interleave_w13(to_mgpu(w13), n_t)
    converted = to_mgpu(sh.tp_interleave_w13(w13, n_t))
    for field in ("qweight", "scales", "zeros"):
        np.testing.assert_array_equal(
            np.asarray(getattr(in_layout, field)), np.asarray(getattr(converted, field))
        )
    back = sh.tp_deinterleave_w13(in_layout, n_t)
    np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(to_mgpu(w13).scales))
    w13s, w2s = place(layout, mesh, to_mgpu(w13), to_mgpu(w2))
    assert w13s.layout == w2s.layout == "mgpu_int4"
    assert w13s.scales.sharding.spec == P(layout.expert_axis, None, "t")  # [E, K//G, N]
    assert w2s.scales.sharding.spec == P(layout.expert_axis, "t", None)
    f = sharded_fn(layout, mesh, implementation="xla")
    check_against_unsharded(f(x, w13s, w2s, wts, ids), x, w13, w2, wts, ids)


# ---- the quantized linear under a mesh ----------------------------------------------------------


def numpy_linear(x, w) -> np.ndarray:
    wd = helpers.numpy_dequantize(w)[0]  # [N, K] float64
    return np.einsum("...k,nk->...n", np.asarray(x, np.float64), wd)


@pytest.mark.parametrize(
    "implementation, layout, dtype",
    [
        ("xla", "canonical", jnp.float32),
        ("pallas_interpret", "canonical", jnp.float32),
        # The Mosaic GPU GEMM compiled on 8 GPUs (its interpreter did not finish under
        # shard_map on 8 CPU devices).
        pytest.param("mgpu", "mgpu_int4", jnp.bfloat16, marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("split", ["n", "k"])
def test_quantized_matmul_sharded(rng, devices8, implementation, layout, dtype, split):
    """Rows over "d", the weight's N (column parallel) or K (row parallel: partial sums added
    in f32) over "t", each device's kernel on its slices: the float64 product on the same
    weights, the output sharded as asked."""
    mesh = jax.make_mesh((2, 4), ("d", "t"), devices=devices8)
    w = helpers.random_quantized_experts(rng, 1, 512, 512, 4, 64, True, dtype)
    w = wj.layouts.to_kernel_layout(w, layout)
    axes = {"n_axis": "t"} if split == "n" else {"k_axis": "t"}
    placed = jax.device_put(w, sh.named_shardings(mesh, sh.linear_specs(w, **axes)))
    x = jnp.asarray(rng.normal(size=(4, 3, 512)), dtype)
    out = sh.quantized_matmul_sharded(
        x, placed, mesh=mesh, row_axis="d", implementation=implementation, **axes
    )
    assert out.shape == (4, 3, 512) and out.dtype == dtype
    assert out.sharding.spec == P("d", None, "t" if split == "n" else None)
    ref = numpy_linear(x, wj.layouts.to_canonical_layout(w))
    helpers.assert_close(out, ref, dtype, f"{implementation} {split}-sharded linear")


def test_quantized_matmul_sharded_errors(rng, devices8):
    mesh = jax.make_mesh((2, 4), ("d", "t"), devices=devices8)
    w = helpers.random_quantized_experts(rng, 1, 128, 256, 4, 64, True, jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 256)), jnp.float32)
    with pytest.raises(ValueError, match="activation='silu' needs whole sums"):
        sh.quantized_matmul_sharded(x, w, mesh=mesh, k_axis="t", activation="silu")
    with pytest.raises(ValueError, match="n_axis='x' is not an axis of the mesh"):
        sh.quantized_matmul_sharded(x, w, mesh=mesh, n_axis="x")
    with pytest.raises(ValueError, match="the mesh axes must differ"):
        sh.quantized_matmul_sharded(x, w, mesh=mesh, row_axis="t", n_axis="t")
    w128 = helpers.random_quantized_experts(rng, 1, 128, 256, 4, 128, True, jnp.float32)
    with pytest.raises(ValueError, match="K=256 does not split into 4 shards of whole units of"):
        sh.quantized_matmul_sharded(x, w128, mesh=mesh, k_axis="t")
