"""gpt-oss configuration: a frozen dataclass read from an HF config.json, with presets."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.common.checks import hf_config_problems
from models.common.config import (
    MXFP4,
    HfConfig,
    QuantSpec,
    eos_ids,
    range_problems,
    type_problems,
)

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class YarnRope:
    """YaRN rope scaling as transformers computes it for gpt-oss (`_compute_yarn_parameters`):
    frequencies blended between theta's and theta's / factor over the correction range of
    beta_fast .. beta_slow rotations (floored / ceiled when `truncate`), cos and sin scaled by
    0.1 ln(factor) + 1."""

    factor: float = 32.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = False

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "yarn", **dataclasses.asdict(self)}


# The least value of each int field, and the float fields that must be finite and positive.
_INT_MINIMUM = {
    "vocab_size": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "num_local_experts": 1,
    "num_experts_per_tok": 1,
    "sliding_window": 1,
    "max_position_embeddings": 1,
}
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "swiglu_alpha", "swiglu_limit")


@dataclasses.dataclass(frozen=True)
class GptOssConfig(HfConfig):
    """Every gpt-oss config.json field the model uses (openai/gpt-oss-20b and -120b).

    Attention: q/k/v/o with biases (`attention_bias`), grouped-query heads, a learned sink per
    head (one more softmax column, dropped after), layers of `layer_types` "sliding_attention"
    (each query sees its last `sliding_window` tokens, itself included) or "full_attention";
    YaRN rope (`rope_scaling`, None: plain rope). MoE on every layer: a biased router linear,
    softmax over the top-k logits, experts with biases and the clamped swiglu
    (`swiglu_limit`, `swiglu_alpha`). `dtype` and `quant` are not HF's: the activations' dtype,
    and how a random model quantizes its experts (models.common.config.MXFP4 as released).
    """

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()  # () : sliding, full, sliding, ... as transformers fills it
    attention_bias: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: YarnRope | None = YarnRope()
    max_position_embeddings: int = 131072
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = (200002,)
    pad_token_id: int | None = 199999
    dtype: str = "bfloat16"
    quant: QuantSpec | None = dataclasses.field(default=None, compare=False)
    quantization_config: dict | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if not self.layer_types:
            kinds = tuple(LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", kinds)
        problems = type_problems(self)
        if problems:
            raise ValueError("invalid gpt-oss config: " + "; ".join(problems))
        problems += range_problems(self, _INT_MINIMUM, _POSITIVE_FLOATS)
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
                f"{self.num_hidden_layers}"
            )
        bad = sorted({repr(t) for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            problems.append(f"layer_types holds {bad}, not one of {list(LAYER_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} is not even (the rope rotates halves)")
        if self.num_experts_per_tok > self.num_local_experts:
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_local_experts="
                f"{self.num_local_experts}"
            )
        r = self.rope_scaling
        if r is not None:
            for f in ("factor", "beta_fast", "beta_slow"):
                v = getattr(r, f)
                if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                    problems.append(f"rope_scaling.{f}={v!r} must be a finite number > 0")
            if not isinstance(r.original_max_position_embeddings, int) or (
                r.original_max_position_embeddings < 1
            ):
                problems.append(
                    f"rope_scaling.original_max_position_embeddings="
                    f"{r.original_max_position_embeddings!r} must be an int >= 1"
                )
        if problems:
            raise ValueError("invalid gpt-oss config: " + "; ".join(problems))

    # --- what the shared layers read --------------------------------------------------------
    model_type = MODEL_TYPE

    @property
    def n_routed_experts(self) -> int:
        return self.num_local_experts

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    qk_norm = False  # no q/k norms

    def is_moe_layer(self, i: int) -> bool:
        return True

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    def quantizes(self, target: str) -> bool:
        return self.quant is not None and target in self.quant.targets

    # --- HF config.json ----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides) -> GptOssConfig:
        """From a config.json dict: transformers 4's rope_scaling + rope_theta (as the
        checkpoints ship) or 5's rope_parameters.

        Raises:
            ValueError: a field of the wrong JSON type or missing (each named), or a rope type
                other than "yarn" or "default", naming it.
        """
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_local_experts")  # fmt: skip
        problems = hf_config_problems(
            d,
            cls,
            required=required,
            nullable=("num_key_value_heads", "head_dim", "sliding_window", "layer_types"),
        )
        if not isinstance(d.get("layer_types") or [], list):
            problems.append(f"layer_types={d['layer_types']!r} must be a list of layer names")
        if problems:
            raise ValueError("invalid gpt-oss config: " + "; ".join(problems))
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "yarn":
            yarn = YarnRope(
                factor=float(rope.get("factor", 32.0)),
                original_max_position_embeddings=rope.get(
                    "original_max_position_embeddings", d.get("initial_context_length", 4096)
                ),
                beta_fast=float(rope.get("beta_fast") or 32.0),
                beta_slow=float(rope.get("beta_slow") or 1.0),
                truncate=bool(rope.get("truncate", True)),
            )
        elif rope_type == "default":
            yarn = None
        else:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: yarn, default)")
        eos = d.get("eos_token_id")
        heads = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            num_local_experts=d["num_local_experts"],
            num_experts_per_tok=d.get("num_experts_per_tok", d.get("experts_per_token", 4)),
            sliding_window=d.get("sliding_window") or 128,
            layer_types=tuple(d.get("layer_types") or ()),
            attention_bias=bool(d.get("attention_bias", True)),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 150000.0))),
            rope_scaling=yarn,
            max_position_embeddings=d.get("max_position_embeddings", 131072),
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids(eos),
            pad_token_id=d.get("pad_token_id"),
            quantization_config=d.get("quantization_config"),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as the checkpoints write it (transformers 4's rope_scaling)."""
        d = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("rope_scaling", "dtype", "quant", "quantization_config")
            },
        }
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        d["num_experts_per_tok"] = d["experts_per_token"] = self.num_experts_per_tok
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf_dict()
        return d

    # --- presets -----------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> GptOssConfig:
        """A four-layer model for tests (f32, a 5-token window)."""
        kw = dict(
            vocab_size=160,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            rope_scaling=YarnRope(original_max_position_embeddings=64),
            max_position_embeddings=2048,
            eos_token_id=(153,),
            pad_token_id=152,
            dtype="float32",
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def preset(cls, name: str, **overrides) -> GptOssConfig:
        """A released size at full width (`PRESETS`), its routed experts MXFP4 as released."""
        if name not in PRESETS:
            raise ValueError(f"preset {name!r} is not one of {sorted(PRESETS)}")
        return cls(**{"quant": MXFP4, **PRESETS[name], **overrides})


# The released sizes' config.json values (the rest are the defaults above).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(num_hidden_layers=36, num_local_experts=128),
}
