"""The model against an independent float64 numpy forward pass written the way HF's
modeling_deepseek_v3.py computes it (interleaved rope by view/transpose, concatenated q/k
heads, per-expert loop), on the dequantized weights of the tiny int4 model."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_deepseek_v3_common import (
    assert_close,
    logits_of,
    random_ids,
    tiny_model,
    v2_lite_tiny,
)

from models.deepseek_v3 import init_random
from models.deepseek_v3.modeling import dequantize_model


def _w(module) -> np.ndarray:
    return np.asarray(module.weight.get_value(), np.float64)


def _rms(x, weight, eps):
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softmax(x, axis=-1):
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


def _rotate_half(x):
    d = x.shape[-1] // 2
    return np.concatenate([-x[..., d:], x[..., :d]], axis=-1)


def _yarn(cfg):
    """(inv_freq [dr/2], cos/sin factor), HF's _compute_yarn_parameters in float64."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, d, 2) / d)
    r = cfg.rope_scaling
    if r is None:
        return 1.0 / pos_freqs, 1.0

    def mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    def corr(rot):
        orig = r.original_max_position_embeddings
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(r.beta_fast)), 0), min(math.ceil(corr(r.beta_slow)), d - 1)
    ramp = np.clip((np.arange(d // 2) - low) / ((high - low) or 0.001), 0, 1)
    extra = 1 - ramp
    inv_freq = 1 / (r.factor * pos_freqs) * (1 - extra) + 1 / pos_freqs * extra
    return inv_freq, mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)


def _mlp(mod, x):
    return (_silu(x @ _w(mod.gate_proj).T) * (x @ _w(mod.up_proj).T)) @ _w(mod.down_proj).T


def _moe(cfg, mod, x):
    """x [T, H]: HF DeepseekV3MoE, one token and one expert at a time."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    logits = x @ _w(mod.gate).T
    scores = 1 / (1 + np.exp(-logits)) if cfg.scoring_func == "sigmoid" else _softmax(logits)
    bias_var = mod.gate.e_score_correction_bias
    bias = 0.0 if bias_var is None else np.asarray(bias_var.get_value(), np.float64)
    w13 = np.asarray(mod.experts.w13.get_value(), np.float64)  # [E, 2I, H]
    w2 = np.asarray(mod.experts.w2.get_value(), np.float64)  # [E, H, I]
    i = w2.shape[-1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        choice = scores[t] + bias if cfg.topk_method == "noaux_tc" else scores[t].copy()
        if cfg.topk_method != "greedy":
            grouped = choice.reshape(cfg.n_group, -1)
            if cfg.topk_method == "noaux_tc":
                gs = np.sort(grouped, axis=-1)[:, -2:].sum(-1)
            else:
                gs = grouped.max(-1)
            keep = np.zeros(cfg.n_group, bool)
            keep[np.argsort(-gs)[: cfg.topk_group]] = True
            choice = np.where(np.repeat(keep, e // cfg.n_group), choice, -np.inf)
        ids = np.argsort(-choice)[:k]
        w = scores[t][ids]
        if cfg.norm_topk_prob and k > 1:
            w = w / (w.sum() + 1e-20)
        w = w * cfg.routed_scaling_factor
        for j, wt in zip(ids, w, strict=True):
            h = w13[j] @ x[t]
            out[t] += wt * (w2[j] @ (_silu(h[:i]) * h[i:]))
    if mod.shared_experts is not None:
        out += _mlp(mod.shared_experts, x)
    return out


def _attention(cfg, mod, x, cos, sin):
    b, s, _ = x.shape
    nh, dn, dr, dv = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    if cfg.q_lora_rank is None:
        q = x @ _w(mod.q_proj).T
    else:
        q = _rms(x @ _w(mod.q_a_proj).T, _w(mod.q_a_layernorm), 1e-6) @ _w(mod.q_b_proj).T
    q = q.reshape(b, s, nh, dn + dr).transpose(0, 2, 1, 3)  # [B, h, S, qk]
    q_pass, q_rot = q[..., :dn], q[..., dn:]
    ckv = x @ _w(mod.kv_a_proj_with_mqa).T
    k_pass, k_rot = ckv[..., : cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank :]
    k_pass = _rms(k_pass, _w(mod.kv_a_layernorm), 1e-6) @ _w(mod.kv_b_proj).T
    k_pass = k_pass.reshape(b, s, nh, dn + dv).transpose(0, 2, 1, 3)
    k_pass, v = k_pass[..., :dn], k_pass[..., dn:]
    k_rot = k_rot.reshape(b, 1, s, dr)
    # apply_rotary_pos_emb_interleave: view [.., d/2, 2], transpose, then rotate_half.
    q_rot = q_rot.reshape(b, nh, s, dr // 2, 2).swapaxes(4, 3).reshape(b, nh, s, dr)
    k_rot = k_rot.reshape(b, 1, s, dr // 2, 2).swapaxes(4, 3).reshape(b, 1, s, dr)
    q_rot = q_rot * cos + _rotate_half(q_rot) * sin
    k_rot = k_rot * cos + _rotate_half(k_rot) * sin
    query = np.concatenate([q_pass, q_rot], axis=-1)
    key = np.concatenate([k_pass, np.broadcast_to(k_rot, (b, nh, s, dr))], axis=-1)
    scores = query @ key.swapaxes(-1, -2) * cfg.softmax_scale
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    out = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, s, nh * dv)
    return out @ _w(mod.o_proj).T


def reference_logits(model, ids) -> np.ndarray:
    """float64 [B, S, V] logits of a float model (no quantized modules)."""
    cfg = model.cfg
    inv_freq, factor = _yarn(cfg)
    freqs = np.arange(ids.shape[1])[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * factor, np.sin(emb) * factor
    x = _w(model.model.embed_tokens)[ids]
    for i, layer in enumerate(model.model.layers):
        h = _rms(x, _w(layer.input_layernorm), cfg.rms_norm_eps)
        x = x + _attention(cfg, layer.self_attn, h, cos, sin)
        h = _rms(x, _w(layer.post_attention_layernorm), cfg.rms_norm_eps)
        if cfg.is_moe_layer(i):
            b, s, hd = h.shape
            x = x + _moe(cfg, layer.mlp, h.reshape(b * s, hd)).reshape(b, s, hd)
        else:
            x = x + _mlp(layer.mlp, h)
    x = _rms(x, _w(model.model.norm), cfg.rms_norm_eps)
    head = _w(model.model.embed_tokens) if model.lm_head is None else _w(model.lm_head)
    return x @ head.T


@pytest.mark.parametrize("variant", ["v3", "v2_lite"])
def test_logits_match_numpy_reference(variant, rng):
    model = tiny_model() if variant == "v3" else init_random(v2_lite_tiny(), seed=5)
    fmodel = dequantize_model(model)  # the same weights as float arrays
    ids = random_ids(rng, (2, 9), model.cfg)
    got = logits_of(model, ids, np.ones(ids.shape, bool))
    assert_close(got, reference_logits(fmodel, ids), "f32_vs_f64")
