"""Batched generation for every family: jitted prefill + decode loop over a static-length cache.

Prompts of different lengths are left-padded; prompt and cache lengths are rounded up to
buckets (powers of two up to 64, then multiples of 64) so a new prompt length rarely
recompiles. Sampling is greedy (temperature 0), temperature or top-p; rows stop at any of the
eos ids. `load_generation_config` reads a checkpoint's defaults (generation_config.json).
A sharded model (sharding.shard_model, init_random / load_pretrained with a mesh) runs the
same code under jax.jit with in/out shardings: batch over the data axis, the generated
tokens replicated so every host can read them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.common.checkpoint import read_json

logger = logging.getLogger("models")

MIN_BUCKET = 16

# generate(speculative=name)'s decoders: name -> fn(model, tokens, padded, pmask, **generate's
# settings) that checks the model can run it, then prefills and decodes. The modules that build
# on this one register theirs ("mtp": models.deepseek_v3.speculative, imported by its package).
SPECULATIVE_DECODERS: dict[str, Callable] = {}


def bucket(n: int) -> int:
    """Rounds a length up: powers of two from MIN_BUCKET to 64, then multiples of 64."""
    if n <= 64:
        return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())
    return -(-n // 64) * 64


@dataclasses.dataclass(frozen=True)
class GenerateStats:
    """Timings of one generate() call (seconds; compile time kept apart)."""

    batch: int
    prompt_len: int  # longest prompt (before bucketing)
    bucket_len: int  # padded prompt length the prefill ran with
    cache_len: int
    new_tokens: int  # tokens sampled per row (max_new_tokens: the loop's fixed trip count)
    compile_s: float
    prefill_s: float
    decode_s: float
    warm: bool = False  # timed on a second execution (first-run costs excluded)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.bucket_len / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_steps(self) -> int:
        """Model steps the decode loop ran: the first new token comes from the prefill."""
        return self.new_tokens - 1

    @property
    def step_s(self) -> float:
        """Seconds per decode step (one token for every row), 0.0 without one."""
        return self.decode_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over all rows, excluding the prefill."""
        return self.batch * self.new_tokens / self.decode_s if self.decode_s else 0.0

    def __str__(self) -> str:
        return (
            f"batch {self.batch}, prompt {self.prompt_len} (bucket {self.bucket_len}), "
            f"{self.new_tokens} new tokens: prefill {self.prefill_s * 1e3:.1f} ms "
            f"({self.prefill_tokens_per_s:.1f} tok/s), decode {self.decode_s * 1e3:.1f} ms "
            f"({self.decode_tokens_per_s:.1f} tok/s, {self.step_s * 1e3:.2f} ms per step), "
            f"compile {self.compile_s:.1f} s"
            f"{', warm' if self.warm else ', first execution'}"
        )


# Temperatures below this sample greedily (`sampling_kind`): at 1e-6 a logit gap of 1e-4 already
# makes the larger token e^100 times likelier, and far smaller ones (1e-45 is a float32
# subnormal, flushed to zero on some devices) would divide the logits by zero.
MIN_TEMPERATURE = 1e-6


def sampling_kind(temperature: float, top_p: float) -> dict[str, bool]:
    """The static kind of choice for `sample`: greedy for temperature < MIN_TEMPERATURE (0
    included), nucleus for top_p < 1."""
    return {"greedy": temperature < MIN_TEMPERATURE, "nucleus": top_p < 1.0}


def scaled_logits(logits, temperature):
    """f32 logits [..., V] / temperature, shifted by their row's max first: the likeliest
    token's scaled logit is 0 and the others at most 0 (-inf where they underflow), finite for
    any temperature >= MIN_TEMPERATURE."""
    return (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature


def sample(logits, key, temperature, top_p, *, greedy: bool, nucleus: bool):
    """Next tokens int32 [B] from f32 logits [B, V].

    The kind of choice is static (one compiled program each, no conditional on a device value;
    `sampling_kind` picks it): greedy: argmax; else softmax(logits / temperature), restricted
    with `nucleus` to the smallest set of tokens whose probability reaches top_p (the logits
    scaled by `scaled_logits`).
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = scaled_logits(logits, temperature)
    if nucleus:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_x = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        # Keep a token while the mass before it is below top_p (the first always stays).
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p
        cut = jnp.where(keep, sorted_x, -jnp.inf)
        choice = jax.random.categorical(key, cut, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def sample_rows(logits, keys, temperature, top_p, *, greedy, nucleus, batch_invariant=False):
    """`sample` row by row: next tokens int32 [B] from f32 logits [B, V] and one key per row
    (keys [B]): row r's token depends on its own logits and key only. `batch_invariant`: each
    row sampled alone (jax.lax.map: the sort and sums over V of one row's shape), else the
    rows batched (jax.vmap)."""
    if greedy:  # an argmax is exact whatever the batch
        return sample(logits, None, temperature, top_p, greedy=True, nucleus=nucleus)

    def one(row, key):
        return sample(row[None], key, temperature, top_p, greedy=False, nucleus=nucleus)[0]

    if batch_invariant:
        return jax.lax.map(lambda args: one(*args), (logits, keys))
    return jax.vmap(one)(logits, keys)


def row_keys(seed, batch: int):
    """The sampling key of each row, typed keys [B]: for one int seed, row r's is
    fold_in(key(seed), r) (it depends on the row's position); for a sequence of B seeds, row
    r's is key(seed[r]) (on its own seed only, whatever the batch). Step t draws with
    fold_in(row key, t)."""
    if isinstance(seed, (int, np.integer)):
        base = jax.random.key(int(seed))
        keys = [jax.random.fold_in(base, r) for r in range(batch)]
    else:
        keys = [jax.random.key(int(s)) for s in seed]
    return jax.random.wrap_key_data(jnp.stack([jax.random.key_data(k) for k in keys]))


def _check_seed(seed, batch: int) -> None:
    """seed: an int, or a sequence of `batch` ints (one a prompt), each in jax.random.key's
    range."""
    if isinstance(seed, (list, tuple, np.ndarray)):
        if len(seed) != batch:
            raise ValueError(f"seed holds {len(seed)} seeds for {batch} prompts (one a prompt)")
        named = [(f"seed[{i}]", s) for i, s in enumerate(seed)]
    else:
        named = [("seed", seed)]
    for name, value in named:
        value = _as_int(name, value)
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{name}={value} is outside [-2**63, 2**63) (jax.random.key's range)")


def _prefill(state, tokens, mask, *, graphdef, cache_len):
    model = nnx.merge(graphdef, state)
    return model.prefill(tokens, mask, max_len=cache_len)


def _decode(
    state,
    logits,
    cache,
    keys,
    temperature,
    top_p,
    *,
    graphdef,
    steps,
    greedy,
    nucleus,
    eos_ids,
    fill_id,
    batch_invariant=False,
    return_logits=False,
):
    """Samples `steps` tokens per row, the first from the prefill's logits, step t of row r
    with fold_in(keys[r], t).

    A fixed trip count (no loop predicate read back by the host each token): a row that has
    produced an eos id is filled with `fill_id` from then on. Returns (int32 [B, steps], the
    cache), then with return_logits the f32 logits [B, steps, V] each token was drawn from:
    the cache is returned so that its donated input buffers serve as the loop's, updated in
    place (XLA reuses a donated buffer only for an output).
    """
    model = nnx.merge(graphdef, state)
    model.prepare_decode()  # before the loop: once per call, not every step
    b, v = logits.shape
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    out = jnp.full((b, steps), fill_id, jnp.int32)
    seen = jnp.zeros((b, steps if return_logits else 0, v), jnp.float32)

    def pick(logits, step, done, seen):
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
        tok = sample_rows(logits, step_keys, temperature, top_p, greedy=greedy,
                          nucleus=nucleus, batch_invariant=batch_invariant)  # fmt: skip
        tok = jnp.where(done, fill_id, tok)
        if return_logits:
            seen = jax.lax.dynamic_update_slice(seen, logits[:, None], (0, step, 0))
        return tok, done | jnp.isin(tok, eos), seen

    tok, done, seen = pick(logits, 0, jnp.zeros((b,), bool), seen)
    out = out.at[:, 0].set(tok)

    def body(step, carry):
        tok, cache, out, done, seen = carry
        logits, cache = model.decode(tok, cache)
        tok, done, seen = pick(logits, step, done, seen)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, step))
        return tok, cache, out, done, seen

    _, cache, out, _, seen = jax.lax.fori_loop(1, steps, body, (tok, cache, out, done, seen))
    return (out, cache, seen) if return_logits else (out, cache)


# Compiled executables by (function, static args, argument shapes and shardings): compile time
# is measured apart from run time, and a repeated shape bucket is never compiled twice.
_COMPILED: dict = {}


def _shape_key(tree):
    return tuple(
        (tuple(x.shape), str(x.dtype), getattr(x, "sharding", None)) for x in jax.tree.leaves(tree)
    )


def _compiled(fn, statics: dict, *args, shardings: dict | None = None, donate=()):
    """(executable, compile seconds) of jax.jit(fn, **shardings) for these arguments, the
    arguments at positions `donate` donated (their buffers reused for the outputs or the loop
    state, invalid after the call)."""
    key = (fn, tuple(sorted(statics.items(), key=lambda kv: kv[0])), _shape_key(args))
    exe = _COMPILED.get(key)
    compile_s = 0.0
    if exe is None:
        t0 = time.perf_counter()
        # Statics bound by partial: jit takes no keyword arguments alongside in_shardings.
        jitted = jax.jit(
            functools.partial(fn, **statics), donate_argnums=donate, **(shardings or {})
        )
        exe = jitted.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        _COMPILED[key] = exe
    return exe, compile_s


def _token_array(values, what: str) -> np.ndarray:
    """Integer token ids as int64 numpy (no wrap-around, no truncation of floats)."""
    arr = np.asarray(values)
    if arr.size == 0:  # an empty list reads as float64: the callers refuse empty prompts
        return arr.astype(np.int64)
    if arr.dtype == object or arr.dtype.kind not in "iub":
        raise TypeError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    if arr.dtype.kind == "b":
        raise TypeError(f"{what} must be integer token ids, got booleans")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} holds an id above int64: {int(arr.max())}")
    return arr.astype(np.int64)


def _check_ids(tokens: np.ndarray, mask: np.ndarray, vocab_size: int) -> None:
    """Every id a row uses (mask True) lies in [0, vocab_size)."""
    used = tokens[mask]
    bad = used[(used < 0) | (used >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"input_ids hold {bad.size} id(s) outside the vocabulary [0, {vocab_size}), "
            f"e.g. {int(bad[0])}"
        )


def _left_pad(input_ids, attention_mask, pad_id: int):
    """-> (int64 [B, S] tokens, bool [B, S] mask), left padded."""
    if isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]):
        rows = [_token_array(r, f"prompt {b}") for b, r in enumerate(input_ids)]
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a [B, S] array, not a list of prompts")
        for b, r in enumerate(rows):
            if r.ndim != 1 or r.size == 0:
                raise ValueError(f"prompt {b} must be a non-empty list of ids, got shape {r.shape}")
        s = max(len(r) for r in rows)
        tokens = np.full((len(rows), s), pad_id, np.int64)
        mask = np.zeros((len(rows), s), bool)
        for b, r in enumerate(rows):
            tokens[b, s - len(r) :] = r
            mask[b, s - len(r) :] = True
        return tokens, mask
    tokens = _token_array(input_ids, "input_ids")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [B, S] array, got shape {tokens.shape}")
    if attention_mask is None:
        mask = np.ones(tokens.shape, bool)
    else:
        mask = np.asarray(attention_mask).astype(bool)
        if mask.shape != tokens.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids {tokens.shape}")
        # Left padding: once a row's tokens start, they continue to the end.
        if np.any(mask[:, :-1] & ~mask[:, 1:]):
            raise ValueError("attention_mask must be left padding (zeros, then ones)")
        if not np.all(mask[:, -1]):
            raise ValueError("every row needs at least one token (attention_mask[:, -1] == 1)")
    return tokens, mask


def _as_int(name: str, value) -> int:
    """An int or numpy integer as a Python int; TypeError for anything else (bool, float)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} (a float is not truncated)")
    return int(value)


def _check_sampling(max_new_tokens, temperature, top_p, max_positions: int | None = None) -> int:
    """Checks the sampling arguments (max_new_tokens against the model's positions where
    given); returns max_new_tokens as a Python int."""
    max_new_tokens = _as_int("max_new_tokens", max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if max_positions is not None and max_new_tokens >= max_positions:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} does not fit the model's context: "
            f"max_position_embeddings={max_positions} positions hold the prompt and the new "
            f"tokens"
        )
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature} must be finite and >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (1: no nucleus)")
    return max_new_tokens


GENERATION_CONFIG_FILE = "generation_config.json"
# Keys of a generation_config.json that say nothing about how to sample: never reported unused.
_METADATA_KEYS = ("transformers_version", "bos_token_id", "pad_token_id")


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """The `generate` arguments a checkpoint's generation_config.json (Hugging Face's
    GenerationConfig file) sets, as `generate` takes them; None where the file sets nothing.

    Hugging Face's meaning is kept: sampling needs do_sample true (temperature then defaults
    to 1.0); do_sample false is greedy (temperature 0.0). max_length is not read: it counts
    the prompt, and the decode loop runs a fixed number of steps, so a large max_length would
    run them all.
    """

    path: str
    eos_id: tuple[int, ...] | None = None  # ids that end a row (eos_token_id: an int or a list)
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    unused: tuple[str, ...] = ()  # the file's keys that set nothing here (e.g. top_k)

    def values(self) -> dict:
        """{generate keyword: value} for what the file sets."""
        names = ("eos_id", "temperature", "top_p", "max_new_tokens")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def merged(self, **given) -> dict:
        """`given` generate keywords (None: not given) with the file's value where one is None;
        keywords that neither sets are left out (their built-in defaults apply)."""
        out = {k: v for k, v in given.items() if v is not None}
        for k, v in self.values().items():
            out.setdefault(k, v)
        return out


def load_generation_config(path: str | os.PathLike) -> GenerationDefaults | None:
    """The defaults of a checkpoint directory's generation_config.json (None where it has
    none), or of that file given by its path.

    Raises:
        FileNotFoundError: `path` is neither a directory nor a file (named).
        ValueError: the file is not a JSON object, or a value is not one `generate` takes
            (eos ids that are not non-negative ints, a do_sample that is not a bool, the
            sampling checks of `generate`): the file named.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, GENERATION_CONFIG_FILE)
        if not os.path.exists(path):
            return None
    hf = read_json(path)
    eos = hf.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
        eos = tuple(ids)
    do_sample = hf.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ValueError(f"{path}: do_sample must be true or false, got {do_sample!r}")
    temperature = top_p = None
    if do_sample:
        temperature, top_p = hf.get("temperature", 1.0), hf.get("top_p")
    elif do_sample is False:
        temperature = 0.0
    max_new_tokens = hf.get("max_new_tokens")
    try:
        _check_sampling(
            1 if max_new_tokens is None else max_new_tokens,
            0.0 if temperature is None else temperature,
            1.0 if top_p is None else top_p,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
    read = {"eos_token_id", "do_sample", "max_new_tokens"}
    if do_sample:
        read |= {"temperature", "top_p"}
    unused = tuple(
        k for k in hf if k not in read and k not in _METADATA_KEYS and not k.startswith("_")
    )
    return GenerationDefaults(
        path=path,
        eos_id=eos,
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        max_new_tokens=max_new_tokens,
        unused=unused,
    )


def generate(
    model,
    input_ids,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    attention_mask=None,
    pad_id: int | None = None,
    eos_id: int | Sequence[int] | None = None,
    return_stats: bool = False,
    warmup: bool = False,
    speculative: str | None = None,
    num_draft_tokens: int = 1,
    batch_invariant: bool | None = None,
    return_logits: bool = False,
):
    """Generates `max_new_tokens` tokens for each prompt.

    Args:
        model: a family's causal LM: `cfg` (vocab_size, max_position_embeddings,
            pad_token_id, eos_token_id), `prefill(ids, mask, max_len=)` -> (logits, cache),
            `decode(tokens, cache)` -> (logits, cache), `prepare_decode()` (run on the traced
            copy before the loop) and `sharding` (None, or its ModelSharding with
            `cache_shardings(num_layers)`).
        input_ids: int32 [B, S] (left-padded, with `attention_mask`), or a list of B token
            lists of different lengths (left-padded here with `pad_id`).
        max_new_tokens: tokens to generate per row.
        temperature: 0 for greedy; else the sampling temperature. Temperatures below
            MIN_TEMPERATURE (1e-6) are greedy too (`sampling_kind`): any temperature > 0 gives
            finite probabilities, never a sample from NaN.
        top_p: nucleus sampling mass (1 = off).
        seed: the sampling seed: one int (row r draws with fold_in(key(seed), r), so its
            samples depend on its position in the batch), or a sequence of one seed per
            prompt (row r draws with key(seed[r]): its samples depend on its own seed only,
            alone or in any batch). Step t of a row draws with fold_in(its key, t).
        attention_mask: [B, S], 0 on left padding (default: no padding).
        pad_id: padding token for list prompts (default cfg.pad_token_id, else 0).
        eos_id: id(s) that end a row: it stops at the first token that is any of them
            (default cfg.eos_token_id; () never stops). A finished row is filled with the
            first of the ids to the end.
        return_stats: also return a GenerateStats.
        warmup: run the prefill and the decode loop once before the timed runs, so the
            timings exclude first-execution costs (loading the kernels' modules, and on a mesh
            setting up the collectives' communicators); the work is done twice.
        speculative: None, or "mtp": speculative decoding with the model's MTP layer
            (`models.deepseek_v3.speculative`): the same tokens when greedy, the same
            distribution when sampling; the stats a SpeculativeStats (acceptance rate,
            tokens per step). One device only.
        num_draft_tokens: k, the chained drafts per step with speculative (1 to 3).
        batch_invariant: None: as the model was prepared; True: each row's tokens and logits
            are bitwise those of its prompt alone (and the same on every run): a model not
            yet prepared gets the flag bound here (`CausalLM.set_batch_invariant`, as
            models.prepare(..., batch_invariant=True) does); False on a model prepared with
            it, or True on one prepared without it, is refused. One device, no speculative.
        return_logits: also return the f32 logits [B, max_new_tokens, V] each new token was
            chosen from (those of finished rows included).

    Returns:
        int32 [B, S + max_new_tokens] (prompt columns as given, then the new tokens);
        with return_logits, (tokens, logits); with return_stats, the GenerateStats last.

    Raises (before any device work; the messages quote the values):
        TypeError: ids that are not integers (floats are not truncated), a max_new_tokens,
            seed, pad_id or eos_id that is not an int (numpy integers are), a temperature or
            top_p that is not a number.
        ValueError: an id outside [0, vocab_size) (negative ones and ones beyond int32
            included), an empty prompt, a malformed attention_mask, max_new_tokens < 1 or
            a prompt plus max_new_tokens past max_position_embeddings (refused before any
            compile), a
            negative or non-finite temperature, top_p outside (0, 1], a pad or eos id outside
            the vocabulary; speculative decoding the model cannot run (no MTP layer, a
            sharded model, num_draft_tokens outside [1, 3]).
    """
    cfg = model.cfg
    max_new_tokens = _check_sampling(
        max_new_tokens, temperature, top_p, cfg.max_position_embeddings
    )
    _bind_batch_invariant(model, batch_invariant, speculative)
    if speculative is not None and speculative not in SPECULATIVE_DECODERS:
        raise ValueError(
            f"speculative={speculative!r} is not None or one of {sorted(SPECULATIVE_DECODERS)}"
        )
    if speculative == "mtp" and getattr(model, "mtp", None) is None:
        raise ValueError(
            f"speculative='mtp': this model ({type(model).__name__}) has no MTP layer; drop "
            f"speculative='mtp' (--mtp), or load a checkpoint that has one "
            f"(num_nextn_predict_layers >= 1) with load_pretrained(..., mtp=True)"
        )
    if pad_id is None:
        pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    pad_id = _as_int("pad_id", pad_id)
    if eos_id is None:
        eos_ids = tuple(cfg.eos_token_id)
    elif isinstance(eos_id, (list, tuple)):
        eos_ids = tuple(_as_int(f"eos_id[{i}]", e) for i, e in enumerate(eos_id))
    else:
        eos_ids = (_as_int("eos_id", eos_id),)
    for what, ids in (("pad_id", (pad_id,)), ("eos_id", eos_ids)):
        if any(not 0 <= i < cfg.vocab_size for i in ids):
            raise ValueError(f"{what} {ids} is outside the vocabulary [0, {cfg.vocab_size})")
    fill_id = eos_ids[0] if eos_ids else pad_id
    tokens, mask = _left_pad(input_ids, attention_mask, pad_id)
    _check_ids(tokens, mask, cfg.vocab_size)
    tokens = tokens.astype(np.int32)
    b, s = tokens.shape
    _check_seed(seed, b)
    if speculative is not None and not isinstance(seed, (int, np.integer)):
        raise ValueError("speculative decoding takes one int seed, not one a prompt")
    if s + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} after a prompt of {s} tokens needs "
            f"{s + max_new_tokens} positions, over the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    s_b = bucket(s)
    cache_len = bucket(s_b + max_new_tokens)
    if cache_len > cfg.max_position_embeddings:
        logger.warning(
            "cache length %d exceeds max_position_embeddings=%d",
            cache_len,
            cfg.max_position_embeddings,
        )
    padded = np.full((b, s_b), pad_id, np.int32)
    padded[:, s_b - s :] = tokens
    pmask = np.zeros((b, s_b), bool)
    pmask[:, s_b - s :] = mask
    if speculative is not None:
        return SPECULATIVE_DECODERS[speculative](
            model,
            tokens,
            padded,
            pmask,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            eos_ids=eos_ids,
            fill_id=fill_id,
            num_draft_tokens=num_draft_tokens,
            return_stats=return_stats,
            warmup=warmup,
        )

    graphdef, state = nnx.split(model)
    ms = model.sharding
    prefill_shardings = decode_shardings = None
    if ms is not None:
        ms.check_batch(b)
        state_sh = jax.tree.map(lambda a: a.sharding, state)
        tok, rep = ms.named(ms.specs.tokens_bt), ms.named(P())
        logits_sh, cache_sh = (
            ms.named(ms.specs.logits_bv),
            ms.cache_shardings(model.cfg.num_hidden_layers),
        )
        prefill_shardings = dict(
            in_shardings=(state_sh, tok, tok), out_shardings=(logits_sh, cache_sh)
        )
        decode_shardings = dict(
            in_shardings=(state_sh, logits_sh, cache_sh, rep, rep, rep),
            # tokens (and logits) replicated: every host can read them
            out_shardings=(rep, cache_sh, rep) if return_logits else (rep, cache_sh),
        )
        padded, pmask = ms.put(padded, ms.specs.tokens_bt), ms.put(pmask, ms.specs.tokens_bt)
    prefill, c1 = _compiled(
        _prefill,
        {"graphdef": graphdef, "cache_len": cache_len},
        state,
        padded,
        pmask,
        shardings=prefill_shardings,
    )
    if warmup:
        jax.block_until_ready(prefill(state, padded, pmask))
    t0 = time.perf_counter()
    logits, cache = jax.block_until_ready(prefill(state, padded, pmask))
    t1 = time.perf_counter()

    scalars = (
        row_keys(seed, b),
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_p, jnp.float32),
    )
    statics = {
        "graphdef": graphdef,
        "steps": max_new_tokens,
        **sampling_kind(temperature, top_p),
        "eos_ids": eos_ids,
        "fill_id": fill_id,
        "batch_invariant": bool(getattr(model, "batch_invariant", False)),
        "return_logits": return_logits,
    }
    # The cache (argument 2) is donated: the loop updates the prefill's buffers in place.
    decode, c2 = _compiled(
        _decode, statics, state, logits, cache, *scalars, shardings=decode_shardings, donate=(2,)
    )
    if warmup:
        jax.block_until_ready(decode(state, logits, jax.tree.map(jnp.copy, cache), *scalars))
    t2 = time.perf_counter()
    new, _, *seen = jax.block_until_ready(decode(state, logits, cache, *scalars))
    t3 = time.perf_counter()

    out = np.concatenate([tokens, np.asarray(new)], axis=1)
    stats = GenerateStats(
        batch=b,
        prompt_len=s,
        bucket_len=s_b,
        cache_len=cache_len,
        new_tokens=max_new_tokens,
        compile_s=c1 + c2,
        prefill_s=t1 - t0,
        decode_s=t3 - t2,
        warm=warmup,
    )
    logger.info("generate: %s", stats)
    result = (jnp.asarray(out, jnp.int32), *seen) + ((stats,) if return_stats else ())
    return result if len(result) > 1 else result[0]


def _bind_batch_invariant(model, batch_invariant: bool | None, speculative) -> None:
    """generate's batch_invariant against the model's (`CausalLM.batch_invariant`: None until
    prepared): True binds it on a model not yet prepared; a model prepared otherwise is
    refused."""
    if batch_invariant is None:
        return
    if not isinstance(batch_invariant, (bool, np.bool_)):
        raise TypeError(f"batch_invariant must be True, False or None, got {batch_invariant!r}")
    prepared = getattr(model, "batch_invariant", None)
    if batch_invariant and prepared is None:
        model.set_batch_invariant(True)
    elif prepared is not None and bool(prepared) != bool(batch_invariant):
        raise ValueError(
            f"generate(batch_invariant={bool(batch_invariant)}) on a model prepared with "
            f"batch_invariant={prepared}: prepare it again with "
            f"models.prepare(model, ..., batch_invariant={bool(batch_invariant)})"
        )
    if batch_invariant and speculative is not None:
        raise ValueError(
            f"batch_invariant=True with speculative={speculative!r}: speculative decoding is "
            f"not batch-invariant (its draft layer's rows are not covered); drop one of them"
        )
