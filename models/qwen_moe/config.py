"""Qwen2-MoE and Qwen3-MoE configuration: a frozen dataclass read from an HF config.json, with a
preset per released size."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.common.checks import hf_config_problems
from models.common.config import HfConfig, QuantSpec, eos_ids, range_problems, type_problems

# config.json model_type -> architectures entry.
MODEL_TYPES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# What the released int4 checkpoints are (GPTQ-Int4): group 128, symmetric, float16 scales.
GPTQ_INT4 = QuantSpec(bits=4, group_size=128, has_zp=False, scale_dtype="float16")


# The least value of each int field, and the float fields that must be finite and positive
# (`range_problems`).
_INT_MINIMUM = {
    "vocab_size": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 0,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 1,
}
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")


@dataclasses.dataclass(frozen=True)
class QwenMoeConfig(HfConfig):
    """One config for both families; `model_type` tells them apart.

    Qwen2-MoE: q/k/v biases, a shared expert of `shared_expert_intermediate_size` scaled by
    sigmoid(shared_expert_gate(x)), softmax top-k without renormalization (norm_topk_prob
    false). Qwen3-MoE: no shared expert, q/k RMSNorm per head (`qk_norm`), GQA. Both: a layer
    is sparse when it is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0.
    """

    model_type: str = "qwen3_moe"
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    shared_expert_intermediate_size: int = 0
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Not in config.json: the activations' dtype and how weights are quantized.
    dtype: str = "bfloat16"
    quant: QuantSpec | None = dataclasses.field(default=None, compare=False)
    quantization_config: dict | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        problems = type_problems(self)
        if problems:  # the value checks below assume the types
            raise ValueError("invalid Qwen MoE config: " + "; ".join(problems))
        if self.model_type not in MODEL_TYPES:
            problems.append(
                f"model_type={self.model_type!r} is not a Qwen MoE ({sorted(MODEL_TYPES)})"
            )
        problems += range_problems(self, _INT_MINIMUM, _POSITIVE_FLOATS)
        if self.num_key_value_heads >= 1 and self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        if self.dtype not in ("bfloat16", "float16", "float32"):
            problems.append(
                f"dtype={self.dtype!r} is not one of bfloat16, float16, float32 (the activations' "
                f"dtype; quantize weights with quantize='int4' or 'int8')"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            problems.append(
                f"mlp_only_layers holds {bad}, not layers in [0, num_hidden_layers="
                f"{self.num_hidden_layers})"
            )
        if problems:
            raise ValueError("invalid Qwen MoE config: " + "; ".join(problems))

    # --- what the shared layers read --------------------------------------------------------
    @property
    def n_routed_experts(self) -> int:
        return self.num_experts

    @property
    def qk_norm(self) -> bool:
        """Qwen3's RMSNorm of each query and key head before the rope."""
        return self.model_type == "qwen3_moe"

    @property
    def qkv_bias(self) -> bool:
        """Biases on q_proj, k_proj, v_proj: always in Qwen2-MoE, `attention_bias` in Qwen3."""
        return self.model_type == "qwen2_moe" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        """A bias on o_proj: Qwen3's `attention_bias`."""
        return self.model_type == "qwen3_moe" and self.attention_bias

    @property
    def shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def quantizes(self, target: str) -> bool:
        return self.quant is not None and target in self.quant.targets

    # --- HF config.json ----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides) -> QwenMoeConfig:
        """From a config.json dict (transformers 4 or 5: rope_theta at the top or in
        rope_parameters). Refused: rope scaling and sliding-window attention, which these
        checkpoints do not use."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_experts",
                    "num_experts_per_tok")  # fmt: skip
        problems = hf_config_problems(
            d,
            cls,
            required=required,
            int_lists=("mlp_only_layers",),
            nullable=("num_key_value_heads", "head_dim", "mlp_only_layers"),
        )
        if problems:
            raise ValueError("invalid Qwen MoE config: " + "; ".join(problems))
        model_type = d.get("model_type")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: 'default')")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")
        eos = d.get("eos_token_id")
        heads = d["num_attention_heads"]
        kw = dict(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            moe_intermediate_size=d["moe_intermediate_size"],
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0)
            if model_type == "qwen2_moe"
            else 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or (d["hidden_size"] // heads if heads else 0),
            num_experts=d["num_experts"],
            num_experts_per_tok=d["num_experts_per_tok"],
            norm_topk_prob=d.get("norm_topk_prob", False),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            attention_bias=d.get("attention_bias", False),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_ids(eos),
            pad_token_id=d.get("pad_token_id"),
            quantization_config=d.get("quantization_config"),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json dict (what `from_hf_dict` reads back); `dtype` and `quant` are
        not written."""
        skip = ("dtype", "quant", "quantization_config", "eos_token_id", "mlp_only_layers")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        eos = self.eos_token_id
        d["eos_token_id"] = None if not eos else eos[0] if len(eos) == 1 else list(eos)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["architectures"] = [MODEL_TYPES[self.model_type]]
        d["torch_dtype"] = self.dtype
        if self.quantization_config is not None:
            d["quantization_config"] = self.quantization_config
        return d

    # --- presets -----------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> QwenMoeConfig:
        """A few-layer model for tests (Qwen3-MoE unless model_type says otherwise)."""
        kw = dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=512,
            dtype="float32",
        )
        if overrides.get("model_type") == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=128, norm_topk_prob=False)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def preset(cls, name: str, **overrides) -> QwenMoeConfig:
        """A released size at full width (`PRESETS`), with GPTQ-like int4 weights."""
        if name not in PRESETS:
            raise ValueError(f"preset {name!r} is not one of {sorted(PRESETS)}")
        return cls(**{"quant": GPTQ_INT4, **PRESETS[name], **overrides})


# The released sizes' config.json values (the rest are the defaults above).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        num_hidden_layers=48, hidden_size=2048, intermediate_size=6144, num_attention_heads=32
    ),
    "qwen3-235b-a22b": dict(
        num_hidden_layers=94,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_attention_heads=64,
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe",
        num_hidden_layers=24,
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        num_experts=60,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        rope_theta=1_000_000.0,
        max_position_embeddings=8192,
    ),
    "qwen2-57b-a14b": dict(
        model_type="qwen2_moe",
        num_hidden_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
    ),
}
