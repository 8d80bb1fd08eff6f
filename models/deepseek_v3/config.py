"""DeepSeek-V3 / V2 configuration: a frozen dataclass read from an HF config.json, with presets."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.common.checks import hf_config_problems
from models.common.config import HfConfig, QuantSpec, range_problems, type_problems

TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
SCORING_FUNCS = ("sigmoid", "softmax")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (rope_scaling / rope_parameters with type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def to_hf_dict(self) -> dict[str, Any]:
        return {"type": "yarn", **dataclasses.asdict(self)}


def _tuple_ids(v) -> tuple[int, ...]:
    """None, one id or a list of ids as a tuple; the ids kept as given (a float is reported by
    the config's checks, never truncated)."""
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(v)
    return (v,)


# The least value of each int field (None-able ones are checked when set), and the float
# fields that must be finite and positive (`range_problems`).
_INT_MINIMUM = {
    "vocab_size": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "moe_intermediate_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "q_lora_rank": 1,
    "kv_lora_rank": 1,
    "qk_nope_head_dim": 0,
    "qk_rope_head_dim": 2,
    "v_head_dim": 1,
    "n_routed_experts": 0,  # 0 or None: no routed experts (every layer dense)
    "n_shared_experts": 0,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "max_position_embeddings": 1,
    "num_nextn_predict_layers": 0,
}
_POSITIVE_FLOATS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")


def _rope_problems(r: YarnScaling | None) -> list[str]:
    """A sentence for each YaRN setting out of range: not finite, a factor <= 0, fewer than one
    original position."""
    if r is None:
        return []
    problems = []
    for f in dataclasses.fields(r):
        v = getattr(r, f.name)
        if not math.isfinite(v):
            problems.append(f"rope_scaling.{f.name}={v} must be finite")
    if math.isfinite(r.factor) and r.factor <= 0:
        problems.append(f"rope_scaling.factor={r.factor} must be > 0")
    if r.original_max_position_embeddings < 1:
        problems.append(
            f"rope_scaling.original_max_position_embeddings="
            f"{r.original_max_position_embeddings} must be >= 1"
        )
    return problems


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(HfConfig):
    """Every DeepSeek-V3 (and V2 / V2-Lite) config.json field the model uses.

    Two fields are not HF's: `dtype` (activations and float weights) and `quant` (which
    weights a randomly initialized model or quantize-on-load quantizes). `quantization_config`
    is the checkpoint's dict, kept for reference. Neither `quant` nor `quantization_config`
    takes part in equality or hashing.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int | None = 256
    n_shared_experts: int | None = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    hidden_act: str = "silu"
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = YarnScaling(
        factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    # Multi-token-prediction layers the checkpoint holds after the decoder layers (DeepSeek-V3:
    # 1, stored as layer num_hidden_layers). Loading reads it on request (load_pretrained's
    # `mtp`); init_random draws it.
    num_nextn_predict_layers: int = 0
    quantization_config: dict | None = dataclasses.field(default=None, compare=False)
    # Not HF fields. `quant` only steers construction (random init, quantize-on-load): the
    # modules built say what is quantized, so it takes no part in equality or hashing either
    # (a loaded model then shares compiled code with the random model it was saved from).
    dtype: str = "bfloat16"
    quant: QuantSpec | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        problems = type_problems(self)
        if problems:  # the value checks below assume the types
            raise ValueError("invalid DeepSeek config: " + "; ".join(problems))
        if not isinstance(self.eos_token_id, tuple):
            object.__setattr__(self, "eos_token_id", _tuple_ids(self.eos_token_id))
        problems += range_problems(self, _INT_MINIMUM, _POSITIVE_FLOATS)
        problems += _rope_problems(self.rope_scaling)
        if self.topk_method not in TOPK_METHODS:
            problems.append(f"topk_method={self.topk_method!r} is not one of {TOPK_METHODS}")
        if self.scoring_func not in SCORING_FUNCS:
            problems.append(f"scoring_func={self.scoring_func!r} is not one of {SCORING_FUNCS}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias:
            problems.append("attention_bias=True is not supported (DeepSeek models have none)")
        if self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.n_routed_experts and self.n_routed_experts > 0:
            e, g = self.n_routed_experts, self.n_group
            if self.num_experts_per_tok > e:
                problems.append(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={e}"
                )
            elif g < 1 or e % g:
                problems.append(f"n_routed_experts={e} is not a multiple of n_group={g}")
            elif not 1 <= self.topk_group <= g:
                problems.append(f"topk_group={self.topk_group} not in [1, n_group={g}]")
            elif self.num_experts_per_tok > (e // g) * self.topk_group:
                problems.append(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of "
                    f"topk_group={self.topk_group} groups of {e // g}"
                )
            if self.topk_method == "noaux_tc" and g and e % g == 0 and e // g < 2:
                problems.append(f"noaux_tc needs >= 2 experts per group, got {e // g}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            problems.append(f"dtype={self.dtype!r} is not one of bfloat16, float16, float32")
        if problems:
            raise ValueError("invalid DeepSeek config: " + "; ".join(problems))

    # --- derived facts -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        """Layer i uses routed experts (HF: i >= first_k_dense_replace and i % freq == 0)."""
        return (
            bool(self.n_routed_experts)
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        r = self.rope_scaling
        if r is not None and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def quantizes(self, target: str) -> bool:
        return self.quant is not None and target in self.quant.targets

    # --- HF config.json ------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides) -> DeepseekV3Config:
        """Reads an HF config.json dict (DeepSeek-V3, V2 or V2-Lite); unknown keys are ignored.

        Rope settings are read from `rope_scaling` or (newer transformers) `rope_parameters`.

        Raises:
            ValueError: unsupported rope type or invalid values, all named at once.
        """
        problems = hf_config_problems(d, cls)
        if problems:
            raise ValueError("invalid DeepSeek config: " + "; ".join(problems))
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "dtype", "quant"}
        kw = {k: d[k] for k in names if k in d}
        rope = d.get("rope_scaling") or d.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in d:
            kw["rope_theta"] = rope["rope_theta"]
        kw["rope_scaling"] = _parse_rope(rope)
        if "eos_token_id" in kw:
            kw["eos_token_id"] = _tuple_ids(kw["eos_token_id"])
        for k in ("rope_theta", "rms_norm_eps", "routed_scaling_factor"):
            if isinstance(kw.get(k), int) and not isinstance(kw[k], bool):  # JSON 10000 -> float
                kw[k] = float(kw[k])
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json dict (model_type deepseek_v3); `dtype`/`quant` are not written."""
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("dtype", "quant", "quantization_config", "rope_scaling")
        }
        d["eos_token_id"] = (
            self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        )
        d["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_hf_dict()
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        d["torch_dtype"] = self.dtype
        if self.quantization_config is not None:
            d["quantization_config"] = self.quantization_config
        return d

    # --- presets -------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> DeepseekV3Config:
        """A CPU-sized model with every V3 feature: 3 layers (1 dense), 16 experts in 4 groups,
        top-4 of 2 groups, q LoRA, YaRN, int4 (group 32) weights, f32 activations."""
        kw = dict(
            vocab_size=512,
            # H and I multiples of 128: the smallest int4 k-tile of the Pallas kernels, so the
            # tiny model runs on every fused_moe backend.
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            rope_scaling=YarnScaling(
                factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0
            ),
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=(2,),
            pad_token_id=0,
            dtype="float32",
            quant=QuantSpec(bits=4, group_size=32),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def deepseek_v3(cls, **overrides) -> DeepseekV3Config:
        """DeepSeek-V3 / R1 (671B): 61 layers and the MTP layer, 256 experts top-8, int4
        group 128 experts."""
        kw = dict(quant=QuantSpec(bits=4, group_size=128), num_nextn_predict_layers=1)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def full_width(cls, num_layers: int, **overrides) -> DeepseekV3Config:
        """DeepSeek-V3 width with `num_layers` layers (the first min(3, N-1) dense), without
        the MTP layer unless `num_nextn_predict_layers=1` is passed."""
        kw = dict(
            num_hidden_layers=num_layers,
            first_k_dense_replace=min(3, max(num_layers - 1, 0)),
            num_nextn_predict_layers=0,
        )
        kw.update(overrides)
        return cls.deepseek_v3(**kw)

    @classmethod
    def kimi_k2(cls, **overrides) -> DeepseekV3Config:
        """Kimi-K2 (1T, config.json model_type kimi_k2): the DeepSeek-V3 architecture with 384
        experts top-8, one expert group, one dense layer and YaRN (factor 32); released with
        int4 group 32 symmetric routed experts (compressed-tensors), the rest bf16."""
        kw = dict(
            vocab_size=163840,
            num_attention_heads=64,
            num_key_value_heads=64,
            n_routed_experts=384,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.827,
            rope_theta=50000.0,
            rope_scaling=YarnScaling(
                factor=32.0,
                original_max_position_embeddings=4096,
                beta_fast=1.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            max_position_embeddings=131072,
            bos_token_id=163584,
            eos_token_id=(163585,),
            quant=QuantSpec(bits=4, group_size=32, has_zp=False, targets=("experts",)),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def deepseek_v2_lite(cls, **overrides) -> DeepseekV3Config:
        """DeepSeek-V2-Lite: no q LoRA, softmax greedy routing over 64 experts, 2 shared."""
        kw = dict(
            vocab_size=102400,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=None,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            scoring_func="softmax",
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            first_k_dense_replace=1,
            rope_scaling=YarnScaling(
                factor=40.0,
                original_max_position_embeddings=4096,
                mscale=0.707,
                mscale_all_dim=0.707,
            ),
            bos_token_id=100000,
            eos_token_id=(100001,),
        )
        kw.update(overrides)
        return cls(**kw)


def _parse_rope(rope: dict | None) -> YarnScaling | None:
    if not rope:
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (DeepSeek uses 'yarn' or none)")
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
    if missing:
        raise ValueError(f"yarn rope settings lack {missing}: {rope}")
    return YarnScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=float(rope.get("mscale", 1.0) or 0.0),
        mscale_all_dim=float(rope.get("mscale_all_dim", 0.0) or 0.0),
    )


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
