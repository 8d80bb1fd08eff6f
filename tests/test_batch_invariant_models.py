"""Whole models under batch_invariant=True: a prompt alone gives its row of a batch, bitwise."""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.common import generate as generate_module
from models.common.attention import KEY_CHUNK
from models.common.generate import bucket, row_keys
from models.common.modules import ROW_BLOCK, Linear
from models.deepseek_v3 import DeepseekV3Config

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
FAMILIES = ("deepseek_v3", "qwen2_moe", "qwen3_moe", "gpt_oss")
# Prompt lengths: alone, all but the last run in the 16-token prompt bucket and a 32-slot cache;
# in the batch every row runs in the 32-token bucket and a 64-slot cache, left padded by
# 12 to 31 tokens: other buckets, other padding, other rows beside it.
LENGTHS = (3, 1, 7, 12, 2, 9, 5, 20)
NEW_TOKENS = 4


def _load(family: str):
    """The family's tiny model in bfloat16 (quantized experts: int4, or gpt-oss's MXFP4);
    "deepseek_v3_moe": DeepSeek-V3's one MoE layer alone, of 4 experts."""
    if family.startswith("deepseek_v3"):
        kw = dict(num_hidden_layers=2, dtype="bfloat16")
        if family.endswith("moe"):
            kw |= dict(num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=4,
                       n_group=1, topk_group=1, num_experts_per_tok=2)  # fmt: skip
        cfg = DeepseekV3Config.tiny(**kw)
        return models.init_random(cfg, seed=0, progress=False)
    path = FIXTURES / family / ("int4" if family.startswith("qwen") else "")
    return models.load_pretrained(path, progress=False)


@functools.cache
def _prepared(family: str, implementation: str = "xla", batch_invariant: bool = True):
    """One prepared model per setting for the whole module: generate's compiled programs are
    kept by shape, so tests that share a model and a shape compile once."""
    return models.prepare(_load(family), implementation=implementation,
                          batch_invariant=batch_invariant, progress=False)  # fmt: skip


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, min(vocab, 150), n).tolist() for n in LENGTHS]


def _generate(model, prompts, **kw):
    kw = dict(max_new_tokens=NEW_TOKENS, eos_id=(), return_logits=True) | kw
    tokens, logits = models.generate(model, prompts, **kw)
    return np.asarray(tokens)[:, -kw["max_new_tokens"] :], np.asarray(logits)


def _assert_rows_alone_equal_batch(model, prompts, rows, **kw):
    tokens, logits = _generate(model, prompts, **kw)
    for r in rows:
        alone_kw = {k: ([v[r]] if k == "seed" else v) for k, v in kw.items()}
        t, lg = _generate(model, [prompts[r]], **alone_kw)
        np.testing.assert_array_equal(t[0], tokens[r], err_msg=f"tokens of prompt {r}")
        np.testing.assert_array_equal(lg[0], logits[r], err_msg=f"logits of prompt {r}")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rows_alone_equal_the_batch(family):
    model = _prepared(family)
    _assert_rows_alone_equal_batch(model, _prompts(model.cfg.vocab_size), range(len(LENGTHS)))


def test_pallas_interpret_rows_alone_equal_the_batch():
    """The routed experts on the interpreted Pallas kernels (DeepSeek-V3's tiny MoE layer:
    H=128, the kernels' smallest int4 k-tile): the one-token prompt, alone in the 16-token
    bucket, in the batch in the 32-token one."""
    model = _prepared("deepseek_v3_moe", "pallas_interpret")
    assert model.implementation == "pallas_interpret"
    _assert_rows_alone_equal_batch(model, _prompts(model.cfg.vocab_size), (1,), max_new_tokens=2)


def test_without_the_flag_rows_differ():
    """The same comparison fails without the flag: the logits of a row alone differ from its
    row in the batch (XLA's CPU dot picks another algorithm for one row than for many)."""
    model = _prepared("qwen2_moe", batch_invariant=False)
    prompts = _prompts(model.cfg.vocab_size)
    _, logits = _generate(model, prompts)
    _, alone = _generate(model, [prompts[0]])
    assert not np.array_equal(alone[0], logits[0])


def test_float_linear_differs_without_the_flag():
    """The part that differs: a float linear's f32 sums for a row alone against the same row
    among 8 (the head's logits are such sums)."""
    cfg = DeepseekV3Config.tiny(dtype="bfloat16")
    linear = Linear(cfg, 512, 96, rngs=np.random.default_rng(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 512)), jnp.bfloat16)
    rows = lambda: (np.asarray(linear(x[:1], out_dtype=jnp.float32)),
                    np.asarray(linear(x, out_dtype=jnp.float32)[:1]))  # fmt: skip
    alone, among = rows()
    assert not np.array_equal(alone, among)
    linear.batch_invariant = True
    np.testing.assert_array_equal(*rows())


def test_same_bits_run_to_run(monkeypatch):
    """Two calls (each compiling its own programs) give the same tokens and logits."""
    model = _prepared("qwen3_moe")
    prompts = _prompts(model.cfg.vocab_size, seed=1)
    first = _generate(model, prompts)
    monkeypatch.setattr(generate_module, "_COMPILED", {})
    second = _generate(model, prompts)
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])


def test_sampled_rows_with_per_prompt_seeds_alone_equal_the_batch():
    model = _prepared("qwen2_moe")
    prompts = _prompts(model.cfg.vocab_size, seed=2)
    seeds = [11, 12, 13, 14, 15, 16, 17, 18]
    kw = dict(temperature=1.0, top_p=0.9, seed=seeds)
    _assert_rows_alone_equal_batch(model, prompts, (0, 7), **kw)
    tokens, _ = _generate(model, prompts, **kw)
    other, _ = _generate(model, prompts, **(kw | {"seed": [s + 100 for s in seeds]}))
    assert np.any(tokens != other), "other seeds gave the same samples"


def test_one_int_seed_keys_rows_by_position():
    keys = row_keys(5, 3)
    for r in range(3):
        want = jax.random.key_data(jax.random.fold_in(jax.random.key(5), r))
        np.testing.assert_array_equal(jax.random.key_data(keys[r]), want)
    own = row_keys([7, 5], 2)
    np.testing.assert_array_equal(
        jax.random.key_data(own[1]), jax.random.key_data(jax.random.key(5))
    )


def test_seed_sequence_must_hold_one_seed_a_prompt():
    model = _load("qwen2_moe")
    with pytest.raises(ValueError, match="seed holds 3 seeds for 2 prompts"):
        models.generate(model, [[3, 4], [5]], max_new_tokens=1, seed=[1, 2, 3])
    with pytest.raises(TypeError, match=r"seed\[1\] must be an int"):
        models.generate(model, [[3, 4], [5]], max_new_tokens=1, seed=[1, 2.0])


def test_every_bucket_is_whole_key_chunks():
    """A row's tokens move by whole attention chunks between buckets (`attend_in_chunks`)."""
    assert KEY_CHUNK == ROW_BLOCK
    assert all(bucket(n) % KEY_CHUNK == 0 for n in range(1, 600))


def test_mgpu_with_the_flag_gives_its_reason():
    model = _load("qwen2_moe")
    with pytest.raises(NotImplementedError, match="backend 'mgpu' does not compute rows batch"):
        models.prepare(model, implementation="mgpu", batch_invariant=True, progress=False)


def test_a_mesh_with_the_flag_is_refused():
    model = _load("qwen2_moe")
    mesh = jax.make_mesh((1,), ("expert",))
    with pytest.raises(ValueError, match="batch_invariant=True runs on one device"):
        models.prepare(model, mesh=mesh, batch_invariant=True, progress=False)


def test_generate_binds_or_refuses_the_flag():
    model = _load("qwen2_moe")
    assert model.batch_invariant is None
    models.generate(model, [[3, 4]], max_new_tokens=1, batch_invariant=True)
    assert model.batch_invariant is True
    assert all(m.batch_invariant for m in model.routed_experts())
    prepared = _prepared("qwen2_moe", batch_invariant=False)
    with pytest.raises(ValueError, match="prepared with batch_invariant=False"):
        models.generate(prepared, [[3, 4]], max_new_tokens=1, batch_invariant=True)
