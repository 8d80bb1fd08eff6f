"""gpt-oss checkpoints (the layout openai/gpt-oss-20b and -120b ship): the name table the loader
engine reads and writes, with the routed experts as a kind of its own.

The routed experts are MXFP4 (config.json quantization_config {quant_method: mxfp4,
modules_to_not_convert}): `mlp.experts.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] with
`_scales` uint8 [E, 2I, H/32] and `down_proj_blocks` [E, H, I/32, 16] with theirs, gate and up
rows interleaved (row 2j gate j, row 2j+1 up j), biases `gate_up_proj_bias` [E, 2I] (interleaved
alike) and `down_proj_bias` [E, H]. A dequantized checkpoint holds the experts as transformers
keeps them, float `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]. Everything else is float
(bfloat16): attention q/k/v/o with biases and `sinks` [n], the router with its bias, norms,
embedding and head. `save_pretrained(model, path)` (format "bf16") writes that layout back.
"""

from __future__ import annotations

import fnmatch

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import wna16_jax as wj
from models.common import loader
from models.common.checkpoint import FLOAT_DTYPES, Checkpoint, fmt_shape, quant_method
from models.common.config import QuantSpec
from models.common.modules import module_at
from models.gpt_oss.config import GptOssConfig
from models.gpt_oss.modeling import Experts, GptOssForCausalLM, shard_model
from wna16_jax.formats import mxfp4

MXFP4 = "mxfp4"  # the quantization_config quant_method of the experts
MXFP4_GROUP = 32  # values per scale; a block row holds 16 bytes of two e2m1 codes
# What the released checkpoints leave unquantized (their quantization_config's list).
MODULES_TO_NOT_CONVERT = (
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
)
EXPERTS_KIND = "gpt_oss_experts"

# models.common.loader's rows (name, kind, shape letters, present when, quantization target)
# after its DECODER_ROWS: "weight" a module's `{name}.weight`, "param" the tensor `name` itself
# (biases, sinks). A projection's bias "self_attn.q_proj.bias" lives on the attention as
# "self_attn.q_bias". The routed experts are EXPERTS_KIND (`EXPERT_TENSORS`).
# fmt: off
NAME_TABLE: tuple[loader.Row, ...] = (
    *loader.DECODER_ROWS,
    ("layer.self_attn.q_proj",         "weight",     "Nq H",  "always", None),
    ("layer.self_attn.k_proj",         "weight",     "Nkv H", "always", None),
    ("layer.self_attn.v_proj",         "weight",     "Nkv H", "always", None),
    ("layer.self_attn.o_proj",         "weight",     "H Nq",  "always", None),
    ("layer.self_attn.q_proj.bias",    "param",      "Nq",    "bias",   None),
    ("layer.self_attn.k_proj.bias",    "param",      "Nkv",   "bias",   None),
    ("layer.self_attn.v_proj.bias",    "param",      "Nkv",   "bias",   None),
    ("layer.self_attn.o_proj.bias",    "param",      "H",     "bias",   None),
    ("layer.self_attn.sinks",          "param",      "n",     "always", None),
    ("layer.mlp.router",               "weight",     "E H",   "always", None),
    ("layer.mlp.router.bias",          "param",      "E",     "always", None),
    ("layer.mlp.experts",              EXPERTS_KIND, "E I H", "always", "experts"),
)
# fmt: on


def _not_converted(module: str, qcfg) -> str | None:
    """The modules_to_not_convert pattern that covers `module` (itself or a parent), if any."""
    for pattern in (qcfg or {}).get("modules_to_not_convert") or ():
        if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*"):
            return pattern
    return None


def _check_float(ckpt: Checkpoint, name: str, shape, problems: list[str]) -> bool:
    if name not in ckpt:
        problems.append(f"{name}: missing")
        return False
    got, dtype = ckpt.meta(name)
    if dtype not in FLOAT_DTYPES or tuple(got) != tuple(shape):
        problems.append(f"{name}: {dtype} {fmt_shape(got)}, expected a float {fmt_shape(shape)}")
        return False
    return True


def _check_mxfp4(ckpt: Checkpoint, prefix: str, e: int, n: int, k: int, problems) -> bool:
    """{prefix}_blocks uint8 [E, N, K/32, 16] and {prefix}_scales uint8 [E, N, K/32] of one
    projection [E, N, K], from the headers."""
    blocks_name, scales_name = f"{prefix}_blocks", f"{prefix}_scales"
    missing = [name for name in (blocks_name, scales_name) if name not in ckpt]
    problems += [f"{name}: missing" for name in missing]
    if missing:
        return False
    (bshape, bdtype), (sshape, sdtype) = ckpt.meta(blocks_name), ckpt.meta(scales_name)
    if bdtype != "U8" or len(bshape) != 4 or bshape[-1] * 2 != MXFP4_GROUP:
        problems.append(
            f"{blocks_name}: {bdtype} {fmt_shape(bshape)}, expected uint8 [E, N, K/32, 16] "
            f"(MXFP4 groups of {MXFP4_GROUP} values, two a byte)"
        )
        return False
    want = (e, n, k // MXFP4_GROUP)
    if k % MXFP4_GROUP or tuple(bshape[:3]) != want:
        problems.append(
            f"{blocks_name}: shape {fmt_shape(bshape)}, expected {fmt_shape((*want, 16))} for "
            f"[E, N, K] = [{e}, {n}, {k}]"
        )
        return False
    if sdtype != "U8" or tuple(sshape) != want:
        problems.append(
            f"{scales_name}: {sdtype} {fmt_shape(sshape)}, expected uint8 {fmt_shape(want)} "
            f"(one exponent per group of {MXFP4_GROUP} of {blocks_name})"
        )
        return False
    return True


def _shapes(entry: loader.WeightEntry):
    """(E, I, H) of the experts, the projections' [E, N, K] and the biases' shapes."""
    e, i, h = entry.shape
    return (e, i, h), {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}, (e, 2 * i), (e, h)


def _mxfp4_form(ckpt: Checkpoint, pre: str) -> bool:
    return any(name.startswith(pre + ".") and name.endswith("_blocks") for name in ckpt)


def check_experts(ckpt: Checkpoint, entry: loader.WeightEntry, cfg, qcfg, problems) -> int | None:
    """The experts' tensors from the headers: MXFP4 blocks and scales in an mxfp4 checkpoint
    on experts modules_to_not_convert does not list, or float ones; both with float biases.
    Returns the number of tensors read (None: not loadable)."""
    (e, i, h), projs, b13_shape, b2_shape = _shapes(entry)
    pre = entry.name
    ok = _check_float(ckpt, f"{pre}.gate_up_proj_bias", b13_shape, problems)
    ok &= _check_float(ckpt, f"{pre}.down_proj_bias", b2_shape, problems)
    if _mxfp4_form(ckpt, pre):
        method = quant_method(qcfg)
        tensors = sorted(n[len(pre) + 1 :] for n in ckpt if n.startswith(pre + ".") and (
            n.endswith(("_blocks", "_scales"))))  # fmt: skip
        where = f"{pre}.{{{', '.join(tensors)}}}: MXFP4 tensors, but quantization_config"
        if method != MXFP4:
            if qcfg is None or method in loader.QUANT_METHODS:  # else the engine names it
                problems.append(f"{where}.quant_method is {method!r}, not {MXFP4!r}")
            return None
        if pattern := _not_converted(pre, qcfg):
            problems.append(f"{where}.modules_to_not_convert lists {pre} ({pattern!r})")
            return None
        for proj, (n, k) in projs.items():
            ok &= _check_mxfp4(ckpt, f"{pre}.{proj}", e, n, k, problems)
        return 6 if ok else None
    ok &= _check_float(ckpt, f"{pre}.gate_up_proj", (e, h, 2 * i), problems)
    ok &= _check_float(ckpt, f"{pre}.down_proj", (e, i, h), problems)
    return 4 if ok else None


def quantize(w, spec: QuantSpec, dtype):
    """float [E, N, K] -> QuantizedExperts as `spec` says (MXFP4 or integer codes)."""
    if spec.scheme is not None:
        return wj.quantize_experts(jnp.asarray(w, jnp.float32), scheme=spec.scheme)
    return wj.quantize_experts(
        jnp.asarray(w),
        bits=spec.bits,
        group_size=spec.group_for(w.shape[-1]),
        has_zp=spec.has_zp,
        scale_dtype=jnp.dtype(spec.scale_dtype or dtype),
    )


def read_experts(ckpt: Checkpoint, entry: loader.WeightEntry, cfg, qcfg, implementation):
    """The Experts module of one layer, rows [gate; up]: MXFP4 as stored, or float ones
    (quantized as cfg.quant says, the `quantize=` of loading)."""
    pre = entry.name
    b13 = mxfp4.deinterleave_gate_up(np.asarray(ckpt[f"{pre}.gate_up_proj_bias"]))
    b2 = np.asarray(ckpt[f"{pre}.down_proj_bias"])
    if _mxfp4_form(ckpt, pre):
        up, down = ([np.asarray(ckpt[f"{pre}.{p}_{t}"]) for t in ("blocks", "scales")]
                    for p in ("gate_up_proj", "down_proj"))  # fmt: skip
        w13 = mxfp4.from_blocks(*(mxfp4.deinterleave_gate_up(a) for a in up))
        w2 = mxfp4.from_blocks(*down)
    else:
        w13 = mxfp4.deinterleave_gate_up(np.asarray(ckpt[f"{pre}.gate_up_proj"]).transpose(0, 2, 1))
        w2 = np.asarray(ckpt[f"{pre}.down_proj"]).transpose(0, 2, 1)
        if cfg.quantizes("experts"):
            w13, w2 = (quantize(w, cfg.quant, cfg.dtype) for w in (w13, w2))
    return Experts(cfg, rngs=None, w13=w13, w2=w2, w13_bias=b13, w2_bias=b2,
                   implementation=implementation)  # fmt: skip


def write_experts(model, entry: loader.WeightEntry, format: str) -> dict[str, np.ndarray]:
    """One layer's experts in the checkpoints' layout: MXFP4 blocks and scales, or float
    weights; gate and up rows interleaved again; biases in bfloat16 for format "bf16".

    Raises:
        ValueError: quantized experts that are not MXFP4 (the layout has no int4 / int8).
    """
    experts, pre = module_at(model, entry.path), entry.name
    cast = (lambda a: a.astype(ml_dtypes.bfloat16)) if format == "bf16" else (lambda a: a)
    out = {
        f"{pre}.gate_up_proj_bias": cast(
            mxfp4.interleave_gate_up(np.asarray(experts.w13_bias.get_value()))
        ),
        f"{pre}.down_proj_bias": cast(np.asarray(experts.w2_bias.get_value())),
    }
    weights = experts.weights
    if experts.quantized:
        w2 = wj.layouts.to_canonical_layout(weights.w2.get())
        for proj, qe in (("gate_up_proj", weights.canonical_w13()), ("down_proj", w2)):
            if not qe.is_mxfp4:
                raise ValueError(
                    f"{pre}: {qe.bits}-bit integer experts; gpt-oss's layout holds MXFP4 or "
                    f"float experts (dequantize_model, or quantize='mxfp4')"
                )
            blocks, scales = mxfp4.to_blocks(qe)
            if proj == "gate_up_proj":
                blocks, scales = mxfp4.interleave_gate_up(blocks), mxfp4.interleave_gate_up(scales)
            out[f"{pre}.{proj}_blocks"], out[f"{pre}.{proj}_scales"] = blocks, scales
    else:
        w13 = mxfp4.interleave_gate_up(np.asarray(weights.canonical_w13()))
        out[f"{pre}.gate_up_proj"] = cast(w13.transpose(0, 2, 1))
        out[f"{pre}.down_proj"] = cast(np.asarray(weights.w2.get_value()).transpose(0, 2, 1))
    return out


def experts_quantization_config(model, entry: loader.WeightEntry) -> dict | None:
    """{quant_method: mxfp4, modules_to_not_convert} where the experts are MXFP4."""
    if not module_at(model, entry.path).quantized:
        return None
    return {"modules_to_not_convert": list(MODULES_TO_NOT_CONVERT), "quant_method": MXFP4}


NAMES = loader.NameTable(
    rows=NAME_TABLE,
    dims={
        "V": lambda c: c.vocab_size,
        "H": lambda c: c.hidden_size,
        "F": lambda c: c.intermediate_size,
        "I": lambda c: c.intermediate_size,
        "E": lambda c: c.num_local_experts,
        "n": lambda c: c.num_attention_heads,
        "Nq": lambda c: c.num_attention_heads * c.head_dim,
        "Nkv": lambda c: c.num_key_value_heads * c.head_dim,
    },
    present={
        "always": lambda c, i: True,
        "untied": lambda c, i: not c.tie_word_embeddings,
        "dense": lambda c, i: False,  # every layer is MoE
        "bias": lambda c, i: c.attention_bias,
    },
    model_class=GptOssForCausalLM,
    config_class=GptOssConfig,
    module_path=lambda name: loader.hf_module_path(name.replace("_proj.bias", "_bias")),
    shard_model=shard_model,
    kinds={
        EXPERTS_KIND: loader.TensorKind(
            check=check_experts,
            read=read_experts,
            write=write_experts,
            quant_methods=(MXFP4,),
            quantization_config=experts_quantization_config,
        )
    },
)


def load_pretrained(path, **kwargs) -> GptOssForCausalLM:
    """The loader engine on gpt-oss's table (`models.common.loader.load_pretrained`): a
    directory or a Hub id ("openai/gpt-oss-20b"); quantize="mxfp4" (or "int4", "int8")
    quantizes float experts, MXFP4 ones stay as stored. One device only.

    Raises:
        ValueError: every problem at once, each naming its tensor or config key.
    """
    return NAMES.load_pretrained(path, **kwargs)


def save_pretrained(model: GptOssForCausalLM, path, *, format: str = "bf16", **kwargs) -> None:
    """The checkpoints' layout (format "bf16": float tensors in bfloat16, the experts MXFP4
    blocks and scales with their quantization_config), through the loader engine's writer."""
    NAMES.save_pretrained(model, path, format=format, **kwargs)
