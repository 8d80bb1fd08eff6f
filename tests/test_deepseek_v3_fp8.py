"""FP8 checkpoints (DeepSeek-V3 / R1's release): block dequantization, quantize-on-load, errors.

The tiny checkpoints here have the official layout: every attention, dense-MLP, shared-expert
and routed-expert linear is `weight` float8_e4m3fn [N, K] with `weight_scale_inv` float32
[ceil(N / 128), ceil(K / 128)] (the tiny attention dims are not multiples of 128: partial
blocks), everything else bf16, and config.json's quantization_config is the official one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import pathlib
import re
import weakref

import helpers
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_deepseek_v3_common import (
    V3_CONFIG_JSON,
    assert_close,
    logits_of,
    random_ids,
    tiny_model,
)
from test_deepseek_v3_reference import reference_logits

import wna16_jax as wj
from models.common import loader
from models.common import progress as progress_module
from models.deepseek_v3 import QuantSpec, load_pretrained, save_pretrained, sharding
from models.deepseek_v3 import params as params_module
from models.deepseek_v3.modeling import (
    FloatExperts,
    Linear,
    QuantizedLinear,
    RoutedExperts,
    dequantize_model,
)
from models.deepseek_v3.params import dequantize_fp8

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate.py"
FP8_CONFIG = V3_CONFIG_JSON["quantization_config"]
BLOCK = tuple(FP8_CONFIG["weight_block_size"])
# The linears DeepSeek-V3's release stores in FP8: not lm_head, not the router (mlp.gate).
FP8_LINEAR = re.compile(
    r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$"
)
E4M3_MAX = 448.0


def fp8_quantize(w, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float [N, K] -> (float8_e4m3fn [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)]), as
    DeepSeek's weight quantization: each block's absmax maps to the largest e4m3 value."""
    w = np.asarray(w, np.float32)
    (n, k), (bn, bk) = w.shape, block
    scale = np.empty((-(-n // bn), -(-k // bk)), np.float32)
    q = np.empty((n, k), ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = max(float(np.abs(blk).max()), 1e-12) / E4M3_MAX
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = blk / scale[i, j]
    return q, scale


def fp8_reference(q, scale_inv, block=BLOCK) -> np.ndarray:
    """float64 [N, K]: q[n, k] * scale_inv[n // bn, k // bk], element by element (exact: 4
    significant bits times 24 fit in float64's 53)."""
    n, k = q.shape
    rows, cols = np.arange(n)[:, None] // block[0], np.arange(k)[None, :] // block[1]
    return q.astype(np.float64) * scale_inv.astype(np.float64)[rows, cols]


def _write(path, tensors: dict, hf: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf))


@dataclasses.dataclass(frozen=True)
class Fp8Checkpoint:
    """A written FP8 checkpoint and what it holds (safetensors' numpy reader has no float8)."""

    path: pathlib.Path
    tensors: dict[str, np.ndarray]
    hf: dict

    def edited(self, path, edit) -> pathlib.Path:
        """A copy at `path` with edit(tensors, config.json dict) applied."""
        tensors, hf = dict(self.tensors), copy.deepcopy(self.hf)
        edit(tensors, hf)
        _write(path, tensors, hf)
        return path


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Fp8Checkpoint:
    """The tiny model's weights as an FP8 checkpoint in the official layout."""
    bf16 = tmp_path_factory.mktemp("bf16")
    save_pretrained(tiny_model(dtype="bfloat16", quant=None), bf16, format="bf16")
    tensors = load_file(str(bf16 / "model.safetensors"))
    for name in [n for n in tensors if FP8_LINEAR.search(n)]:
        q, s = fp8_quantize(tensors[name])
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = s
    hf = json.loads((bf16 / "config.json").read_text())
    hf["quantization_config"] = FP8_CONFIG
    path = tmp_path_factory.mktemp("fp8")
    _write(path, tensors, hf)
    return Fp8Checkpoint(path, tensors, hf)


@pytest.fixture(scope="module")
def dequantized_dir(fp8, tmp_path_factory):
    """The same checkpoint with each FP8 weight dequantized by the float64 reference and
    stored as float32 (no quantization_config): a float checkpoint holding the FP8 values."""

    def dequantize(tensors, hf):
        for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            tensors[weight] = fp8_reference(tensors[weight], tensors.pop(name)).astype(np.float32)
        del hf["quantization_config"]

    return fp8.edited(tmp_path_factory.mktemp("dequantized"), dequantize)


def _logits(model, ids):
    return np.asarray(logits_of(model, ids, np.ones(ids.shape, bool)))


def _reference(fp8: Fp8Checkpoint, prefix: str) -> np.ndarray:
    """float64 [N, K]: the FP8 linear `prefix` dequantized by the reference."""
    return fp8_reference(fp8.tensors[f"{prefix}.weight"], fp8.tensors[f"{prefix}.weight_scale_inv"])


# ---- dequantization -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, k, block",
    [(300, 200, (128, 128)), (256, 128, (128, 128)), (96, 64, (128, 128)), (13, 7, (4, 3))],
    ids=["partial-both", "whole-blocks", "one-partial-block", "small-blocks"],
)
def test_dequantize_fp8_matches_float64(n, k, block, rng):
    """Random float8 bit patterns (every finite one where the tensor is large enough), random
    scales over 2^-20..2^4: the float32 result is the float64 product rounded once."""
    codes = np.arange(256, dtype=np.uint8)
    finite = codes[~np.isnan(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))]
    bits = rng.choice(finite, n * k)
    m = min(bits.size, finite.size)
    bits[:m] = rng.permutation(finite)[:m]
    q = bits.reshape(n, k).view(ml_dtypes.float8_e4m3fn)
    rows, cols = -(-n // block[0]), -(-k // block[1])
    scale = np.exp2(rng.uniform(-20, 4, (rows, cols))).astype(np.float32)
    got = dequantize_fp8(q, scale, block)
    want = fp8_reference(q, scale, block)
    assert got.dtype == np.float32 and got.shape == (n, k)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_dequantize_fp8_refuses_bad_arguments():
    q = np.zeros((130, 10), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"shape \[1, 1\], expected \[2, 1\]"):
        dequantize_fp8(q, np.ones((1, 1), np.float32), (128, 128))
    with pytest.raises(ValueError, match="weight is bfloat16 .* expected float8_e4m3fn"):
        dequantize_fp8(q.astype(ml_dtypes.bfloat16), np.ones((2, 1), np.float32), (128, 128))


# ---- loading --------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_fp8_load_equals_quantize_on_load_of_the_dequantized_weights(
    quantize, fp8, dequantized_dir, rng
):
    """An FP8 checkpoint with quantize=: the linears become the same WNA16 modules, bit for
    bit, as quantize-on-load of a float32 checkpoint holding the float64-dequantized FP8
    weights; each weight is within half a quantization step of its FP8 value; the logits match
    a float64 numpy forward pass of the loaded (dequantized) weights."""
    got = load_pretrained(fp8.path, dtype=jnp.float32, quantize=quantize, progress=False)
    want = load_pretrained(dequantized_dir, dtype=jnp.float32, quantize=quantize, progress=False)
    layers = got.model.layers
    assert isinstance(layers[1].mlp.experts, RoutedExperts)
    for mod in (layers[0].mlp.down_proj, layers[1].mlp.shared_experts.up_proj,
                layers[2].self_attn.q_b_proj, layers[0].self_attn.kv_a_proj_with_mqa):  # fmt: skip
        assert isinstance(mod, QuantizedLinear)
    assert isinstance(got.lm_head, Linear)  # lm_head and the router stay float (bf16 stored)
    ids = random_ids(rng, (2, 9), got.cfg)
    logits = _logits(got, ids)
    np.testing.assert_array_equal(logits, _logits(want, ids))
    assert_close(logits, reference_logits(dequantize_model(got), ids), "f32_vs_f64")

    # Round to nearest from the FP8 values: within half a step (the check of
    # test_quantize_on_load for bf16 checkpoints), here on a partial-block attention weight,
    # plus one float32 spacing of the value: the dequantized weight is an f32 product (the
    # int4 steps hide it; int8's 16x finer steps at |w| ~ 0.3 do not).
    bits = {"int4": 4, "int8": 8}[quantize]
    prefix = "model.layers.2.self_attn.q_b_proj"  # [96, 64]: one partial 128 x 128 block
    qe = layers[2].self_attn.q_b_proj.weight.get()
    assert (qe.bits, qe.group_size, qe.shape) == (bits, -1, (1, 96, 64))  # K=64: one group
    want = _reference(fp8, prefix)
    err = np.abs(np.asarray(wj.dequantize_experts(qe), np.float64)[0] - want)
    half_step = np.asarray(qe.scales, np.float64)[0] / 2
    assert np.all(err <= half_step * (1 + 1e-5) + np.spacing(np.abs(want).astype(np.float32)))


def test_fp8_kept_float_is_exact(fp8, rng):
    """quantize=QuantSpec(targets=()): every FP8 linear dequantized to float (here f32) and kept
    so; the weights are the float64 products rounded once, the logits those of a float64
    numpy forward pass."""
    model = load_pretrained(
        fp8.path, dtype=jnp.float32, quantize=QuantSpec(targets=()), progress=False
    )
    assert isinstance(model.model.layers[1].mlp.experts, FloatExperts)
    for prefix, value in [
        ("model.layers.0.self_attn.q_b_proj", model.model.layers[0].self_attn.q_b_proj.weight),
        ("model.layers.0.mlp.down_proj", model.model.layers[0].mlp.down_proj.weight),
    ]:
        want = _reference(fp8, prefix).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(value.get_value()), want)
    w2 = np.asarray(model.model.layers[2].mlp.experts.w2.get_value())  # [E, H, I]
    want = _reference(fp8, "model.layers.2.mlp.experts.7.down_proj")
    np.testing.assert_array_equal(w2[7], want.astype(np.float32))
    ids = random_ids(rng, (2, 9), model.cfg)
    assert_close(_logits(model, ids), reference_logits(model, ids), "f32_vs_f64")


def test_fp8_default_is_int4_with_a_warning(fp8, caplog, monkeypatch):
    """quantize=None on an FP8 checkpoint: int4 group 128 (asymmetric), said in a warning. The
    progress bar counts every tensor read, weight and scale, and reaches its total; the host
    holds one dequantized float32 tensor at a time."""
    bars = []

    class Bar:
        def __init__(self, iterable=None, *, total, **kw):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            pass

    live: list[weakref.ref] = []
    most_alive = [0]

    def tracked(*args):
        out = dequantize_fp8(*args)
        live.append(weakref.ref(out))
        most_alive[0] = max(most_alive[0], sum(r() is not None for r in live))
        return out

    monkeypatch.setattr(progress_module, "tqdm", Bar)
    monkeypatch.setattr(loader, "dequantize_fp8", tracked)  # the loader engine reads FP8
    with caplog.at_level(logging.WARNING, logger="models.deepseek_v3"):
        model = load_pretrained(fp8.path, dtype=jnp.float32, progress=False)
    assert "holds FP8 weights and quantize=None: quantizing them to int4" in caplog.text
    assert model.cfg.quant == QuantSpec(bits=4, group_size=128)
    w13 = model.model.layers[1].mlp.experts.w13.get()
    assert (w13.bits, w13.group_size, w13.has_zeros) == (4, 128, True)
    fp8_weights = sum(v.dtype == ml_dtypes.float8_e4m3fn for v in fp8.tensors.values())
    (bar,) = bars
    assert bar.total == bar.n == len(fp8.tensors)  # every tensor is used: weights and scales
    assert len(live) == fp8_weights
    assert most_alive[0] == 1, f"{most_alive[0]} dequantized tensors alive at once"


def test_rerun_the_mesh_test_with_8_cpu_devices():
    helpers.run_file_with_cpu_devices(__file__, 8, "-k", "on_a_mesh")


def test_fp8_load_on_a_mesh(fp8):
    """With mesh= the routed experts are read one expert shard at a time, each FP8 tensor
    dequantized and quantized on the host's CPU device: the same arrays (values and
    shardings), hence the same logits, as the model loaded on one device and then sharded."""
    helpers.require_devices(8)
    mesh = sharding.make_mesh(expert=2, tensor=2)
    # Group 32: the tensor axis splits w2's K = I = 128 in two, and a group cannot span shards.
    quant = QuantSpec(bits=4, group_size=32)
    got = load_pretrained(fp8.path, dtype=jnp.float32, quantize=quant, mesh=mesh, progress=False)
    one = load_pretrained(fp8.path, dtype=jnp.float32, quantize=quant, progress=False)
    want = sharding.shard_model(one, mesh)
    flat = dict(nnx.to_flat_state(nnx.state(want)))
    for path, var in nnx.to_flat_state(nnx.state(got)):
        a, b = var.get_value(), flat[path].get_value()
        assert a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    ids = random_ids(np.random.default_rng(0), (2, 8), got.cfg)
    mask = np.ones(ids.shape, bool)
    (fn, state), (fn_want, state_want) = sharding.jit_forward(got), sharding.jit_forward(want)
    np.testing.assert_array_equal(
        np.asarray(fn(state, ids, mask)), np.asarray(fn_want(state_want, ids, mask))
    )


@pytest.mark.parametrize(
    "flags, bits", [([], 4), (["--quantize", "int8"], 8)], ids=["default", "int8"]
)
def test_example_generates_from_an_fp8_checkpoint(fp8, flags, bits, capsys, monkeypatch):
    """examples/generate.py --model <FP8 directory> [--quantize int8]: loads as int4 (the
    default) or int8 and generates."""
    example = helpers.load_script(EXAMPLE, "example_generate", [EXAMPLE.parent])
    models = []
    monkeypatch.setattr(
        example,
        "load_pretrained",
        lambda *a, **kw: models.append(load_pretrained(*a, **kw)) or models[-1],
    )
    argv = ["--model", str(fp8.path), "--max-new-tokens", "2", "--no-warmup"]
    assert example.main(argv + flags) == 0
    out = capsys.readouterr().out
    assert "[0] tokens:" in out
    # Every attention / MLP linear of the 3 layers: 21 GEMMs and kv_b_proj, read dequantized.
    assert "quantized linears: 21 on" in out and "dequantized for attention: 3 kv_b_proj" in out
    (model,) = models
    assert model.model.layers[1].mlp.experts.w13.get().bits == bits


# ---- errors ---------------------------------------------------------------------------------


def _set_config(key, value):
    def edit(tensors, hf):
        hf["quantization_config"] = dict(hf["quantization_config"], **{key: value})

    return edit


def _edit_tensor(name, fn):
    def edit(tensors, hf):
        tensors[name] = fn(tensors[name])

    return edit


def _drop(name):
    def edit(tensors, hf):
        del tensors[name]

    return edit


def _no_quantization_config(tensors, hf):
    del hf["quantization_config"]


def _nan_at_7(q):
    q = q.copy()
    q.view(np.uint8).flat[7] = 0x7F  # the e4m3fn NaN
    return q


ATTN = "model.layers.0.self_attn"
EXPERT = "model.layers.2.mlp.experts.5"
# case -> (edit of the checkpoint's tensors / config.json, the error's words, read before it)
BAD_CHECKPOINTS = {
    "scale-shape": (
        _edit_tensor(f"{ATTN}.q_b_proj.weight_scale_inv", lambda s: np.ones((2, 1), s.dtype)),
        rf"{ATTN}.q_b_proj.weight_scale_inv: shape \[2, 1\], expected \[1, 1\] \(blocks of "
        r"weight_block_size \[128, 128\] over \[N, K\] = \[96, 64\]\)",
        False,
    ),
    "scale-missing": (
        _drop(f"{EXPERT}.down_proj.weight_scale_inv"),
        rf"{EXPERT}.down_proj.weight_scale_inv: missing \(the block scales",
        False,
    ),
    "scale-dtype": (
        _edit_tensor(f"{ATTN}.o_proj.weight_scale_inv", lambda s: s.astype(np.int32)),
        rf"{ATTN}.o_proj.weight_scale_inv: dtype I32, expected a float dtype",
        False,
    ),
    "weight-bf16-with-scale": (
        _edit_tensor(f"{ATTN}.kv_b_proj.weight", lambda q: q.astype(ml_dtypes.bfloat16)),
        rf"{ATTN}.kv_b_proj.weight: dtype BF16 beside its weight_scale_inv, expected F8_E4M3",
        False,
    ),
    "weight-int8": (
        _edit_tensor(f"{EXPERT}.up_proj.weight", lambda q: q.view(np.int8)),
        rf"{EXPERT}.up_proj.weight: dtype I8 beside its weight_scale_inv, expected F8_E4M3",
        False,
    ),
    "weight-e5m2": (
        _edit_tensor(f"{ATTN}.q_a_proj.weight", lambda q: q.astype(ml_dtypes.float8_e5m2)),
        rf"{ATTN}.q_a_proj.weight: dtype F8_E5M2 beside its weight_scale_inv, expected F8_E4M3",
        False,
    ),
    "weight-shape": (
        _edit_tensor(f"{ATTN}.o_proj.weight", lambda q: q[:, :-1]),
        rf"{ATTN}.o_proj.weight: shape \[128, 63\], expected \[128, 64\]",
        False,
    ),
    "block-64x128": (
        _set_config("weight_block_size", [64, 128]),
        rf"{EXPERT}.gate_proj.weight_scale_inv: shape \[1, 1\], expected \[2, 1\]",
        False,
    ),
    "block-one-int": (
        _set_config("weight_block_size", [128]),
        r"config.json: quantization_config weight_block_size=\[128\] is not two positive "
        r"integers",
        False,
    ),
    "block-zero": (
        _set_config("weight_block_size", [128, 0]),
        r"weight_block_size=\[128, 0\] is not two positive integers",
        False,
    ),
    "fmt-e5m2": (
        _set_config("fmt", "e5m2"),
        r"config.json: quantization_config fmt='e5m2' is not supported \(supported: \['e4m3'\]\)",
        False,
    ),
    "no-quantization-config": (
        _no_quantization_config,
        rf"{ATTN}.q_a_proj: quantized tensors \(\['weight'\]\) but config.json has no "
        r"quantization_config",
        False,
    ),
    "nan-in-weight": (
        _edit_tensor(f"{EXPERT}.gate_proj.weight", _nan_at_7),
        rf"tensor '{EXPERT}.gate_proj.weight' holds 1 non-finite value",
        True,
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_fp8_checkpoint_names_the_problem(case, fp8, tmp_path, monkeypatch):
    """Each malformed FP8 checkpoint: a ValueError naming the tensor (or config.json) and what
    was expected; problems the headers show are raised before any tensor is read."""
    edit, message, reads_first = BAD_CHECKPOINTS[case]
    fp8.edited(tmp_path, edit)
    read = []
    original = params_module.Checkpoint.__getitem__
    monkeypatch.setattr(
        params_module.Checkpoint,
        "__getitem__",
        lambda self, name: read.append(name) or original(self, name),
    )
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path, dtype=jnp.float32, quantize="int4", progress=False)
    assert bool(read) == reads_first, read[:5]


def test_fp8_problems_are_listed_together(fp8, tmp_path):
    """Several bad tensors: one error listing each."""

    def edit(tensors, hf):
        for case in ("scale-shape", "scale-missing", "weight-bf16-with-scale", "weight-int8"):
            BAD_CHECKPOINTS[case][0](tensors, hf)

    fp8.edited(tmp_path, edit)
    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path, progress=False)
    msg = str(err.value)
    assert "4 problem(s)" in msg, msg
    for name in (f"{ATTN}.q_b_proj.weight_scale_inv", f"{EXPERT}.down_proj.weight_scale_inv",
                 f"{ATTN}.kv_b_proj.weight", f"{EXPERT}.up_proj.weight"):  # fmt: skip
        assert name in msg, f"{name!r} not in:\n{msg}"
