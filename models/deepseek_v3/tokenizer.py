"""Tokenizers: a Hugging Face tokenizer.json through `tokenizers`, or a byte-level fallback."""

from __future__ import annotations

import logging
import os
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
