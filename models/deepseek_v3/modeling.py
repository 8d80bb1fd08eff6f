"""DeepSeek-V3 in Flax NNX: MLA attention with a latent KV cache, group-limited routing, WNA16 MoE.

Module names mirror Hugging Face's (`model.layers.3.self_attn.kv_b_proj.weight`), so checkpoint
names map onto module paths with few exceptions (routed experts are stacked, see params.py).
Letters in shapes: B batch, S query tokens, L cache slots, T tokens (B*S), h heads, H hidden,
E experts, k top-k, I intermediate, R kv_lora_rank, dr rope dim, dn nope dim, dv value dim.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import wna16_jax as wj
from models.common.checks import check_input_ids
from models.common.modules import (
    MLP,
    DecoderStack,
    Embed,
    FloatExperts,
    FusedLinear,
    Fusion,
    Linear,
    ModelSharding,
    PreNormDecoderLayer,
    QuantizedLinear,
    RMSNorm,
    Rng,
    RoutedExperts,
    activation_quant_of,
    chunk_mask,
    constrain,
    decode_mask,
    make_linear,
    module_at,
    normal,
    positions_from_mask,
    set_module,
)
from models.common.modules import QuantizedTensor as QuantizedTensor

# The shared layers (models.common.modules), under this module's names too.
from models.common.modules import QuantParam as QuantParam
from models.common.modules import float_experts as float_experts
from models.common.modules import fusion_reason as fusion_reason
from models.common.modules import random_quantized as random_quantized
from models.common.progress import PROGRESS_DELAY_S as PROGRESS_DELAY_S
from models.common.progress import progress_bar as progress_bar
from models.deepseek_v3.config import DeepseekV3Config, QuantSpec, yarn_get_mscale

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The compressed MLA cache: per layer one array of the normalized latent and the rotated
    rope key side by side (DeepSeek's and vLLM's MLA layout: keys of R + dr, the first R also
    the values).

    Attributes:
        latent: per layer [B, L, R + dr] (model dtype): [..., :R] c_kv, [..., R:] roped k_pe.
        valid: bool [B, L]: the slot holds a real token (left padding is False).
        next_pos: int32 [B]: rope position of each row's next token.
        index: int32 []: the next slot to write (shared by all rows).
    """

    latent: tuple
    valid: jax.Array
    next_pos: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


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
        q_lat = jnp.einsum("bshd,hdr->bshr", q_nope, w_uk)  # [B, S, h, R]
        q = jnp.concatenate([q_lat, q_pe], axis=-1)  # [B, S, h, R + dr]
        scores = jnp.einsum("bshk,btk->bhst", q, latent, preferred_element_type=_F32)
        p = self._softmax(scores, mask[:, None]).astype(latent.dtype)
        o_lat = jnp.einsum("bhst,btr->bshr", p, latent[..., : self.cfg.kv_lora_rank])
        return jnp.einsum("bshr,hvr->bshv", o_lat, w_uv)

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


class Router(nnx.Module):
    """The MoE gate: weight [E, H], e_score_correction_bias f32 [E] (noaux_tc only)."""

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng):
        self.cfg = cfg
        e, hdim = cfg.n_routed_experts, cfg.hidden_size
        # Stored in the model dtype like HF; the logits are computed in f32.
        self.weight = nnx.Param(jnp.asarray(normal(rngs, (e, hdim), hdim**-0.5), cfg.dtype))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nnx.Param(jnp.asarray(normal(rngs, (e,), 0.1)))
        else:
            self.e_score_correction_bias = None

    def __call__(self, x):
        """x [T, H] -> (topk_weights f32 [T, k], topk_ids int32 [T, k])."""
        logits = jnp.dot(x.astype(_F32), self.weight.get_value().astype(_F32).T, precision=_HIGHEST)
        bias = self.e_score_correction_bias
        return route(logits, None if bias is None else bias.get_value(), cfg=self.cfg)


class MoE(nnx.Module):
    """Router + routed experts + shared experts (HF DeepseekV3MoE)."""

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng):
        self.gate = Router(cfg, rngs=rngs)
        if cfg.quantizes("experts"):
            self.experts = RoutedExperts(cfg, rngs=rngs)
        else:
            self.experts = FloatExperts(cfg, rngs=rngs)
        if cfg.n_shared_experts:
            self.shared_experts = MLP(
                cfg,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                target="shared_experts",
                rngs=rngs,
            )
        else:
            self.shared_experts = None

    def __call__(self, x):
        b, s, hdim = x.shape
        xt = x.reshape(b * s, hdim)
        topk_weights, topk_ids = self.gate(xt)
        out = self.experts(xt, topk_weights, topk_ids).reshape(b, s, hdim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


# ---- model ----------------------------------------------------------------------------------


class DecoderLayer(PreNormDecoderLayer):
    ATTENTION = MLAttention
    MOE = MoE


class DeepseekV3Model(DecoderStack):
    # The parts draw their random weights in the order `random_parts` lists.
    LAYER = DecoderLayer


def decode_positions_and_mask(cache: KVCache, b: int, s: int):
    """For S tokens appended to every row at slots index..index+S-1: their rope positions
    int32 [B, S] (from next_pos), the cache's valid slots bool [B, L] with them, and the
    attention mask bool [B, S, L] (`decode_mask`: valid slots up to each query's own)."""
    idx = cache.index
    positions = cache.next_pos[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
    valid = jax.lax.dynamic_update_slice(cache.valid, jnp.ones((b, s), bool), (0, idx))
    return positions, valid, decode_mask(valid, idx, s)


class DeepseekV3ForCausalLM(nnx.Module):
    """The causal LM: `model(input_ids)` -> f32 logits; `prefill` / `decode` for generation."""

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng, implementation=None):
        self.cfg = cfg
        self.model = DeepseekV3Model(cfg, rngs=rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs=rngs)
        # Set by sharding.shard_model / init_random(mesh=) / load_pretrained(mesh=).
        self.sharding: ModelSharding | None = None
        # The multi-token-prediction draft layer (mtp.MultiTokenPredictor), set where one is
        # loaded (load_pretrained(mtp=True)) or drawn (init_random, num_nextn_predict_layers).
        self.mtp = nnx.data(None)
        if implementation is not None:
            self.set_implementation(implementation)

    # --- configuration -------------------------------------------------------------------
    def set_implementation(self, implementation: str | Sequence[str] | None) -> None:
        """Selects the fused_moe backend of every routed-expert layer (None = automatic)."""
        if implementation is not None and not isinstance(implementation, str):
            implementation = tuple(implementation)
        for _, m in nnx.iter_modules(self):
            if isinstance(m, RoutedExperts):
                m.implementation = implementation

    def set_activation_quant(self, activation_quant: str | wj.ActivationQuant | None) -> None:
        """Sets how every routed-expert layer quantizes its activations (fused_moe's
        activation_quant): None (16-bit activations), "int8_per_token" or a
        wj.ActivationQuant (static scales: the same in every layer). A checkpoint's own
        (per-layer static scales included) is set by `params.load_pretrained`.

        W8A8 kernels need int8 per-channel symmetric experts (QuantSpec(bits=8,
        group_size=-1, has_zp=False)); the 'xla' backend runs any weights, and fused_moe
        names the reason where a backend cannot. The non-expert linears keep 16-bit
        activations.

        Raises:
            ValueError: a value `activation_quant_of` refuses, or int8 activations on a model
                without quantized routed experts (float experts run 16-bit activations).
        """
        aq = activation_quant_of(activation_quant)
        experts = [m for _, m in nnx.iter_modules(self) if isinstance(m, RoutedExperts)]
        if aq is not None and not experts:
            raise ValueError(
                f"activation_quant={aq}: the model has no quantized routed experts (float "
                f"experts run 16-bit activations)"
            )
        for m in experts:
            m.activation_quant = aq

    def set_expert_layout(self, layout: str, *, progress: bool = True) -> None:
        """Converts every routed-expert layer's weights to `layout` (wna16_jax.layouts):
        "mgpu_int4" for the 'mgpu' backend (fused_moe then picks it automatically), or back to
        "canonical". One layer at a time, each replaced (no second copy of the experts);
        `progress`: a tqdm bar over the layers (`progress_bar`)."""
        layers = [m for _, m in nnx.iter_modules(self) if isinstance(m, RoutedExperts)]
        bar = progress_bar(layers, desc=f"experts to {layout}", unit="layer", enabled=progress)
        for m in bar:
            m.set_layout(layout)
            jax.block_until_ready(m.w13.qweight.get_value())  # the bar follows the device

    def resolve_expert_layout(self, requested: str, implementation=None) -> str:
        """The experts' layout for a `requested` one ("auto", or a wna16_jax.layouts name) and
        a fused_moe `implementation`: "auto" means, for a named implementation, the first of
        its layouts that holds the experts' bits (`wna16_jax.backend_layout`: mgpu_int4 or
        mgpu_int8 for the 'mgpu' backends, canonical for the others), and
        `preferred_expert_layout()` when none is named."""
        if requested != "auto":
            return requested
        if isinstance(implementation, str):
            bits = next(
                (m.w13.bits for _, m in nnx.iter_modules(self) if isinstance(m, RoutedExperts)), 4
            )
            return wj.backend_layout(implementation, bits=bits)
        if implementation is not None:  # a sequence of names: the first decides
            return self.resolve_expert_layout("auto", tuple(implementation)[0])
        return self.preferred_expert_layout()

    def preferred_expert_layout(self) -> str:
        """wna16_jax.preferred_layout for the routed experts on this platform, for the
        activations they run (cfg.dtype, their activation_quant: W8A8 experts take int8 rows
        whatever the dtype) and for one tensor shard's slice when they are split over a tensor
        axis; "canonical" for a model without routed experts."""
        for _, m in nnx.iter_modules(self):
            if isinstance(m, RoutedExperts):
                w13, w2 = m.w13.get(), m.w2.get()
                n = m.w13_tp_shards
                if n != 1:  # one tensor shard's slice: 2I/n rows of w13, I/n of w2's K
                    shard = functools.partial(wj.sharding.tensor_shard, num_shards=n)
                    w13 = jax.eval_shape(functools.partial(shard, split="n"), w13)
                    w2 = jax.eval_shape(functools.partial(shard, split="k"), w2)
                return wj.preferred_layout(
                    w13, w2, dtype=self.cfg.dtype, activation_quant=m.activation_quant
                )
        return "canonical"

    def set_linear_implementation(
        self, implementation: str, *, fuse: bool = True, progress: bool = True
    ) -> None:
        """Selects how every quantized non-expert linear runs, converting its weight to the
        layout that implementation reads (`wna16_jax.linear.preferred_layout`):
        - "xla" (the default): dequantize + dot, canonical layout; works under any sharding;
        - "auto": the fastest kernel here (`wna16_jax.linear.quantized_matmul`'s automatic
          choice: the Mosaic GPU GEMM on mgpu_int4 weights on an H100/H200, the Pallas GEMM
          on other NVIDIA GPUs, else "xla");
        - a backend with a grouped GEMM ("mgpu", "pallas", "mgpu_interpret", ...).
        Layers a kernel does not take here stay on "xla" (why, for a named backend, is
        logged). `progress`: a tqdm bar over the linears (`progress_bar`).

        On a sharded model (`sharding.shard_model`, `init_random` / `load_pretrained` with a
        mesh) each kernel runs per device on its shard of the weight (`LinearSharding`,
        `wna16_jax.sharding.quantized_matmul_sharded`): the layout and the kernel are chosen
        for the shard, and each device converts its own shard. A shard a kernel cannot run
        (e.g. q_b_proj's rows per device not whole 64-row tiles of the mgpu layout) leaves
        that linear on "xla", the reason logged.

        kv_b_proj runs no GEMM (attention reads its dequantized weight:
        `dequantized_linears`): it stays canonical on "xla", converted for no kernel.

        On an unsharded model a kernel also runs the linears that read one input as one GEMM
        (`FusedLinear`): MLP's gate_proj and up_proj as gate_up_proj (silu(gate) * up in the
        GEMM's epilogue), MLA's q_a_proj and kv_a_proj_with_mqa as qkv_a_proj, where both
        parts are QuantizedLinears of one format (`fusion_reason`) and the kernel takes the
        fused weight (why a pair stays apart is logged); `fuse=False` keeps them apart. "xla"
        splits them back into the HF module tree, bit-identically. A sharded model never
        fuses: a fused weight has no ShardingSpecs field of its own, and a [gate; up] weight
        split column-parallel would need each shard's gate and up rows side by side
        (TP-interleaved halves, as the routed experts' w13).

        Raises:
            ValueError: `implementation` is neither "auto" nor a registered backend.
        """
        if implementation != "auto" and implementation not in wj.registered_backends():
            raise ValueError(
                f"linear implementation {implementation!r} is neither 'auto' nor a registered "
                f"backend {wj.registered_backends()}"
            )
        chosen = None if implementation == "auto" else implementation
        self._unfuse_linears()
        for m in self.dequantized_linears().values():
            m.set_implementation("xla", dtype=self.cfg.dtype)
        pairs = []  # (owner, {name: part}): linears that may run as one GEMM
        if fuse and implementation != "xla" and self.sharding is None:
            for owner in self._fusing_modules():
                parts = owner.FUSION.unfused(owner)
                if parts and any(isinstance(m, QuantizedLinear) for m in parts.values()):
                    pairs.append((owner, parts))
        paired = {id(m) for _, parts in pairs for m in parts.values()}
        singles = [m for m in self.gemm_linears().values() if id(m) not in paired]
        paths = {id(m): ".".join(map(str, p)) for p, m in nnx.iter_modules(self)}
        on_xla = collections.defaultdict(list)  # why a named kernel does not run a linear
        apart = collections.Counter()  # why pairs stay two GEMMs
        desc = f"linears for {implementation}"
        for item in progress_bar(pairs + singles, desc=desc, unit="linear", enabled=progress):
            if isinstance(item, QuantizedLinear):
                module, alone = item, [item]
            else:
                module, parts = item
                why = module.FUSION.fuse(module, chosen, cfg=self.cfg)  # converts the fused one
                alone = []
                if why is not None:
                    apart[why] += 1
                    alone = [m for m in parts.values() if isinstance(m, QuantizedLinear)]
            for m in alone:
                m.set_implementation(chosen, dtype=self.cfg.dtype)
                if (why := m.kernel_reason(self.cfg.dtype)) is not None:
                    on_xla[why].append(paths[id(m)])
            jax.block_until_ready(nnx.state(module))  # the bar follows the device
        for why, count in apart.items():
            logger.info("%s (%d modules)", why, count)
        for why, where in on_xla.items():
            more = f" and {len(where) - 1} more linears stay" if len(where) > 1 else " stays"
            logger.info("%s%s on 'xla': %s", where[0], more, why)

    def _quantized_linears(self, *, dequantized: bool) -> dict[str, QuantizedLinear]:
        """{module path: layer} of the QuantizedLinears read only as a dequantized weight
        (`dequantized`), or of the others."""
        read_dense = {
            id(getattr(m, name))
            for _, m in nnx.iter_modules(self)
            if isinstance(m, MLAttention)
            for name in m.DEQUANTIZED
        }
        return {
            ".".join(map(str, path)): m
            for path, m in nnx.iter_modules(self)
            if isinstance(m, QuantizedLinear) and (id(m) in read_dense) == dequantized
        }

    def gemm_linears(self) -> dict[str, QuantizedLinear]:
        """{module path: layer} of the quantized linears the model runs as a GEMM of their
        input, on their `implementation` (FusedLinears included, in place of their parts)."""
        return self._quantized_linears(dequantized=False)

    def dequantized_linears(self) -> dict[str, QuantizedLinear]:
        """{module path: layer} of the quantized linears the model reads only as their
        dequantized weight, never as a GEMM (MLA's kv_b_proj: `MLAttention.DEQUANTIZED`);
        `set_linear_implementation` leaves them canonical on "xla"."""
        return self._quantized_linears(dequantized=True)

    def _fusing_modules(self) -> list[MLP | MLAttention]:
        """The modules with a `Fusion` (their linears that read one input)."""
        return [m for _, m in nnx.iter_modules(self) if isinstance(m, (MLP, MLAttention))]

    def _unfuse_linears(self) -> None:
        """Every FusedLinear split back into its parts (the HF module tree)."""
        for owner in self._fusing_modules():
            owner.FUSION.unfuse(owner)

    def fused_linears(self) -> list[str]:
        """The module paths of the FusedLinears this model runs (e.g.
        "model.layers.0.mlp.gate_up_proj"); empty on "xla" or a sharded model."""
        return [
            ".".join(map(str, path))
            for path, m in nnx.iter_modules(self)
            if isinstance(m, FusedLinear)
        ]

    def quantize_lm_head(self, spec: QuantSpec | str) -> None:
        """Replaces the float lm_head with a QuantizedLinear of `spec` ("int4", "int8" or a
        QuantSpec: bits, group_size, has_zp; round to nearest), canonical layout on "xla";
        `set_linear_implementation` then moves it to a kernel with the other linears.

        The vocabulary projection is the largest weight a decode step reads (DeepSeek-V3: 129280
        x 7168, 1.85 GB as the checkpoints ship it, bf16); int4 g128 reads about a quarter of
        those bytes, int8 half, for the quantization error in the logits that the model's
        other linears already carry. A serving choice: the model's checkpoint keeps a float
        lm_head (`save_pretrained` writes this one quantized).

        Raises:
            ValueError: the lm_head is tied to the embedding table, already quantized, or the
                model is sharded (quantize before sharding).
        """
        spec = QuantSpec.parse(spec)
        if self.lm_head is None:
            raise ValueError(
                "the lm_head is the embedding table (tie_word_embeddings): it is not quantized"
            )
        if isinstance(self.lm_head, QuantizedLinear):
            raise ValueError("the lm_head is already quantized")
        if self.sharding is not None:
            raise ValueError("quantize_lm_head needs an unsharded model (quantize, then shard)")
        w = self.lm_head.weight.get_value()  # [V, H]
        n, k = w.shape
        qe = wj.quantize_experts(
            w[None],
            bits=spec.bits,
            group_size=spec.group_for(k),
            has_zp=spec.has_zp,
            scale_dtype=jnp.dtype(self.cfg.dtype),
        )
        self.lm_head = QuantizedLinear(self.cfg, k, n, rngs=None, qe=qe)

    def dequantize_kv_b(self) -> None:
        """Replaces every quantized kv_b_proj with a float Linear holding its dequantized weight
        (cfg.dtype), in place.

        The absorbed decode multiplies W_UK and W_UV (kv_b_proj's two halves) into every
        token's queries and outputs; a quantized kv_b would be dequantized in every step of
        the decode loop (XLA does not hoist loop-invariant work out of a loop on GPUs).
        `generate` calls this on its own traced copy of the model before the loop, so the
        weights are dequantized once per call and the model's stored kv_b stays quantized.
        Tokens are unchanged: the step dequantized to cfg.dtype as well.
        """
        for _, m in list(nnx.iter_modules(self)):
            if isinstance(m, MLAttention) and isinstance(m.kv_b_proj, QuantizedLinear):
                _, n, k = m.kv_b_proj.weight.shape
                dense = m.kv_b_proj.dense_weight(self.cfg.dtype)
                m.kv_b_proj = Linear(self.cfg, k, n, rngs=None, weight=dense)

    def prepare_decode(self) -> None:
        """What `generate` runs on its traced copy of the model before the decode loop:
        `dequantize_kv_b`."""
        self.dequantize_kv_b()

    @property
    def implementation(self):
        for _, m in nnx.iter_modules(self):
            if isinstance(m, RoutedExperts):
                return m.implementation
        return None

    def set_sharding(self, sharding: ModelSharding | None) -> None:
        """Records the mesh and specs the model runs with on every module that uses them.

        Low level: it moves no weight; `sharding.shard_model` places the weights and calls it.
        Each QuantizedLinear gets its own LinearSharding (`ModelSharding.linear`: the split of
        its weight by the ShardingSpecs field of its name).
        """
        for path, m in nnx.iter_modules(self):
            if isinstance(m, QuantizedLinear):
                m.sharding = None if sharding is None else sharding.linear(path, m.weight)
            elif hasattr(m, "sharding"):
                m.sharding = sharding

    # --- forward -------------------------------------------------------------------------
    def _logits(self, x):
        if isinstance(self.lm_head, QuantizedLinear):
            return self.lm_head(x, out_dtype=_F32)
        if self.lm_head is None:
            w = self.model.embed_tokens.weight.get_value()
        else:
            w = self.lm_head.dense_weight(x.dtype)
        return jnp.einsum("...h,vh->...v", x, w.astype(x.dtype), preferred_element_type=_F32)

    def _run(self, ids, positions, mask, *, mode, cache=None, index=None):
        cos, sin = rope_cos_sin(self.cfg, positions)
        x = constrain(self.sharding, self.model.embed_tokens(ids), "act_btd")
        new = []
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else cache.latent[i]
            x, nc = layer(x, cos=cos, sin=sin, mask=mask, mode=mode, cache=layer_cache, index=index)
            x = constrain(self.sharding, x, "act_btd")
            new.append(nc)
        return self.model.norm(x), new

    def __call__(self, input_ids, attention_mask=None):
        """Logits without a cache.

        Args:
            input_ids: int32 [B, S].
            attention_mask: optional [B, S] (1 = token, 0 = left padding).

        Returns:
            f32 [B, S, vocab].
        """
        check_input_ids(input_ids, self.cfg.vocab_size, attention_mask)
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        key_valid = jnp.asarray(attention_mask).astype(bool)
        x, _ = self._run(
            input_ids, positions_from_mask(key_valid), chunk_mask(key_valid), mode="full"
        )
        return self._logits(x)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        n = cfg.num_hidden_layers
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # R + dr
        return KVCache(
            latent=tuple(jnp.zeros((batch, max_len, width), cfg.dtype) for _ in range(n)),
            valid=jnp.zeros((batch, max_len), bool),
            next_pos=jnp.zeros((batch,), jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    def prefill(self, input_ids, attention_mask, *, max_len: int, return_hidden: bool = False):
        """Runs the (left-padded) prompt and fills a fresh cache of `max_len` slots.

        Args:
            input_ids: int32 [B, S].  attention_mask: [B, S], 0 on left padding.
            max_len: static cache length L >= S.
            return_hidden: also return the final norm's output [B, S, H] (what the MTP layer
                reads).

        Returns:
            (f32 [B, vocab] logits of the last column, KVCache with index = S), then the
            hidden states with return_hidden.
        """
        input_ids = jnp.asarray(input_ids, jnp.int32)
        b, s = input_ids.shape
        if max_len < s:
            raise ValueError(f"max_len={max_len} is shorter than the prompt ({s} tokens)")
        key_valid = jnp.asarray(attention_mask).astype(bool)
        cache = self.init_cache(b, max_len)
        x, new = self._run(
            input_ids,
            positions_from_mask(key_valid),
            chunk_mask(key_valid),
            mode="prefill",
            cache=cache,
        )
        cache = KVCache(
            latent=tuple(new),
            valid=jax.lax.dynamic_update_slice(cache.valid, key_valid, (0, 0)),
            next_pos=key_valid.sum(axis=1).astype(jnp.int32),
            index=jnp.asarray(s, jnp.int32),
        )
        if return_hidden:
            return self._logits(x[:, -1]), cache, x
        return self._logits(x[:, -1]), cache

    def decode(self, tokens, cache: KVCache, *, return_hidden: bool = False):
        """Appends tokens int32 [B, S] (or [B]) to every row and attends over the cache
        (absorbed MLA).

        Returns:
            (f32 logits [B, S, vocab] (or [B, vocab]), the updated KVCache), then with
            return_hidden the final norm's output [B, S, H] (or [B, H]).
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        squeeze = tokens.ndim == 1
        if squeeze:
            tokens = tokens[:, None]
        positions, valid, mask = decode_positions_and_mask(cache, *tokens.shape)
        idx = cache.index
        x, new = self._run(tokens, positions, mask, mode="decode", cache=cache, index=idx)
        s = tokens.shape[1]
        cache = KVCache(
            latent=tuple(new),
            valid=valid,
            next_pos=cache.next_pos + s,
            index=idx + s,
        )
        logits = self._logits(x)
        if squeeze:
            logits, x = logits[:, 0], x[:, 0]
        return (logits, cache, x) if return_hidden else (logits, cache)


def abstract_model(cfg: DeepseekV3Config) -> DeepseekV3ForCausalLM:
    """The model with jax.ShapeDtypeStruct in place of every array (nothing is allocated): the
    frame that loading and random init fill part by part."""
    return nnx.eval_shape(lambda: DeepseekV3ForCausalLM(cfg, rngs=nnx.Rngs(0)))


def random_parts(cfg: DeepseekV3Config) -> list[tuple[tuple, str, Callable[[Rng], nnx.Module]]]:
    """The parts of DeepseekV3ForCausalLM that hold weights, as (path, kind, build(rngs)), in
    the order its constructor draws their random weights: built one after another from one
    random stream they hold the constructor's values. Parts of one kind have the same structure
    (`sharding.init_random` compiles one program per kind)."""
    parts = [(("model", "embed_tokens"), "embed", lambda rngs: Embed(cfg, rngs=rngs))]
    for i in range(cfg.num_hidden_layers):
        kind = "moe_layer" if cfg.is_moe_layer(i) else "dense_layer"
        build = lambda rngs, i=i: DecoderLayer(cfg, i, rngs=rngs)
        parts.append((("model", "layers", i), kind, build))
    norm = lambda rngs: RMSNorm(cfg, cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs)
    parts.append((("model", "norm"), "norm", norm))
    if not cfg.tie_word_embeddings:
        head = lambda rngs: Linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs=rngs)
        parts.append((("lm_head",), "lm_head", head))
    return parts


def linear_at(root: DeepseekV3ForCausalLM, path: tuple):
    """The linear at the HF module path `path` (e.g. ("model", "layers", 0, "mlp",
    "gate_proj")), also while it runs fused: then split off its FusedLinear (canonical
    layout, bit-identical)."""
    owner = module_at(root, path[:-1])
    if isinstance(owner, (MLP, MLAttention)) and path[-1] in owner.FUSION.parts:
        return owner.FUSION.part(owner, path[-1])
    return getattr(owner, path[-1])


def param_bytes(cfg: DeepseekV3Config) -> int:
    """Bytes of the model's weights (from an abstract model: nothing is allocated)."""
    abstract = abstract_model(cfg)
    return sum(
        int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
        for a in jax.tree.leaves(nnx.state(abstract))
    )


def dequantize_model(model: DeepseekV3ForCausalLM) -> DeepseekV3ForCausalLM:
    """A float copy of `model`: every quantized linear and the routed experts replaced by float
    modules holding the dequantized weights (in cfg.dtype). The test oracle for WNA16 layers;
    float experts run 16-bit activations (a W8A8 model's activation_quant is not kept).

    Raises:
        ValueError: the model is sharded (move it to one device with sharding.shard_model).
    """
    if model.sharding is not None:
        raise ValueError("dequantize_model needs an unsharded model: shard_model(model, None)")
    new = nnx.clone(model)
    new._unfuse_linears()  # the HF module tree: a float Linear per part
    cfg = new.cfg
    for path, module in list(nnx.iter_modules(new)):
        if isinstance(module, QuantizedLinear):
            _, n, k = module.weight.shape
            repl = Linear(cfg, k, n, rngs=None, weight=module.dense_weight(_F32))
        elif isinstance(module, RoutedExperts):
            repl = FloatExperts(
                cfg,
                rngs=None,
                w13=wj.dequantize_experts(module.canonical_w13(), _F32),
                w2=wj.dequantize_experts(module.w2.get(), _F32),
            )
        else:
            continue
        set_module(new, path, repl)
    return new
