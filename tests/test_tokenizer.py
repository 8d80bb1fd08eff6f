"""tiktoken.model tokenizers (Kimi-K2): ids equal to the `tiktoken` library's own encoding with
the same ranks, regex and special tokens; decoding; chat templates from chat_template.jinja.
(tokenizer.json and tokenizer_config.json's chat_template: test_deepseek_v3_params.py and
test_deepseek_v3_tokenizer.py.)"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

import pytest

from models.common.tiktoken_tokenizer import KIMI_PATTERN, TiktokenTokenizer, read_tiktoken_ranks
from models.common.tokenizer import load_chat_template, load_tokenizer

tiktoken = pytest.importorskip("tiktoken", reason="tiktoken.model tokenizers need tiktoken")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
KIMI = FIXTURES / "kimi_tokenizer"
TEXTS = {
    "ascii": "Hello world! The quick brown fox's tokenizer returns 12345 ids.\n  def f(x): pass",
    "accents": "Les élèves à l'école; señor, ¿dónde está la estación? Der Bär läuft über.",
    "cjk": "你好，世界！我们学习语言模型。東京の天気は晴れです。",
    "emoji": "😀🎉 👍 ❤️ 🚀🚀 🧪 Emoji: 😀",
    "special_tokens": "[BOS]<|im_user|>user<|im_middle|>Hi 世界 😀<|im_end|><think>x</think>[EOS]",
    "special_like_text": "<|im_unknown|> <|reserved_token_1|> [BOS [EOS]]",
    "mixed": "The 模型 said: ça coûte 3.14€ 😀\n\n\tdone<|im_end|>",
}


def test_kimi_pattern_pieces():
    """Kimi's pre-tokenizer: Han runs alone, words split at a lower-to-upper case change with
    their contraction, digits by three, whitespace before a newline kept with it."""
    regex = pytest.importorskip("regex")  # tiktoken's own dependency
    pieces = regex.findall("(?V1)" + KIMI_PATTERN, "HelloWorld世界it's ABCdef 12345  \n\nx")
    assert pieces == ["Hello", "World", "世界", "it's", " ABCdef", " ", "123", "45", "  \n\n", "x"]


def _reference() -> tiktoken.Encoding:
    """The fixture as the `tiktoken` library itself reads it: its own file loader, Kimi's
    regex, and the special tokens numbered as Kimi numbers them (every id of the 256 after the
    ranks, named by added_tokens_decoder or <|reserved_token_{id}|>)."""
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(KIMI / "tiktoken.model"))
    n = len(ranks)
    specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + 256)}
    added = json.loads((KIMI / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    for key, token in added.items():
        del specials[f"<|reserved_token_{key}|>"]
        specials[token["content"]] = int(key)
    return tiktoken.Encoding(
        "reference", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )


@pytest.fixture
def reference(monkeypatch):
    # tiktoken's loader keeps a copy of each file it reads under a key of its path unless the
    # cache directory is "": a regenerated fixture must not read stale.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    return _reference()


@pytest.mark.parametrize("name", list(TEXTS))
def test_tiktoken_ids_equal_tiktoken(reference, name):
    text = TEXTS[name]
    tok = load_tokenizer(KIMI)
    assert isinstance(tok, TiktokenTokenizer)
    ids = tok.encode(text, add_bos=False)
    assert ids == reference.encode(text, allowed_special="all")
    assert len(ids) < len(text.encode("utf-8"))  # merges applied, not bytes alone
    # Kimi's own encode adds no bos token; add_bos=True asks for one.
    assert tok.encode(text) == ids
    assert tok.encode(text, add_bos=True) == [tok.bos_id, *ids]


def test_special_tokens_numbered_as_kimi(reference):
    tok = load_tokenizer(KIMI)
    n = tok.num_ranks
    assert n == reference.n_vocab - 256
    assert len(tok.special_tokens) == 256
    assert tok.special_tokens["[BOS]"] == n and tok.special_tokens["[PAD]"] == n + 255
    assert tok.special_tokens["<|im_middle|>"] == n + 17
    assert tok.special_tokens[f"<|reserved_token_{n + 5}|>"] == n + 5
    # no config.json: bos/eos/pad from tokenizer_config.json's bos_token, eos_token, pad_token
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 255)
    ids = tok.encode("<|im_user|>hi<|im_end|>", add_bos=False)
    assert ids[0] == n + 3 and ids[-1] == n + 2


def test_tiktoken_ids_from_config_json(tmp_path):
    shutil.copytree(KIMI, tmp_path, dirs_exist_ok=True)
    n = len(read_tiktoken_ranks(tmp_path / "tiktoken.model"))
    config = {"bos_token_id": n, "eos_token_id": [n + 2, n + 1], "pad_token_id": n + 9}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 2, n + 9)


@pytest.mark.parametrize("name", ["ascii", "accents", "cjk", "emoji", "mixed"])
def test_tiktoken_round_trip(name):
    tok = load_tokenizer(KIMI)
    text = TEXTS[name].replace("<|im_end|>", "")
    assert tok.decode(tok.encode(text)) == text


def test_decode_keeps_special_tokens_unless_skipped(reference):
    tok = load_tokenizer(KIMI)
    ids = tok.encode(TEXTS["special_tokens"])
    # Kimi's decode keeps special tokens, as tiktoken's does.
    assert tok.decode(ids) == reference.decode(ids) == TEXTS["special_tokens"]
    # Skipped as transformers' decode skips them (Kimi's decode with skip_special_tokens): the
    # named special tokens dropped, <think> and </think> (added, "special": false) written apart.
    assert tok.decode(ids, skip_special_tokens=True) == "userHi 世界 😀 <think> x </think>"
    n = tok.num_ranks
    # ids past the vocabulary decode as nothing; reserved special tokens as their names
    assert tok.decode([n + 5, *tok.encode("ok"), 10**6]) == f"<|reserved_token_{n + 5}|>ok"


def test_fixture_is_what_its_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make", FIXTURES / "make_kimi_tokenizer.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    make.write(str(tmp_path))
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (KIMI / name).read_bytes(), name


@pytest.mark.parametrize(
    "lines,match",
    [
        (["QQ== 0", "Qg== x"], r"line 2: .* is not a base64 token and a rank"),
        (["QQ== 0", "Q!== 1"], r"line 2: .* is not a base64 token and a rank"),
        (["QQ== 0", "Qg== 2"], r"do not have the ranks 0 \.\. 1, each once"),
        (["QQ== 0", "QQ== 1"], r"its 1 tokens do not have the ranks 0 \.\. 0"),
    ],
    ids=["rank_not_int", "not_base64", "rank_gap", "token_twice"],
)
def test_malformed_tiktoken_model_names_the_file(tmp_path, lines, match):
    path = tmp_path / "tiktoken.model"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match) as err:
        read_tiktoken_ranks(path)
    assert str(path) in str(err.value)


def test_malformed_added_tokens_name_the_file(tmp_path):
    shutil.copytree(KIMI, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["7"] = {"content": "<|clash|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"added_tokens_decoder names ids \[7\] below 556"):
        load_tokenizer(tmp_path)
    config["added_tokens_decoder"]["7"] = {"special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"added_tokens_decoder\['7'\] .* is not an id and a"):
        load_tokenizer(tmp_path)


def test_chat_template_from_jinja_file():
    pytest.importorskip("jinja2", reason="rendering a chat template needs jinja2")
    template = load_chat_template(KIMI)
    assert template.path == str(KIMI / "chat_template.jinja")
    assert template.special_tokens == {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
    }
    prompt = template.render([{"role": "user", "content": "你好 😀"}])
    assert prompt == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
        "<|im_user|>user<|im_middle|>你好 😀<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    tok = load_tokenizer(KIMI)
    n = tok.num_ranks
    ids = tok.encode(prompt, add_bos=False)
    # each marker one id: system, middle, end, user, middle, end, assistant, middle
    markers = [n + 10, n + 17, n + 2, n + 3, n + 17, n + 2, n + 4, n + 17]
    assert [i for i in ids if i >= n] == markers
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.render(system, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|>"
    )


def test_jinja_file_wins_over_tokenizer_config(tmp_path):
    """As in transformers: a chat template file takes priority over the config's entry."""
    pytest.importorskip("jinja2", reason="rendering a chat template needs jinja2")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "config: {{ messages[0]['content'] }}", "eos_token": "</s>"})
    )
    messages = [{"role": "user", "content": "x"}]
    assert load_chat_template(tmp_path).render(messages) == "config: x"
    (tmp_path / "chat_template.jinja").write_text(
        "jinja: {{ messages[0]['content'] }}{{ eos_token }}"
    )
    template = load_chat_template(tmp_path)
    assert template.path == str(tmp_path / "chat_template.jinja")
    assert template.render(messages) == "jinja: x</s>"
    (tmp_path / "tokenizer_config.json").unlink()  # a .jinja file alone: no special tokens
    assert load_chat_template(tmp_path).render(messages) == "jinja: x"


def test_missing_chat_template_names_both_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config.json does not exist, nor "):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("")
    with pytest.raises(ValueError, match=r"chat_template.jinja is empty"):
        load_chat_template(tmp_path)
