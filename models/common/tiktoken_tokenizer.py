"""A tiktoken.model tokenizer (Kimi-K2, K2-Thinking, K2.5): its ranks read from the file, Kimi's
pre-tokenizer regex and special tokens, encoded by the `tiktoken` library."""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Sequence

TIKTOKEN_FILE = "tiktoken.model"
# Kimi's pre-tokenizer (tokenization_kimi.py's pat_str), the regex every tiktoken.model here is
# read with: a run of Han characters alone; a word (capitals then lower case, or capitals
# alone; other letters, Han aside) with its English contraction; up to three digits;
# punctuation with its newlines; newlines; whitespace. "&&" is class intersection in tiktoken's
# (Rust) regex.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# Kimi's special tokens follow the ranks: ids n .. n + 255 for n ranks, each named by
# tokenizer_config.json's added_tokens_decoder or else <|reserved_token_{id}|>.
RESERVED_SPECIAL_TOKENS = 256


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """The ranks of a tiktoken.model: a line per token, its bytes in base64 and its rank (the
    format of tiktoken.load.load_tiktoken_bpe, which is not used because it keeps a copy of each
    file it reads in a temporary directory under a key of the path, and reads a rewritten file
    stale).

    Raises:
        FileNotFoundError: no such file.
        ValueError: no tokens, a line is not a base64 token and a rank (the file and line
            named), or the ranks are not 0 .. n-1, each once.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(
                    f"{path}, line {number}: {line[:80]!r} is not a base64 token and a rank"
                ) from None
    if not ranks:
        raise ValueError(f"{path} holds no tokens (an empty file): download it again")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(
            f"{path}: its {len(ranks)} tokens do not have the ranks 0 .. {len(ranks) - 1}, "
            f"each once"
        )
    return ranks


def kimi_special_tokens(
    named: dict[int, str], num_ranks: int, *, file: str = "tokenizer_config.json"
) -> dict[str, int]:
    """The special tokens of a tiktoken.model of `num_ranks` ranks as Kimi numbers them
    (RESERVED_SPECIAL_TOKENS): text -> id.

    Args:
        named: id -> text of the named special tokens (tokenizer_config.json's
            added_tokens_decoder: {"163584": {"content": "[BOS]", ...}, ...}).
        num_ranks: the number of ranks; the first special token's id.
        file: the file `named` came from, named in errors.

    Raises:
        ValueError: an id is below `num_ranks` (it would be an ordinary token's), or the first
            one is above it (a truncated tiktoken.model).
    """
    if below := sorted(i for i in named if i < num_ranks):
        raise ValueError(
            f"{file}: added_tokens_decoder names ids {below[:8]} below {num_ranks} (the number "
            f"of ranks): special tokens follow the ranks"
        )
    if named and min(named) > num_ranks:
        # Kimi's first special token ([BOS]) has the id right after the last rank: a file cut
        # at a line boundary still has ranks 0 .. n-1, but too few of them.
        raise ValueError(
            f"{TIKTOKEN_FILE} has {num_ranks} ranks, but the first special token of {file} has "
            f"the id {min(named)}: the special tokens follow the ranks, so {TIKTOKEN_FILE} is "
            f"truncated (or from another tokenizer): download it again"
        )
    end = max([num_ranks + RESERVED_SPECIAL_TOKENS, *(i + 1 for i in named)])
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_ranks, end)}


# The special tokens Kimi's TikTokenTokenizer names when tokenizer_config.json gives no
# additional_special_tokens (its additional_special_tokens default).
KIMI_ADDITIONAL_SPECIAL_TOKENS = (
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
    "[EOT]", "<|im_system|>", "<|im_middle|>",
)  # fmt: skip


class TiktokenTokenizer:
    """A tiktoken.model (Kimi-K2, K2-Thinking, K2.5) through the `tiktoken` library: its `ranks`
    (read_tiktoken_ranks), the pre-tokenizer regex `pattern` and `special_tokens` (text -> id,
    above the ranks; kimi_special_tokens).

    As Kimi's own TikTokenTokenizer (tokenization_kimi.py of moonshotai/Kimi-K2-Instruct):
    encode adds no bos token (add_bos=True adds one), and special tokens written in the text
    encode as their ids; decode keeps special tokens as their text. decode with
    skip_special_tokens goes, in Kimi's tokenizer, through transformers' slow decode, and here
    does as it does: `skipped_tokens` (bos, eos, unk, pad and the additional special tokens)
    are dropped, each other of `added_tokens` (tokenizer_config.json's added_tokens_decoder) is
    written apart, and the pieces are joined with spaces. Ids the tokenizer does not have (a
    model's vocabulary may be larger) decode to nothing.
    """

    def __init__(
        self,
        ranks: dict[bytes, int],
        *,
        special_tokens: dict[str, int],
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None = None,
        pattern: str = KIMI_PATTERN,
        skipped_tokens: Sequence[str] = (),
        added_tokens: Sequence[str] = (),
        name: str = TIKTOKEN_FILE,
    ):
        import tiktoken

        self.num_ranks = len(ranks)
        self.special_tokens = dict(special_tokens)
        self._enc = tiktoken.Encoding(
            name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self._skipped = frozenset(
            self.special_tokens[t] for t in skipped_tokens if t in self.special_tokens
        )
        self._apart = (
            frozenset(self.special_tokens[t] for t in added_tokens if t in self.special_tokens)
            - self._skipped
        )
        self._ids = frozenset(self.special_tokens.values())
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text={text!r:.80} is a {type(text).__name__}, not a str")
        ids = self._enc.encode(text, allowed_special="all")
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        ids = [i for i in map(int, ids) if 0 <= i < self.num_ranks or i in self._ids]
        if not skip_special_tokens:
            return self._enc.decode(ids)
        pieces, run = [], []
        for i in ids:
            if i in self._skipped:
                continue
            if i in self._apart:
                if run and (text := self._enc.decode(run)):
                    pieces.append(text)
                pieces.append(self._enc.decode([i]))
                run = []
            else:
                run.append(i)
        if run:
            pieces.append(self._enc.decode(run))
        return " ".join(pieces)
