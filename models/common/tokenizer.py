"""Tokenizers of every model family: a Hugging Face tokenizer.json through `tokenizers`, a
tiktoken.model (Kimi-K2) through `tiktoken`, or a byte-level fallback; chat templates from
chat_template.jinja or tokenizer_config.json."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from collections.abc import Sequence
from typing import Protocol

from models.common.checkpoint import read_json
from models.common.tiktoken_tokenizer import (
    KIMI_ADDITIONAL_SPECIAL_TOKENS,
    TIKTOKEN_FILE,
    TiktokenTokenizer,
    kimi_special_tokens,
    read_tiktoken_ranks,
)


class Tokenizer(Protocol):
    """encode(text) gives the ids the checkpoint's own tokenizer gives (transformers'
    `tokenizer(text)["input_ids"]`, Kimi's TikTokenTokenizer.encode): a bos token only where it
    adds one; add_bos=True / False forces one / none (False for a rendered chat template, which
    writes its own). decode(ids) keeps special tokens as text, as transformers' decode does by
    default, unless skip_special_tokens."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str: ...


def _check_text(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text={text!r:.80} is a {type(text).__name__}, not a str")
    return text


class ByteTokenizer:
    """Bytes as ids: id = byte + offset; ids below the offset are special (pad, bos, eos).

    Needs vocab_size >= 256 + offset; encoding adds the bos id unless add_bos=False; decoding
    skips ids that are not bytes (it has no text for its special tokens).
    """

    def __init__(
        self, *, offset: int = 3, pad_id: int = 0, bos_id: int | None = 1, eos_id: int | None = 2
    ):
        self.offset = offset
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = [b + self.offset for b in _check_text(text).encode("utf-8")]
        return ([self.bos_id] if add_bos is not False and self.bos_id is not None else []) + ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        del skip_special_tokens  # special ids have no text here
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")


# transformers' clean_up_tokenization (PreTrainedTokenizerBase), which decode applies where
# tokenizer_config.json's clean_up_tokenization_spaces is true.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip


class HFTokenizer:
    """A tokenizer.json read with the `tokenizers` library (no transformers needed), encoding
    and decoding as transformers' fast tokenizer of it does: bos/eos added by the file's own
    post-processor (DeepSeek-V3's adds a bos, Qwen's none), special tokens kept by decode.

    Args:
        path: the tokenizer.json.
        bos_id, eos_id, pad_id: config.json's ids.
        clean_up_tokenization_spaces: tokenizer_config.json's (transformers' decode option).

    Raises:
        ValueError: the file is not a tokenizer.json `tokenizers` can read (the file named).
    """

    def __init__(
        self,
        path: str,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        clean_up_tokenization_spaces: bool = False,
    ):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as err:  # `tokenizers` raises a bare Exception for a malformed file
            raise ValueError(f"{path} cannot be read as a tokenizer.json: {err}") from None
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self.clean_up = clean_up_tokenization_spaces

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        text = _check_text(text)
        if add_bos is None:  # the file's own post-processor decides
            return list(self._tok.encode(text, add_special_tokens=True).ids)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + list(ids)

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up:
            for a, b in _CLEAN_UP:
                text = text.replace(a, b)
        return text


TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _tiktoken_tokenizer(
    path: str, *, bos: int | None, eos: int | None, pad: int | None
) -> TiktokenTokenizer:
    """The tiktoken.model of the directory `path` with tokenizer_config.json's special tokens;
    bos/eos/pad not given are its bos_token / eos_token / pad_token."""
    config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    config = read_json(config_file) if os.path.exists(config_file) else {}
    added = config.get("added_tokens_decoder") or {}
    names = {}
    for key, token in added.items():
        if not str(key).isdigit() or (text := _token_text(token)) is None:
            raise ValueError(
                f"{config_file}: added_tokens_decoder[{key!r}] = {token!r} is not an id and a "
                f"token with a content text"
            )
        names[int(key)] = text
    ranks = read_tiktoken_ranks(os.path.join(path, TIKTOKEN_FILE))
    specials = kimi_special_tokens(names, len(ranks), file=config_file)
    named = [_token_text(config.get(k)) for k in _SPECIAL_TOKENS + ("sep_token", "cls_token")]
    extra = config.get("additional_special_tokens")
    extra = KIMI_ADDITIONAL_SPECIAL_TOKENS if extra is None else [_token_text(t) for t in extra]

    def token_id(key: str, given: int | None) -> int | None:
        return given if given is not None else specials.get(_token_text(config.get(key)))

    return TiktokenTokenizer(
        ranks,
        special_tokens=specials,
        bos_id=token_id("bos_token", bos),
        eos_id=token_id("eos_token", eos),
        pad_id=token_id("pad_token", pad),
        skipped_tokens=[t for t in (*named, *extra) if t is not None],
        added_tokens=list(names.values()),
    )


logger = logging.getLogger("models")


def load_tokenizer(path: str | os.PathLike | None = None, *, cfg=None) -> Tokenizer:
    """The tokenizer of an HF directory: its tokenizer.json, else its tiktoken.model (Kimi-K2)
    with tokenizer_config.json's special tokens, else the byte-level fallback (with a warning
    when `path` is a directory: a real checkpoint's text would be wrong; path None is a random
    model's tokenizer).

    bos/eos/pad ids come from `cfg` (a DeepseekV3Config) when given, else config.json; a
    tiktoken.model's, where neither names them, from tokenizer_config.json's bos_token, ...
    """
    bos = eos = pad = None
    if cfg is not None:
        bos, pad = cfg.bos_token_id, cfg.pad_token_id
        eos = cfg.eos_token_id[0] if cfg.eos_token_id else None
    elif path is not None and os.path.exists(os.path.join(path, "config.json")):
        hf = read_json(os.path.join(path, "config.json"))
        bos, pad = hf.get("bos_token_id"), hf.get("pad_token_id")
        eos = hf.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
    if path is not None and os.path.exists(os.path.join(path, "tokenizer.json")):
        config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
        config = read_json(config_file) if os.path.exists(config_file) else {}
        return HFTokenizer(
            os.path.join(path, "tokenizer.json"),
            bos_id=bos,
            eos_id=eos,
            pad_id=pad,
            clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces") is True,
        )
    if path is not None and os.path.exists(os.path.join(path, TIKTOKEN_FILE)):
        return _tiktoken_tokenizer(os.fspath(path), bos=bos, eos=eos, pad=pad)
    if path is not None:
        logger.warning(
            "%s has no tokenizer.json: using the byte-level fallback tokenizer (it has no "
            "%s either), whose ids are not the model's vocabulary (the text in and out will "
            "be wrong)",
            path,
            TIKTOKEN_FILE,
        )
    return ByteTokenizer(
        pad_id=pad if pad is not None else 0,
        bos_id=bos if bos is not None else 1,
        eos_id=eos if eos is not None else 2,
    )


CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The special tokens a chat template may name, passed to it as text.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template (Jinja) and the special tokens it may name (bos_token,
    eos_token, ... as text)."""

    path: str  # the chat_template.jinja or tokenizer_config.json it came from
    template: str
    special_tokens: dict[str, str]

    def render(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text for `messages` ([{"role": "user", "content": "..."}, ...]), as
        transformers' apply_chat_template(tokenize=False) renders it: a sandboxed Jinja
        environment with trim_blocks, lstrip_blocks, loop controls, raise_exception, tojson
        and strftime_now (today's date, as gpt-oss's harmony template writes it); `kwargs` are
        the template's own variables (e.g. gpt-oss's reasoning_effort, tools, model_identity).
        Encode the text without a bos token of the tokenizer's own: the template writes it.

        Raises:
            ImportError: jinja2 is not installed (pip install 'wna16_jax[chat]').
            ValueError: the template does not compile or raised an error (the file named).
        """
        try:
            import jinja2
            import jinja2.ext
            import jinja2.sandbox
        except ImportError:
            raise ImportError(
                f"rendering the chat template of {self.path} needs jinja2: "
                f"pip install jinja2 (or 'wna16_jax[chat]')"
            ) from None

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            return env.from_string(self.template).render(
                messages=list(messages),
                **{**self.special_tokens, **kwargs},
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat_template of {self.path} failed: {err}") from None


def strftime_now(fmt: str) -> str:
    """The local time now in `fmt` (a chat template's strftime_now, as transformers gives it)."""
    return datetime.datetime.now().strftime(fmt)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken object
    ({"content": text, ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(path: str | os.PathLike) -> ChatTemplate:
    """The chat template of a checkpoint directory: its chat_template.jinja, else its
    tokenizer_config.json's chat_template (a Jinja string, or a list of {"name", "template"} of
    which "default" is taken). The .jinja file wins where both are, as in transformers (a
    template file takes priority over the config's entry); the special tokens come from
    tokenizer_config.json either way, where there is one.

    Raises:
        FileNotFoundError: the directory has neither file (named).
        ValueError: tokenizer_config.json is not a JSON object, chat_template.jinja is not
            UTF-8, or neither file holds a template (the file named).
    """
    config_file = os.path.join(os.fspath(path), TOKENIZER_CONFIG_FILE)
    jinja_file = os.path.join(os.fspath(path), CHAT_TEMPLATE_FILE)
    has_config, has_jinja = os.path.exists(config_file), os.path.exists(jinja_file)
    if not has_config and not has_jinja:
        raise FileNotFoundError(
            f"{config_file} does not exist, nor {CHAT_TEMPLATE_FILE} beside it: no chat template "
            f"to apply"
        )
    hf = read_json(config_file) if has_config else {}
    tokens = {k: text for k in _SPECIAL_TOKENS if (text := _token_text(hf.get(k))) is not None}
    if has_jinja:
        try:
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        except UnicodeDecodeError as err:
            raise ValueError(f"{jinja_file} is not UTF-8 text ({err}): save it as UTF-8") from None
        if not template:
            raise ValueError(f"{jinja_file} is empty: no chat template to apply")
        return ChatTemplate(path=jinja_file, template=template, special_tokens=tokens)
    template = hf.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{config_file} has no chat_template (a Jinja string), nor is there a "
            f"{CHAT_TEMPLATE_FILE} beside it: no chat template to apply"
        )
    return ChatTemplate(path=config_file, template=template, special_tokens=tokens)
