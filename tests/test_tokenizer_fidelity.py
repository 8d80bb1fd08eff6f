"""Each family's tokenizer gives the ids and text of its checkpoint's own (reference.json)."""

from __future__ import annotations

import json
import pathlib

import pytest

import models
from models.common.tokenizer import load_chat_template

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FAMILIES = ("deepseek_tokenizer", "qwen_tokenizer", "kimi_tokenizer")
TEXTS = ("ascii", "accents", "cjk", "emoji", "spaces", "empty", "special_tokens")


def _reference(family: str) -> dict:
    return json.loads((FIXTURES / family / "reference.json").read_text())


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_ids_and_text_equal_the_checkpoints_own(family, text):
    """encode: the own tokenizer's ids (a bos token only where it adds one: DeepSeek-V3's
    does, Qwen's and Kimi's do not); decode: special tokens kept, and dropped on request."""
    if family == "kimi_tokenizer":
        pytest.importorskip("tiktoken", reason="tiktoken.model tokenizers need tiktoken")
    want = _reference(family)["texts"][text]
    tok = models.load_tokenizer(FIXTURES / family)
    ids = tok.encode(want["text"])
    assert ids == want["ids"]
    assert tok.decode(ids) == want["decoded"]
    assert tok.decode(ids, skip_special_tokens=True) == want["decoded_skip_special"]


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_equals_the_checkpoints_own(family):
    """The rendered chat (apply_chat_template(tokenize=False)) and its ids (tokenize=True:
    encoded without a bos of the tokenizer's own; the template writes it)."""
    pytest.importorskip("jinja2")
    if family == "kimi_tokenizer":
        pytest.importorskip("tiktoken", reason="tiktoken.model tokenizers need tiktoken")
    want = _reference(family)["chat"]
    text = load_chat_template(FIXTURES / family).render(want["messages"])
    assert text == want["text"]
    tok = models.load_tokenizer(FIXTURES / family)
    assert tok.encode(text, add_bos=False) == want["ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_add_bos_forces_one_or_none(family):
    if family == "kimi_tokenizer":
        pytest.importorskip("tiktoken", reason="tiktoken.model tokenizers need tiktoken")
    tok = models.load_tokenizer(FIXTURES / family)
    plain = _reference(family)["texts"]["ascii"]
    body = [i for i in plain["ids"] if i != tok.bos_id]
    assert tok.encode(plain["text"], add_bos=False) == body
    assert tok.encode(plain["text"], add_bos=True) == [tok.bos_id, *body]
    with pytest.raises(TypeError, match="text=b'x' is a bytes"):
        tok.encode(b"x")


def test_fixtures_are_what_their_script_writes(tmp_path):
    """The tokenizer.json fixtures come from make_hf_tokenizers.py (deterministic training):
    rerun, it writes the same files (reference.json: make_tokenizer_references.py, which needs
    transformers, so it is not rerun here)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(FIXTURES))
    try:
        spec = importlib.util.spec_from_file_location("make_hf", FIXTURES / "make_hf_tokenizers.py")
        make = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(make)
    finally:
        sys.path.remove(str(FIXTURES))
    make.write(str(tmp_path))
    for family in ("deepseek_tokenizer", "qwen_tokenizer"):
        for file in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            assert (tmp_path / family / file).read_text() == (FIXTURES / family / file).read_text()
