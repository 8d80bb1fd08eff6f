"""generate() refuses bad inputs before any device work, with messages that quote them; a
checkpoint's generation_config.json gives its defaults, checked the same way."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_deepseek_v3_common import random_ids, tiny_model

from models.deepseek_v3 import GenerationDefaults, generate, load_generation_config


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


# ---- generation_config.json -------------------------------------------------------------------


def _write(tmp_path, content) -> str:
    path = tmp_path / "generation_config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize(
    "content,want",
    [
        # DeepSeek-V3's own file: sampling at 0.6 with nucleus 0.95.
        ({"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
          "temperature": 0.6, "top_p": 0.95, "transformers_version": "4.46.3"},
         dict(eos_id=(1,), temperature=0.6, top_p=0.95)),
        # Several eos ids; do_sample false is greedy whatever the temperature (Hugging Face's
        # meaning), which is then unused like top_k and max_length.
        ({"eos_token_id": [7, 9], "do_sample": False, "temperature": 0.7, "top_k": 20,
          "max_length": 4096, "max_new_tokens": 5},
         dict(eos_id=(7, 9), temperature=0.0, max_new_tokens=5,
              unused=("temperature", "top_k", "max_length"))),
        # do_sample true without a temperature samples at 1.0.
        ({"do_sample": True}, dict(temperature=1.0)),
        # Without do_sample Hugging Face decodes greedily: a temperature alone sets nothing.
        ({"temperature": 0.5, "top_p": 0.9}, dict(unused=("temperature", "top_p"))),
        ({"eos_token_id": []}, dict(eos_id=())),
    ],
    ids=["deepseek_v3", "eos_list_greedy", "sample_default_temperature", "no_do_sample",
         "no_eos"],
)  # fmt: skip
def test_generation_config_values(tmp_path, content, want):
    path = _write(tmp_path, content)
    got = load_generation_config(tmp_path)  # the directory, or the file itself
    assert got == load_generation_config(path) == GenerationDefaults(path=path, **want)


def test_generation_config_merges_under_given_values(tmp_path):
    """Given values win, the file fills the ones not given (None), the rest are left out."""
    _write(tmp_path, {"eos_token_id": [7, 9], "do_sample": True, "temperature": 0.6})
    defaults = load_generation_config(tmp_path)
    assert defaults.values() == dict(eos_id=(7, 9), temperature=0.6)
    got = defaults.merged(max_new_tokens=3, temperature=0.0, top_p=None, eos_id=None)
    assert got == dict(max_new_tokens=3, temperature=0.0, eos_id=(7, 9))


def test_no_generation_config(tmp_path):
    assert load_generation_config(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="nothing.json"):
        load_generation_config(tmp_path / "nothing.json")


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ({"eos_token_id": "2"}, "eos_token_id must be an id or a list of ids, got '2'"),
        ({"eos_token_id": [1, True]}, r"got \[1, True\]"),
        ({"eos_token_id": -1}, "got -1"),
        ({"do_sample": "yes"}, "do_sample must be true or false, got 'yes'"),
        ({"do_sample": True, "temperature": -1.0}, "temperature=-1.0 must be finite and >= 0"),
        ({"do_sample": True, "temperature": "hot"}, "temperature must be a number"),
        ({"do_sample": True, "top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 must be >= 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
    ],
    ids=["not_json", "not_object", "eos_text", "eos_bool", "eos_negative", "do_sample_text",
         "negative_temperature", "temperature_text", "top_p", "max_new_tokens_0",
         "max_new_tokens_float"],
)  # fmt: skip
def test_malformed_generation_config_names_the_file(tmp_path, content, match):
    path = _write(tmp_path, content)
    with pytest.raises(ValueError, match=match) as err:
        load_generation_config(tmp_path)
    assert path in str(err.value)
