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

from models.common.attention import Attention, kv_cache_shape
from models.common.causal_lm import CausalLM
from models.common.causal_lm import KVCache as KVCache
from models.common.causal_lm import dequantize_model as dequantize_model
from models.common.modules import (
    MLP,
    Linear,
    MoEBlock,
    PreNormDecoderLayer,
    Rng,
    Router,
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
        return kv_cache_shape(self.cfg, batch, max_len)
