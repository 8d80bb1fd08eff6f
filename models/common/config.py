"""What every family's config shares: how the model quantizes its weights (QuantSpec), and the
checks of a config's field types and ranges."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

from models.common.checkpoint import CONFIG_FILE, read_config

# The linears a QuantSpec may quantize, by role; each family's name table tags its linears
# with these.
QUANT_TARGETS = ("experts", "shared_experts", "dense_mlp", "attention")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How the model quantizes its weights (random init and quantize-on-load).

    Attributes:
        bits: 4 or 8.
        group_size: G; a layer whose K is not a multiple of G uses one group per row (-1).
        has_zp: asymmetric (zero points stored) or symmetric.
        targets: which linears are quantized: "experts" (routed), "shared_experts",
            "dense_mlp" (the MLPs of dense layers), "attention" (the attention projections).
            The router and the embeddings / lm_head always stay float.
        scale_dtype: the scales' dtype (e.g. "float16", as GPTQ checkpoints store them);
            None: the model's dtype.
        scheme: None (integer codes, the fields above) or "mxfp4" (E2M1 codes, one uint8 E8M0
            scale per 32 inputs, no zero points: bits 4, group_size 32, has_zp False;
            `MXFP4`, as gpt-oss and DeepSeek-V4 ship their routed experts).
    """

    bits: int = 4
    group_size: int = 128
    has_zp: bool = True
    targets: tuple[str, ...] = QUANT_TARGETS
    scale_dtype: str | None = None
    scheme: str | None = None

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"QuantSpec.bits={self.bits} is not supported (supported: 4, 8)")
        if self.scheme not in (None, "mxfp4"):
            raise ValueError(f"QuantSpec.scheme={self.scheme!r} is not None or 'mxfp4'")
        if self.scheme == "mxfp4" and (
            (self.bits, self.group_size, self.has_zp, self.scale_dtype) != (4, 32, False, None)
        ):
            raise ValueError(
                f"QuantSpec.scheme='mxfp4' is bits 4, group_size 32, has_zp False with E8M0 "
                f"scales, got bits={self.bits}, group_size={self.group_size}, "
                f"has_zp={self.has_zp}, scale_dtype={self.scale_dtype!r}"
            )
        unknown = sorted(set(self.targets) - set(QUANT_TARGETS))
        if unknown:
            raise ValueError(
                f"QuantSpec.targets has unknown entries {unknown}; known: {list(QUANT_TARGETS)}"
            )

    def group_for(self, k: int) -> int:
        """The group size used for a weight with K input features."""
        return self.group_size if self.group_size > 0 and k % self.group_size == 0 else -1

    @classmethod
    def parse(cls, spec: str | QuantSpec | None, *, group_size: int = 128) -> QuantSpec | None:
        """`None`, a QuantSpec, "int4" / "int8" (asymmetric, `group_size`) or "mxfp4" (`MXFP4`)."""
        if spec is None or isinstance(spec, QuantSpec):
            return spec
        if spec == "mxfp4":
            return MXFP4
        names = {"int4": 4, "int8": 8}
        if spec not in names:
            raise ValueError(f"quantize={spec!r} is not one of {sorted(names) + ['mxfp4']} or None")
        return cls(bits=names[spec], group_size=group_size)


# MXFP4 routed experts, the rest float: how gpt-oss and DeepSeek-V4 ship their weights.
MXFP4 = QuantSpec(bits=4, group_size=32, has_zp=False, targets=("experts",), scheme="mxfp4")


def type_problems(cfg) -> list[str]:
    """A sentence for each field of the config dataclass `cfg` whose value is not of its
    default's kind: an int field holds an int (not a bool, not a string such as "64"), a float
    field a number, a bool field a bool, a string field a string. Fields whose default is None
    or a container are not typed here (their own checks read them)."""
    problems = []
    for f in dataclasses.fields(cfg):
        v, default = getattr(cfg, f.name), f.default
        if v is None or default is None or default is dataclasses.MISSING:
            continue
        if isinstance(default, bool):
            ok, kind = isinstance(v, bool), "a bool"
        elif isinstance(default, int):
            ok, kind = isinstance(v, int) and not isinstance(v, bool), "an int"
        elif isinstance(default, float):
            ok = isinstance(v, int | float) and not isinstance(v, bool)
            kind = "a number"
        elif isinstance(default, str):
            ok, kind = isinstance(v, str), "a string"
        else:
            continue
        if not ok:
            problems.append(f"{f.name}={v!r} must be {kind}")
    return problems


def range_problems(cfg, least: Mapping[str, int], positive: Sequence[str]) -> list[str]:
    """A sentence for each field of the right type whose value is out of its range: an int
    field of `least` below its least value (None passes), a field of `positive` NaN, inf or
    not > 0, a bos_token_id, pad_token_id or eos_token_id entry that is not an int in
    [0, vocab_size)."""
    problems = []
    for name, minimum in least.items():
        v = getattr(cfg, name)
        if v is not None and v < minimum:
            problems.append(f"{name}={v} must be >= {minimum}")
    for name in positive:
        v = getattr(cfg, name)
        if not math.isfinite(v) or v <= 0:
            problems.append(f"{name}={v} must be a finite number > 0")
    ids = [(name, getattr(cfg, name)) for name in ("bos_token_id", "pad_token_id")]
    ids += [(f"eos_token_id[{i}]", v) for i, v in enumerate(cfg.eos_token_id)]
    for name, v in ids:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            problems.append(f"{name}={v!r} must be an int token id")
        elif v is not None and not 0 <= v < max(cfg.vocab_size, 1):
            problems.append(f"{name}={v} is not a token id in [0, vocab_size={cfg.vocab_size})")
    return problems


class HfConfig:
    """What every family's config shares of config.json: `from_json` reads the file through
    `read_config` (a save killed before config.json was written reads the config saved with
    the weights) and hands the dict to the family's `from_hf_dict`."""

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides):
        """Reads `path` (a config.json or a directory holding one).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a JSON object, or invalid values; the message names the file.
        """
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_FILE)
        d = read_config(path)
        try:
            return cls.from_hf_dict(d, **overrides)
        except (KeyError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None


def eos_ids(value) -> tuple[int, ...]:
    """config.json's eos_token_id (absent, one id or a list of ids) as a tuple of ids."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
