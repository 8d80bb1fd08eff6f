"""Speculative decoding with the MTP draft layer: draft k tokens, verify k + 1 in one forward.

Each step of the loop (a lax.while_loop on the device, no host round trip) feeds the main model
the row's last token and its k drafts at once (the latent cache takes the k + 1 positions),
accepts a prefix of the drafts (greedy: those equal to the model's argmax; sampling: rejection
sampling, so the tokens follow the model's own distribution), and appends the accepted drafts
and one token of the model's own (the correction after a rejected draft, or the bonus token
after k accepted). The MTP layer then reads the accepted positions' hidden states (its own
cache takes them) and drafts the next k tokens, chained: each draft feeds its own output back.

Rows accept different counts. The cache's write slot (`KVCache.index`) is shared by the rows:
each step writes slots index..index+k of every row, keeps the accepted ones valid (`valid`),
marks the rejected ones invalid (never attended again) and advances `index` by one more than
the most drafts any row accepted, so the slots no row keeps are written again by the next step.
A row's rope positions (`next_pos`) advance by its own count.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.common.generate import (
    SPECULATIVE_DECODERS,
    GenerateStats,
    _compiled,
    bucket,
    logger,
    sampling_kind,
    scaled_logits,
)
from models.deepseek_v3.modeling import KVCache
from models.deepseek_v3.mtp import draft_logits, mtp_decode, mtp_prefill

MAX_DRAFT_TOKENS = 3  # the published MTP speed-ups use 1 to 3 chained drafts


@dataclasses.dataclass(frozen=True)
class SpeculativeStats(GenerateStats):
    """GenerateStats of a speculative generate(): the verify steps and the drafts accepted."""

    num_draft_tokens: int = 0  # k: drafts per step
    verify_steps: int = 0  # the loop's trips: one forward of k + 1 tokens for every row
    row_steps: int = 0  # verify steps summed over the rows still generating in them
    accepted: int = 0  # drafts accepted, summed over the rows

    @property
    def decode_steps(self) -> int:
        return self.verify_steps

    @property
    def acceptance_rate(self) -> float:
        """The share of the drafts that the model accepted."""
        proposed = self.num_draft_tokens * self.row_steps
        return self.accepted / proposed if proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row gains per verify step: accepted drafts + the model's own token."""
        return (self.accepted + self.row_steps) / self.row_steps if self.row_steps else 0.0

    @property
    def token_s(self) -> float:
        """Seconds of decoding per generated token of a row (the first comes from the
        prefill)."""
        return self.decode_s / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    def __str__(self) -> str:
        return (
            f"{super().__str__()}; MTP with {self.num_draft_tokens} drafts: acceptance "
            f"{self.acceptance_rate:.1%}, {self.tokens_per_step:.2f} tokens per step, "
            f"{self.token_s * 1e3:.2f} ms per token"
        )


def check_mtp_decoding(model, num_draft_tokens: int) -> None:
    """Raises ValueError (TypeError for a non-int count) where `model` cannot decode with its
    MTP layer and `num_draft_tokens` drafts."""
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)):
        raise TypeError(f"num_draft_tokens must be an int, got {num_draft_tokens!r}")
    if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} is not in [1, {MAX_DRAFT_TOKENS}]")
    if model.mtp is None:
        raise ValueError(
            "speculative='mtp' needs the model's MTP layer: load_pretrained(..., mtp=True), or "
            "init_random with num_nextn_predict_layers=1 in the config"
        )
    if model.sharding is not None:
        raise ValueError("speculative='mtp' runs on one device: the model is sharded")


def cache_slots(batch: int, max_new_tokens: int, k: int) -> int:
    """Cache slots past the prompt that the loop may write. A step advances the write slot by
    1 + the most drafts a row accepted (<= k + 1), and by no more than the tokens that row
    gains; a row gains at most max_new_tokens - 1 + k (the first token is the prefill's),
    and its last step may end early at an eos (k more); then the last step writes k + 1."""
    steps = max(max_new_tokens - 1, 0)
    return min(batch * (steps + 2 * k), steps * (k + 1)) + k + 1


def sampling_probs(logits, temperature, top_p, *, nucleus: bool):
    """f32 [..., V]: the distribution `generate.sample` draws from (softmax of logits /
    temperature, restricted with `nucleus` to the smallest set of tokens reaching top_p)."""
    scaled = scaled_logits(logits, temperature)
    if not nucleus:
        return jax.nn.softmax(scaled, axis=-1)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_x = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p
    kept = jax.nn.softmax(jnp.where(keep, sorted_x, -jnp.inf), axis=-1)
    return jnp.take_along_axis(kept, jnp.argsort(order, axis=-1), axis=-1)


def _draw(probs, key):
    """int32 [...] tokens drawn from probs [..., V]."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def accept(logits, drafts, draft_probs, key, temperature, top_p, *, greedy: bool, nucleus: bool):
    """Which drafts the model accepts, and the tokens a row gains.

    Args:
        logits: f32 [B, k + 1, V]: the model's at the row's last token and its k drafts.
        drafts: int32 [B, k].
        draft_probs: f32 [B, k, V] the drafts were drawn from (None when greedy).

    Returns:
        (n int32 [B] in [0, k]: drafts accepted, tokens int32 [B, k + 1]: the row gains
        tokens[:, :n + 1], the accepted drafts and then the model's own token).

    Greedy: a draft is accepted while it equals the model's argmax, and the argmax follows.
    Sampling (p the model's distribution, q the draft's): draft i is accepted with probability
    min(1, p_i(d) / q_i(d)); at the first rejection the token is drawn from max(0, p - q)
    renormalized, after k acceptances from p_k; the tokens are then distributed as p.
    """
    k = drafts.shape[1]
    if greedy:
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k + 1]
        match = drafts == target[:, :k]
        n = jnp.cumprod(match, axis=1).sum(axis=1).astype(jnp.int32)
        return n, target
    key_u, key_t = jax.random.split(key)
    p = sampling_probs(logits, temperature, top_p, nucleus=nucleus)  # [B, k + 1, V]
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, k]
    qd = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    ok = jax.random.uniform(key_u, pd.shape) * qd < pd
    n = jnp.cumprod(ok, axis=1).sum(axis=1).astype(jnp.int32)
    residual = jnp.maximum(p[:, :k] - draft_probs, 0.0)
    total = residual.sum(axis=-1, keepdims=True)
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p[:, :k])
    after = jnp.concatenate([residual, p[:, k:]], axis=1)  # [B, k + 1, V]
    last = _draw(jnp.take_along_axis(after, n[:, None, None], axis=1)[:, 0], key_t)  # [B]
    place = jnp.arange(k + 1)[None] == n[:, None]
    tokens = jnp.where(place, last[:, None], jnp.concatenate([drafts, last[:, None]], axis=1))
    return n, tokens


def _settle(cache: KVCache, index, next_pos, keep, gained, advance) -> KVCache:
    """The cache after a step that wrote slots index..index+k: slot index+i of a row stays
    valid where keep [B, k + 1]; next_pos advances by gained [B], index by advance."""
    valid = jax.lax.dynamic_update_slice(cache.valid, keep, (0, index))
    return KVCache(
        layers=cache.layers, valid=valid, next_pos=next_pos + gained, index=index + advance
    )


def _speculative_decode(
    state,
    logits,
    cache,
    hidden,
    tokens,
    mask,
    key,
    temperature,
    top_p,
    *,
    graphdef,
    steps,
    k,
    greedy,
    nucleus,
    eos_ids,
    fill_id,
    cache_len,
):
    """`steps` tokens per row from the prefill's logits [B, V], cache and hidden states [B, S,
    H] of the padded prompt tokens / mask [B, S]. Returns (int32 [B, steps], int32 [3]: the
    verify steps, the row steps, the accepted drafts; the cache, so that its donated input
    buffers serve as the loop's)."""
    model = nnx.merge(graphdef, state)
    model.dequantize_kv_b()  # before the loop: once per call, not every step
    b = logits.shape[0]
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    width = steps + k + 1  # a row's last step may write k tokens past `steps`
    places = jnp.arange(k + 1, dtype=jnp.int32)

    def draw(logits, key):
        """(tokens [...], their distribution [..., V] or None when greedy)."""
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        probs = sampling_probs(logits, temperature, top_p, nucleus=nucleus)
        return _draw(probs, key), probs

    def drafts_from(g_last, mcache, key):
        """k chained drafts from the MTP output g_last [B, H] at each row's last position;
        the chained positions are written past mcache.index (the next step rewrites them)."""
        keys = jax.random.split(key, k)
        d, q = draw(draft_logits(model, g_last), keys[0])
        ds, qs, g, c = [d], [q], g_last, mcache
        for j in range(1, k):
            g, c = mtp_decode(model, g[:, None], ds[-1][:, None], c)
            d, q = draw(draft_logits(model, g[:, 0]), keys[j])
            ds.append(d)
            qs.append(q)
            g = g[:, 0]
        c = KVCache(layers=c.layers, valid=c.valid, next_pos=mcache.next_pos, index=mcache.index)
        return jnp.stack(ds, axis=1), None if greedy else jnp.stack(qs, axis=1), c

    key, sub = jax.random.split(key)
    tok, _ = draw(logits, sub)
    out = jnp.full((b, width), fill_id, jnp.int32).at[:, 0].set(tok)
    count = jnp.ones((b,), jnp.int32)
    done = jnp.isin(tok, eos) | (count >= steps)
    # The MTP layer over the prompt: position i reads the token after it.
    next_ids = jnp.concatenate([tokens[:, 1:], tok[:, None]], axis=1)
    g, mcache = mtp_prefill(model, hidden, next_ids, mask, max_len=cache_len)
    key, sub = jax.random.split(key)
    drafts, q, mcache = drafts_from(g[:, -1], mcache, sub)
    counters = jnp.zeros((3,), jnp.int32)  # verify steps, row steps, accepted drafts

    def cond(carry):
        done, counters = carry[7], carry[9]
        return jnp.any(~done) & (counters[0] < steps)

    def body(carry):
        tok, drafts, q, cache, mcache, out, count, done, key, counters = carry
        active = ~done
        index, pos = cache.index, cache.next_pos
        logits, cache, h = model.decode(
            jnp.concatenate([tok[:, None], drafts], axis=1), cache, return_hidden=True
        )
        key, key_accept, key_draft = jax.random.split(key, 3)
        n, new = accept(
            logits, drafts, q, key_accept, temperature, top_p, greedy=greedy, nucleus=nucleus
        )
        n = jnp.where(active, n, 0)
        gained = jnp.where(active, n + 1, 0)
        # A row ends at its first eos among the tokens it gains.
        is_eos = jnp.isin(new, eos) & (places[None] < gained[:, None])
        ends = jnp.any(is_eos, axis=1)
        written = jnp.where(ends, jnp.argmax(is_eos, axis=1) + 1, gained)
        cols = jnp.where(places[None] < written[:, None], count[:, None] + places[None], width)
        out = out.at[jnp.arange(b)[:, None], cols].set(new, mode="drop")
        count = count + written
        done = done | ends | (count >= steps)
        counters = counters + jnp.stack(
            [jnp.ones((), jnp.int32), active.sum(dtype=jnp.int32), n.sum(dtype=jnp.int32)]
        )
        # Slots index..index+n of a row hold accepted inputs (its last token, n drafts).
        keep = (places[None] <= n[:, None]) & active[:, None]
        advance = 1 + n.max()
        cache = _settle(cache, index, pos, keep, gained, advance)
        # The MTP layer at the same positions: the hidden states just computed, each with the
        # token the row now has after it (garbage past n: those slots are dropped).
        g, mcache = mtp_decode(model, h, new, mcache)
        mcache = _settle(mcache, index, pos, keep, gained, advance)
        g_last = jnp.take_along_axis(g, n[:, None, None], axis=1)[:, 0]
        drafts, q, mcache = drafts_from(g_last, mcache, key_draft)
        tok = jnp.take_along_axis(new, n[:, None], axis=1)[:, 0]
        return tok, drafts, q, cache, mcache, out, count, done, key, counters

    carry = (tok, drafts, q, cache, mcache, out, count, done, key, counters)
    carry = jax.lax.while_loop(cond, body, carry)
    return carry[5][:, :steps], carry[9], carry[3]


def _prefill(state, tokens, mask, *, graphdef, cache_len):
    model = nnx.merge(graphdef, state)
    return model.prefill(tokens, mask, max_len=cache_len, return_hidden=True)


def generate_speculative(
    model,
    tokens: np.ndarray,
    padded: np.ndarray,
    pmask: np.ndarray,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    eos_ids: tuple[int, ...],
    fill_id: int,
    num_draft_tokens: int,
    return_stats: bool,
    warmup: bool,
):
    """generate()'s speculative path, after its checks and padding: tokens int [B, S] as
    given, padded / pmask [B, S_b] the bucketed prompt. Returns what generate() returns, the
    stats a SpeculativeStats.

    Raises:
        ValueError, TypeError: `check_mtp_decoding`'s, before any device work.
    """
    check_mtp_decoding(model, num_draft_tokens)
    b, s = tokens.shape
    s_b = padded.shape[1]
    k = num_draft_tokens
    cache_len = bucket(s_b + cache_slots(b, max_new_tokens, k))
    graphdef, state = nnx.split(model)
    prefill, c1 = _compiled(
        _prefill, {"graphdef": graphdef, "cache_len": cache_len}, state, padded, pmask
    )
    if warmup:
        jax.block_until_ready(prefill(state, padded, pmask))
    t0 = time.perf_counter()
    logits, cache, hidden = jax.block_until_ready(prefill(state, padded, pmask))
    t1 = time.perf_counter()
    args = (
        state,
        logits,
        cache,
        hidden,
        jnp.asarray(padded),
        jnp.asarray(pmask),
        jax.random.key(seed),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_p, jnp.float32),
    )
    statics = {
        "graphdef": graphdef,
        "steps": max_new_tokens,
        "k": k,
        **sampling_kind(temperature, top_p),
        "eos_ids": eos_ids,
        "fill_id": fill_id,
        "cache_len": cache_len,
    }
    # The cache (argument 2) is donated: the loop updates the prefill's buffers in place.
    decode, c2 = _compiled(_speculative_decode, statics, *args, donate=(2,))
    if warmup:
        copy = (*args[:2], jax.tree.map(jnp.copy, cache), *args[3:])
        jax.block_until_ready(decode(*copy))
    t2 = time.perf_counter()
    new, counters, _ = jax.block_until_ready(decode(*args))
    t3 = time.perf_counter()
    verify_steps, row_steps, accepted = (int(c) for c in np.asarray(counters))
    out = np.concatenate([tokens, np.asarray(new)], axis=1)
    stats = SpeculativeStats(
        batch=b,
        prompt_len=s,
        bucket_len=s_b,
        cache_len=cache_len,
        new_tokens=max_new_tokens,
        compile_s=c1 + c2,
        prefill_s=t1 - t0,
        decode_s=t3 - t2,
        warm=warmup,
        num_draft_tokens=k,
        verify_steps=verify_steps,
        row_steps=row_steps,
        accepted=accepted,
    )
    logger.info("generate: %s", stats)
    out = jnp.asarray(out, jnp.int32)
    return (out, stats) if return_stats else out


SPECULATIVE_DECODERS["mtp"] = generate_speculative
