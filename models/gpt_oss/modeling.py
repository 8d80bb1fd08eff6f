"""gpt-oss in Flax NNX: attention with learned sinks, alternating sliding-window and full layers,
YaRN rope, a biased top-k softmax router and MXFP4 routed experts with biases and the clamped
swiglu (wna16_jax.fused_moe).

Module names mirror Hugging Face's (`model.layers.3.self_attn.sinks`, `...mlp.router.weight`);
the routed experts hold w13 with rows [gate; up] (the checkpoint interleaves them; params.py
reorders them on load and back on save). Letters in shapes: B batch, S query tokens, L cache
slots, T tokens (B*S), H hidden, n query heads, m key/value heads, g = n / m, D head dim,
E experts, k top-k, I the experts' intermediate size.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import wna16_jax as wj
from models.common.attention import Attention as GQAttention
from models.common.attention import kv_cache_shape
from models.common.causal_lm import CausalLM
from models.common.causal_lm import KVCache as KVCache
from models.common.causal_lm import dequantize_model as dequantize_model
from models.common.modules import (
    FloatExperts,
    PreNormDecoderLayer,
    Rng,
    RoutedExperts,
    constrain,
    in_row_blocks,
    normal,
    random_quantized,
)
from models.common.modules import (
    Router as RouterBase,
)
from models.gpt_oss.config import GptOssConfig

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


# ---- rotary embedding -----------------------------------------------------------------------


def rope_inv_freq(cfg: GptOssConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies f32 [D/2] and the cos/sin scale: plain rope, or YaRN as transformers
    computes it (`_compute_yarn_parameters` with no mscale: attention factor 0.1 ln(factor) + 1;
    correction range not rounded when rope_scaling.truncate is false, as gpt-oss ships)."""
    d, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    r = cfg.rope_scaling
    if r is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0

    def correction_dim(rotations):
        orig = r.original_max_position_embeddings
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # share of the unscaled frequency
    inv_freq = (1.0 / (r.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    scale = 0.1 * math.log(r.factor) + 1.0 if r.factor > 1 else 1.0
    return inv_freq.astype(np.float32), scale


def rope_cos_sin(cfg: GptOssConfig, positions):
    """positions int32 [B, S] -> cos, sin f32 [B, S, D] (halves layout, scaled by YaRN's
    attention factor)."""
    inv_freq, scale = rope_inv_freq(cfg)
    freqs = positions.astype(_F32)[..., None] * jnp.asarray(inv_freq)  # [B, S, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


# ---- attention ------------------------------------------------------------------------------


def window_mask(mask, window: int, first_query_slot=0):
    """`mask` bool [B, S, L] narrowed to a sliding window: query s (at cache slot
    first_query_slot + s) sees keys at slots l with query_slot - window < l."""
    s, l = mask.shape[1], mask.shape[2]
    query = first_query_slot + jnp.arange(s, dtype=jnp.int32)[:, None]
    key = jnp.arange(l, dtype=jnp.int32)[None, :]
    return mask & (key > query - window)[None]


class Attention(GQAttention):
    """GQA with q/k/v/o biases (`attention_bias`) and a learned sink per query head: softmax
    over the scores and the head's sink logit, the sink's share dropped (it takes weight from
    every value)."""

    def __init__(self, cfg: GptOssConfig, *, rngs: Rng):
        super().__init__(cfg, rngs=rngs)
        n = cfg.num_attention_heads
        self.sinks = nnx.Param(jnp.asarray(normal(rngs, (n,), 1.0), cfg.dtype))  # [n]

    def sink_logits(self):
        return self.sinks.get_value().astype(_F32)  # [n], head j*g + i

    def _softmax(self, scores):
        """scores f32 [B, m, g, S, L] -> the softmax over them and each head's sink logit,
        the sink's column dropped."""
        b, m, g, s, _ = scores.shape
        sinks = self.sinks.get_value().astype(_F32).reshape(1, m, g, 1, 1)  # head j*g + i
        sinks = jnp.broadcast_to(sinks, (b, m, g, s, 1))
        return jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]


# ---- MoE ------------------------------------------------------------------------------------


def route(logits, *, cfg: GptOssConfig):
    """gpt-oss routing in f32: the top k logits, softmax over them.
    logits f32 [T, E] -> (topk_weights f32 [T, k], topk_ids int32 [T, k])."""
    values, ids = jax.lax.top_k(logits.astype(_F32), cfg.num_experts_per_tok)
    return jax.nn.softmax(values, axis=-1), ids.astype(jnp.int32)


class Router(RouterBase):
    """The biased router linear: weight [E, H], bias [E] (model dtype); logits in f32."""

    def __init__(self, cfg: GptOssConfig, *, rngs: Rng):
        super().__init__(cfg, rngs=rngs)
        self.bias = nnx.Param(jnp.asarray(normal(rngs, (cfg.n_routed_experts,), 0.1), cfg.dtype))

    def route(self, logits):
        return route(logits + self.bias.get_value().astype(_F32), cfg=self.cfg)


def float_moe(x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, *, activation):
    """The routed experts on float weights, each token's k experts gathered (the oracle of
    small models: it reads a [T, k, 2I, H] copy of the weights).

    Args:
        x: [T, H].  w13: float [E, 2I, H] (gate rows, then up rows).  w2: float [E, H, I].
        w13_bias: [E, 2I].  w2_bias: [E, H].  topk_weights: f32 [T, k].  topk_ids: int [T, k].
        activation: the wj.ClampedSwiGLU of the experts (`activation_of`).

    Returns:
        [T, H] in x.dtype.
    """
    x32 = x.astype(_F32)
    h = jnp.einsum("th,tknh->tkn", x32, w13[topk_ids].astype(_F32), precision=_HIGHEST)
    h = h + w13_bias[topk_ids].astype(_F32)  # [T, k, 2I]
    act = activation(h)  # [T, k, I]
    y = jnp.einsum("tki,tkhi->tkh", act, w2[topk_ids].astype(_F32), precision=_HIGHEST)
    y = y + w2_bias[topk_ids].astype(_F32)  # [T, k, H]
    return jnp.einsum("tkh,tk->th", y, topk_weights.astype(_F32)).astype(x.dtype)


def random_experts(cfg: GptOssConfig, rngs: Rng):
    """Random (w13 [E, 2I, H], w2 [E, H, I]): quantized as cfg.quant says, else float."""
    e, i, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
    if cfg.quant is None:
        return normal(rngs, (e, 2 * i, h), h**-0.5), normal(rngs, (e, h, i), i**-0.5)
    w13 = random_quantized(rngs, (e, 2 * i, h), cfg.quant, dtype=cfg.dtype)
    return w13, random_quantized(rngs, (e, h, i), cfg.quant, dtype=cfg.dtype)


def activation_of(cfg: GptOssConfig) -> wj.ClampedSwiGLU:
    """The experts' activation (fused_moe's `activation`): the clamped swiglu of the config."""
    return wj.ClampedSwiGLU(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


class Experts(nnx.Module):
    """The routed experts with biases: w13 [E, 2I, H] (rows [gate; up]) and w2 [E, H, I] as
    QuantizedExperts (wna16_jax.fused_moe: MXFP4 as the checkpoints ship, or int4 / int8) or
    float arrays (`float_moe`); w13_bias [E, 2I], w2_bias [E, H] in the model dtype."""

    def __init__(self, cfg: GptOssConfig, *, rngs: Rng, w13=None, w2=None, w13_bias=None,
                 w2_bias=None, implementation=None):  # fmt: skip
        e, i, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
        self.cfg = cfg
        if w13 is None or w2 is None:
            w13, w2 = random_experts(cfg, rngs)
        if isinstance(w13, wj.QuantizedExperts):
            self.weights = RoutedExperts(cfg, rngs=None, w13=w13, w2=w2,
                                         implementation=implementation)  # fmt: skip
        else:
            self.weights = FloatExperts(cfg, rngs=None, w13=w13, w2=w2)
        if w13_bias is None:
            w13_bias = normal(rngs, (e, 2 * i), 0.1)
        if w2_bias is None:
            w2_bias = normal(rngs, (e, h), 0.1)
        self.w13_bias = nnx.Param(jnp.asarray(w13_bias, cfg.dtype))
        self.w2_bias = nnx.Param(jnp.asarray(w2_bias, cfg.dtype))

    batch_invariant = False  # fused_moe's; float_moe on blocks of tokens (`in_row_blocks`)

    @property
    def quantized(self) -> bool:
        return isinstance(self.weights, RoutedExperts)

    def __call__(self, x, topk_weights, topk_ids):
        """x [T, H] -> [T, H] (x.dtype)."""
        cfg = self.cfg
        b13, b2 = self.w13_bias.get_value(), self.w2_bias.get_value()
        if not self.quantized:
            w13, w2 = self.weights.w13.get_value(), self.weights.w2.get_value()
            moe = functools.partial(float_moe, w13=w13, w2=w2, w13_bias=b13, w2_bias=b2,
                                    activation=activation_of(cfg))  # fmt: skip
            if self.batch_invariant:
                block = lambda xb, wb, ib: moe(xb, topk_weights=wb, topk_ids=ib)
                return in_row_blocks(block, x, topk_weights, topk_ids)
            return moe(x, topk_weights=topk_weights, topk_ids=topk_ids)
        m = self.weights
        return wj.fused_moe(
            x,
            m.w13.get(),
            m.w2.get(),
            topk_weights,
            topk_ids,
            w13_bias=b13,
            w2_bias=b2,
            activation=activation_of(cfg),
            implementation=m.implementation,
            batch_invariant=self.batch_invariant,
        )


class MoE(nnx.Module):
    """The router and the routed experts (`mlp.router`, `mlp.experts`)."""

    def __init__(self, cfg: GptOssConfig, *, rngs: Rng):
        self.router = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs)

    def __call__(self, x):
        b, s, h = x.shape
        xt = x.reshape(b * s, h)
        topk_weights, topk_ids = self.router(xt)
        return self.experts(xt, topk_weights, topk_ids).reshape(b, s, h)


# ---- model ----------------------------------------------------------------------------------


class DecoderLayer(PreNormDecoderLayer):
    ATTENTION = Attention
    MOE = MoE


class GptOssForCausalLM(CausalLM):
    """The causal LM (models.common.causal_lm.CausalLM) with sink attention and YaRN rope;
    its cache holds keys and values [B, L, 2, m, D] per layer, and its sliding layers narrow
    the causal mask to their window."""

    LAYER = DecoderLayer

    def rope(self, positions):
        return rope_cos_sin(self.cfg, positions)

    def cache_layer_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        return kv_cache_shape(self.cfg, batch, max_len)

    def _run(self, ids, positions, mask, *, mode, cache=None, index=None):
        cfg = self.cfg
        cos, sin = self.rope(positions)
        sliding = window_mask(mask, cfg.sliding_window, 0 if mode != "decode" else index)
        x = constrain(self.sharding, self.model.embed_tokens(ids), "act_btd")
        new = []
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else cache.layers[i]
            layer_mask = sliding if cfg.is_sliding(i) else mask
            x, nc = layer(
                x, cos=cos, sin=sin, mask=layer_mask, mode=mode, cache=layer_cache, index=index
            )
            x = constrain(self.sharding, x, "act_btd")
            new.append(nc)
        return self.model.norm(x), new


def init_random(
    cfg: GptOssConfig,
    *,
    seed: int = 0,
    implementation=None,
    on_device: bool | None = None,
    mesh=None,
    moe_mode: str = "replicated",
    progress: bool = True,
) -> GptOssForCausalLM:
    """A model of random weights, its experts as cfg.quant says (the presets: MXFP4), drawn
    on the device or with numpy on the host (`on_device`: `CausalLM.draws_on_device`).
    `moe_mode` and `progress` are accepted for the registry's signature.

    Raises:
        NotImplementedError: a mesh (`shard_model`).
    """
    if mesh is not None:
        shard_model(None, mesh)
    on_device = GptOssForCausalLM.draws_on_device(cfg, on_device)
    rngs = nnx.Rngs(seed) if on_device else np.random.default_rng(seed)
    return GptOssForCausalLM(cfg, rngs=rngs, implementation=implementation)


def shard_model(model, mesh, *, moe_mode: str = "replicated"):
    """gpt-oss runs on one device: its experts' biases have no sharded fused_moe yet.

    Raises:
        NotImplementedError: always, for a mesh; None (one device) returns the model.
    """
    if mesh is None:
        return model
    raise NotImplementedError(
        "gpt-oss on a mesh is not supported: its routed experts' biases have no sharded "
        "fused_moe (wna16_jax.sharding); run it on one device"
    )
