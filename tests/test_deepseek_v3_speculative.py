"""Speculative decoding with the MTP layer: greedy gives exactly the plain greedy tokens for any
draft head, a head that agrees with the model is always accepted (k + 1 tokens per step), and
sampling keeps the model's distribution."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats
from test_deepseek_v3_common import tiny_config, tiny_model
from test_deepseek_v3_mtp import mtp_model

from models.deepseek_v3 import generate, init_random
from models.deepseek_v3.modeling import MLP
from models.deepseek_v3.speculative import SpeculativeStats, cache_slots

PROMPTS = [[5, 9, 33, 7, 81], [8, 100, 3]]  # different lengths: left padding


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_random_head_gives_the_plain_tokens(k):
    """A random MTP layer (drafts mostly rejected): the tokens of plain greedy decoding, eos
    included (row 0 stops at its sixth token, the rest filled as plain decoding fills it)."""
    model = mtp_model()
    plain = np.asarray(generate(model, PROMPTS, max_new_tokens=12, eos_id=()))
    eos = int(plain[0, 5 + 5])  # row 0's sixth new token (its prompt is 5 long)
    want = np.asarray(generate(model, PROMPTS, max_new_tokens=12, eos_id=eos))
    got, stats = generate(
        model,
        PROMPTS,
        max_new_tokens=12,
        eos_id=eos,
        speculative="mtp",
        num_draft_tokens=k,
        return_stats=True,
    )
    np.testing.assert_array_equal(np.asarray(got), want)
    assert isinstance(stats, SpeculativeStats) and stats.num_draft_tokens == k
    assert 1 <= stats.verify_steps <= 11 and stats.row_steps >= stats.verify_steps
    assert stats.tokens_per_step == pytest.approx(1 + k * stats.acceptance_rate)


def rigged_model(scale: float):
    """A float model whose layers add `scale` times their output to the residual (o_proj, the
    MLPs' down_proj and the experts' w2 scaled). At 0 its next token is a function of the
    current one, f(t) = argmax head(norm(embed(t))), and its MTP layer is rigged to compute the
    same from the next token: eh_proj [I, 0] passes enorm(embed) (enorm of ones), its layer
    adds nothing either, and shared_head.norm is the model's norm; the drafts are then the
    model's own tokens. A small scale > 0 makes the model's tokens depend on the context a
    little: the drafts are then accepted in part, and rows accept different counts."""
    model = nnx.clone(init_random(tiny_config(quant=None, num_nextn_predict_layers=1), seed=3))
    h = model.cfg.hidden_size

    def shrink(var):
        var.set_value(var.get_value() * scale)

    for layer in [*model.model.layers, model.mtp]:
        shrink(layer.self_attn.o_proj.weight)
        if isinstance(layer.mlp, MLP):
            shrink(layer.mlp.down_proj.weight)
        else:
            shrink(layer.mlp.experts.w2)
            shrink(layer.mlp.shared_experts.down_proj.weight)
    model.mtp.eh_proj.weight.set_value(jnp.eye(h, 2 * h, dtype=jnp.float32))
    model.mtp.enorm.weight.set_value(jnp.ones((h,), jnp.float32))
    model.mtp.shared_head.norm.weight.set_value(model.model.norm.weight.get_value())
    return model


def _rigged_run(scale: float, prompts):
    model = rigged_model(scale)
    want = np.asarray(generate(model, prompts, max_new_tokens=13, eos_id=()))
    got, stats = generate(
        model,
        prompts,
        max_new_tokens=13,
        eos_id=(),
        speculative="mtp",
        num_draft_tokens=2,
        return_stats=True,
    )
    np.testing.assert_array_equal(np.asarray(got), want)
    return stats


def test_a_head_that_agrees_is_always_accepted():
    """Every draft accepted: k + 1 = 3 tokens per verify step, 12 tokens after the prefill's
    in 4 steps (not 12), the tokens those of plain greedy decoding."""
    stats = _rigged_run(0.0, PROMPTS)
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_step == 3.0
    assert (stats.verify_steps, stats.row_steps, stats.accepted) == (4, 8, 16)


def test_rows_that_accept_different_counts_keep_the_plain_tokens():
    """A head that agrees in part (scale 0.004: about a third of the drafts accepted): three
    rows accept different counts, so each step keeps other slots of each row valid and
    rows finish at different steps; the tokens are still those of plain greedy decoding."""
    prompts = [*PROMPTS, [44, 45, 46, 47, 48, 49, 50]]
    stats = _rigged_run(0.004, prompts)
    assert 0.1 < stats.acceptance_rate < 0.9, stats.acceptance_rate
    assert stats.row_steps < 3 * stats.verify_steps  # some row finished before the others


def test_sampling_keeps_the_model_distribution():
    """Sampling (temperature 1, top-p 0.9) with a random MTP layer over a vocabulary of 16:
    the new tokens 2 to 4 of 1500 independent rows follow the distribution of the plain
    sampler's (a chi-square test of the two samples' counts at each place), while part of
    the drafts is accepted and part rejected (both rules at work)."""
    model = mtp_model(seed=1, vocab_size=16, num_hidden_layers=2)
    prompts = np.tile(np.array([[5, 9, 3, 7]], np.int32), (1500, 1))
    kw = dict(max_new_tokens=4, temperature=1.0, top_p=0.9, eos_id=())
    plain = np.asarray(generate(model, prompts, seed=11, **kw))[:, 4:]
    spec, stats = generate(
        model,
        prompts,
        seed=12,
        speculative="mtp",
        num_draft_tokens=2,
        return_stats=True,
        **kw,
    )
    spec = np.asarray(spec)[:, 4:]
    assert 0.1 < stats.acceptance_rate < 0.9, stats.acceptance_rate
    for place in (1, 2, 3):
        counts = np.stack([np.bincount(x[:, place], minlength=16) for x in (plain, spec)])
        counts = counts[:, counts.sum(axis=0) > 0]
        p = scipy_stats.chi2_contingency(counts).pvalue
        assert p > 1e-3, (place, p, counts)


def test_cache_slots_bound_the_writes():
    """One row: the write slot advances by the tokens it gains; many rows: by k + 1 a step."""
    assert cache_slots(1, 10, 3) == 9 + 6 + 4
    assert cache_slots(64, 10, 3) == 9 * 4 + 4
    assert cache_slots(1, 1, 2) == 3


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(speculative="eagle"), ValueError, "speculative='eagle' is not None or one of"),
        (
            dict(speculative="mtp", num_draft_tokens=4),
            ValueError,
            r"num_draft_tokens=4 .* \[1, 3\]",
        ),
        (dict(speculative="mtp", num_draft_tokens=0), ValueError, "num_draft_tokens=0"),
        (dict(speculative="mtp", num_draft_tokens=True), TypeError, "must be an int"),
    ],
)
def test_speculative_arguments_are_checked(kw, error, match):
    with pytest.raises(error, match=match):
        generate(mtp_model(), PROMPTS, max_new_tokens=4, **kw)


def test_speculative_needs_the_mtp_layer():
    with pytest.raises(ValueError, match="has no MTP layer; drop speculative='mtp'"):
        generate(tiny_model(), PROMPTS, max_new_tokens=4, speculative="mtp")
