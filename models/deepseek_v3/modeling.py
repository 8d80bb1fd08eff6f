"""DeepSeek-V3 in Flax NNX: MLA attention with a latent KV cache, group-limited routing, WNA16 MoE.

Module names mirror Hugging Face's (`model.layers.3.self_attn.kv_b_proj.weight`), so checkpoint
names map onto module paths with few exceptions (routed experts are stacked, see params.py).
Letters in shapes: B batch, S query tokens, L cache slots, T tokens (B*S), h heads, H hidden,
E experts, k top-k, I intermediate, R kv_lora_rank, dr rope dim, dn nope dim, dv value dim.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.common.attention import attend_in_chunks
from models.common.causal_lm import CausalLM
from models.common.causal_lm import KVCache as KVCache
from models.common.causal_lm import decode_positions_and_mask as decode_positions_and_mask
from models.common.causal_lm import dequantize_model as dequantize_model
from models.common.causal_lm import linear_at as linear_at
from models.common.modules import (
    MLP,
    FusedLinear,
    Fusion,
    ModelSharding,
    MoEBlock,
    PreNormDecoderLayer,
    RMSNorm,
    Rng,
    Router,
    constrain,
    in_row_blocks,
    make_linear,
    matmul_nk,
    normal,
)

# The shared layers (models.common.modules), under this module's names too.
from models.common.modules import Embed as Embed
from models.common.modules import FloatExperts as FloatExperts
from models.common.modules import Linear as Linear
from models.common.modules import QuantizedLinear as QuantizedLinear
from models.common.modules import QuantizedTensor as QuantizedTensor
from models.common.modules import QuantParam as QuantParam
from models.common.modules import RoutedExperts as RoutedExperts
from models.common.modules import float_experts as float_experts
from models.common.modules import fusion_reason as fusion_reason
from models.common.modules import random_quantized as random_quantized
from models.common.progress import PROGRESS_DELAY_S as PROGRESS_DELAY_S
from models.common.progress import progress_bar as progress_bar
from models.deepseek_v3.config import DeepseekV3Config, yarn_get_mscale

logger = logging.getLogger("models.deepseek_v3")


_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST

# ---- rotary embedding -----------------------------------------------------------------------


def rope_inv_freq(cfg: DeepseekV3Config) -> tuple[np.ndarray, float]:
    """Inverse frequencies f32 [dr/2] and the cos/sin magnitude factor (DeepSeek's YaRN).

    YaRN (modeling_deepseek.py's DeepseekV3YarnRotaryEmbedding): frequencies below the
    correction range are divided by `factor`, above it kept, linearly blended in between;
    cos/sin are multiplied by yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor,
    mscale_all_dim).
    """
    d = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    freq_extra = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    r = cfg.rope_scaling
    if r is None:
        return freq_extra.astype(np.float32), 1.0
    freq_inter = freq_extra / r.factor

    def correction_dim(num_rotations):
        return (
            d * math.log(r.original_max_position_embeddings / (num_rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low = max(math.floor(correction_dim(r.beta_fast)), 0)
    high = min(math.ceil(correction_dim(r.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extra_mask = 1.0 - ramp
    inv_freq = freq_inter * (1.0 - extra_mask) + freq_extra * extra_mask
    mscale = yarn_get_mscale(r.factor, r.mscale) / yarn_get_mscale(r.factor, r.mscale_all_dim)
    return inv_freq.astype(np.float32), float(mscale)


def rope_cos_sin(cfg: DeepseekV3Config, positions):
    """positions int32 [B, S] -> cos, sin f32 [B, S, dr] (the half-split layout of HF)."""
    inv_freq, mscale = rope_inv_freq(cfg)
    freqs = positions.astype(_F32)[..., None] * jnp.asarray(inv_freq)  # [B, S, dr/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * mscale, jnp.sin(emb) * mscale


def apply_rope(x, cos, sin):
    """DeepSeek rope on x [B, S, ..., dr]: de-interleave pairs ([d/2, 2] -> [2, d/2]), then
    x * cos + rotate_half(x) * sin. cos/sin: [B, S, dr], broadcast over the middle axes."""
    d = x.shape[-1]
    x32 = x.astype(_F32)
    x32 = x32.reshape(*x.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(x.shape)
    rot = jnp.concatenate([-x32[..., d // 2 :], x32[..., : d // 2]], axis=-1)
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    return (x32 * cos + rot * sin).astype(x.dtype)


# ---- attention ------------------------------------------------------------------------------


class MLAttention(nnx.Module):
    """Multi-head latent attention (HF DeepseekV3Attention) with an absorbed decode path."""

    # q_a_proj and kv_a_proj_with_mqa both read x: one GEMM when served on a kernel.
    FUSION = Fusion("qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"))
    # Linears read only as their dequantized weight, never as a GEMM of an input: kv_b_proj's
    # halves W_UK and W_UV (`_split_kv_b`) expand the latent (prefill) or absorb into the
    # queries and outputs (decode). They stay canonical on "xla" whatever the others run on.
    DEQUANTIZED = ("kv_b_proj",)

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng):
        self.cfg = cfg
        h, hd = cfg.num_attention_heads, cfg.qk_head_dim
        lin = lambda k, n: make_linear(cfg, k, n, target="attention", rngs=rngs)
        if cfg.q_lora_rank is None:
            self.q_proj = lin(cfg.hidden_size, h * hd)
        else:
            self.q_a_proj = lin(cfg.hidden_size, cfg.q_lora_rank)
            # HF builds the two LoRA norms with the default eps 1e-6, not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(cfg, cfg.q_lora_rank, eps=1e-6, rngs=rngs)
            self.q_b_proj = lin(cfg.q_lora_rank, h * hd)
        self.kv_a_proj_with_mqa = lin(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg, cfg.kv_lora_rank, eps=1e-6, rngs=rngs)
        self.kv_b_proj = lin(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = lin(h * cfg.v_head_dim, cfg.hidden_size)
        # [q_a; kv_a] rows [Q + R + dr, H] while fused (FUSION), else None.
        self.qkv_a_proj: FusedLinear | None = nnx.data(None)
        self.sharding: ModelSharding | None = None  # heads split over the tensor axis

    def _project(self, x, cos, sin):
        """x [B, S, H] -> q_nope [B,S,h,dn], q_pe [B,S,h,dr], c_kv [B,S,R], k_pe [B,S,dr]
        (q_pe and k_pe roped)."""
        cfg = self.cfg
        b, s, _ = x.shape
        # q_a [B, S, Q] (q LoRA only), kv_a [B, S, R + dr]
        if self.qkv_a_proj is not None:  # both from one GEMM
            q_a, kv_a = jnp.split(self.qkv_a_proj(x), [cfg.q_lora_rank], axis=-1)
        elif cfg.q_lora_rank is not None:
            q_a, kv_a = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv_a = None, self.kv_a_proj_with_mqa(x)
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.reshape(b, s, cfg.num_attention_heads, cfg.qk_head_dim)
        q = constrain(self.sharding, q, "act_btnk")
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        c_kv = self.kv_a_layernorm(kv_a[..., : cfg.kv_lora_rank])
        k_pe = kv_a[..., cfg.kv_lora_rank :]
        return q_nope, apply_rope(q_pe, cos, sin), c_kv, apply_rope(k_pe, cos, sin)

    def _split_kv_b(self, dtype):
        """kv_b_proj as W_UK [h, dn, R] and W_UV [h, dv, R]."""
        cfg = self.cfg
        w = self.kv_b_proj.dense_weight(dtype).reshape(
            cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def _softmax(self, scores, mask):
        scores = jnp.where(mask, scores * self.cfg.softmax_scale, -jnp.inf)
        return jax.nn.softmax(scores, axis=-1)

    def naive(self, q_nope, q_pe, c_kv, k_pe, mask):
        """Attention with keys/values expanded through kv_b_proj (prefill form).

        q_nope [B,S,h,dn], q_pe [B,S,h,dr]; c_kv [B,T,R], k_pe [B,T,dr]; mask bool [B,S,T].
        Returns [B, S, h, dv].
        """
        w_uk, w_uv = self._split_kv_b(c_kv.dtype)
        if self.batch_invariant:
            return self._naive_in_chunks(q_nope, q_pe, c_kv, k_pe, mask, w_uk, w_uv)
        k_nope = jnp.einsum("btr,hdr->bthd", c_kv, w_uk)  # [B, T, h, dn]
        v = jnp.einsum("btr,hvr->bthv", c_kv, w_uv)  # [B, T, h, dv]
        scores = jnp.einsum("bshd,bthd->bhst", q_nope, k_nope, preferred_element_type=_F32)
        scores += jnp.einsum("bshd,btd->bhst", q_pe, k_pe, preferred_element_type=_F32)
        p = self._softmax(scores, mask[:, None]).astype(v.dtype)
        return jnp.einsum("bhst,bthv->bshv", p, v)

    def absorbed(self, q_nope, q_pe, latent, mask):
        """The same attention computed against the latent cache (decode form).

        q_nope is absorbed into W_UK, so [q_lat, q_pe] scores against the whole latent (c_kv
        and k_pe) in one product; the output is the probability-weighted c_kv, mapped through
        W_UV. q_nope [B,S,h,dn], q_pe [B,S,h,dr]; latent [B,T,R + dr]; mask bool [B,S,T].
        Returns [B, S, h, dv].
        """
        w_uk, w_uv = self._split_kv_b(q_nope.dtype)
        if self.batch_invariant:
            return self._absorbed_in_chunks(q_nope, q_pe, latent, mask, w_uk, w_uv)
        q_lat = jnp.einsum("bshd,hdr->bshr", q_nope, w_uk)  # [B, S, h, R]
        q = jnp.concatenate([q_lat, q_pe], axis=-1)  # [B, S, h, R + dr]
        scores = jnp.einsum("bshk,btk->bhst", q, latent, preferred_element_type=_F32)
        p = self._softmax(scores, mask[:, None]).astype(latent.dtype)
        o_lat = jnp.einsum("bhst,btr->bshr", p, latent[..., : self.cfg.kv_lora_rank])
        return jnp.einsum("bshr,hvr->bshv", o_lat, w_uv)

    # The batch-invariant forms (`batch_invariant`): the per-token products over blocks of
    # rows (`in_row_blocks`), the attention in key chunks (`attend_in_chunks`).
    batch_invariant = False

    def _naive_in_chunks(self, q_nope, q_pe, c_kv, k_pe, mask, w_uk, w_uv):
        b, t, _ = c_kv.shape
        h, dn, r = w_uk.shape
        # k_nope [B, T, h, dn], v [B, T, h, dv]
        k_nope = matmul_nk(c_kv, w_uk.reshape(h * dn, r), batch_invariant=True)
        v = matmul_nk(c_kv, w_uv.reshape(-1, r), batch_invariant=True).reshape(b, t, h, -1)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)  # [B, S, h, dn + dr]
        k_pe = jnp.broadcast_to(k_pe[:, :, None], (b, t, h, k_pe.shape[-1]))
        k = jnp.concatenate([k_nope.reshape(b, t, h, dn), k_pe], axis=-1)
        out = attend_in_chunks(q, k, v, mask, scale=self.cfg.softmax_scale)
        return out.astype(v.dtype)

    def _absorbed_in_chunks(self, q_nope, q_pe, latent, mask, w_uk, w_uv):
        dtype = q_nope.dtype

        def per_head(x, w, spec):  # rows of x [B, S, h, .] times each head's w, f32 sums
            # f32 operands (16-bit products are exact in f32): XLA's CPU runtime has no
            # batched dot of bf16 operands into f32
            w32 = w.astype(_F32)
            f = lambda xb: jnp.einsum(spec, xb.astype(_F32), w32, precision=_HIGHEST)
            return in_row_blocks(f, x, batch_dims=2).astype(dtype)

        q_lat = per_head(q_nope, w_uk, "shd,hdr->shr")  # [B, S, h, R]
        q = jnp.concatenate([q_lat, q_pe], axis=-1)  # [B, S, h, R + dr]
        kv = latent[:, :, None]  # [B, L, 1, R + dr]: one key head for every query head
        o_lat = attend_in_chunks(
            q, kv, kv[..., : self.cfg.kv_lora_rank], mask, scale=self.cfg.softmax_scale
        ).astype(latent.dtype)  # [B, S, h, R]
        return per_head(o_lat, w_uv, "shr,hvr->shv")  # [B, S, h, dv]

    def __call__(self, x, *, cos, sin, mask, mode: str, cache=None, index=None):
        """Args:
            x: [B, S, H].  cos, sin: f32 [B, S, dr].
            mask: bool [B, S, S] ("full", "prefill") or [B, S, L] ("decode").
            mode: "full" (no cache), "prefill" (write slots 0..S-1 of an empty cache, attend
                over this chunk) or "decode" (write slots index..index+S-1, attend over the
                cache in the absorbed form).
            cache: the layer's latent [B, L, R + dr] (KVCache.latent) for prefill / decode.
            index: int32 [] first slot written by decode.

        Returns:
            ([B, S, H], the new latent [B, L, R + dr] or None).
        """
        b, s, _ = x.shape
        q_nope, q_pe, c_kv, k_pe = self._project(x, cos, sin)
        new_cache = None
        if mode == "full":
            out = self.naive(q_nope, q_pe, c_kv, k_pe, mask)
        elif mode in ("prefill", "decode"):
            latent = jnp.concatenate([c_kv, k_pe], axis=-1).astype(cache.dtype)  # [B, S, R + dr]
            first = 0 if mode == "prefill" else index
            new_cache = jax.lax.dynamic_update_slice(cache, latent, (0, first, 0))
            if mode == "prefill":
                out = self.naive(q_nope, q_pe, c_kv, k_pe, mask)
            else:
                out = self.absorbed(q_nope, q_pe, new_cache, mask)
        else:
            raise ValueError(f"mode={mode!r} is not one of 'full', 'prefill', 'decode'")
        out = constrain(self.sharding, out, "act_btnk")
        out = out.reshape(b, s, self.cfg.num_attention_heads * self.cfg.v_head_dim)
        return self.o_proj(out), new_cache


# ---- MLP and MoE ----------------------------------------------------------------------------


# Comparisons up to which `top_k` ranks scores pairwise instead of sorting them: XLA:GPU runs
# each lax.top_k as a sort kernel, three per MoE layer (~45 us of a batch-1 decode step of 8
# layers on the H200), where ranks are a few fused compare-and-count kernels. Ranks take
# rows x width^2 comparisons: up to 256 rows of DeepSeek-V3's 256 experts; more (a prefill) sort.
RANKED_TOP_K_MAX_COMPARISONS = 256**3


def descending_ranks(x):
    """int32 [..., n]: each entry's place along x's last axis in descending order (0: the
    largest), equal values placed by position (the first first): lax.top_k's order. x must
    hold no NaN (a NaN compares false and would share a place)."""
    pos = jnp.arange(x.shape[-1])
    after = x[..., None, :] > x[..., :, None]  # [..., i, j]: x[j] comes before x[i]
    after |= (x[..., None, :] == x[..., :, None]) & (pos[None, :] < pos[:, None])
    return after.sum(axis=-1, dtype=jnp.int32)


def top_k(x, k: int):
    """lax.top_k(x, k) along the last axis ((values, int32 indices), largest first, ties by
    position) for x without NaN: by `descending_ranks` up to RANKED_TOP_K_MAX_COMPARISONS."""
    if x.size * x.shape[-1] > RANKED_TOP_K_MAX_COMPARISONS:
        return jax.lax.top_k(x, k)
    ranks = descending_ranks(x)
    places = jnp.arange(k, dtype=jnp.int32)[:, None]  # [k, 1]
    pos = jnp.arange(x.shape[-1], dtype=jnp.int32)
    # The entry of each place 0..k-1 (places are a permutation: exactly one entry each).
    ids = jnp.where(ranks[..., None, :] == places, pos, 0).sum(axis=-1, dtype=jnp.int32)
    return jnp.take_along_axis(x, ids, axis=-1), ids


def route(logits, bias, *, cfg: DeepseekV3Config):
    """DeepSeek routing in f32: which experts each token uses, and with what weight.

    Args:
        logits: f32 [T, E] router logits.
        bias: f32 [E] e_score_correction_bias (noaux_tc), or None.
        cfg: the config (scoring_func, topk_method, n_group, topk_group, num_experts_per_tok,
            norm_topk_prob, routed_scaling_factor).

    Returns:
        topk_weights f32 [T, k], topk_ids int32 [T, k].

    noaux_tc (V3): sigmoid (or softmax) scores; the bias shifts scores for *selection* only;
    a group's score is the sum of its top-2 biased scores; the topk_group best groups are kept
    (others masked to -inf); top-k inside them; weights are the unbiased scores of the chosen
    experts. greedy (V2-Lite): top-k of the scores. group_limited_greedy (V2): groups ranked
    by their max score. Then weights are normalized when norm_topk_prob (and k > 1) and
    multiplied by routed_scaling_factor.
    """
    logits = logits.astype(_F32)
    t, e = logits.shape
    k = cfg.num_experts_per_tok
    if cfg.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    if cfg.topk_method == "greedy":
        choice = scores
    else:
        choice = scores + bias.astype(_F32) if bias is not None else scores
        g = cfg.n_group
        grouped = choice.reshape(t, g, e // g)
        if cfg.topk_method == "noaux_tc":
            group_scores = top_k(grouped, 2)[0].sum(axis=-1)  # [T, g]
        else:
            group_scores = grouped.max(axis=-1)
        # The topk_group best groups (top_k's), by rank: a mask with no scatter.
        keep = descending_ranks(group_scores) < cfg.topk_group  # [T, g]
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(t, e)
    _, ids = top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids.astype(jnp.int32)


class DeepseekRouter(Router):
    """The MoE gate: weight [E, H], e_score_correction_bias f32 [E] (noaux_tc only)."""

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng):
        super().__init__(cfg, rngs=rngs)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nnx.Param(
                jnp.asarray(normal(rngs, (cfg.n_routed_experts,), 0.1))
            )
        else:
            self.e_score_correction_bias = None

    def route(self, logits):
        bias = self.e_score_correction_bias
        return route(logits, None if bias is None else bias.get_value(), cfg=self.cfg)


class MoE(MoEBlock):
    """Router + routed experts + shared experts (HF DeepseekV3MoE)."""

    ROUTER = DeepseekRouter

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng):
        super().__init__(cfg, rngs=rngs)
        if cfg.n_shared_experts:
            self.shared_experts = MLP(
                cfg,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                target="shared_experts",
                rngs=rngs,
            )
        else:
            self.shared_experts = None

    def shared(self, x):
        return None if self.shared_experts is None else self.shared_experts(x)


# ---- model ----------------------------------------------------------------------------------


class DecoderLayer(PreNormDecoderLayer):
    ATTENTION = MLAttention
    MOE = MoE


class DeepseekV3ForCausalLM(CausalLM):
    """The causal LM (models.common.causal_lm.CausalLM) with MLA attention: DeepSeek's YaRN
    rope and the latent cache [B, L, R + dr] per layer; `mtp` holds the multi-token-prediction
    layer (mtp.MultiTokenPredictor) where one is loaded (load_pretrained(mtp=True)) or drawn
    (init_random, num_nextn_predict_layers)."""

    LAYER = DecoderLayer

    def rope(self, positions):
        return rope_cos_sin(self.cfg, positions)

    def cache_layer_shape(self, batch: int, max_len: int) -> tuple[int, ...]:
        return (batch, max_len, self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim)

    def dequantize_kv_b(self) -> None:
        """Replaces every quantized kv_b_proj with a float Linear holding its dequantized
        weight (cfg.dtype), in place (`dequantize_attention_linears`: the absorbed decode
        multiplies W_UK and W_UV into every token's queries and outputs)."""
        self.dequantize_attention_linears()


def abstract_model(cfg: DeepseekV3Config) -> DeepseekV3ForCausalLM:
    """The model with jax.ShapeDtypeStruct in place of every array (nothing is allocated)."""
    return DeepseekV3ForCausalLM.abstract(cfg)


def random_parts(cfg: DeepseekV3Config):
    """`CausalLM.random_parts` of DeepseekV3ForCausalLM (`sharding.init_random` compiles one
    program per kind of part)."""
    return DeepseekV3ForCausalLM.random_parts(cfg)


def param_bytes(cfg: DeepseekV3Config) -> int:
    """Bytes of the model's weights (from an abstract model: nothing is allocated)."""
    return DeepseekV3ForCausalLM.param_bytes(cfg)
