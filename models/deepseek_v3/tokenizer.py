"""Tokenizers: a Hugging Face tokenizer.json through `tokenizers`, or a byte-level fallback;
chat templates from tokenizer_config.json."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Protocol

from models.deepseek_v3.config import read_json


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """Bytes as ids: id = byte + offset; ids below the offset are special (pad, bos, eos).

    Needs vocab_size >= 256 + offset; decoding skips ids that are not bytes.
    """

    def __init__(
        self, *, offset: int = 3, pad_id: int = 0, bos_id: int | None = 1, eos_id: int | None = 2
    ):
        self.offset = offset
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json read with the `tokenizers` library (no transformers needed)."""

    def __init__(
        self, path: str, *, bos_id: int | None, eos_id: int | None, pad_id: int | None = None
    ):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(path)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + list(ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


logger = logging.getLogger("models.deepseek_v3")


def load_tokenizer(path: str | os.PathLike | None = None, *, cfg=None) -> Tokenizer:
    """The tokenizer of an HF directory (tokenizer.json), else the byte-level fallback (with a
    warning when `path` is a directory without tokenizer.json: a real checkpoint's text would
    be wrong; path None is a random model's tokenizer).

    bos/eos/pad ids come from `cfg` (a DeepseekV3Config) when given, else config.json.
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
        return HFTokenizer(os.path.join(path, "tokenizer.json"), bos_id=bos, eos_id=eos, pad_id=pad)
    if path is not None:
        logger.warning(
            "%s has no tokenizer.json: using the byte-level fallback tokenizer, whose ids are "
            "not the model's vocabulary (the text in and out will be wrong)",
            path,
        )
    return ByteTokenizer(
        pad_id=pad if pad is not None else 0,
        bos_id=bos if bos is not None else 1,
        eos_id=eos if eos is not None else 2,
    )


TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The special tokens a chat template may name, passed to it as text.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer_config.json's chat_template (a Jinja template) and the special tokens it may
    name (bos_token, eos_token, ... as text)."""

    path: str  # the tokenizer_config.json it came from
    template: str
    special_tokens: dict[str, str]

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{"role": "user", "content": "..."}, ...]), as
        transformers' apply_chat_template(tokenize=False) renders it: a sandboxed Jinja
        environment with trim_blocks, lstrip_blocks, loop controls, raise_exception and tojson.
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
        try:
            return env.from_string(self.template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat_template of {self.path} failed: {err}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken object
    ({"content": text, ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(path: str | os.PathLike) -> ChatTemplate:
    """The chat template of a checkpoint directory's tokenizer_config.json: its chat_template
    (a Jinja string, or a list of {"name", "template"} of which "default" is taken).

    Raises:
        FileNotFoundError: the directory has no tokenizer_config.json (named).
        ValueError: the file is not a JSON object or has no chat_template (the file named).
    """
    file = os.path.join(os.fspath(path), TOKENIZER_CONFIG_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: no chat template to apply")
    hf = read_json(file)
    template = hf.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{file} has no chat_template (a Jinja string): no chat template to apply")
    tokens = {k: text for k in _SPECIAL_TOKENS if (text := _token_text(hf.get(k))) is not None}
    return ChatTemplate(path=file, template=template, special_tokens=tokens)
