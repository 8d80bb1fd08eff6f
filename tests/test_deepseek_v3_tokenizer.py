"""Chat templates: tokenizer_config.json's chat_template rendered as transformers renders it, and
the errors that name the file. (The tokenizers themselves: test_deepseek_v3_params.py.)"""

from __future__ import annotations

import json

import pytest

from models.deepseek_v3 import load_chat_template, load_tokenizer

# A template in the style of Hugging Face's: bos first, a turn per message, the assistant's turn
# opened on request; trim_blocks / lstrip_blocks drop the newline after a tag and the
# indentation before one (not the newline after an expression: "{%-" strips that).
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {% if message['role'] == 'user' %}
User: {{ message['content'] }}{{ eos_token }}
    {% else %}
{{ raise_exception('only user turns, got ' + message['role']) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
Assistant:
{% endif %}"""


def _write_config(path, **config) -> None:
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_chat_template_renders_like_transformers(tmp_path):
    pytest.importorskip("jinja2", reason="rendering a chat template needs jinja2")
    # DeepSeek-V3 writes bos as an AddedToken object, eos as text.
    bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True}
    _write_config(tmp_path, chat_template=TEMPLATE, bos_token=bos, eos_token="</s>")
    template = load_chat_template(tmp_path)
    assert template.path == str(tmp_path / "tokenizer_config.json")
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    messages = [{"role": "user", "content": "hello world"}]
    assert template.render(messages) == "<s>User: hello world</s>\nAssistant:\n"
    assert template.render(messages, add_generation_prompt=False) == "<s>User: hello world</s>\n"
    with pytest.raises(ValueError, match="only user turns, got assistant") as err:
        template.render([{"role": "assistant", "content": "hi"}])
    assert "tokenizer_config.json" in str(err.value)


def test_named_chat_templates_take_the_default(tmp_path):
    pytest.importorskip("jinja2", reason="rendering a chat template needs jinja2")
    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0]['content'] | tojson }}"},
    ]
    _write_config(tmp_path, chat_template=named)
    template = load_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": 'say "hi"'}]) == '"say \\"hi\\""'


def test_chat_template_syntax_error_names_the_file(tmp_path):
    pytest.importorskip("jinja2", reason="rendering a chat template needs jinja2")
    _write_config(tmp_path, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="the chat_template of .*tokenizer_config.json failed"):
        load_chat_template(tmp_path).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "config,error,match",
    [
        (None, FileNotFoundError, r"tokenizer_config.json does not exist"),
        ({"bos_token": "<s>"}, ValueError, r"tokenizer_config.json has no chat_template"),
        ({"chat_template": [{"name": "rag", "template": "x"}]}, ValueError, "no chat_template"),
        ({"chat_template": 3}, ValueError, "no chat_template"),
    ],
    ids=["no_file", "no_template", "no_default_template", "not_a_string"],
)
def test_missing_chat_template_names_the_file(tmp_path, config, error, match):
    if config is not None:
        _write_config(tmp_path, **config)
    with pytest.raises(error, match=match) as err:
        load_chat_template(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_rendered_special_tokens_encode_as_their_ids(tmp_path):
    """The template writes the bos token as text: the tokenizer reads it back as its id, so the
    rendered prompt is encoded without a bos of the tokenizer's own."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "User": 3, ":": 4, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    hf = load_tokenizer(tmp_path)
    assert hf.encode("<s>User: hello</s>", add_bos=False) == [0, 3, 4, 2, 1]
