"""DeepSeek routing (noaux_tc / greedy / group_limited_greedy) against a per-token numpy oracle."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.deepseek_v3 import DeepseekV3Config, route
from models.deepseek_v3.modeling import RANKED_TOP_K_MAX_COMPARISONS, descending_ranks, top_k

CASES = {
    # V3 at tiny size: sigmoid, bias, 16 experts in 4 groups, keep 2, top-4, normalized.
    "v3_tiny": DeepseekV3Config.tiny(),
    # V3's real routing shape: 256 experts, 8 groups, keep 4, top-8, scale 2.5.
    "v3": DeepseekV3Config.deepseek_v3(),
    # V2-Lite: softmax, greedy top-6 of 64, no bias, no normalization, scale 1.
    "v2_lite": DeepseekV3Config.deepseek_v2_lite(),
    # V2: softmax, groups ranked by their max, 160 experts in 8 groups, keep 3, scale 16.
    "v2": DeepseekV3Config.deepseek_v2_lite(
        n_routed_experts=160,
        n_group=8,
        topk_group=3,
        topk_method="group_limited_greedy",
        routed_scaling_factor=16.0,
    ),
    # Softmax scores with normalization (norm_topk_prob on a greedy router).
    "greedy_norm": DeepseekV3Config.deepseek_v2_lite(
        norm_topk_prob=True, routed_scaling_factor=2.0
    ),
}


def route_oracle(logits: np.ndarray, bias: np.ndarray | None, cfg: DeepseekV3Config):
    """Token by token in float64: (weights [T, k], ids [T, k]) sorted by selection score."""
    x = logits.astype(np.float64)
    if cfg.scoring_func == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-x))
    else:
        z = np.exp(x - x.max(-1, keepdims=True))
        scores = z / z.sum(-1, keepdims=True)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_group = e // cfg.n_group
    ids_out, w_out = [], []
    for s in scores:
        if cfg.topk_method == "greedy":
            choice, candidates = s, np.arange(e)
        else:
            choice = s + (bias.astype(np.float64) if bias is not None else 0.0)
            group_score = []
            for g in range(cfg.n_group):
                members = np.sort(choice[g * per_group : (g + 1) * per_group])[::-1]
                if cfg.topk_method == "noaux_tc":
                    group_score.append(members[0] + members[1])
                else:
                    group_score.append(members[0])
            kept = np.argsort(-np.asarray(group_score), kind="stable")[: cfg.topk_group]
            candidates = np.concatenate(
                [np.arange(g * per_group, (g + 1) * per_group) for g in sorted(kept)]
            )
        ids = candidates[np.argsort(-choice[candidates], kind="stable")[:k]]
        w = s[ids]
        if cfg.norm_topk_prob and k > 1:
            w = w / (w.sum() + 1e-20)
        ids_out.append(ids)
        w_out.append(w * cfg.routed_scaling_factor)
    return np.asarray(w_out), np.asarray(ids_out)


@pytest.mark.parametrize("t", [96, 300], ids=["ranked", "sorted"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_route_matches_oracle(case, t, rng):
    """96 tokens pick experts by rank (`top_k`); 300 of V3's 256 experts are over
    RANKED_TOP_K_MAX_COMPARISONS: lax.top_k's sort."""
    cfg = CASES[case]
    e = cfg.n_routed_experts
    logits = rng.standard_normal((t, e)).astype(np.float32) * 2.0
    bias = None
    if cfg.topk_method == "noaux_tc":
        # Large enough to change which experts win (checked below).
        bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    weights, ids = jax.jit(lambda lg, b: route(lg, b, cfg=cfg))(logits, bias)
    weights, ids = np.asarray(weights), np.asarray(ids)
    want_w, want_ids = route_oracle(logits, bias, cfg)
    assert ids.dtype == np.int32 and ids.shape == (t, cfg.num_experts_per_tok)
    # Same expert sets per token (integer outputs compared exactly) ...
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(want_ids, axis=1))
    # ... and the same weight for each expert.
    order, want_order = np.argsort(ids, axis=1), np.argsort(want_ids, axis=1)
    np.testing.assert_allclose(
        np.take_along_axis(weights, order, 1),
        np.take_along_axis(want_w, want_order, 1),
        rtol=1e-6,
        atol=1e-7,
    )
    if cfg.n_group > 1:
        # Every token's experts lie in at most topk_group groups.
        groups = ids // (e // cfg.n_group)
        assert max(len(set(row)) for row in groups.tolist()) <= cfg.topk_group
    if bias is not None:
        # The bias steers selection: without it some tokens pick other experts.
        _, plain_ids = route_oracle(logits, None, cfg)
        assert np.any(np.sort(plain_ids, 1) != np.sort(want_ids, 1))


def test_noaux_tc_weights_ignore_the_bias(rng):
    """The bias picks experts but the weights are the unbiased sigmoid scores."""
    cfg = dataclasses.replace(CASES["v3_tiny"], norm_topk_prob=False, routed_scaling_factor=1.0)
    logits = rng.standard_normal((8, cfg.n_routed_experts)).astype(np.float32)
    bias = (rng.standard_normal(cfg.n_routed_experts) * 5).astype(np.float32)
    weights, ids = route(logits, bias, cfg=cfg)
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    np.testing.assert_allclose(weights, np.take_along_axis(sig, np.asarray(ids), 1), rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.integers(1, 40),
    data=st.data(),
)
def test_top_k_by_rank_is_lax_top_k(rows, n, data):
    """Values and indices equal lax.top_k's exactly, ties (drawn from few values, -inf among
    them) placed by position as lax.top_k places them."""
    k = data.draw(st.integers(1, n))
    pool = [-np.inf, -1.5, 0.0, 0.25, 2.0, 3.0e38]
    values = data.draw(st.lists(st.sampled_from(pool), min_size=rows * n, max_size=rows * n))
    x = np.asarray(values, np.float32).reshape(rows, n)
    assert x.size * n <= RANKED_TOP_K_MAX_COMPARISONS  # the ranked path
    got_v, got_i = top_k(x, k)
    want_v, want_i = jax.lax.top_k(x, k)
    assert got_i.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    ranks = np.asarray(descending_ranks(x))
    assert all(sorted(r) == list(range(n)) for r in ranks.tolist())  # a permutation per row


def test_top_k_sorts_over_the_comparison_budget(monkeypatch):
    """Over RANKED_TOP_K_MAX_COMPARISONS top_k is lax.top_k (no [rows, n, n] comparisons)."""
    from models.deepseek_v3 import modeling

    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16))
    calls = []
    monkeypatch.setattr(modeling, "descending_ranks", lambda v: calls.append(v) or v)
    monkeypatch.setattr(modeling, "RANKED_TOP_K_MAX_COMPARISONS", 4 * 16 * 16 - 1)
    got_v, got_i = modeling.top_k(x, 3)
    want_v, want_i = jax.lax.top_k(x, 3)
    assert not calls
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
