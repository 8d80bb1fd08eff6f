"""The grouped-query attention of the families with a key/value cache per layer (Qwen-MoE,
gpt-oss): projections with optional biases and q/k norms, HF's rotate-half rope, the cache
modes of models.common.causal_lm. Letters in shapes: B batch, S query tokens, L cache slots,
H hidden, n query heads, m key/value heads, g = n / m, D head dim."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.common.modules import ROW_BLOCK, RMSNorm, Rng, in_row_blocks, make_linear, normal

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST

# Cache slots per step of `attend_in_chunks`. generate's prompt and cache buckets are
# multiples of it, so a row's tokens sit at the same place inside their chunks whatever the
# bucket (the left padding of a longer batch shifts them by whole chunks).
KEY_CHUNK = ROW_BLOCK


def attend_in_chunks(q, k, v, mask, *, scale: float, sinks=None, chunk: int = KEY_CHUNK):
    """softmax(q k^T * scale) v with reductions that depend on neither the batch nor the cache
    length: each row (jax.lax.map) and each block of queries (`in_row_blocks`) alone, the keys
    in chunks of `chunk` slots summed one chunk after another (an online softmax: running max,
    sum and output rescaled per chunk). Chunks holding no visible key change nothing, so the
    same tokens at a shift of whole chunks give the same bits. The batch-invariant form of
    the families' attention (`batch_invariant`).

    Args:
        q: [B, S, n, Dk]; query head j*g + i reads key/value head j (g = n / m).
        k: [B, L, m, Dk].  v: [B, L, m, Dv].
        mask: bool [B, S, L], True where a query sees a key (each query sees one at least).
        scale: the scores' factor.
        sinks: None, or f32 [n]: a logit per query head in every softmax, whose share is
            dropped (gpt-oss).

    Returns:
        f32 [B, S, n, Dv].
    """
    b, s, n, dk = q.shape
    length, m, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = n // m
    pad = -length % chunk
    if pad:  # slots past the end: never seen
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    chunks = (length + pad) // chunk
    if sinks is None:
        m0, l0 = jnp.full((n,), -jnp.inf, _F32), jnp.zeros((n,), _F32)
    else:  # the sink is the first key: exp(sink - sink) = 1 in the sum, nothing in the output
        m0, l0 = sinks.astype(_F32), jnp.ones((n,), _F32)

    def block(qb, mb, kc, vc):
        """qb [Q, n, Dk], mb [Q, L] against one row's keys kc [C, chunk, m, Dk], values
        vc [C, chunk, m, Dv] -> [Q, n, Dv]."""
        rows = qb.shape[0]
        qg = qb.reshape(rows, m, g, dk)
        mc = mb.reshape(rows, chunks, chunk).swapaxes(0, 1)  # [C, Q, chunk]

        def step(carry, xs):
            run_max, total, acc = carry  # [Q, n], [Q, n], [Q, n, Dv]
            kj, vj, mj = xs
            sc = (
                jnp.einsum(
                    "qmgd,cmd->qmgc", qg, kj, precision=_HIGHEST, preferred_element_type=_F32
                ).reshape(rows, n, chunk)
                * scale
            )
            seen = mj[:, None, :]  # [Q, 1, chunk]
            new_max = jnp.maximum(run_max, jnp.where(seen, sc, -jnp.inf).max(axis=-1))
            empty = new_max == -jnp.inf  # nothing seen yet: keep the zeros
            alpha = jnp.where(empty, 0.0, jnp.exp(run_max - jnp.where(empty, 0.0, new_max)))
            p = jnp.where(seen, jnp.exp(sc - new_max[..., None]), 0.0)  # [Q, n, chunk]
            pv = jnp.einsum(
                "qmgc,cmd->qmgd",
                p.reshape(rows, m, g, chunk).astype(vj.dtype),
                vj,
                precision=_HIGHEST,
                preferred_element_type=_F32,
            )
            total = total * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + pv.reshape(rows, n, dv)
            return (new_max, total, acc), None

        init = (
            jnp.broadcast_to(m0, (rows, n)),
            jnp.broadcast_to(l0, (rows, n)),
            jnp.zeros((rows, n, dv), _F32),
        )
        (_, total, acc), _ = jax.lax.scan(step, init, (kc, vc, mc))
        return acc / total[..., None]

    def row(args):
        qr, mr, kr, vr = args  # [S, n, Dk], [S, L], [L, m, Dk], [L, m, Dv]
        kc = kr.reshape(chunks, chunk, m, dk)
        vc = vr.reshape(chunks, chunk, m, dv)
        return in_row_blocks(lambda qb, mb: block(qb, mb, kc, vc), qr, mr, rows=min(s, chunk))

    return jax.lax.map(row, (q, mask, k, v))


def apply_rope(x, cos, sin):
    """x [B, S, heads, D] * cos + rotate_half(x) * sin, in x.dtype (cos/sin cast to it, as HF)."""
    d = x.shape[-1]
    cos, sin = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
    rot = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def kv_cache_shape(cfg, batch: int, max_len: int) -> tuple[int, ...]:
    """One layer's cache entry: keys then values [B, L, 2, m, D] (roped keys)."""
    return (batch, max_len, 2, cfg.num_key_value_heads, cfg.head_dim)


def _bias(cfg, n: int, rngs: Rng, present: bool):
    return nnx.Param(jnp.asarray(normal(rngs, (n,), 0.1), cfg.dtype)) if present else None


class Attention(nnx.Module):
    """GQA with a key/value cache: q_proj [n*D, H], k_proj / v_proj [m*D, H], o_proj [H, n*D];
    biases on q/k/v where cfg.qkv_bias, on o where cfg.o_bias; q_norm / k_norm (RMSNorm over
    each head's D) before the rope where cfg.qk_norm. A family overrides `_attend` to change
    the softmax (gpt-oss's sinks)."""

    def __init__(self, cfg, *, rngs: Rng):
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
        self.o_bias = _bias(cfg, h, rngs, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, d, eps=cfg.rms_norm_eps, rngs=rngs)
            self.k_norm = RMSNorm(cfg, d, eps=cfg.rms_norm_eps, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    batch_invariant = False  # `attend_in_chunks`

    def sink_logits(self):
        """f32 [n]: a logit per query head that joins every softmax (its share dropped), or
        None (a family with sinks overrides it)."""
        return None

    @staticmethod
    def _linear(proj, bias, x):
        y = proj(x)
        return y if bias is None else y + bias.get_value().astype(y.dtype)

    def _attend(self, q, k, v, mask):
        """q [B, S, n, D], k / v [B, L, m, D], mask bool [B, S, L] -> [B, S, n, D]."""
        b, s, n, d = q.shape
        m = k.shape[2]
        if self.batch_invariant:
            out = attend_in_chunks(q, k, v, mask, scale=d**-0.5, sinks=self.sink_logits())
            return out.astype(q.dtype)
        qg = q.reshape(b, s, m, n // m, d)  # query head j*g + i reads key/value head j
        scores = jnp.einsum(
            "bsmgd,blmd->bmgsl", qg, k, precision=_HIGHEST, preferred_element_type=_F32
        )
        scores = scores * d**-0.5
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(_F32).min)
        probs = self._softmax(scores).astype(q.dtype)
        out = jnp.einsum(
            "bmgsl,blmd->bsmgd", probs, v, precision=_HIGHEST, preferred_element_type=_F32
        )
        return out.astype(q.dtype).reshape(b, s, n, d)

    def _softmax(self, scores):
        """The attention weights of the masked, scaled scores f32 [B, m, g, S, L] (a family
        with another softmax overrides it)."""
        return jax.nn.softmax(scores, axis=-1)

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
