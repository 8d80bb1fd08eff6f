"""Qwen2-MoE and Qwen3-MoE in Flax NNX: GQA attention with a key/value cache, softmax top-k
routing, WNA16 routed experts on the shared layers (models.common.modules).

Module names mirror Hugging Face's (`model.layers.3.self_attn.q_proj.weight`); the routed
experts are stacked (params.py), q/k/v biases are the attention's `q_bias` / `k_bias` /
`v_bias`. Letters in shapes: B batch, S query tokens, L cache slots, T tokens (B*S), H hidden,
n query heads, m key/value heads, g = n / m, D head dim, E experts, k top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.common.causal_lm import CausalLM
from models.common.causal_lm import KVCache as KVCache
from models.common.causal_lm import dequantize_model as dequantize_model
from models.common.modules import (
    MLP,
    Linear,
    MoEBlock,
    PreNormDecoderLayer,
    RMSNorm,
    Rng,
    Router,
    make_linear,
    normal,
)
from models.qwen_moe.config import QwenMoeConfig

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


# ---- rotary embedding -----------------------------------------------------------------------


def rope_cos_sin(cfg: QwenMoeConfig, positions):
    """positions int32 [B, S] -> cos, sin f32 [B, S, D] (HF's default rope, halves layout)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = positions.astype(_F32)[..., None] * jnp.asarray(inv_freq, _F32)  # [B, S, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, S, heads, D] * cos + rotate_half(x) * sin, in x.dtype (cos/sin cast to it, as HF)."""
    d = x.shape[-1]
    cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
    rot = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


# ---- attention ------------------------------------------------------------------------------


def _bias(cfg, n: int, rngs: Rng, present: bool):
    return nnx.Param(jnp.asarray(normal(rngs, (n,), 0.1), cfg.dtype)) if present else None


class Attention(nnx.Module):
    """GQA: q_proj [n*D, H], k_proj / v_proj [m*D, H], o_proj [H, n*D]; Qwen2's q/k/v biases;
    Qwen3's q_norm / k_norm (RMSNorm over each head's D) before the rope."""

    def __init__(self, cfg: QwenMoeConfig, *, rngs: Rng):
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        n, m = cfg.num_attention_heads, cfg.num_key_value_heads
        lin = lambda k, out: make_linear(cfg, k, out, target="attention", rngs=rngs)
        self.q_proj = lin(h, n * d)
        self.k_proj = lin(h, m * d)
        self.v_proj = lin(h, m * d)
        self.o_proj = lin(n * d, h)
        self.q_bias = _bias(cfg, n * d, rngs, cfg.qkv_bias)
        self.k_bias = _bias(cfg, m * d, rngs, cfg.qkv_bias)
        self.v_bias = _bias(cfg, m * d, rngs, cfg.qkv_bias)
        self.o_bias = _bias(cfg, h, rngs, cfg.model_type == "qwen3_moe" and cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, d, eps=cfg.rms_norm_eps, rngs=rngs)
            self.k_norm = RMSNorm(cfg, d, eps=cfg.rms_norm_eps, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    @staticmethod
    def _linear(proj, bias, x):
        y = proj(x)
        return y if bias is None else y + bias.get_value().astype(y.dtype)

    def _attend(self, q, k, v, mask):
        """q [B, S, n, D], k / v [B, L, m, D], mask bool [B, S, L] -> [B, S, n, D]."""
        b, s, n, d = q.shape
        m = k.shape[2]
        qg = q.reshape(b, s, m, n // m, d)  # query head j*g + i reads key/value head j
        scores = jnp.einsum(
            "bsmgd,blmd->bmgsl", qg, k, precision=_HIGHEST, preferred_element_type=_F32
        )
        scores = scores * d**-0.5
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(_F32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum(
            "bmgsl,blmd->bsmgd", probs, v, precision=_HIGHEST, preferred_element_type=_F32
        )
        return out.astype(q.dtype).reshape(b, s, n, d)

    def __call__(self, x, *, cos, sin, mask, mode: str, cache=None, index=None):
        """x [B, S, H]; mask bool [B, S, S] ("full", "prefill") or [B, S, L] ("decode");
        cache: the layer's kv [B, L, 2, m, D]; index: int32 [] first slot decode writes.
        Returns ([B, S, H], the new kv or None)."""
        cfg = self.cfg
        b, s, _ = x.shape
        d = cfg.head_dim
        q = self._linear(self.q_proj, self.q_bias, x).reshape(b, s, -1, d)
        k = self._linear(self.k_proj, self.k_bias, x).reshape(b, s, -1, d)
        v = self._linear(self.v_proj, self.v_bias, x).reshape(b, s, -1, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_cache = None
        if mode == "full":
            keys, values = k, v
        elif mode in ("prefill", "decode"):
            kv = jnp.stack([k, v], axis=2).astype(cache.dtype)  # [B, S, 2, m, D]
            first = 0 if mode == "prefill" else index
            new_cache = jax.lax.dynamic_update_slice(cache, kv, (0, first, 0, 0, 0))
            if mode == "prefill":
                keys, values = k, v
            else:
                keys, values = new_cache[:, :, 0], new_cache[:, :, 1]
        else:
            raise ValueError(f"mode={mode!r} is not one of 'full', 'prefill', 'decode'")
        out = self._attend(q, keys, values, mask).reshape(b, s, -1)
        return self._linear(self.o_proj, self.o_bias, out), new_cache


# ---- MoE ------------------------------------------------------------------------------------


def route(logits, *, cfg: QwenMoeConfig):
    """Qwen routing in f32: softmax over the E experts, the top k, renormalized only when
    cfg.norm_topk_prob. logits f32 [T, E] -> (topk_weights f32 [T, k], topk_ids int32 [T, k])."""
    probs = jax.nn.softmax(logits.astype(_F32), axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


class QwenRouter(Router):
    """The MoE gate: weight [E, H] in the model dtype; softmax top-k routing (`route`)."""

    def route(self, logits):
        return route(logits, cfg=self.cfg)


class MoE(MoEBlock):
    """Router + routed experts (+ Qwen2's shared expert, scaled by sigmoid(shared_expert_gate))."""

    ROUTER = QwenRouter

    def __init__(self, cfg: QwenMoeConfig, *, rngs: Rng):
        super().__init__(cfg, rngs=rngs)
        if cfg.shared_expert:
            size = cfg.shared_expert_intermediate_size
            self.shared_expert = MLP(cfg, size, target="shared_experts", rngs=rngs)
            self.shared_expert_gate = Linear(cfg, cfg.hidden_size, 1, rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def shared(self, x):
        if self.shared_expert is None:
            return None
        return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


# ---- model ----------------------------------------------------------------------------------


class DecoderLayer(PreNormDecoderLayer):
    ATTENTION = Attention
    MOE = MoE


class QwenMoeForCausalLM(CausalLM):
    """The causal LM (models.common.causal_lm.CausalLM) with GQA attention and softmax
    routing: its rope and its key/value cache [B, L, 2, m, D] per layer."""

    LAYER = DecoderLayer

    def rope(self, positions):
        return rope_cos_sin(self.cfg, positions)

    def cache_layer_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        cfg = self.cfg
        return (batch, max_len, 2, cfg.num_key_value_heads, cfg.head_dim)
