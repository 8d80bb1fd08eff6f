"""DeepSeek-V3's multi-token-prediction (MTP) layer: the draft head of speculative decoding.

The layer (DeepSeek's `num_nextn_predict_layers: 1`, stored as layer `num_hidden_layers` of the
checkpoint) predicts the token after next. For a position i it reads the main model's final
hidden state h_i (after the final norm) and the embedding of the next token t_{i+1}:

    x   = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])     # [H] from [2H], embedding first
    g_i = DecoderLayer(x)                                    # MLA + MoE, its own latent cache
    logits of t_{i+2} = head(shared_head.norm(g_i))

The embedding and the head are the main model's (DeepSeek shares them; the checkpoint's copies
under the layer are not read). Chained drafting feeds the layer its own output g_i as the
next position's hidden state, as the serving engines do. Letters as in modeling.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.common.causal_lm import empty_cache
from models.common.modules import chunk_mask, positions_from_mask
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.modeling import (
    DecoderLayer,
    KVCache,
    QuantizedLinear,
    RMSNorm,
    Rng,
    decode_positions_and_mask,
    make_linear,
    rope_cos_sin,
)

# The MTP layer's own tensors beside its decoder layer's (NAME_TABLE's "layer." rows), in
# NAME_TABLE's columns: (name under the layer, kind, shape letters, quantization target).
# eh_proj stays float unless the checkpoint stores it quantized (as lm_head: not a target).
# fmt: off
MTP_NAME_TABLE: tuple[tuple[str, str, str, str | None], ...] = (
    ("enorm",             "weight", "H",    None),
    ("hnorm",             "weight", "H",    None),
    ("eh_proj",           "linear", "H H2", None),
    ("shared_head.norm",  "weight", "H",    None),
)
# fmt: on
# The attribute of DeepseekV3ForCausalLM that holds the layer (its module paths start here).
MTP_ATTRIBUTE = "mtp"


class SharedHead(nnx.Module):
    """The norm before the (shared) output head."""

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng):
        self.norm = RMSNorm(cfg, cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs)


class MultiTokenPredictor(DecoderLayer):
    """The MTP layer: a decoder layer (the checkpoint's layer `num_hidden_layers`: its
    self_attn, mlp and norms under the HF names) with enorm, hnorm, eh_proj [H, 2H] and
    shared_head.norm."""

    def __init__(self, cfg: DeepseekV3Config, *, rngs: Rng):
        super().__init__(cfg, cfg.num_hidden_layers, rngs=rngs)
        h = cfg.hidden_size
        self.enorm = RMSNorm(cfg, h, eps=cfg.rms_norm_eps, rngs=rngs)
        self.hnorm = RMSNorm(cfg, h, eps=cfg.rms_norm_eps, rngs=rngs)
        self.eh_proj = make_linear(cfg, 2 * h, h, target=None, rngs=rngs)
        self.shared_head = SharedHead(cfg, rngs=rngs)

    def predict(self, hidden, embedded, **attn_kw):
        """hidden [B, S, H] (the main model's final hidden states, or this layer's own output),
        embedded [B, S, H] (the next tokens' embeddings) -> (g [B, S, H] before shared_head's
        norm, the layer's new latent). attn_kw: MLAttention's (cos, sin, mask, mode, cache,
        index)."""
        x = jnp.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1)
        return self(self.eh_proj(x), **attn_kw)


def check_mtp_config(cfg: DeepseekV3Config) -> None:
    """Raises ValueError unless the config holds one MTP layer."""
    if cfg.num_nextn_predict_layers != 1:
        raise ValueError(
            f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}: the MTP layer needs a "
            f"config with num_nextn_predict_layers=1 (DeepSeek-V3's one layer)"
        )


def saved_copies(model) -> dict:
    """The MTP layer's copies of the shared embedding and head, as DeepSeek's checkpoints hold
    them (engines that load the layer apart read them; loading here does not); none beside a
    quantized head."""
    if isinstance(model.lm_head, QuantizedLinear):
        return {}
    layer = f"model.layers.{model.cfg.num_hidden_layers}"
    embed = model.model.embed_tokens.weight.get_value()
    head = embed if model.lm_head is None else model.lm_head.weight.get_value()
    return {f"{layer}.embed_tokens.weight": embed, f"{layer}.shared_head.head.weight": head}


def random_mtp(cfg: DeepseekV3Config, *, seed: int, on_device: bool) -> MultiTokenPredictor:
    """A random MTP layer (quantized as `cfg.quant` says), from its own random stream (the main
    model's weights are those drawn without it): numpy on the host, or one jitted program."""
    check_mtp_config(cfg)
    if not on_device:
        return MultiTokenPredictor(cfg, rngs=np.random.default_rng((seed, 1)))
    key = jax.random.fold_in(jax.random.key(seed), 1)
    abstract = nnx.eval_shape(lambda: MultiTokenPredictor(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda k: nnx.state(MultiTokenPredictor(cfg, rngs=nnx.Rngs(k))))(key)
    return nnx.merge(graphdef, state)


# ---- forward helpers (the speculative loop's) -----------------------------------------------


def draft_logits(model, g):
    """f32 [..., V]: the MTP layer's logits from its output g [..., H] through the main
    model's head."""
    return model._logits(model.mtp.shared_head.norm(g))


def init_mtp_cache(model, batch: int, max_len: int) -> KVCache:
    """An empty latent cache for the MTP layer (one layer's)."""
    return empty_cache(model.cache_layer_shape(batch, max_len), 1, model.cfg.dtype)


def mtp_prefill(model, hidden, next_ids, attention_mask, *, max_len: int):
    """The MTP layer over a (left-padded) prompt: position i reads hidden [B, S, H] (the main
    model's prefill) and next_ids [B, S] (the token after position i: the prompt shifted left
    by one, then the first sampled token). Returns (g [B, S, H], its KVCache, index = S)."""
    key_valid = jnp.asarray(attention_mask).astype(bool)
    b, s = key_valid.shape
    cache = init_mtp_cache(model, b, max_len)
    positions = positions_from_mask(key_valid)
    cos, sin = rope_cos_sin(model.cfg, positions)
    g, latent = model.mtp.predict(
        hidden,
        model.model.embed_tokens(next_ids),
        cos=cos,
        sin=sin,
        mask=chunk_mask(key_valid),
        mode="prefill",
        cache=cache.layers[0],
    )
    cache = KVCache(
        layers=(latent,),
        valid=jax.lax.dynamic_update_slice(cache.valid, key_valid, (0, 0)),
        next_pos=key_valid.sum(axis=1).astype(jnp.int32),
        index=jnp.asarray(s, jnp.int32),
    )
    return g, cache


def mtp_decode(model, hidden, next_ids, cache: KVCache):
    """The MTP layer at S new positions of every row (slots index..index+S-1, as
    DeepseekV3ForCausalLM.decode): hidden [B, S, H], next_ids int32 [B, S]. Returns (g [B, S,
    H], the KVCache with the S slots written and valid, next_pos and index advanced by S)."""
    b, s = next_ids.shape
    positions, valid, mask = decode_positions_and_mask(cache, b, s)
    cos, sin = rope_cos_sin(model.cfg, positions)
    g, latent = model.mtp.predict(
        hidden,
        model.model.embed_tokens(next_ids),
        cos=cos,
        sin=sin,
        mask=mask,
        mode="decode",
        cache=cache.layers[0],
        index=cache.index,
    )
    cache = KVCache(
        layers=(latent,), valid=valid, next_pos=cache.next_pos + s, index=cache.index + s
    )
    return g, cache
