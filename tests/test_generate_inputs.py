"""generate() refuses bad inputs before any device work, with messages that quote them."""

from __future__ import annotations

import numpy as np
import pytest
from test_deepseek_v3_common import random_ids, tiny_model

from models.deepseek_v3 import generate


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def prompt(model, rng):
    return random_ids(rng, (2, 5), model.cfg)


@pytest.mark.parametrize(
    "make_ids,error,match",
    [
        (lambda p, v: np.where(np.arange(5) == 2, v, p), ValueError, "outside the vocabulary"),
        (lambda p, v: np.where(np.arange(5) == 2, -1, p), ValueError, "e.g. -1"),
        (lambda p, v: np.where(np.arange(5) == 2, 2**32 + 3, p.astype(np.int64)), ValueError,
         "e.g. 4294967299"),
        (lambda p, v: p.astype(np.float32) + 0.5, TypeError, "dtype float32"),
        (lambda p, v: p.astype(bool), TypeError, "booleans"),
        (lambda p, v: p[:, :0], ValueError, "non-empty"),
        (lambda p, v: [p[0].tolist(), []], ValueError, "prompt 1 must be a non-empty"),
        (lambda p, v: [p[0].tolist(), [1.5, 2.0]], TypeError, "prompt 1 must be integer"),
        (lambda p, v: [p[0].tolist(), [v]], ValueError, "outside the vocabulary"),
    ],
    ids=["above_vocab", "negative", "beyond_int32", "float", "bool", "empty", "empty_row",
         "float_row", "row_above_vocab"],
)  # fmt: skip
def test_bad_ids(model, prompt, make_ids, error, match):
    ids = make_ids(prompt, model.cfg.vocab_size)
    with pytest.raises(error, match=match):
        generate(model, ids, max_new_tokens=2)


def test_ids_under_padding_are_not_checked(model, prompt):
    """Left padding may hold any id: only the tokens the mask keeps are looked up."""
    ids = prompt.copy()
    ids[1, 0] = model.cfg.vocab_size + 7
    mask = np.ones_like(ids, bool)
    mask[1, 0] = False
    out = np.asarray(generate(model, ids, attention_mask=mask, max_new_tokens=2, eos_id=()))
    assert out.shape == (2, 7) and np.all((out[:, 5:] >= 0) & (out[:, 5:] < model.cfg.vocab_size))


@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int, got 2.5"),
        (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens=0 must be >= 1"),
        (dict(temperature=float("nan")), ValueError, "temperature=nan"),
        (dict(temperature=-0.5), ValueError, "temperature=-0.5"),
        (dict(temperature="1"), TypeError, "temperature must be a number"),
        (dict(top_p=0.0), ValueError, r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), ValueError, "top_p=1.5"),
        (dict(top_p=float("nan")), ValueError, "top_p=nan"),
        (dict(eos_id=10**6), ValueError, "eos_id"),
        (dict(pad_id=-3), ValueError, "pad_id"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]}" for k in v),
)
def test_bad_sampling_arguments(model, prompt, kw, error, match):
    kw = {"max_new_tokens": 2, **kw}
    with pytest.raises(error, match=match):
        generate(model, prompt, **kw)
