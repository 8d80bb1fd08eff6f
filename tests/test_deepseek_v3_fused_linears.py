"""DeepSeek-V3 linears fused for serving (FusedLinear): gate_up_proj and qkv_a_proj."""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from test_deepseek_v3_common import (
    KERNEL_LINEAR_MODELS,
    MGPU,
    assert_close,
    prefill_and_decode,
    random_ids,
    tiny_model,
)

import wna16_jax as wj
from models.deepseek_v3 import load_pretrained, save_pretrained, sharding
from models.deepseek_v3.modeling import (
    MLP,
    FusedLinear,
    Linear,
    MLAttention,
    QuantizedLinear,
    QuantizedTensor,
    dequantize_model,
    fusion_reason,
)

# Two layers (a dense MLP, then a MoE layer with a shared expert); kv_lora_rank and
# qk_rope_head_dim 64: kv_a_proj_with_mqa's N = 64 + 64 and [q_a; kv_a]'s 64 + 128 are whole
# 64-row tiles of the Mosaic GPU layout (the preset's 32 + 8 = 40 is not: no kernel would run
# it fused), and kv_b_proj's K = 64 a whole group (one quantization_config saves the model).
FUSABLE = dict(num_hidden_layers=2, kv_lora_rank=64, qk_rope_head_dim=64)
# The module paths set_linear_implementation fuses in that model.
FUSED = [
    "model.layers.0.mlp.gate_up_proj",
    "model.layers.0.self_attn.qkv_a_proj",
    "model.layers.1.mlp.shared_experts.gate_up_proj",
    "model.layers.1.self_attn.qkv_a_proj",
]


def fusable_model(implementation: str):
    """(the tiny model `implementation`'s kernel takes, the tolerance kind of its logits)."""
    overrides, _, kind = KERNEL_LINEAR_MODELS[implementation]
    return tiny_model(**FUSABLE, **overrides), kind


def served(model, implementation: str, **kwargs):
    """A copy of `model` with its linears on `implementation`."""
    out = nnx.clone(model)
    out.set_linear_implementation(implementation, progress=False, **kwargs)
    return out


def _flat(model) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def assert_same_weights(got, want) -> None:
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


@pytest.mark.parametrize("implementation", sorted(KERNEL_LINEAR_MODELS))
def test_fused_model_matches_unfused(rng, implementation):
    """The fused GEMMs (silu(gate) * up from one [gate; up] weight, [q_a; kv_a] split after one
    GEMM) give the prefill and decode logits of the same kernel running each linear alone."""
    model, kind = fusable_model(implementation)
    fused = served(model, implementation)
    apart = served(model, implementation, fuse=False)
    assert fused.fused_linears() == FUSED and apart.fused_linears() == []
    assert all(m.weight.layout == KERNEL_LINEAR_MODELS[implementation][1]
               for _, m in nnx.iter_modules(fused) if isinstance(m, FusedLinear))  # fmt: skip
    ids = random_ids(rng, (2, 5), model.cfg)
    next_tokens = random_ids(rng, (2, 2), model.cfg)
    assert_close(
        prefill_and_decode(fused, ids, next_tokens),
        prefill_and_decode(apart, ids, next_tokens),
        kind,
    )


@pytest.mark.parametrize("implementation", sorted(KERNEL_LINEAR_MODELS))
def test_each_pair_is_one_quantized_matmul(monkeypatch, implementation):
    """Traced, the fused model calls the quantized GEMM once per pair: gated ([gate; up] rows,
    activation "silu") for each MLP, [q_a; kv_a] for each attention; apart, once per linear."""
    model, _ = fusable_model(implementation)
    cfg = model.cfg
    calls = []
    matmul = wj.linear.quantized_matmul

    def recorded(x, w, **kwargs):
        calls.append((w.n, kwargs.get("activation"), kwargs.get("implementation")))
        return matmul(x, w, **kwargs)

    monkeypatch.setattr(wj.linear, "quantized_matmul", recorded)
    ids = jnp.asarray(random_ids(np.random.default_rng(0), (1, 3), cfg))
    nnx.eval_shape(lambda m: m(ids), served(model, implementation))
    gated = sorted(n for n, activation, _ in calls if activation == "silu")
    two_f = [2 * cfg.moe_intermediate_size * cfg.n_shared_experts, 2 * cfg.intermediate_size]
    assert gated == two_f, "one gated GEMM per MLP: the shared expert's, the dense layer's"
    assert {impl for _, _, impl in calls} == {implementation}
    fused_calls = len(calls)
    calls.clear()
    nnx.eval_shape(lambda m: m(ids), served(model, implementation, fuse=False))
    assert not any(activation == "silu" for _, activation, _ in calls)
    # Apart, each pair is two GEMMs (kv_a_proj's N = 128: whole tiles of either kernel).
    assert len(calls) == fused_calls + len(FUSED)


def fused_on_xla(model):
    """A copy of `model` whose pairs are FusedLinears on "xla" (a FusedLinear's default: set by
    hand, as set_linear_implementation fuses only for a kernel)."""
    out = nnx.clone(model)
    for _, owner in nnx.iter_modules(out):
        if isinstance(owner, (MLP, MLAttention)):
            parts = owner.FUSION.unfused(owner)
            assert parts is not None and fusion_reason(parts) is None
            setattr(owner, owner.FUSION.fused, FusedLinear(out.cfg, parts))
            for name in owner.FUSION.parts:
                setattr(owner, name, None)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_linears_on_xla_compute_the_unfused_model(rng, dtype):
    """On "xla" a FusedLinear computes what its parts do on the float dot: one dot rounded to
    the activation dtype, silu(gate) * up of the rounded halves (the unfused MLP's), so the
    fused and unfused "xla" models give the same prefill and decode logits: bit for bit on
    the CPU (each output's sum over K in one order); a GPU's dot may order the sums of a
    [2F, K] weight otherwise than of two [F, K] ones (then the model's tolerance of another
    order of sums: f32_reordered, and bf16's for a bf16 model, as a kernel's fused pairs)."""
    model = tiny_model(dtype=dtype, **FUSABLE)
    fused = fused_on_xla(model)
    assert fused.fused_linears() == FUSED
    assert all(m.implementation == "xla" and m.kernel(model.cfg.dtype) is None
               for _, m in nnx.iter_modules(fused) if isinstance(m, FusedLinear))  # fmt: skip
    ids = random_ids(rng, (2, 5), model.cfg)
    next_tokens = random_ids(rng, (2, 2), model.cfg)
    got = prefill_and_decode(fused, ids, next_tokens)
    want = prefill_and_decode(model, ids, next_tokens)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want, "f32_reordered" if dtype == "float32" else "bf16")


def _with_perm(linear: QuantizedLinear, perm: np.ndarray) -> None:
    """Gives `linear` the input order `perm` [K] (act-order) over the same packed weight."""
    w = linear.weight.get()
    linear.weight = QuantizedTensor(dataclasses.replace(w, perm=perm[None].astype(np.int32)))


def test_fuse_then_unfuse_is_bit_identical(rng, caplog):
    """A kernel fuses the pairs (act-order ones that share an input order too), "xla" splits
    them back: the module tree and every array of the original, bit for bit. A pair whose
    input orders differ stays apart, and the log says why."""
    model, _ = fusable_model(MGPU)
    model = nnx.clone(model)
    k = model.cfg.hidden_size
    layers = model.model.layers
    same = rng.permutation(k)
    _with_perm(layers[0].mlp.gate_proj, same)
    _with_perm(layers[0].mlp.up_proj, same)
    _with_perm(layers[1].mlp.shared_experts.gate_proj, rng.permutation(k))
    _with_perm(layers[1].mlp.shared_experts.up_proj, rng.permutation(k))
    with caplog.at_level(logging.INFO, logger="models.deepseek_v3"):
        fused = served(model, MGPU)
    assert fused.fused_linears() == [p for p in FUSED if "shared_experts" not in p]
    assert "gate_proj and up_proj stay two GEMMs: up_proj orders its inputs" in caplog.text
    gate_up = fused.model.layers[0].mlp.gate_up_proj
    assert gate_up.parts == (("gate_proj", 256), ("up_proj", 256))
    np.testing.assert_array_equal(np.asarray(gate_up.weight.perm.get_value())[0], same)
    assert fused.model.layers[0].mlp.gate_proj is None
    fused.set_linear_implementation("xla", progress=False)
    assert fused.fused_linears() == []
    assert nnx.graphdef(fused) == nnx.graphdef(served(model, "xla"))
    assert_same_weights(fused, model)


def test_mixed_forms_stay_apart_and_match(rng, caplog):
    """A pair with a float part (kv_a_proj_with_mqa kept in bf16 while q_a_proj is int4) or
    parts of different group sizes stays two linears (the log says why); the other pairs
    fuse, act-order ones included, and the logits match the model run unfused."""
    model, kind = fusable_model(MGPU)
    model = nnx.clone(model)
    cfg = model.cfg
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    kv_a = attn.kv_a_proj_with_mqa
    _, n, k = kv_a.weight.shape
    attn.kv_a_proj_with_mqa = Linear(cfg, k, n, rngs=None, weight=kv_a.dense_weight(jnp.float32))
    up = mlp.up_proj.dense_weight(jnp.float32)  # [F, H] again in groups of 128
    qe = wj.quantize_experts(up[None], bits=4, group_size=128, has_zp=True,
                             scale_dtype=jnp.dtype(cfg.dtype))  # fmt: skip
    mlp.up_proj = QuantizedLinear(cfg, k, up.shape[0], rngs=None, qe=qe)
    same = rng.permutation(k)
    _with_perm(model.model.layers[1].mlp.shared_experts.gate_proj, same)
    _with_perm(model.model.layers[1].mlp.shared_experts.up_proj, same)
    with caplog.at_level(logging.INFO, logger="models.deepseek_v3"):
        fused = served(model, MGPU)
    assert fused.fused_linears() == [p for p in FUSED if "layers.0" not in p]
    assert (
        "q_a_proj and kv_a_proj_with_mqa stay two GEMMs: kv_a_proj_with_mqa is a Linear"
        in caplog.text
    )
    assert "gate_proj and up_proj stay two GEMMs: up_proj has group_size 128, gate_proj 64" in (
        caplog.text
    )
    apart = served(model, MGPU, fuse=False)
    ids = random_ids(rng, (2, 5), cfg)
    next_tokens = random_ids(rng, (2, 1), cfg)
    assert_close(
        prefill_and_decode(fused, ids, next_tokens),
        prefill_and_decode(apart, ids, next_tokens),
        kind,
    )


def test_fused_model_saves_the_unfused_checkpoint(tmp_path):
    """save_pretrained writes a fused model's parts under their HF names: the same files as the
    unfused model's, which load back to its weights."""
    model, _ = fusable_model(MGPU)
    fused = served(model, MGPU)
    assert fused.fused_linears() == FUSED
    save_pretrained(model, tmp_path / "unfused", format="gptq")
    save_pretrained(fused, tmp_path / "fused", format="gptq")
    want, got = (load_file(tmp_path / d / "model.safetensors") for d in ("unfused", "fused"))
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("unfused", "fused")]
    assert configs[0] == configs[1]
    loaded = load_pretrained(tmp_path / "fused", dtype=model.cfg.dtype, progress=False)
    assert_same_weights(loaded, model)


def test_other_walkers_of_a_fused_model():
    """dequantize_model splits the fused linears first (the float model of the HF tree);
    shard_model refuses a mesh, naming the call that unfuses (keeping the kernel); to one
    device it moves as is."""
    model, _ = fusable_model(MGPU)
    fused = served(model, MGPU)
    assert_same_weights(dequantize_model(fused), dequantize_model(model))
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"set_linear_implementation\(<implementation>, fuse"):
        sharding.shard_model(fused, mesh)
    assert sharding.shard_model(fused, None).fused_linears() == FUSED
