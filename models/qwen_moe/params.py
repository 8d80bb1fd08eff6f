"""Hugging Face Qwen2-MoE / Qwen3-MoE checkpoints -> the NNX model: one name table, every
problem reported at once.

Float (f32/bf16/f16) weights, or GPTQ / AWQ / compressed-tensors ones as config.json's
quantization_config says (the released GPTQ-Int4 checkpoints: int4 group 128 symmetric,
float16 scales, g_idx; scales are kept in the dtype stored). Each linear is read as stored:
float where the checkpoint holds its `.weight` (e.g. the router and the shared expert's gate),
float ones quantized on load where `quantize=` targets them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

import wna16_jax as wj
from models.common.checkpoint import (
    CONFIG_FILE,
    FLOAT_DTYPES,
    Checkpoint,
    fmt_shape,
    quant_method,
    resolve_checkpoint,
)
from models.common.config import QuantSpec
from models.common.modules import FloatExperts, Linear, QuantizedLinear, RoutedExperts, module_at
from models.common.progress import progress_bar
from models.qwen_moe.config import QwenMoeConfig
from models.qwen_moe.modeling import QwenMoeForCausalLM

logger = logging.getLogger("models.qwen_moe")

_PROJS = ("gate_proj", "up_proj", "down_proj")

# One row per HF tensor: (name, kind, shape, present when, quantization target). "layer."
# stands for "model.layers.{i}."; the module path is the name's, but a projection's bias
# "self_attn.q_proj.bias" lives on the attention as "self_attn.q_bias". kinds: "param" (a
# float tensor, as is), "linear" (its ".weight": float [N, K], or quantized tensors),
# "experts" (experts.{j}.{gate,up,down}_proj, stacked: shape (E, I, H)).
# fmt: off
NAME_TABLE: tuple[tuple[str, str, str, str, str | None], ...] = (
    ("model.embed_tokens.weight",             "param",   "V H",   "always",   None),
    ("model.norm.weight",                     "param",   "H",     "always",   None),
    ("lm_head",                               "linear",  "V H",   "untied",   None),
    ("layer.input_layernorm.weight",          "param",   "H",     "always",   None),
    ("layer.post_attention_layernorm.weight", "param",   "H",     "always",   None),
    ("layer.self_attn.q_proj",                "linear",  "Nq H",  "always",   "attention"),
    ("layer.self_attn.k_proj",                "linear",  "Nkv H", "always",   "attention"),
    ("layer.self_attn.v_proj",                "linear",  "Nkv H", "always",   "attention"),
    ("layer.self_attn.o_proj",                "linear",  "H Nq",  "always",   "attention"),
    ("layer.self_attn.q_proj.bias",           "param",   "Nq",    "qkv_bias", None),
    ("layer.self_attn.k_proj.bias",           "param",   "Nkv",   "qkv_bias", None),
    ("layer.self_attn.v_proj.bias",           "param",   "Nkv",   "qkv_bias", None),
    ("layer.self_attn.o_proj.bias",           "param",   "H",     "o_bias",   None),
    ("layer.self_attn.q_norm.weight",         "param",   "D",     "qk_norm",  None),
    ("layer.self_attn.k_norm.weight",         "param",   "D",     "qk_norm",  None),
    ("layer.mlp.gate_proj",                   "linear",  "F H",   "dense",    "dense_mlp"),
    ("layer.mlp.up_proj",                     "linear",  "F H",   "dense",    "dense_mlp"),
    ("layer.mlp.down_proj",                   "linear",  "H F",   "dense",    "dense_mlp"),
    ("layer.mlp.gate.weight",                 "param",   "E H",   "moe",      None),
    ("layer.mlp.experts",                     "experts", "E I H", "moe",      "experts"),
    ("layer.mlp.shared_expert.gate_proj",     "linear",  "Is H",  "shared",   "shared_experts"),
    ("layer.mlp.shared_expert.up_proj",       "linear",  "Is H",  "shared",   "shared_experts"),
    ("layer.mlp.shared_expert.down_proj",     "linear",  "H Is",  "shared",   "shared_experts"),
    ("layer.mlp.shared_expert_gate",          "linear",  "1 H",   "shared",   None),
)
# fmt: on

_DIMS: dict[str, Callable[[QwenMoeConfig], int]] = {
    "1": lambda c: 1,
    "V": lambda c: c.vocab_size,
    "H": lambda c: c.hidden_size,
    "D": lambda c: c.head_dim,
    "Nq": lambda c: c.num_attention_heads * c.head_dim,
    "Nkv": lambda c: c.num_key_value_heads * c.head_dim,
    "F": lambda c: c.intermediate_size,
    "E": lambda c: c.num_experts,
    "I": lambda c: c.moe_intermediate_size,
    "Is": lambda c: c.shared_expert_intermediate_size,
}
_PRESENT: dict[str, Callable[[QwenMoeConfig, int | None], bool]] = {
    "always": lambda c, i: True,
    "untied": lambda c, i: not c.tie_word_embeddings,
    "qkv_bias": lambda c, i: c.qkv_bias,
    "o_bias": lambda c, i: c.model_type == "qwen3_moe" and c.attention_bias,
    "qk_norm": lambda c, i: c.qk_norm,
    "dense": lambda c, i: not c.is_moe_layer(i),
    "moe": lambda c, i: c.is_moe_layer(i),
    "shared": lambda c, i: c.is_moe_layer(i) and c.shared_expert,
}


def weight_table(cfg: QwenMoeConfig) -> list[tuple[str, str, tuple[int, ...], str | None, tuple]]:
    """Every tensor the config implies: (HF name, kind, shape, target, module path)."""
    out = []
    for name, kind, dims, present, target in NAME_TABLE:
        shape = tuple(_DIMS[d](cfg) for d in dims.split())
        per_layer = name.startswith("layer.")
        for i in range(cfg.num_hidden_layers) if per_layer else (None,):
            if not _PRESENT[present](cfg, i):
                continue
            prefix = f"model.layers.{i}." if per_layer else ""
            full = prefix + name[len("layer.") :] if per_layer else name
            where = full.replace("_proj.bias", "_bias")
            parts = tuple(int(p) if p.isdigit() else p for p in where.split("."))
            out.append((full, kind, shape, target, parts))
    return out


class _Reader:
    """Reads the table's tensors from a Checkpoint, recording every problem."""

    def __init__(self, cfg: QwenMoeConfig, ckpt: Checkpoint):
        self.cfg, self.ckpt = cfg, ckpt
        self.qcfg = cfg.quantization_config
        self.problems: list[str] = []

    def _float(self, name: str, shape) -> np.ndarray | None:
        if name not in self.ckpt:
            self.problems.append(f"{name}: missing")
            return None
        got, dtype = self.ckpt.meta(name)
        if dtype not in FLOAT_DTYPES or tuple(got) != tuple(shape):
            self.problems.append(
                f"{name}: {dtype} {fmt_shape(got)}, expected a float {fmt_shape(shape)}"
            )
            return None
        return np.asarray(self.ckpt[name])

    def linear(self, prefix: str, shape, target: str | None):
        """-> float [N, K] numpy, or QuantizedExperts [1, N, K] (None on a problem)."""
        cfg = self.cfg
        if f"{prefix}.weight" in self.ckpt and (
            self.ckpt.meta(f"{prefix}.weight")[1] in FLOAT_DTYPES
        ):
            w = self._float(f"{prefix}.weight", shape)
            if w is None or target is None or not cfg.quantizes(target):
                return w
            return _quantize(w[None], cfg.quant, cfg.dtype)
        if self.qcfg is None:
            self.problems.append(f"{prefix}.weight: missing")
            return None
        try:
            qe = wj.formats.from_quantization_config(self.ckpt, self.qcfg, prefix)
        except ValueError as err:
            self.problems.append(f"{prefix}: {err}")
            return None
        if qe.shape != (1, *shape):
            self.problems.append(f"{prefix}: quantized shape {qe.shape}, expected (1, {shape})")
            return None
        return qe  # scales as stored (GPTQ: float16), dequantized into cfg.dtype

    def experts(self, name: str, shape):
        """-> (w13 [E, 2I, H], w2 [E, H, I]): QuantizedExperts, or float numpy (None on a
        problem)."""
        e, i, h = shape
        want = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        parts = {p: [] for p in _PROJS}
        for j in range(e):
            for proj in _PROJS:
                parts[proj].append(self.linear(f"{name}.{j}.{proj}", want[proj], "experts"))
        if any(p is None for ps in parts.values() for p in ps):
            return None
        if isinstance(parts["gate_proj"][0], wj.QuantizedExperts):
            gate, up, down = (wj.QuantizedExperts.concatenate(parts[p], axis=0) for p in _PROJS)
            w13 = wj.QuantizedExperts.concatenate([gate, up], axis=1)  # rows [gate; up]
            return wj.formats.fold_w2_act_order(w13, down)
        w13 = np.concatenate([np.stack(parts["gate_proj"]), np.stack(parts["up_proj"])], axis=1)
        return w13, np.stack(parts["down_proj"])


def _quantize(w, spec: QuantSpec, dtype) -> wj.QuantizedExperts:
    """float [E, N, K] -> QuantizedExperts (round to nearest), scales in spec.scale_dtype or
    `dtype`."""
    return wj.quantize_experts(
        jnp.asarray(w),
        bits=spec.bits,
        group_size=spec.group_for(w.shape[-1]),
        has_zp=spec.has_zp,
        scale_dtype=jnp.dtype(spec.scale_dtype or dtype),
    )


def _set(root, path: tuple, value) -> None:
    parent = module_at(root, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def load_pretrained(
    path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    dtype=jnp.bfloat16,
    implementation=None,
    quantize: str | QuantSpec | None = None,
    progress: bool = True,
) -> QwenMoeForCausalLM:
    """Loads a Hugging Face Qwen2-MoE / Qwen3-MoE checkpoint: a local directory or a Hub id.

    Args:
        path: a directory with config.json and safetensors, or a Hub id ("org/name",
            `models.common.checkpoint.resolve_checkpoint`).
        revision, cache_dir: for a Hub id.
        dtype: activations, float weights and quantization scales.
        implementation: fused_moe backend of the routed experts (None = automatic).
        quantize: quantize float weights on load: "int4", "int8" or a QuantSpec (its targets
            say which linears); quantized ones stay as stored.
        progress: a tqdm bar over the tensors read, once the load has run PROGRESS_DELAY_S
            seconds (`models.common.progress`).

    Raises:
        FileNotFoundError: no such directory or Hub repository, or a missing file (named).
        ValueError: every problem at once (a missing tensor, a wrong shape or dtype, an
            unsupported quantization_config or config value).
    """
    path = resolve_checkpoint(path, revision=revision, cache_dir=cache_dir)
    quant = QuantSpec.parse(quantize)
    cfg = QwenMoeConfig.from_json(
        os.path.join(path, CONFIG_FILE), dtype=jnp.dtype(dtype).name, quant=quant
    )
    ckpt = Checkpoint(path)
    reader = _Reader(cfg, ckpt)
    model = nnx.eval_shape(lambda: QwenMoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    table = weight_table(cfg)
    bar = progress_bar(
        table, desc=f"loading {os.path.basename(path)}", unit="weight", enabled=progress
    )
    try:
        for name, kind, shape, target, where in bar:
            if kind == "param":
                value = reader._float(name, shape)
                if value is not None:
                    module_at(model, where).set_value(jnp.asarray(value, cfg.dtype))
            elif kind == "linear":
                value = reader.linear(name, shape, target)
                if isinstance(value, wj.QuantizedExperts):
                    _set(
                        model, where, QuantizedLinear(cfg, shape[1], shape[0], rngs=None, qe=value)
                    )
                elif value is not None:
                    _set(model, where, Linear(cfg, shape[1], shape[0], rngs=None, weight=value))
            else:
                read = reader.experts(name, shape)
                if read is None:
                    continue
                w13, w2 = read
                if isinstance(w13, wj.QuantizedExperts):
                    module = RoutedExperts(
                        cfg,
                        rngs=None,
                        w13=w13,
                        w2=w2,
                        implementation=implementation,
                    )
                elif cfg.quantizes("experts"):
                    module = RoutedExperts(
                        cfg,
                        rngs=None,
                        w13=_quantize(w13, cfg.quant, cfg.dtype),
                        w2=_quantize(w2, cfg.quant, cfg.dtype),
                        implementation=implementation,
                    )
                else:
                    module = FloatExperts(cfg, rngs=None, w13=w13, w2=w2)
                _set(model, where, module)
    finally:
        bar.close()
        ckpt.close()
    if reader.problems:
        shown = "\n  ".join(reader.problems[:50])
        more = len(reader.problems) - 50
        raise ValueError(
            f"{path}: {len(reader.problems)} problem(s) loading the checkpoint:\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
        )
    logger.info(
        "loaded %s: %s, %d layers, quantization %s",
        path,
        cfg.model_type,
        cfg.num_hidden_layers,
        quant_method(cfg.quantization_config) or quantize or "none",
    )
    return model
