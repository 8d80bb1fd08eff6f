"""DeepSeek-V3 on a device mesh: sharded == unsharded, placement, no weight collectives, loading.

The mesh tests need 8 JAX devices; on CPU that takes XLA_FLAGS=
--xla_force_host_platform_device_count=8 before JAX starts, which a full pytest run has already
done with one device. As in test_sharding.py, they take the `devices8` fixture (skipped with
fewer devices) and `test_run_this_file_with_8_cpu_devices` re-runs this file in a fresh
`python -m pytest` with the flag set, failing with its output when a test there fails.

Sharded logits are compared with the unsharded model's on the same weights (the f32 model:
only the order of the cross-device sums differs, "f32_reordered"; the bf16 model: "bf16").
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_deepseek_v3_common import assert_close, tiny_config, tiny_model

import wna16_jax as wj
from models.common import loader
from models.deepseek_v3 import (
    QuantSpec,
    generate,
    init_random,
    load_pretrained,
    save_pretrained,
)
from models.deepseek_v3 import sharding as sh
from models.deepseek_v3.modeling import QuantParam, RoutedExperts, dequantize_model

NUM_DEVICES = 8
ROOT = Path(__file__).resolve().parents[1]

LAYOUTS = {
    "ep2": dict(expert=2),
    "ep4": dict(expert=4),
    "ep8": dict(expert=8),
    "tp2": dict(tensor=2),
    "ep2xtp2": dict(expert=2, tensor=2),
    "dp2xep2xtp2": dict(data=2, expert=2, tensor=2),
}
# Two prompts of 8 tokens (batch 2, so that the data axis splits it).
IDS = np.random.default_rng(7).integers(3, 512, (2, 8), dtype=np.int32)
MASK = np.ones(IDS.shape, bool)
MASK[1, :3] = False  # row 1 left-padded


@pytest.fixture
def devices8():
    """The 8 devices, or a skip (the test below then re-runs this file with 8 CPU devices)."""
    return helpers.require_devices(NUM_DEVICES)


def test_run_this_file_with_8_cpu_devices():
    print(helpers.run_file_with_cpu_devices(__file__, NUM_DEVICES, "--durations=12")[-3000:])


# ---- helpers --------------------------------------------------------------------------------


@functools.cache
def sharded_model(layout: str, moe_mode: str = "replicated", **overrides):
    """tiny_model(**overrides) placed on the mesh of `layout` (a copy; cached)."""
    mesh = sh.make_mesh(**LAYOUTS[layout])
    return sh.shard_model(nnx.clone(tiny_model(**overrides)), mesh, moe_mode=moe_mode)


_COMPILED: dict[int, tuple] = {}


def compiled_forward(model):
    """(compiled jit_forward executable, state) for IDS / MASK, kept per model."""
    if id(model) not in _COMPILED:
        fn, state = sh.jit_forward(model)
        _COMPILED[id(model)] = (model, fn.lower(state, IDS, MASK).compile(), state)
    _, exe, state = _COMPILED[id(model)]
    return exe, state


def logits(model) -> np.ndarray:
    exe, state = compiled_forward(model)
    return np.asarray(exe(state, IDS, MASK))


@functools.cache
def unsharded_logits(**overrides) -> np.ndarray:
    return logits(tiny_model(**overrides))


def packed_weight_shapes(state) -> set[tuple[int, ...]]:
    """Global and per-device shapes of every packed (QuantParam) array."""
    shapes = set()
    for _, var in nnx.to_flat_state(state):
        if isinstance(var, QuantParam):
            arr = var.get_value()
            shapes.add(tuple(arr.shape))
            shapes.add(tuple(arr.addressable_shards[0].data.shape))
    return shapes


COLLECTIVE = re.compile(
    r"=\s*(\w+)\[([\d,]*)\]\S*\s+"
    r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all)"
    r"(?:-start)?\("
)


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d), op)
        for dtype, dims, op in COLLECTIVE.findall(hlo)
    ]


# ---- meshes and specs (no devices needed) ---------------------------------------------------


def test_parse_mesh():
    assert sh.parse_mesh("expert=2") == {"expert": 2}
    assert sh.parse_mesh("expert=2, tensor=2,data=1") == {"expert": 2, "tensor": 2, "data": 1}
    assert sh.parse_mesh("") == {}
    for bad, match in [
        ("experts=2", "not <axis>=<size>"),
        ("expert", "not <axis>=<size>"),
        ("expert=0", "positive integer"),
        ("expert=x", "positive integer"),
        ("expert=2,expert=4", "given twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            sh.parse_mesh(bad)


def test_make_mesh_needs_enough_devices():
    with pytest.raises(ValueError, match="needs 4096 devices.*--cpu-devices 4096"):
        sh.make_mesh(expert=64, tensor=64)
    with pytest.raises(ValueError, match="positive integers"):
        sh.make_mesh(expert=0)


def test_maybe_initialize_distributed_plumbing():
    calls = []
    record = lambda **kw: calls.append(kw)  # noqa: E731
    assert not sh.maybe_initialize_distributed(initialize=record)
    assert not sh.maybe_initialize_distributed(num_processes=1, initialize=record)
    assert calls == []
    assert sh.maybe_initialize_distributed("10.0.0.1:1234", 2, 1, initialize=record)
    assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)]
    with pytest.raises(ValueError, match=r"missing \['process_id'\]"):
        sh.maybe_initialize_distributed("10.0.0.1:1234", 2, initialize=record)
    with pytest.raises(ValueError, match=r"process_id=2 is not in \[0, num_processes=2\)"):
        sh.maybe_initialize_distributed("10.0.0.1:1234", 2, 2, initialize=record)
    assert len(calls) == 1


def test_example_flags_reach_the_distributed_helper(monkeypatch):
    """examples/generate.py passes --coordinator / --num-processes / --process-id through."""
    example = helpers.load_script(ROOT / "examples/generate.py", "example_generate")
    seen = []

    def fake(*args, **kw):
        seen.append(args)
        raise SystemExit(3)  # stop before building anything

    monkeypatch.setattr(example.sharding, "maybe_initialize_distributed", fake)
    argv = ["--coordinator", "h0:99", "--num-processes", "4", "--process-id", "2"]
    with pytest.raises(SystemExit):
        example.main(argv)
    assert seen == [("h0:99", 4, 2)]
    args = example.parse_args(["--mesh", "expert=2,tensor=2", "--cpu-devices", "8"])
    assert (args.mesh, args.cpu_devices, args.moe_mode) == ("expert=2,tensor=2", 8, "replicated")


def test_specs_for_mesh_names_only_split_axes(devices8, monkeypatch):
    cfg = tiny_config()
    mesh = sh.make_mesh(expert=2, tensor=2, devices=devices8[:4])
    assert mesh.axis_types == (AxisType.Auto,) * 3
    specs = sh.ShardingSpecs.for_mesh(mesh, cfg)
    assert specs.moe_w13_efd == P("expert", "tensor", None)
    assert specs.moe_w2_edf == P("expert", None, "tensor")
    assert specs.attn_kv_b_nr == P("tensor", None) and specs.attn_o_dn == P(None, "tensor")
    assert specs.act_btd == P(None, None, None) and specs.embed_vd == P()
    with pytest.raises(ValueError, match="n_routed_experts=16 is not divisible by the expert"):
        sh.ShardingSpecs.for_mesh(sh.make_mesh(expert=3, devices=devices8[:3]), cfg)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
    with pytest.raises(RuntimeError, match="asked for 4 CPU devices but JAX already runs"):
        sh.use_cpu_devices(4)


# ---- sharded == unsharded -------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_logits_equal_unsharded(devices8, layout):
    assert_close(logits(sharded_model(layout)), unsharded_logits(), "f32_reordered")


def test_all_to_all_moe_mode(devices8):
    """Tokens split over the expert axis (gathered, then reduce-scattered)."""
    assert_close(logits(sharded_model("ep4", "all_to_all")), unsharded_logits(), "f32_reordered")


@pytest.mark.parametrize("layout", ["ep4", "ep2xtp2"])
def test_bf16_model(devices8, layout):
    """The bf16 model on a mesh vs its f32 twin (the same bf16-rounded weights in f32), as
    the tolerance table defines bf16 accuracy."""
    bf16 = tiny_model(dtype="bfloat16")
    upcast = lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a  # noqa: E731
    twin_state = jax.tree.map(upcast, nnx.state(bf16))
    exe, _ = compiled_forward(tiny_model())  # the f32 model: same structure, f32 arrays
    want = np.asarray(exe(twin_state, IDS, MASK))
    assert_close(logits(sharded_model(layout, dtype="bfloat16")), want, "bf16")


def test_float_experts(devices8):
    """Float routed experts (ragged_dot on each device's experts, -1 ids skipped) and float
    attention, sharded as the quantized ones."""
    model = dequantize_model(tiny_model())
    want = logits(model)
    sharded = sh.shard_model(nnx.clone(model), sh.make_mesh(expert=2, tensor=2))
    assert_close(logits(sharded), want, "f32_reordered")


@pytest.mark.parametrize("layout", ["ep2", "tp2", "ep2xtp2"])
def test_kernel_expert_layout_on_a_mesh(devices8, layout):
    """set_expert_layout("mgpu_int4") on a sharded model converts each shard where it lives
    (experts over the expert axis; w13's rows and w2's K over the tensor axis, w13's
    tensor-parallel row order kept): under 'xla' (which reads the layout by converting back)
    the logits equal the canonical sharded model's bit for bit, and back again restores the
    arrays."""
    canonical = sharded_model(layout)
    model = nnx.clone(canonical)
    model.set_expert_layout("mgpu_int4")
    experts = [m for _, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)]
    assert experts and all(m.w13.get().layout == "mgpu_int4" for m in experts)
    ta = LAYOUTS[layout].get("tensor") and "tensor"
    ea = LAYOUTS[layout].get("expert") and "expert"
    w13, w2 = experts[0].w13.get(), experts[0].w2.get()
    assert w13.scales.sharding.spec == P(ea, None, ta)  # [E, K//G, N]: rows last
    assert w2.scales.sharding.spec == P(ea, ta, None)  # w2's K groups
    np.testing.assert_array_equal(logits(model), logits(canonical))
    model.set_expert_layout("canonical")
    before = [m for _, m in nnx.iter_modules(canonical) if isinstance(m, RoutedExperts)]
    for a, b in zip(experts, before, strict=True):
        np.testing.assert_array_equal(np.asarray(a.w13.get().qweight), b.w13.get().qweight)
        np.testing.assert_array_equal(np.asarray(a.w2.get().scales), b.w2.get().scales)


def test_greedy_generation_equals_unsharded(devices8):
    prompts = [IDS[0, :3].tolist(), IDS[1].tolist()]
    want = generate(tiny_model(), prompts, max_new_tokens=4, eos_id=())
    got = generate(sharded_model("ep2xtp2"), prompts, max_new_tokens=4, eos_id=())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- placement ------------------------------------------------------------------------------


def test_parameter_shardings_follow_the_specs(devices8):
    model = sharded_model("ep2xtp2")
    ms = model.sharding
    state = nnx.state(model)
    want = sh.param_specs(model, ms)
    flat_want = dict(nnx.to_flat_state(want))
    checked = 0
    for path, var in nnx.to_flat_state(state):
        arr = var.get_value()
        assert arr.sharding.spec == flat_want[path].get_value(), path
        checked += 1
    assert checked == len(flat_want) > 50
    cfg = model.cfg
    e, i, hdim = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    layer = model.model.layers[1]
    w13 = layer.mlp.experts.w13.qweight.get_value()
    assert w13.sharding.spec == P("expert", "tensor", None)
    assert w13.addressable_shards[0].data.shape == (e // 2, 2 * i // 2, hdim // 8)
    w2_scales = layer.mlp.experts.w2.scales.get_value()
    assert w2_scales.sharding.spec == P("expert", None, "tensor")
    kv_b = layer.self_attn.kv_b_proj.weight.qweight.get_value()  # [1, h*(dn+dv), R/8]
    assert kv_b.sharding.spec == P(None, "tensor", None)
    o_proj = layer.self_attn.o_proj.weight.qweight.get_value()  # [1, H, h*dv/8]
    assert o_proj.sharding.spec == P(None, None, "tensor")
    for replicated in (
        model.model.embed_tokens.weight.get_value(),
        layer.mlp.gate.weight.get_value(),
        layer.mlp.shared_experts.down_proj.weight.qweight.get_value(),
        layer.self_attn.q_a_proj.weight.qweight.get_value(),
    ):
        assert replicated.sharding.is_fully_replicated
    # Interleaved for 2 tensor shards: shard s holds [gate_s; up_s]; canonical_w13 undoes it.
    assert layer.mlp.experts.w13_tp_shards == 2
    canonical = tiny_model().model.layers[1].mlp.experts.w13.get()
    np.testing.assert_array_equal(
        np.asarray(layer.mlp.experts.canonical_w13().qweight), np.asarray(canonical.qweight)
    )


@pytest.mark.parametrize("layout", ["ep8", "tp2", "ep2xtp2", "dp2xep2xtp2"])
def test_no_weight_collectives_in_hlo(devices8, layout):
    """The compiled forward pass never gathers or exchanges packed weights: every collective
    moves float activations, none of them weight-shaped."""
    model = sharded_model(layout)
    exe, state = compiled_forward(model)
    found = collectives(exe.as_text())
    assert found, "no collective at all: the partial outputs were never combined"
    weights = packed_weight_shapes(state)
    for dtype, shape, op in found:
        assert dtype not in ("u32", "u8"), f"{op} moves packed weights: {dtype}{shape}"
        assert shape not in weights, f"{op} of a weight-shaped array {dtype}{shape}"
    assert "all-reduce" in {op for _, _, op in found}


# ---- building on a mesh ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    if jax.device_count() < NUM_DEVICES:
        pytest.skip("the checkpoint is for the 8-device tests")
    path = tmp_path_factory.mktemp("awq")
    save_pretrained(tiny_model(), path, format="awq")
    return path


@pytest.mark.parametrize("layout", ["ep2xtp2", "ep4"])
def test_load_pretrained_on_mesh(devices8, awq_dir, layout, monkeypatch):
    """Each tensor is placed slice by slice, the routed experts read one expert shard at a
    time; the result equals the in-memory model sharded the same way: identical arrays
    (values and shardings), hence identical logits."""
    mesh = sh.make_mesh(**LAYOUTS[layout])
    blocks = []
    read = loader._read_experts

    def recording(cfg, ckpt, qcfg, entry, form, experts, problems):
        blocks.append(experts)
        return read(cfg, ckpt, qcfg, entry, form, experts, problems)

    monkeypatch.setattr(loader, "_read_experts", recording)
    loaded = load_pretrained(awq_dir, dtype=jnp.float32, mesh=mesh, progress=False)
    per = tiny_config().n_routed_experts // mesh.shape["expert"]
    moe_layers = tiny_config().num_hidden_layers - tiny_config().first_k_dense_replace
    assert [len(b) for b in blocks] == [per] * mesh.shape["expert"] * moe_layers
    want = sharded_model(layout)
    assert loaded.sharding == want.sharding
    flat = dict(nnx.to_flat_state(nnx.state(want)))
    for path, var in nnx.to_flat_state(nnx.state(loaded)):
        got, ref = var.get_value(), flat[path].get_value()
        assert got.sharding == ref.sharding, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=str(path))
    np.testing.assert_array_equal(logits(loaded), logits(want))


def test_init_random_on_mesh_draws_each_shard_in_place(devices8):
    """init_random(mesh=, on_device=True): a jitted program per kind of part whose outputs are
    the shards: no collective in them (no device ever sees another's experts), the values those
    of the unsharded on-device init, every array sharded as the specs say."""
    # One MoE layer, only the experts quantized: few random ops (XLA:CPU compiles slowly).
    quant = QuantSpec(bits=4, group_size=32, targets=("experts",))
    cfg = tiny_config(num_hidden_layers=1, first_k_dense_replace=0, q_lora_rank=None, quant=quant)
    mesh = sh.make_mesh(expert=4, tensor=2)
    model = init_random(cfg, seed=5, mesh=mesh, on_device=True)
    ms = model.sharding
    programs = sh.part_programs(cfg, ms, seed=5)
    assert sorted(programs) == ["embed", "lm_head", "moe_layer", "norm"]
    for kind, (program, _) in programs.items():
        hlo = program.lower(jnp.zeros((), jnp.uint32)).compile().as_text()
        assert collectives(hlo) == [], kind
    want = dict(nnx.to_flat_state(sh.param_specs(model, ms)))
    ref = dict(nnx.to_flat_state(nnx.state(init_random(cfg, seed=5, on_device=True))))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        arr = var.get_value()
        assert arr.sharding.spec == want[path].get_value(), path
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(ref[path].get_value()))
    w13 = model.model.layers[0].mlp.experts.w13.qweight.get_value()
    assert w13.addressable_shards[0].data.shape[0] == cfg.n_routed_experts // 4


def test_errors(devices8):
    model = nnx.clone(tiny_model())
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        sh.shard_model(model, "expert=2")
    mesh = sh.make_mesh(tensor=8)  # I/n = 128/8 = 16 is not a multiple of group_size 32
    with pytest.raises(ValueError, match="not a multiple of group_size=32"):
        sh.shard_model(model, mesh)
    sharded = sharded_model("ep2xtp2")
    with pytest.raises(ValueError, match="batch 3 is not divisible by the data axis"):
        sharded_model("dp2xep2xtp2").sharding.check_batch(3)
    with pytest.raises(ValueError, match="needs an unsharded model"):
        dequantize_model(sharded)
    # A model whose w13 rows are interleaved cannot run unsharded by accident.
    bad = nnx.clone(sharded)
    bad.set_sharding(None)
    with pytest.raises(ValueError, match="interleaved for 2 tensor shards"):
        nnx.eval_shape(lambda m: m(IDS[:, :4]), bad)


def test_save_pretrained_of_a_sharded_model(devices8, tmp_path):
    """Saving gathers the shards and writes canonical [gate; up] rows whatever the TP layout:
    the reloaded arrays are the unsharded model's, bit for bit."""
    save_pretrained(sharded_model("ep2xtp2"), tmp_path, format="awq")
    loaded = load_pretrained(tmp_path, dtype=jnp.float32, progress=False)
    want = dict(nnx.to_flat_state(nnx.state(tiny_model())))
    for path, var in nnx.to_flat_state(nnx.state(loaded)):
        np.testing.assert_array_equal(
            np.asarray(var.get_value()), np.asarray(want[path].get_value()), err_msg=str(path)
        )


# ---- W8A8 routed experts --------------------------------------------------------------------

W8A8_QUANT = QuantSpec(bits=8, group_size=-1, has_zp=False)
# The tiny model's expert inputs reach about 3.9 (GEMM1) and 10 (GEMM2): scales near max / 127,
# exact in float32 (the input_scale tensors' dtype: saved and loaded unchanged).
W8A8_STATIC = wj.ActivationQuant("int8_static", gemm1_scale=0.03125, gemm2_scale=0.078125)


def w8a8_model(aq, layout: str | None = None):
    """The tiny int8 per-channel symmetric model with `aq` on its experts, on `layout`'s
    mesh (None: one device); a copy."""
    model = nnx.clone(tiny_model(quant=W8A8_QUANT))
    model.set_activation_quant(aq)
    return model if layout is None else sh.shard_model(model, sh.make_mesh(**LAYOUTS[layout]))


@pytest.mark.parametrize(
    "layout,aq,implementation",
    [
        ("ep4", "int8_per_token", "xla"),
        ("ep4", "int8_per_token", "pallas_interpret"),
        ("ep2xtp2", W8A8_STATIC, "xla"),
    ],
    ids=["ep4-token-xla", "ep4-token-pallas", "ep2xtp2-static-xla"],
)
def test_w8a8_experts_on_a_mesh(devices8, layout, aq, implementation):
    """The sharded model passes its experts' activation_quant to every shard: its logits
    equal the unsharded W8A8 model's (per token the rows of x are whole on every shard; under
    a tensor axis GEMM2's per-token scales would be each shard's own, so the static scheme
    runs there) and differ from the W8A16 model's."""
    sharded = w8a8_model(aq, layout)
    sharded.set_implementation(implementation)
    got = logits(sharded)
    assert_close(got, logits(w8a8_model(aq)), "f32_reordered")
    assert helpers.relative_error(got, logits(w8a8_model(None))) > 1e-4


def test_w8a8_checkpoint_loads_onto_a_mesh(devices8, tmp_path):
    """Each layer's static scales reach the experts loaded shard by shard."""
    save_pretrained(w8a8_model(W8A8_STATIC), tmp_path, format="compressed-tensors")
    mesh = sh.make_mesh(**LAYOUTS["ep2xtp2"])
    loaded = load_pretrained(tmp_path, dtype=jnp.float32, mesh=mesh, progress=False)
    experts = [m for _, m in nnx.iter_modules(loaded) if isinstance(m, RoutedExperts)]
    assert experts and all(m.activation_quant == W8A8_STATIC for m in experts)
    assert_close(logits(loaded), logits(w8a8_model(W8A8_STATIC)), "f32_reordered")


def test_back_to_one_device(devices8):
    model = sh.shard_model(nnx.clone(sharded_model("ep2xtp2")), None)
    assert model.sharding is None
    assert model.model.layers[1].mlp.experts.w13_tp_shards == 1
    w13 = model.model.layers[1].mlp.experts.w13.qweight.get_value()
    assert len(w13.devices()) == 1
    want = tiny_model().model.layers[1].mlp.experts.w13.qweight.get_value()
    np.testing.assert_array_equal(np.asarray(w13), np.asarray(want))


# ---- the example ----------------------------------------------------------------------------


def test_example_generate_on_a_mesh():
    """examples/generate.py --mesh expert=2 --cpu-devices 8 in a fresh process (the flag
    must reach XLA before JAX starts)."""
    if os.environ.get(helpers.CPU_DEVICES_CHILD_ENV):
        pytest.skip("run once, by the parent process")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "examples/generate.py"), "--mesh", "expert=2"]
    cmd += ["--cpu-devices", "8", "--max-new-tokens", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "mesh: data=1 x expert=2 x tensor=1 on 2 cpu devices" in out, out
    assert "8 device(s)" in out and "[0] tokens:" in out, out
    assert re.search(r"decode: [\d.]+ tokens/s", out), out
