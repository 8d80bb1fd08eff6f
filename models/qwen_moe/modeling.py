"""Qwen2-MoE and Qwen3-MoE in Flax NNX: GQA attention with a key/value cache, softmax top-k
routing, WNA16 routed experts on the shared layers (models.common.modules).

Module names mirror Hugging Face's (`model.layers.3.self_attn.q_proj.weight`); the routed
experts are stacked (params.py), q/k/v biases are the attention's `q_bias` / `k_bias` /
`v_bias`. Letters in shapes: B batch, S query tokens, L cache slots, T tokens (B*S), H hidden,
n query heads, m key/value heads, g = n / m, D head dim, E experts, k top-k.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import wna16_jax as wj
from models.common.checks import check_input_ids
from models.common.modules import (
    MLP,
    DecoderStack,
    FloatExperts,
    FusedLinear,
    Linear,
    PreNormDecoderLayer,
    QuantizedLinear,
    RMSNorm,
    Rng,
    RoutedExperts,
    activation_quant_of,
    chunk_mask,
    decode_mask,
    make_linear,
    normal,
    positions_from_mask,
    set_module,
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The key/value cache.

    Attributes:
        kv: per layer [B, L, 2, m, D] (model dtype): roped keys, then values.
        valid: bool [B, L]: the slot holds a real token (left padding is False).
        next_pos: int32 [B]: rope position of each row's next token.
        index: int32 []: the next slot to write (shared by all rows).
    """

    kv: tuple
    valid: jax.Array
    next_pos: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


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


class Router(nnx.Module):
    """The MoE gate: weight [E, H] in the model dtype; logits in f32."""

    def __init__(self, cfg: QwenMoeConfig, *, rngs: Rng):
        self.cfg = cfg
        e, h = cfg.num_experts, cfg.hidden_size
        self.weight = nnx.Param(jnp.asarray(normal(rngs, (e, h), h**-0.5), cfg.dtype))

    def __call__(self, x):
        """x [T, H] -> (topk_weights f32 [T, k], topk_ids int32 [T, k])."""
        w = self.weight.get_value().astype(_F32)
        logits = jnp.dot(x.astype(_F32), w.T, precision=_HIGHEST)
        return route(logits, cfg=self.cfg)


class MoE(nnx.Module):
    """Router + routed experts (+ Qwen2's shared expert, scaled by sigmoid(shared_expert_gate))."""

    def __init__(self, cfg: QwenMoeConfig, *, rngs: Rng):
        self.gate = Router(cfg, rngs=rngs)
        if cfg.quantizes("experts"):
            self.experts = RoutedExperts(cfg, rngs=rngs)
        else:
            self.experts = FloatExperts(cfg, rngs=rngs)
        if cfg.shared_expert:
            size = cfg.shared_expert_intermediate_size
            self.shared_expert = MLP(cfg, size, target="shared_experts", rngs=rngs)
            self.shared_expert_gate = Linear(cfg, cfg.hidden_size, 1, rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x):
        b, s, h = x.shape
        xt = x.reshape(b * s, h)
        topk_weights, topk_ids = self.gate(xt)
        out = self.experts(xt, topk_weights, topk_ids).reshape(b, s, h)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# ---- model ----------------------------------------------------------------------------------


class DecoderLayer(PreNormDecoderLayer):
    ATTENTION = Attention
    MOE = MoE


class QwenMoeModel(DecoderStack):
    LAYER = DecoderLayer


class QwenMoeForCausalLM(nnx.Module):
    """The causal LM: `model(input_ids)` -> f32 logits; `prefill` / `decode` for generation
    (models.common.generate)."""

    def __init__(self, cfg: QwenMoeConfig, *, rngs: Rng, implementation=None):
        self.cfg = cfg
        self.model = QwenMoeModel(cfg, rngs=rngs)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs=rngs)
        self.sharding = None  # generation runs it unsharded
        if implementation is not None:
            self.set_implementation(implementation)

    # --- configuration -------------------------------------------------------------------
    def set_implementation(self, implementation) -> None:
        """Selects the fused_moe backend of every routed-expert layer (None = automatic)."""
        if implementation is not None and not isinstance(implementation, str):
            implementation = tuple(implementation)
        for _, m in nnx.iter_modules(self):
            if isinstance(m, RoutedExperts):
                m.implementation = implementation

    @property
    def implementation(self):
        for _, m in nnx.iter_modules(self):
            if isinstance(m, RoutedExperts):
                return m.implementation
        return None

    def set_linear_implementation(
        self, implementation: str, *, fuse: bool = True, progress: bool = True
    ) -> None:
        """Runs every quantized linear on `implementation` ("xla", "auto" or a backend with a
        grouped GEMM), its weight in the layout that backend reads (a weight no kernel takes
        stays on the float dot). With a kernel and `fuse`, an MLP's gate_proj and up_proj run
        as one GEMM (`Fusion`: silu(gate) * up in its epilogue) where both are quantized
        alike; "xla" splits them back. `progress` is accepted for the DeepSeek model's
        signature (the Qwen layers convert without a bar)."""
        if implementation != "auto" and implementation not in wj.registered_backends():
            raise ValueError(
                f"linear implementation {implementation!r} is neither 'auto' nor a registered "
                f"backend {wj.registered_backends()}"
            )
        chosen = None if implementation == "auto" else implementation
        mlps = [m for _, m in nnx.iter_modules(self) if isinstance(m, MLP)]
        for m in mlps:
            m.FUSION.unfuse(m)
        if fuse and implementation != "xla":
            for m in mlps:
                parts = m.FUSION.unfused(m)
                if parts and all(isinstance(p, QuantizedLinear) for p in parts.values()):
                    m.FUSION.fuse(m, chosen, cfg=self.cfg)  # else they stay two GEMMs
        for m in self.gemm_linears().values():
            if not isinstance(m, FusedLinear):
                m.set_implementation(chosen, dtype=self.cfg.dtype)

    def gemm_linears(self) -> dict[str, QuantizedLinear]:
        """{module path: layer} of the quantized linears (FusedLinears in place of parts)."""
        return {
            ".".join(map(str, path)): m
            for path, m in nnx.iter_modules(self)
            if isinstance(m, QuantizedLinear)
        }

    def dequantized_linears(self) -> dict[str, QuantizedLinear]:
        """None here: every quantized linear runs as a GEMM (unlike MLA's kv_b_proj)."""
        return {}

    def fused_linears(self) -> list[str]:
        """The module paths of the FusedLinears this model runs."""
        return [p for p, m in self.gemm_linears().items() if isinstance(m, FusedLinear)]

    def set_activation_quant(self, activation_quant) -> None:
        """Sets how every routed-expert layer quantizes its activations (fused_moe's
        activation_quant; None: 16-bit)."""
        aq = activation_quant_of(activation_quant)
        for _, m in nnx.iter_modules(self):
            if isinstance(m, RoutedExperts):
                m.activation_quant = aq

    def set_expert_layout(self, layout: str, *, progress: bool = True) -> None:
        """Converts every routed-expert layer's weights to `layout` (wna16_jax.layouts), one
        layer at a time (no second copy kept); `progress` as in set_linear_implementation."""
        for _, m in nnx.iter_modules(self):
            if isinstance(m, RoutedExperts):
                m.set_layout(layout)

    def resolve_expert_layout(self, requested: str, implementation=None) -> str:
        """ "auto": the layout a named implementation reads for the experts' bits
        (`wna16_jax.backend_layout`), else wna16_jax.preferred_layout; a named layout as is."""
        if requested != "auto":
            return requested
        experts = [m for _, m in nnx.iter_modules(self) if isinstance(m, RoutedExperts)]
        if not experts:
            return "canonical"
        if implementation is not None:
            first = implementation if isinstance(implementation, str) else implementation[0]
            return wj.backend_layout(first, bits=experts[0].w13.bits)
        m = experts[0]
        return wj.preferred_layout(
            m.w13.get(), m.w2.get(), dtype=self.cfg.dtype, activation_quant=m.activation_quant
        )

    def prepare_decode(self) -> None:
        """Nothing to prepare before the decode loop (models.common.generate calls it)."""

    # --- forward -------------------------------------------------------------------------
    def _logits(self, x):
        if isinstance(self.lm_head, QuantizedLinear):
            return self.lm_head(x, out_dtype=_F32)
        if self.lm_head is None:
            w = self.model.embed_tokens.weight.get_value()
        else:
            w = self.lm_head.dense_weight(x.dtype)
        return jnp.einsum(
            "...h,vh->...v", x, w.astype(x.dtype), precision=_HIGHEST, preferred_element_type=_F32
        )

    def _run(self, ids, positions, mask, *, mode, cache=None, index=None):
        cos, sin = rope_cos_sin(self.cfg, positions)
        x = self.model.embed_tokens(ids)
        new = []
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else cache.kv[i]
            x, nc = layer(x, cos=cos, sin=sin, mask=mask, mode=mode, cache=layer_cache, index=index)
            new.append(nc)
        return self.model.norm(x), new

    def __call__(self, input_ids, attention_mask=None):
        """input_ids int32 [B, S], attention_mask [B, S] (0 on left padding) -> f32
        [B, S, vocab] logits, without a cache."""
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
        shape = (batch, max_len, 2, cfg.num_key_value_heads, cfg.head_dim)
        return KVCache(
            kv=tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_hidden_layers)),
            valid=jnp.zeros((batch, max_len), bool),
            next_pos=jnp.zeros((batch,), jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )

    def prefill(self, input_ids, attention_mask, *, max_len: int):
        """Runs the left-padded prompt int32 [B, S] and fills a fresh cache of `max_len` slots:
        -> (f32 [B, vocab] logits of the last column, KVCache with index = S)."""
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
            kv=tuple(new),
            valid=jax.lax.dynamic_update_slice(cache.valid, key_valid, (0, 0)),
            next_pos=key_valid.sum(axis=1).astype(jnp.int32),
            index=jnp.asarray(s, jnp.int32),
        )
        return self._logits(x[:, -1]), cache

    def decode(self, tokens, cache: KVCache):
        """Appends tokens int32 [B, S] (or [B]) to every row: -> (f32 logits [B, S, vocab]
        (or [B, vocab]), the updated KVCache)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        squeeze = tokens.ndim == 1
        if squeeze:
            tokens = tokens[:, None]
        b, s = tokens.shape
        idx = cache.index
        positions = cache.next_pos[:, None] + jnp.arange(s, dtype=jnp.int32)[None]
        valid = jax.lax.dynamic_update_slice(cache.valid, jnp.ones((b, s), bool), (0, idx))
        mask = decode_mask(valid, idx, s)
        x, new = self._run(tokens, positions, mask, mode="decode", cache=cache, index=idx)
        cache = KVCache(kv=tuple(new), valid=valid, next_pos=cache.next_pos + s, index=idx + s)
        logits = self._logits(x)
        return (logits[:, 0] if squeeze else logits), cache


# Above this many bytes of weights a random model is drawn on the device (jax.random), below
# it on the host with numpy (XLA would compile each random op of a tiny model separately).
HOST_INIT_MAX_BYTES = 1 << 30


def param_bytes(cfg: QwenMoeConfig) -> int:
    """Bytes of the model's weights (from an abstract model: nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: QwenMoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    return sum(
        int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
        for a in jax.tree.leaves(nnx.state(abstract))
    )


def init_random(
    cfg: QwenMoeConfig, *, seed: int = 0, implementation=None, on_device: bool | None = None
) -> QwenMoeForCausalLM:
    """A model of random weights, quantized where cfg.quant says (scales in
    cfg.quant.scale_dtype, e.g. GPTQ's float16): drawn on the device (`on_device`, default
    above HOST_INIT_MAX_BYTES) or with numpy on the host."""
    if on_device is None:
        on_device = param_bytes(cfg) > HOST_INIT_MAX_BYTES
    rngs = nnx.Rngs(seed) if on_device else np.random.default_rng(seed)
    return QwenMoeForCausalLM(cfg, rngs=rngs, implementation=implementation)


def dequantize_model(model: QwenMoeForCausalLM) -> QwenMoeForCausalLM:
    """A float copy of `model` (each quantized linear and the routed experts dequantized in
    f32): the oracle of the quantized layers."""
    new = nnx.clone(model)
    for _, m in nnx.iter_modules(new):
        if isinstance(m, MLP):
            m.FUSION.unfuse(m)  # the HF module tree: a float Linear per part
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
