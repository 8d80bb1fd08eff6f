"""DeepSeek-V3 model tests: shared helpers (tolerance table, tiny models) and config tests."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.deepseek_v3 import DeepseekV3Config, QuantSpec, init_random
from models.deepseek_v3.modeling import rope_inv_freq

# ---- the one tolerance table ----------------------------------------------------------------

# kind -> (tolerance on ||a - b|| / ||b||, also checked element-wise with rtol = atol / rms).
TOLERANCES: dict[str, tuple[float, bool]] = {
    # The same math in a different order (fused_moe's f32 reference vs ragged_dot, absorbed vs
    # expanded MLA, another XLA fusion): f32 rounding only.
    "f32_reordered": (1e-5, True),
    # The f32 model vs a float64 numpy forward pass on the same weights: f32 rounding through
    # 3 layers (observed ~1e-6).
    "f32_vs_f64": (1e-4, True),
    # Pallas kernels in interpret mode vs the xla reference: f32 accumulation in other tile
    # orders (split-K partial sums).
    "pallas_interpret": (1e-5, True),
    # Loose, norm-wise only: a bf16 model vs its f32 twin. bf16 has unit roundoff 2^-8 and the
    # rounding compounds over the layers (observed ~2%); near-zero logits have no useful
    # element-wise bound. The same holds with the routed experts' I split over devices
    # (tensor parallel): the shards' partial layers are summed in f32 and rounded once
    # (fused_moe(out_dtype=float32)); summed as bf16 partials they were observed at 4%.
    "bf16": (5e-2, False),
}


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_close(actual, expected, kind: str) -> None:
    tol, elementwise = TOLERANCES[kind]
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape
    assert np.all(np.isfinite(a)), f"{np.sum(~np.isfinite(a))} non-finite values"
    if elementwise:
        rms = float(np.sqrt(np.mean(e**2)))
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol * rms)
    rel = relative_error(a, e)
    assert rel <= tol, f"relative error {rel:.3g} > {tol} ({kind})"


# ---- tiny models ----------------------------------------------------------------------------


def tiny_config(**overrides) -> DeepseekV3Config:
    """The tiny preset (f32, int4 group 32); tests pass overrides for variants."""
    return DeepseekV3Config.tiny(**overrides)


def v2_lite_tiny(**overrides) -> DeepseekV3Config:
    """DeepSeek-V2-Lite's structure at tiny size: no q LoRA, softmax greedy routing without
    bias, one group, 2 shared experts, no weight normalization."""
    kw = dict(
        q_lora_rank=None,
        topk_method="greedy",
        scoring_func="softmax",
        n_group=1,
        topk_group=1,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )
    kw.update(overrides)
    return tiny_config(**kw)


@functools.cache
def tiny_model(seed: int = 0, **overrides):
    """A random tiny model, cached: build once per process (read-only in tests)."""
    return init_random(tiny_config(**overrides), seed=seed)


# The kernel linears' models: the Pallas GEMM (interpreted everywhere: compiled on the H200 the
# f32 model missed the f32 tolerance against the XLA dot, not yet examined) on the f32 tiny
# model; the Mosaic GPU GEMM (compiled on a GPU, interpreted elsewhere; bf16 activations, groups
# of 64 or more) on a bf16 one with groups of 64. implementation -> (tiny_model overrides, the
# layout its linears take, the TOLERANCES kind of its logits against the xla path's).
MGPU = "mgpu" if jax.default_backend() == "gpu" else "mgpu_interpret"
KERNEL_LINEAR_MODELS = {
    "pallas_interpret": ({}, "canonical", "f32_reordered"),
    MGPU: (
        dict(dtype="bfloat16", quant=QuantSpec(bits=4, group_size=64)),
        "mgpu_int4",
        "bf16",
    ),
}


@nnx.jit
def logits_of(model, ids, mask):
    """Jitted `model(ids, attention_mask)` -> f32 [B, S, V]."""
    return model(ids, attention_mask=mask)


def random_ids(rng: np.random.Generator, shape, cfg: DeepseekV3Config) -> np.ndarray:
    return rng.integers(3, cfg.vocab_size, shape, dtype=np.int32)


@functools.partial(nnx.jit, static_argnames="max_len")
def _prefill(model, ids, mask, *, max_len):
    return model.prefill(ids, mask, max_len=max_len)


@nnx.jit
def _decode(model, tokens, cache):
    return model.decode(tokens, cache)


def prefill_and_decode(model, ids, next_tokens) -> np.ndarray:
    """f32 [B, 1 + steps, V]: the prefill's logits of ids' last column, then those of each
    decode step fed next_tokens [B, steps] (the same tokens for every model compared)."""
    logits, cache = _prefill(model, ids, np.ones(ids.shape, bool), max_len=ids.shape[1] + 4)
    out = [logits]
    for step in range(next_tokens.shape[1]):
        logits, cache = _decode(model, next_tokens[:, step], cache)
        out.append(logits)
    return np.stack([np.asarray(x) for x in out], axis=1)


# ---- config tests ---------------------------------------------------------------------------

V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "ep_size": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}

V2_LITE_CONFIG_JSON = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
    # The newer transformers layout: rope settings (and theta) under rope_parameters.
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000,
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
    },
}


def test_v3_config_json_matches_preset():
    cfg = DeepseekV3Config.from_hf_dict(V3_CONFIG_JSON)
    assert cfg == DeepseekV3Config.deepseek_v3()
    assert cfg.quantization_config == V3_CONFIG_JSON["quantization_config"]
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert cfg.qk_head_dim == 192
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    again = DeepseekV3Config.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg


def test_v2_lite_config_json_matches_preset():
    cfg = DeepseekV3Config.from_hf_dict(V2_LITE_CONFIG_JSON)
    assert cfg == DeepseekV3Config.deepseek_v2_lite()
    assert cfg.q_lora_rank is None and cfg.rope_scaling.mscale_all_dim == 0.707


def test_full_width_preset():
    cfg = DeepseekV3Config.full_width(4)
    assert (cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.hidden_size) == (4, 3, 7168)
    assert cfg.quant == QuantSpec(bits=4, group_size=128)


def test_invalid_config_lists_every_problem():
    bad = dict(V3_CONFIG_JSON, topk_method="random", scoring_func="tanh", n_group=7)
    with pytest.raises(ValueError) as err:
        DeepseekV3Config.from_hf_dict(bad)
    for word in ("topk_method='random'", "scoring_func='tanh'", "n_group=7"):
        assert word in str(err.value)
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        DeepseekV3Config.from_hf_dict(dict(V3_CONFIG_JSON, rope_scaling={"type": "dynamic"}))


def _yarn_inv_freq_oracle(dim, base, factor, orig, beta_fast, beta_slow):
    """HF's _compute_yarn_parameters written out in float64 numpy (truncate=True)."""

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    pos = base ** (np.arange(0, dim, 2) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / ((high - low) or 0.001), 0, 1)
    extrapolation = 1 - ramp
    return (1 / (factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation


@pytest.mark.parametrize("preset", ["deepseek_v3", "deepseek_v2_lite", "tiny"])
def test_yarn_frequencies(preset):
    cfg = getattr(DeepseekV3Config, preset)()
    r = cfg.rope_scaling
    inv_freq, mscale = rope_inv_freq(cfg)
    want = _yarn_inv_freq_oracle(
        cfg.qk_rope_head_dim,
        cfg.rope_theta,
        r.factor,
        r.original_max_position_embeddings,
        r.beta_fast,
        r.beta_slow,
    )
    np.testing.assert_allclose(inv_freq, want, rtol=1e-6)
    # mscale == mscale_all_dim in all three: the cos/sin factor cancels to 1.
    assert mscale == pytest.approx(1.0)
    # The fastest frequency is kept, the slowest interpolated by `factor`.
    assert inv_freq[0] == pytest.approx(1.0)
    d = cfg.qk_rope_head_dim
    assert inv_freq[-1] == pytest.approx(cfg.rope_theta ** (-(d - 2) / d) / r.factor)


def test_config_is_hashable_and_quant_excluded():
    a = tiny_config()
    b = dataclasses.replace(a, quant=None, quantization_config={"quant_method": "awq"})
    assert a == b and hash(a) == hash(b)
    assert a != dataclasses.replace(a, dtype="bfloat16")
    assert jnp.dtype(a.dtype) == jnp.float32
