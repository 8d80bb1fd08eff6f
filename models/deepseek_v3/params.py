"""DeepSeek-V3 / V2 / Kimi-K2 checkpoints: the name table the loader engine reads and writes.

`models.common.loader` does the reading (only JSON and safetensors, every problem reported
at once), the quantized formats (AWQ, GPTQ, compressed-tensors, FP8), placement on a mesh as
the tensors are read, the MTP layer and `save_pretrained`; this module gives it DeepSeek's
names, shapes and sharded placement.
"""

from __future__ import annotations

from collections.abc import Callable

from models.common import loader
from models.common.checkpoint import Checkpoint as Checkpoint
from models.common.checkpoint import dequantize_fp8 as dequantize_fp8
from models.common.checkpoint import resolve_checkpoint as resolve_checkpoint
from models.deepseek_v3 import mtp as mtp_layer
from models.deepseek_v3 import sharding
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.modeling import DeepseekV3ForCausalLM

# One row per HF weight, without a linear's ".weight" (models.common.loader.Row): "layer."
# stands for "model.layers.{i}."; the module path is the HF name itself, the routed experts
# "experts.{j}.{gate,up,down}_proj" stacked into one module. Shapes use the letters of _DIMS;
# the experts row gives (E, I, H).
# fmt: off
NAME_TABLE: tuple[loader.Row, ...] = (
    *loader.DECODER_ROWS,
    ("layer.self_attn.q_proj",                 "linear",    "Hq H",  "no_q_lora", "attention"),
    ("layer.self_attn.q_a_proj",               "linear",    "Q H",   "q_lora",    "attention"),
    ("layer.self_attn.q_a_layernorm",          "weight",    "Q",     "q_lora",    None),
    ("layer.self_attn.q_b_proj",               "linear",    "Hq Q",  "q_lora",    "attention"),
    ("layer.self_attn.kv_a_proj_with_mqa",     "linear",    "Rp H",  "always",    "attention"),
    ("layer.self_attn.kv_a_layernorm",         "weight",    "R",     "always",    None),
    ("layer.self_attn.kv_b_proj",              "linear",    "Hkv R", "always",    "attention"),
    ("layer.self_attn.o_proj",                 "linear",    "H Hv",  "always",    "attention"),
    ("layer.mlp.gate",                         "weight",    "E H",   "moe",       None),
    ("layer.mlp.gate.e_score_correction_bias", "param_f32", "E",     "noaux_tc",  None),
    ("layer.mlp.shared_experts.gate_proj",     "linear",    "Is H",  "shared",    "shared_experts"),
    ("layer.mlp.shared_experts.up_proj",       "linear",    "Is H",  "shared",    "shared_experts"),
    ("layer.mlp.shared_experts.down_proj",     "linear",    "H Is",  "shared",    "shared_experts"),
    ("layer.mlp.experts",                      "experts",   "E I H", "moe",       "experts"),
)
# fmt: on

_DIMS: dict[str, Callable[[DeepseekV3Config], int]] = {
    "V": lambda c: c.vocab_size,
    "H": lambda c: c.hidden_size,
    "H2": lambda c: 2 * c.hidden_size,
    "Q": lambda c: c.q_lora_rank,
    "Hq": lambda c: c.num_attention_heads * c.qk_head_dim,
    "R": lambda c: c.kv_lora_rank,
    "Rp": lambda c: c.kv_lora_rank + c.qk_rope_head_dim,
    "Hkv": lambda c: c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
    "Hv": lambda c: c.num_attention_heads * c.v_head_dim,
    "F": lambda c: c.intermediate_size,
    "E": lambda c: c.n_routed_experts,
    "I": lambda c: c.moe_intermediate_size,
    "Is": lambda c: c.moe_intermediate_size * (c.n_shared_experts or 0),
}
_PRESENT: dict[str, Callable[[DeepseekV3Config, int | None], bool]] = {
    "always": lambda c, i: True,
    "untied": lambda c, i: not c.tie_word_embeddings,
    "q_lora": lambda c, i: c.q_lora_rank is not None,
    "no_q_lora": lambda c, i: c.q_lora_rank is None,
    "dense": lambda c, i: not c.is_moe_layer(i),
    "moe": lambda c, i: c.is_moe_layer(i),
    "noaux_tc": lambda c, i: c.is_moe_layer(i) and c.topk_method == "noaux_tc",
    "shared": lambda c, i: c.is_moe_layer(i) and bool(c.n_shared_experts),
}


def _sharded_loading(mesh, cfg, *, specs, moe_mode):
    """The ModelSharding tensors are placed with as they are read, and the placing."""
    ms = sharding.model_sharding(mesh, cfg, specs=specs, moe_mode=moe_mode)
    return ms, sharding.place_variables


# The table, the sizes of its letters and its conditions, for this model and config.
NAMES = loader.NameTable(
    NAME_TABLE,
    _DIMS,
    _PRESENT,
    DeepseekV3ForCausalLM,
    DeepseekV3Config,
    draft=loader.DraftLayer(
        attribute=mtp_layer.MTP_ATTRIBUTE,
        rows=mtp_layer.MTP_NAME_TABLE,
        build=mtp_layer.MultiTokenPredictor,
        check=mtp_layer.check_mtp_config,
        saved_copies=mtp_layer.saved_copies,
    ),
    sharded_loading=_sharded_loading,
)

load_pretrained = NAMES.load_pretrained
save_pretrained = NAMES.save_pretrained


def weight_table(cfg: DeepseekV3Config, *, mtp: bool = False) -> list[loader.WeightEntry]:
    """Every weight the config implies, in checkpoint order (`loader.weight_table`)."""
    return loader.weight_table(NAMES, cfg, mtp=mtp)
