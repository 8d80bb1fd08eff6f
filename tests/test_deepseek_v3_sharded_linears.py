"""DeepSeek-V3's quantized linears on a kernel under a mesh: each device runs the kernel on its
shard of the weight (wna16_jax.sharding.quantized_matmul_sharded), placed for its layout.

The mesh tests need 8 JAX devices, as test_deepseek_v3_sharding.py's: they take the `devices8`
fixture (skipped with fewer devices) and `test_run_this_file_with_8_cpu_devices` re-runs this
file in a fresh `python -m pytest` with 8 CPU devices. The kernels run in the Pallas
interpreter ("pallas_interpret") on the f32 tiny model: sharded logits equal the unsharded
model's on the same kernel up to the order of the f32 sums ("f32_reordered"). The Mosaic GPU
interpreter does not run under shard_map on several CPU devices (it never returned on two, and
left a barrier allocated on eight), so the Mosaic GPU layouts are checked for placement here
and run compiled on GPUs only.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import helpers
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_deepseek_v3_common import (
    KERNEL_LINEAR_MODELS,
    MGPU,
    assert_close,
    prefill_and_decode,
    random_ids,
    tiny_model,
)

import wna16_jax as wj
from models.deepseek_v3 import QuantSpec
from models.deepseek_v3 import sharding as sh
from models.deepseek_v3.modeling import QuantizedLinear

NUM_DEVICES = 8
ROOT = Path(__file__).resolve().parents[1]
KERNEL = "pallas_interpret"

# Meshes whose every linear shard the Pallas GEMM tiles (q_b_proj's 96 rows in 48-row shards,
# o_proj's 64 inputs in 32-input shards: whole groups of 32); kv_a_proj_with_mqa's N = 40 no
# kernel tiles, sharded or not.
LAYOUTS = {
    "dp2xtp2": dict(data=2, tensor=2),
    "dp2xep2xtp2": dict(data=2, expert=2, tensor=2),
}
# A bf16 model whose linears (groups of 64) hold whole 64 x 64 tiles of the mgpu_int4 layout
# per device at tensor=2: q_b_proj 4 x (48 + 16) = 256 rows, o_proj 4 x 32 = 128 inputs;
# kv_b_proj's 4 x (48 + 32) = 320 rows would as a whole (5 tiles), not in 160-row shards (it
# runs no GEMM: set on a kernel by hand only).
MGPU_MESH_MODEL = dict(
    dtype="bfloat16",
    quant=QuantSpec(bits=4, group_size=64),
    num_hidden_layers=2,
    qk_nope_head_dim=48,
    qk_rope_head_dim=16,
    v_head_dim=32,
    kv_lora_rank=64,
)


@pytest.fixture
def devices8():
    """The 8 devices, or a skip (the test below then re-runs this file with 8 CPU devices)."""
    return helpers.require_devices(NUM_DEVICES)


def test_run_this_file_with_8_cpu_devices():
    print(helpers.run_file_with_cpu_devices(__file__, NUM_DEVICES, "--durations=8")[-3000:])


# ---- helpers --------------------------------------------------------------------------------


@functools.cache
def served(implementation: str, mesh_axes: tuple = (), **overrides):
    """tiny_model(**overrides) with its linears on `implementation`: sharded on the mesh of
    `mesh_axes` ((name, size) pairs) first, or unsharded and unfused (as a mesh runs them)."""
    model = nnx.clone(tiny_model(**overrides))
    if mesh_axes:
        sh.shard_model(model, sh.make_mesh(**dict(mesh_axes)))
    model.set_linear_implementation(implementation, fuse=False, progress=False)
    return model


def linears(model) -> dict[str, QuantizedLinear]:
    return {
        ".".join(map(str, path)): m
        for path, m in nnx.iter_modules(model)
        if isinstance(m, QuantizedLinear)
    }


def kernels(model) -> dict[str, str | None]:
    """The backend of each linear the model runs as a GEMM (None: the float dot)."""
    return {path: m.kernel(model.cfg.dtype) for path, m in model.gemm_linears().items()}


def tokens(rng, cfg):
    """(prompt ids [2, 5], next tokens [2, 3]): batch 2, so that the data axis splits it."""
    return random_ids(rng, (2, 5), cfg), random_ids(rng, (2, 3), cfg)


def spec(a) -> P:
    return a.get_value().sharding.spec


# ---- sharded == unsharded -------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_linears_on_a_mesh_equal_unsharded(devices8, layout, rng):
    """Prefill and decode logits of the sharded model, its linears on the kernel per shard,
    equal the unsharded model's on the same kernel; the same linears run on it."""
    sharded = served(KERNEL, tuple(LAYOUTS[layout].items()))
    unsharded = served(KERNEL)
    on_kernel = kernels(sharded)
    assert on_kernel == kernels(unsharded)
    assert sum(k == KERNEL for k in on_kernel.values()) == len(on_kernel) - 3  # kv_a_proj's 3
    ids, next_tokens = tokens(rng, sharded.cfg)
    assert_close(
        prefill_and_decode(sharded, ids, next_tokens),
        prefill_and_decode(unsharded, ids, next_tokens),
        "f32_reordered",
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_kernel_linear_runs_per_shard(devices8, layout, monkeypatch):
    """Traced, the sharded model calls quantized_matmul_sharded once per linear the unsharded
    model runs on the kernel (rows over the data axis, column- and row-parallel weights split
    over the tensor axis), and the kernel only inside it: none falls back to the float dot."""
    sharded_calls, kernel_calls = [], []
    sharded_matmul, matmul = wj.sharding.quantized_matmul_sharded, wj.linear.quantized_matmul

    def on_shards(x, w, **kwargs):
        sharded_calls.append(kwargs)
        return sharded_matmul(x, w, **kwargs)

    def kernel(x, w, **kwargs):
        kernel_calls.append(kwargs["implementation"])
        return matmul(x, w, **kwargs)

    monkeypatch.setattr(wj.sharding, "quantized_matmul_sharded", on_shards)
    monkeypatch.setattr(wj.linear, "quantized_matmul", kernel)
    ids = random_ids(np.random.default_rng(0), (2, 3), tiny_model().cfg)
    nnx.eval_shape(lambda m: m(ids), served(KERNEL))
    assert sharded_calls == [] and set(kernel_calls) == {KERNEL}
    unsharded = len(kernel_calls)
    kernel_calls.clear()
    nnx.eval_shape(lambda m: m(ids), served(KERNEL, tuple(LAYOUTS[layout].items())))
    assert len(sharded_calls) == len(kernel_calls) == unsharded
    assert {c["implementation"] for c in sharded_calls} == {KERNEL}
    assert {c["row_axis"] for c in sharded_calls} == {"data"}
    assert {(c["n_axis"], c["k_axis"]) for c in sharded_calls} == {
        (None, None),  # replicated: q_a_proj, the MLPs
        ("tensor", None),  # column parallel: q_b_proj
        (None, "tensor"),  # row parallel: o_proj
    }


# ---- shards a kernel cannot run -------------------------------------------------------------


def test_a_shard_the_kernel_cannot_tile_stays_on_xla(devices8, rng, caplog):
    """data=2 x tensor=4: q_b_proj's 24-row shards are not whole 16-row blocks of the Pallas
    GEMM, so it stays on the float dot (the reason logged and given by kernel_reason); o_proj's
    16 inputs per shard are not a whole group, so it is replicated on K and runs whole. The
    logits are still the unsharded model's."""
    mesh_axes = (("data", 2), ("tensor", 4))
    with caplog.at_level(logging.INFO, logger="models.deepseek_v3"):
        model = served(KERNEL, mesh_axes)
    q_b = model.model.layers[0].self_attn.q_b_proj
    assert q_b.kernel(model.cfg.dtype) is None and q_b.sharding.n_axis == "tensor"
    why = "its shard (1, 24, 64) of (1, 96, 64) (N over 'tensor'): "
    assert why in q_b.kernel_reason(model.cfg.dtype)
    assert "N=24 is not a multiple of block_n=16" in q_b.kernel_reason(model.cfg.dtype)
    assert f"model.layers.0.self_attn.q_b_proj and 2 more linears stay on 'xla': {why}" in (
        caplog.text
    )
    o_proj = model.model.layers[0].self_attn.o_proj
    assert (o_proj.sharding.n_axis, o_proj.sharding.k_axis) == (None, None)
    assert o_proj.kernel(model.cfg.dtype) == KERNEL
    assert spec(o_proj.weight.qweight) == P()
    refused = "a shard (1, 24, 64) of the linear weight (1, 96, 64) (N over 'tensor') cannot"
    with pytest.raises(ValueError, match=re.escape(f"{refused} take the mgpu_int4 layout")):
        q_b.set_layout("mgpu_int4")
    ids, next_tokens = tokens(rng, model.cfg)
    assert_close(
        prefill_and_decode(model, ids, next_tokens),
        prefill_and_decode(served(KERNEL), ids, next_tokens),
        "f32_reordered",
    )


# ---- kernel layouts on a mesh ---------------------------------------------------------------


def _arrays(model) -> dict:
    return {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}


def test_kernel_layouts_are_placed_per_shard(devices8):
    """The Mosaic GPU layouts on a mesh (converted, not run): each device converts and holds its
    shard ([1, N/64, K/64, 64, 64] tiles, per-group arrays [1, K//G, N]: N over "tensor" on
    their last dim); kv_b_proj (no GEMM) stays canonical, and set on the kernel by hand its
    shard, not in whole tiles, stays canonical on the float dot. A model sharded after
    set_linear_implementation ends as one sharded before it, and back on one device as one
    never sharded; the canonical weights are the same bits throughout."""
    mesh_axes = (("data", 2), ("tensor", 2))
    model = served(MGPU, mesh_axes, **MGPU_MESH_MODEL)
    dtype = model.cfg.dtype
    attn = model.model.layers[0].self_attn
    q_b, o_proj, kv_b = attn.q_b_proj, attn.o_proj, attn.kv_b_proj
    assert q_b.weight.layout == o_proj.weight.layout == "mgpu_int4"
    assert q_b.kernel(dtype) == o_proj.kernel(dtype) == MGPU
    assert spec(q_b.weight.qweight) == P(None, "tensor", None)
    assert spec(q_b.weight.scales) == P(None, None, "tensor")  # [1, K//G, N]
    shard = q_b.weight.qweight.get_value().addressable_shards[0].data
    assert shard.shape == (1, 2, 1, 64, 64)  # 128 of 256 rows, all 64 inputs
    assert spec(o_proj.weight.qweight) == P(None, None, "tensor")
    assert spec(o_proj.weight.scales) == P(None, "tensor", None)  # K's groups
    assert kv_b.weight.layout == "canonical" and kv_b.implementation == "xla"
    by_hand = nnx.clone(kv_b)
    by_hand.set_implementation(MGPU, dtype=dtype)
    assert by_hand.weight.layout == "canonical" and by_hand.kernel(dtype) is None
    assert "its shard (1, 160, 64) of (1, 320, 64) (N over 'tensor') cannot take the " in (
        by_hand.kernel_reason(dtype)
    )
    # Sharded after the conversion: converted back, placed, converted per shard again.
    later = sh.shard_model(
        nnx.clone(served(MGPU, **MGPU_MESH_MODEL)), sh.make_mesh(data=2, tensor=2)
    )
    assert nnx.graphdef(later) == nnx.graphdef(model)
    want = _arrays(model)
    for path, got in _arrays(later).items():
        assert got.sharding == want[path].sharding, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want[path]), err_msg=str(path))
    # Back to one device: the layouts of the whole weights.
    alone = sh.shard_model(later, None)
    assert alone.model.layers[0].self_attn.q_b_proj.weight.layout == "mgpu_int4"
    assert alone.model.layers[0].self_attn.kv_b_proj.weight.layout == "canonical"
    assert nnx.graphdef(alone) == nnx.graphdef(served(MGPU, **MGPU_MESH_MODEL))
    want = _arrays(served(MGPU, **MGPU_MESH_MODEL))
    for path, got in _arrays(alone).items():
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want[path]), err_msg=str(path))
    base = linears(tiny_model(**MGPU_MESH_MODEL))
    for path, m in linears(model).items():
        jax.tree.map(np.testing.assert_array_equal, m.canonical_weight(), base[path].weight.get())


def test_fused_linears_are_not_sharded(devices8):
    """A model whose linears run fused refuses a mesh, naming the call that unfuses them;
    on a mesh set_linear_implementation never fuses."""
    fused = nnx.clone(tiny_model(**MGPU_MESH_MODEL))
    fused.set_linear_implementation(MGPU, progress=False)
    assert fused.fused_linears()
    with pytest.raises(ValueError, match=r"set_linear_implementation\(<implementation>, "
                                         r"fuse=False\) first"):  # fmt: skip
        sh.shard_model(fused, sh.make_mesh(tensor=2))
    model = sh.shard_model(nnx.clone(tiny_model(**MGPU_MESH_MODEL)), sh.make_mesh(tensor=2))
    model.set_linear_implementation(MGPU, progress=False)  # fuse=True, the default
    assert model.fused_linears() == []


@pytest.mark.gpu
def test_mgpu_linears_on_a_mesh_equal_unsharded(rng):
    """The Mosaic GPU GEMM per shard (compiled: its interpreter does not run under shard_map
    on several CPU devices) on tensor=2 gives the unsharded model's logits on the same GEMM."""
    devices = helpers.require_devices(2)
    mesh = sh.make_mesh(tensor=2, devices=devices[:2])
    overrides = dict(MGPU_MESH_MODEL, **KERNEL_LINEAR_MODELS[MGPU][0])
    sharded = sh.shard_model(nnx.clone(tiny_model(**overrides)), mesh)
    sharded.set_linear_implementation(MGPU, progress=False)
    unsharded = served(MGPU, **overrides)
    assert kernels(sharded)["model.layers.0.self_attn.q_b_proj"] == MGPU
    ids, next_tokens = tokens(rng, sharded.cfg)
    assert_close(
        prefill_and_decode(sharded, ids, next_tokens),
        prefill_and_decode(unsharded, ids, next_tokens),
        KERNEL_LINEAR_MODELS[MGPU][2],
    )


# ---- the example ----------------------------------------------------------------------------


def test_example_generate_with_kernel_linears_on_a_mesh(capsys):
    """examples/generate.py --mesh data=2,tensor=2 --linear-implementation pallas_interpret on
    8 CPU devices (a fresh process: the flag must reach XLA before JAX starts): the linears run
    on the kernel per shard, as the printed counts say, and generate the unsharded tokens."""
    if os.environ.get(helpers.CPU_DEVICES_CHILD_ENV):
        pytest.skip("run once, by the parent process")
    argv = ["--linear-implementation", KERNEL, "--batch-size", "2", "--max-new-tokens", "3"]
    argv += ["--no-warmup"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "examples/generate.py"), *argv]
    cmd += ["--mesh", "data=2,tensor=2", "--cpu-devices", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "mesh: data=2 x expert=1 x tensor=2 on 4 cpu devices" in out, out
    counts = f"18 on {KERNEL!r}, 3 on 'xla'; dequantized for attention: 3 kv_b_proj\n"
    assert f"quantized linears: {counts}" in out, out
    assert f"3 not on {KERNEL!r}: its weight (1, 40, 128): " in out, out
    example = helpers.load_script(ROOT / "examples/generate.py", "example_generate")
    assert example.main(argv) == 0  # unsharded, in this process
    token_lines = lambda text: re.findall(r"\[\d\] tokens: .*", text)  # noqa: E731
    assert token_lines(out) == token_lines(capsys.readouterr().out) != []
