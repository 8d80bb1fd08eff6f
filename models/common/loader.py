"""The loader engine: a family's checkpoint name table <-> its NNX model, for every family alike.

A family gives a `NameTable` (one row per Hugging Face tensor: name, kind, shape letters, when
present, quantization target; the letters' sizes from its config). Everything else is written
here once: reading only config.json, model.safetensors.index.json and safetensors files (never
pickle), confinement of the files to the checkpoint directory (`checkpoint.Checkpoint`), the
check of every tensor the config implies (presence, shape, dtype) from the headers before
anything is read, with all problems reported in one ValueError, float / AWQ / GPTQ /
compressed-tensors (weight-only and W8A8) / FP8 weights, unused-tensor reporting, placement on
a mesh as the tensors are read, and `save_pretrained`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import wna16_jax as wj
from models.common.causal_lm import linear_at
from models.common.checkpoint import (
    CONFIG_FILE,
    FLOAT_DTYPES,
    FP8_DEFAULT_QUANTIZE,
    FP8_FORMATS,
    INT_DTYPES,
    Checkpoint,
    dequantize_fp8,
    fmt_shape,
    fp8_block_size,
    quant_method,
    resolve_checkpoint,
    write_checkpoint,
)
from models.common.checks import tied_weight_problems
from models.common.config import QuantSpec
from models.common.modules import (
    FloatExperts,
    Linear,
    QuantizedLinear,
    RoutedExperts,
    module_at,
    set_module,
)
from models.common.progress import progress_bar
from models.common.sharding import host_device, reorder_w13

_PROJS = ("gate_proj", "up_proj", "down_proj")

# Tensors a quantized linear `prefix` carries, per quant_method: (required, optional).
_QUANT_TENSORS = {
    "awq": (("qweight", "qzeros", "scales"), ()),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "compressed-tensors": (
        ("weight_scale",),
        ("weight_packed", "weight", "weight_zero_point", "weight_shape", "weight_g_idx"),
    ),
}
QUANT_METHODS = (*_QUANT_TENSORS, "fp8")
# A compressed-tensors linear's input quantization (W8A8): read only where the model runs int8
# activations (the routed experts' static scales), never taken as used by its prefix alone.
_ACTIVATION_TENSORS = ("input_scale", "input_zero_point")


# ---- the name table -------------------------------------------------------------------------

# A row of a family's table: (name, kind, shape letters, present when, quantization target).
# "layer." stands for "model.layers.{i}."; names are HF's without a linear's ".weight". kinds:
# "weight" (a float `{name}.weight` held by the module `name`: embeddings, norms, routers),
# "param" (the float tensor `name` itself, in the variable at its path: biases; "param_f32"
# one held and saved in float32 whatever the model dtype: DeepSeek's router bias), "linear"
# (float [N, K], quantized or FP8), "experts" (`{name}.{j}.{gate,up,down}_proj`, stacked into
# one module; its shape letters give (E, I, H)).
Row = tuple[str, str, str, str, "str | None"]
KINDS = ("weight", "param", "param_f32", "linear", "experts")


# The rows every pre-norm decoder family holds under Hugging Face's names: the embedding, the
# final norm, the head and each layer's two norms (letters V vocabulary, H hidden; conditions
# "always" and "untied"), and a dense layer's gated MLP (F its intermediate size, condition
# "dense"). A family's table starts with them and adds its attention and MoE rows.
DECODER_ROWS: tuple[Row, ...] = (
    ("model.embed_tokens", "weight", "V H", "always", None),
    ("model.norm", "weight", "H", "always", None),
    ("lm_head", "linear", "V H", "untied", None),
    ("layer.input_layernorm", "weight", "H", "always", None),
    ("layer.post_attention_layernorm", "weight", "H", "always", None),
    ("layer.mlp.gate_proj", "linear", "F H", "dense", "dense_mlp"),
    ("layer.mlp.up_proj", "linear", "F H", "dense", "dense_mlp"),
    ("layer.mlp.down_proj", "linear", "H F", "dense", "dense_mlp"),
)


def hf_module_path(name: str) -> tuple[str | int, ...]:
    """The module path of an HF name: its parts, integers for list indices (the NNX modules
    carry HF's names)."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


@dataclasses.dataclass(frozen=True)
class TensorKind:
    """A family's own kind of row, for tensors the built-in kinds do not read (e.g. experts
    stored fused, or in a format of the family's own). Its tensors are `{row name}` and
    `{row name}.*`, so unused-tensor reporting covers them.

    Attributes:
        check: `(ckpt, entry, cfg, qcfg, problems) -> int | None`: checks the entry's tensors
            from the headers (`ckpt.meta`), appending each problem to `problems`; returns the
            number of tensors it will read (None: not loadable).
        read: `(ckpt, entry, cfg, qcfg, implementation) -> nnx.Module | array`: the module put
            at `entry.path`, or the value of the variable there.
        write: `(model, entry, format) -> {tensor name: numpy array}` for `save_pretrained`
            (None: a model holding such rows is not saved).
        quant_methods: the config.json quantization_config quant_method values its tensors
            come in (beside the engine's QUANT_METHODS; e.g. gpt-oss's "mxfp4").
        quantization_config: `(model, entry) -> dict | None`: the quantization_config the
            written tensors of the entry need in config.json (None: none).
    """

    check: Callable
    read: Callable
    write: Callable | None = None
    quant_methods: tuple[str, ...] = ()
    quantization_config: Callable | None = None


@dataclasses.dataclass(frozen=True)
class DraftLayer:
    """A family's draft layer (DeepSeek's multi-token prediction): stored as checkpoint layer
    `num_hidden_layers`, held by the model's `attribute`; its rows are the table's layer rows
    plus `rows` (name under the layer, kind, shape letters, quantization target)."""

    attribute: str
    rows: tuple[tuple[str, str, str, str | None], ...]
    build: Callable  # (cfg, *, rngs) -> the layer module
    check: Callable  # (cfg) -> None, raising ValueError where the config has no such layer
    # (model, float dtype or None) -> {tensor name: array} the checkpoint holds beside the
    # layer's own (DeepSeek's copies of the shared embedding and head), written on save.
    saved_copies: Callable | None = None


@dataclasses.dataclass(frozen=True)
class NameTable:
    """What a family gives the loader engine.

    Attributes:
        rows: its checkpoint names (`Row`), in checkpoint order.
        dims: {shape letter: cfg -> size}.
        present: {condition: (cfg, layer index or None) -> bool}.
        model_class, config_class: its CausalLM subclass and config (`from_json(path, dtype=,
            quant=)`, `to_hf_dict()`); loading logs under the model's package's logger.
        module_path: HF name -> module path (default `hf_module_path`; Qwen's biases live on
            the attention as `q_bias`).
        draft: its draft layer, or None.
        sharded_loading: `(mesh, cfg, *, specs, moe_mode) -> (ModelSharding, place(model,
            path, ms))` where tensors go to their shards as they are read; None loads onto
            one device and places the model with `shard_model` after.
        shard_model: `(model, mesh, *, moe_mode) -> model` (with sharded_loading None).
        kinds: {kind: TensorKind} of the family's own kinds of rows.
    """

    rows: tuple[Row, ...]
    dims: Mapping[str, Callable]
    present: Mapping[str, Callable]
    model_class: type
    config_class: type
    module_path: Callable[[str], tuple] = hf_module_path
    draft: DraftLayer | None = None
    sharded_loading: Callable | None = None
    shard_model: Callable | None = None
    kinds: Mapping[str, TensorKind] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        bad = []
        for name, kind, dims, present, _ in self.rows:
            if kind not in KINDS and kind not in self.kinds:
                bad.append(f"{name}: kind {kind!r} is not one of {(*KINDS, *self.kinds)}")
            bad += [
                f"{name}: no size for shape letter {d!r}"
                for d in dims.split()
                if d not in self.dims
            ]
            if present not in self.present:
                bad.append(f"{name}: no condition {present!r}")
        if bad:
            raise ValueError("name table: " + "; ".join(bad))

    def __repr__(self) -> str:
        return f"NameTable({self.model_class.__name__}, {len(self.rows)} rows)"

    def shape(self, cfg, dims: str) -> tuple[int, ...]:
        return tuple(self.dims[d](cfg) for d in dims.split())

    @property
    def log(self) -> logging.Logger:
        """The family's logger ("models.deepseek_v3", ...)."""
        return self.model_class.logger()

    def load_pretrained(self, path, **kwargs):
        """`load_pretrained(self, path, **kwargs)`: the family's loader."""
        return load_pretrained(self, path, **kwargs)

    def save_pretrained(self, model, path, **kwargs) -> None:
        """`save_pretrained(self, model, path, **kwargs)`: the family's writer."""
        save_pretrained(self, model, path, **kwargs)


@dataclasses.dataclass(frozen=True)
class WeightEntry:
    """One row of a NameTable instantiated for a layer."""

    name: str  # HF name without ".weight", e.g. "model.layers.3.self_attn.kv_b_proj"
    kind: str
    shape: tuple[int, ...]
    target: str | None
    path: tuple[str | int, ...]  # the module (or variable) path in the model

    def expert_names(self, num_experts: int) -> Iterator[tuple[int, str, str]]:
        for j in range(num_experts):
            for proj in _PROJS:
                yield j, proj, f"{self.name}.{j}.{proj}"


def weight_table(names: NameTable, cfg, *, mtp: bool = False) -> list[WeightEntry]:
    """Every weight the config implies, in checkpoint order (the table instantiated); with
    `mtp`, then the draft layer's (layer num_hidden_layers: the table's layer rows and the
    draft's own, under the model's `draft.attribute`)."""
    out = []
    for name, kind, dims, present, target in names.rows:
        per_layer = name.startswith("layer.")
        shape = names.shape(cfg, dims)
        for i in range(cfg.num_hidden_layers) if per_layer else (None,):
            if names.present[present](cfg, i):
                full = f"model.layers.{i}.{name[len('layer.') :]}" if per_layer else name
                out.append(WeightEntry(full, kind, shape, target, names.module_path(full)))
    if mtp:
        if names.draft is None:
            raise ValueError(f"mtp=True: {names.model_class.__name__} has no draft layer")
        n, draft = cfg.num_hidden_layers, names.draft
        rows = [
            (name[len("layer.") :], *rest) for name, *rest in names.rows if name[:6] == "layer."
        ]
        rows += [(name, kind, dims, "always", t) for name, kind, dims, t in draft.rows]
        for name, kind, dims, present, target in rows:
            if names.present[present](cfg, n):
                full = f"model.layers.{n}.{name}"
                path = (draft.attribute, *names.module_path(full)[3:])
                out.append(WeightEntry(full, kind, names.shape(cfg, dims), target, path))
    return out


# ---- reading safetensors --------------------------------------------------------------------


# ---- checking -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Plan:
    """What the checkpoint holds for one WeightEntry: "float" or "quantized" tensors."""

    entry: WeightEntry
    form: str
    num_tensors: int


def _check_float(ckpt: Checkpoint, name: str, shape, problems: list[str]) -> None:
    got_shape, got_dtype = ckpt.meta(name)
    if got_dtype not in FLOAT_DTYPES:
        problems.append(f"{name}: dtype {got_dtype}, expected a float dtype {FLOAT_DTYPES}")
    if tuple(got_shape) != tuple(shape):
        problems.append(f"{name}: shape {fmt_shape(got_shape)}, expected {fmt_shape(shape)}")


def _fp8_form(ckpt: Checkpoint, prefix: str, shape, block, problems: list[str]) -> str | None:
    """Checks an FP8 linear [N, K]: weight float8 [N, K] and weight_scale_inv float
    [ceil(N / bn), ceil(K / bk)] (the scales' shape only when `block` (bn, bk) is known)."""
    n, k = shape
    weight, scale = f"{prefix}.weight", f"{prefix}.weight_scale_inv"
    if weight not in ckpt:
        problems.append(f"{weight}: missing (quant_method 'fp8' needs a float8 weight)")
        return None
    got_shape, got_dtype = ckpt.meta(weight)
    want_dtype = FP8_FORMATS["e4m3"]
    if got_dtype != want_dtype:
        beside = " beside its weight_scale_inv" if scale in ckpt else ""
        problems.append(
            f"{weight}: dtype {got_dtype}{beside}, expected {want_dtype} (config.json "
            f"quant_method 'fp8', fmt 'e4m3')"
        )
    if tuple(got_shape) != tuple(shape):
        problems.append(f"{weight}: shape {fmt_shape(got_shape)}, expected {fmt_shape(shape)}")
    if scale not in ckpt:
        problems.append(
            f"{scale}: missing (the block scales of the float8 weight {fmt_shape(shape)})"
        )
        return "fp8"
    got_shape, got_dtype = ckpt.meta(scale)
    if got_dtype not in FLOAT_DTYPES:
        problems.append(f"{scale}: dtype {got_dtype}, expected a float dtype {FLOAT_DTYPES}")
    if block is not None:
        bn, bk = block
        want = (math.ceil(n / bn), math.ceil(k / bk))
        if tuple(got_shape) != want:
            problems.append(
                f"{scale}: shape {fmt_shape(got_shape)}, expected {fmt_shape(want)} "
                f"(blocks of weight_block_size {fmt_shape(block)} over [N, K] = "
                f"{fmt_shape(shape)})"
            )
    return "fp8"


def _linear_form(
    ckpt: Checkpoint, prefix: str, shape, qcfg, problems: list[str], fp8_block=None
) -> str | None:
    """Checks the tensors of one linear layer [N, K]; returns "float", "quantized", "fp8" or
    None. Under quant_method "fp8" a float weight without weight_scale_inv is a float linear
    (HF's modules_to_not_convert); `fp8_block` is the scales' block (None: not checked)."""
    n, k = shape
    weight = f"{prefix}.weight"
    method = quant_method(qcfg)
    fp8_scaled = method == "fp8" and f"{prefix}.weight_scale_inv" in ckpt
    if weight in ckpt and ckpt.meta(weight)[1] in FLOAT_DTYPES and not fp8_scaled:
        _check_float(ckpt, weight, shape, problems)
        return "float"
    if method == "fp8":
        return _fp8_form(ckpt, prefix, shape, fp8_block, problems)
    present = sorted(s for s in ("qweight", "weight_packed", "weight") if f"{prefix}.{s}" in ckpt)
    if not present:
        problems.append(f"{weight}: missing (no float weight and no quantized tensors)")
        return None
    if method not in _QUANT_TENSORS:
        problems.append(
            f"{prefix}: quantized tensors ({present}) but config.json has "
            f"{'no quantization_config' if qcfg is None else f'quant_method={method!r}'}"
        )
        return None
    required, _ = _QUANT_TENSORS[method]
    missing = [f"{prefix}.{s}" for s in required if f"{prefix}.{s}" not in ckpt]
    if missing:
        problems.append(f"{prefix}: missing {missing}")
        return None
    # The dimensions that do not depend on bits / group size; the converter checks the rest.
    expect = {
        "awq": {"qweight": (0, k, "K"), "scales": (1, n, "N")},
        "gptq": {"qweight": (1, n, "N"), "scales": (1, n, "N")},
        "compressed-tensors": {
            "weight_packed": (0, n, "N"),
            "weight": (0, n, "N"),
            "weight_scale": (0, n, "N"),
        },
    }[method]
    for suffix, (axis, want, letter) in expect.items():
        name = f"{prefix}.{suffix}"
        if name not in ckpt:
            continue
        got_shape, got_dtype = ckpt.meta(name)
        is_scale = suffix in ("scales", "weight_scale")
        if (got_dtype not in FLOAT_DTYPES) if is_scale else (got_dtype not in INT_DTYPES):
            problems.append(
                f"{name}: dtype {got_dtype}, expected "
                f"{'a float' if is_scale else 'an integer'} dtype"
            )
        if len(got_shape) != 2 or got_shape[axis] != want:
            problems.append(
                f"{name}: shape {fmt_shape(got_shape)}, expected dim {axis} = "
                f"{letter} = {want} (layer [N, K] = {fmt_shape(shape)})"
            )
    return "quantized"


def _count_tensors(ckpt: Checkpoint, prefix: str, form: str) -> int:
    """The tensors loading reads for one linear (the progress bar's unit)."""
    if form == "quantized":  # a linear's input_scale is not among them (`activation_plan`)
        children = ckpt.children.get(prefix, ())
        return sum(name.rpartition(".")[2] not in _ACTIVATION_TENSORS for name in children)
    return 2 if form == "fp8" else 1  # fp8: weight and weight_scale_inv


def check_checkpoint(
    names: NameTable, cfg, ckpt: Checkpoint, qcfg, *, mtp: bool = False
) -> tuple[list[_Plan], list[str]]:
    """Checks every tensor the config implies (with `mtp`, the draft layer's too) against the
    checkpoint's headers.

    Returns:
        (the plan: one _Plan per weight, the list of problems; empty when loadable).
    """
    problems: list[str] = []
    method = quant_method(qcfg)
    methods = {*QUANT_METHODS, *(m for kind in names.kinds.values() for m in kind.quant_methods)}
    if qcfg is not None and method not in methods:
        problems.append(
            f"quantization_config: quant_method={method!r} is not supported "
            f"(supported: {sorted(methods)})"
        )
    fp8_block = None
    if method == "fp8":
        try:
            fp8_block = fp8_block_size(qcfg)
        except ValueError as err:  # the scales' shapes are then not checked
            problems.append(str(err))
    plans = []
    for entry in weight_table(names, cfg, mtp=mtp):
        if entry.kind in ("weight", "param", "param_f32"):
            name = f"{entry.name}.weight" if entry.kind == "weight" else entry.name
            if name not in ckpt:
                problems.append(f"{name}: missing")
                continue
            _check_float(ckpt, name, entry.shape, problems)
            plans.append(_Plan(entry, "float", 1))
        elif entry.kind in names.kinds:
            count = names.kinds[entry.kind].check(ckpt, entry, cfg, qcfg, problems)
            if count is not None:
                plans.append(_Plan(entry, entry.kind, count))
        elif entry.kind == "linear":
            form = _linear_form(ckpt, entry.name, entry.shape, qcfg, problems, fp8_block)
            if form is not None:
                plans.append(_Plan(entry, form, _count_tensors(ckpt, entry.name, form)))
        elif entry.kind == "experts":
            e, i, hdim = entry.shape
            forms = set()
            count = 0
            for _, proj, prefix in entry.expert_names(e):
                shape = (hdim, i) if proj == "down_proj" else (i, hdim)
                form = _linear_form(ckpt, prefix, shape, qcfg, problems, fp8_block)
                if form is not None:
                    forms.add(form)
                    count += _count_tensors(ckpt, prefix, form)
            if len(forms) > 1:
                problems.append(f"{entry.name}: mixes {' and '.join(sorted(forms))} experts")
            elif forms:
                plans.append(_Plan(entry, forms.pop(), count))
    return plans, problems


def _raise_problems(path, problems: list[str]) -> None:
    if problems:
        listed = "\n  - ".join(problems)
        raise ValueError(f"cannot load {path}: {len(problems)} problem(s):\n  - {listed}")


# ---- activation quantization (W8A8) ---------------------------------------------------------


@dataclasses.dataclass
class ActivationPlan:
    """How the model runs what a checkpoint's input_activations ask for.

    experts: experts entry name (e.g. "model.layers.3.mlp.experts") -> that layer's
        wj.ActivationQuant, static scales filled; absent for weight-only (W8A16) experts.
    read: the input_scale tensors those static scales were read from.
    linears: the quantized non-expert linears whose inputs the checkpoint quantizes: they run
        cfg.dtype activations (QuantizedLinear has no int8-activation path).
    """

    experts: dict[str, wj.ActivationQuant] = dataclasses.field(default_factory=dict)
    read: set[str] = dataclasses.field(default_factory=set)
    linears: list[str] = dataclasses.field(default_factory=list)


def _scheme_name(aq: wj.ActivationQuant | None) -> str:
    return "none (16-bit activations)" if aq is None else aq.scheme


def activation_plan(ckpt: Checkpoint, qcfg, plans: list[_Plan], problems: list[str]):
    """The activation quantization of a compressed-tensors checkpoint's quantized layers.

    The routed experts of every layer take `formats.activation_quant_from_config` at each of
    their gate, up and down prefixes: one scheme per layer and per model (a layer whose experts
    differ, or layers that differ, are problems naming them). A static ("int8_static") layer
    takes its own scales: GEMM1's the largest input_scale of its experts' gate_proj and
    up_proj, GEMM2's of their down_proj (`formats.static_input_scale`, as vLLM does: no
    expert's activations clip); each layer keeps its own values. Problems are appended to
    `problems`; other quant_methods ask for none (ActivationPlan()).
    """
    out = ActivationPlan()
    if quant_method(qcfg) != "compressed-tensors":
        return out
    layers: dict[str, wj.ActivationQuant | None] = {}
    for plan in plans:
        entry = plan.entry
        if plan.form != "quantized":
            continue
        if entry.kind == "linear":
            try:
                wants = wj.formats.activation_quant_from_config(qcfg, entry.name) is not None
            except ValueError:  # input_activations no kernel runs: 16-bit all the same
                wants = True
            if wants:
                out.linears.append(entry.name)
            continue
        if entry.kind != "experts":
            continue
        found: dict[wj.ActivationQuant | None, str] = {}  # scheme -> its first prefix
        try:
            for _, _, prefix in entry.expert_names(entry.shape[0]):
                found.setdefault(wj.formats.activation_quant_from_config(qcfg, prefix), prefix)
        except ValueError as err:
            problems.append(str(err))
            continue
        if len(found) > 1:
            listed = ", ".join(f"{_scheme_name(aq)} at {p}" for aq, p in found.items())
            problems.append(
                f"{entry.name}: its experts' input_activations differ ({listed}); fused_moe "
                f"quantizes a layer's activations one way"
            )
            continue
        layers[entry.name] = next(iter(found))
    by_scheme: dict[str, list[str]] = {}
    for name, aq in layers.items():
        by_scheme.setdefault(_scheme_name(aq), []).append(name)
    if len(by_scheme) > 1:
        listed = "; ".join(f"{k}: {', '.join(names)}" for k, names in by_scheme.items())
        problems.append(
            f"the routed experts' input_activations differ between layers ({listed}); the "
            f"model runs one activation scheme in every layer"
        )
        return out
    num_experts = {plan.entry.name: plan.entry.shape[0] for plan in plans}
    for name, aq in layers.items():
        if aq is None:
            continue
        if aq.scheme == "int8_static":
            experts = range(num_experts[name])
            gate_up = [f"{name}.{j}.{p}" for j in experts for p in ("gate_proj", "up_proj")]
            down = [f"{name}.{j}.down_proj" for j in experts]
            try:
                aq = dataclasses.replace(
                    aq,
                    gemm1_scale=wj.formats.static_input_scale(ckpt, gate_up),
                    gemm2_scale=wj.formats.static_input_scale(ckpt, down),
                )
            except ValueError as err:
                problems.append(f"{name}: {err}")
                continue
            out.read.update(f"{p}.input_scale" for p in gate_up + down)
        out.experts[name] = aq
    return out


def _warn_16_bit_linears(log: logging.Logger, path, cfg, linears: list[str]) -> None:
    """One warning for the quantized linears that run 16-bit activations although the
    checkpoint quantizes their inputs."""
    if linears:
        log.warning(
            "%s: %d quantized linears run with %s activations although the checkpoint's "
            "quantization_config quantizes their inputs (only the routed experts run int8 "
            "activations; their input_scale tensors, if any, are not read), e.g. %s",
            path,
            len(linears),
            jnp.dtype(cfg.dtype).name,
            linears[0],
        )


# ---- building modules -----------------------------------------------------------------------


# One compiled program per weight shape (eager dispatch would compile every op separately).
_quantize_jit = jax.jit(
    wj.quantize_experts, static_argnames=("bits", "group_size", "has_zp", "scale_dtype")
)


def _quantize(w, spec: QuantSpec, dtype) -> wj.QuantizedExperts:
    """float [E, N, K] -> QuantizedExperts with `spec` (round to nearest). The caller checks
    each checkpoint tensor for NaN and inf as it reads it (wj.check_finite, naming it): under
    jit quantize_experts cannot."""
    w = jnp.asarray(w)
    return _quantize_jit(
        w,
        bits=spec.bits,
        group_size=spec.group_for(w.shape[-1]),
        has_zp=spec.has_zp,
        scale_dtype=jnp.dtype(dtype),
    )


def _float_weight(cfg, ckpt, qcfg, prefix, form, target):
    """The weight [N, K] of a float ("float") or FP8 ("fp8", dequantized in float32) linear:
    QuantizedExperts [1, N, K] when the config quantizes `target` (quantize-on-load, each
    tensor as it is read), else a float numpy array (as stored; FP8 in cfg.dtype)."""
    name = f"{prefix}.weight"
    if form == "fp8":
        block = fp8_block_size(qcfg)
        w = dequantize_fp8(ckpt[name], ckpt[f"{prefix}.weight_scale_inv"], block)
    else:
        w = np.asarray(ckpt[name])
    if target is not None and cfg.quantizes(target):
        wj.check_finite(w, f"tensor {name!r}")
        # Waited for: an asynchronous copy would keep `w` alive, and the host could run ahead
        # of the device by many tensors.
        return jax.block_until_ready(_quantize(w[None], cfg.quant, cfg.dtype))
    return w if form == "float" else w.astype(jnp.dtype(cfg.dtype))


def _load_linear(cfg, ckpt, qcfg, prefix, form, target):
    """-> a float [N, K] numpy array or a QuantizedExperts [1, N, K]."""
    if form == "quantized":
        return wj.formats.from_quantization_config(ckpt, qcfg, prefix).astype(cfg.dtype)
    return _float_weight(cfg, ckpt, qcfg, prefix, form, target)


def _linear_module(cfg, value, shape):
    n, k = shape
    if isinstance(value, wj.QuantizedExperts):
        if value.shape != (1, n, k):
            raise ValueError(f"quantized weight has shape {value.shape}, expected (1, {n}, {k})")
        return QuantizedLinear(cfg, k, n, rngs=None, qe=value)
    return Linear(cfg, k, n, rngs=None, weight=value)


def _read_experts(cfg, ckpt, qcfg, entry: WeightEntry, form: str, experts: range, problems):
    """Experts `experts` of a layer, stacked: (w13 [n, 2I, H], w2 [n, H, I]) as
    QuantizedExperts (quantized checkpoints, and float or FP8 ones quantized on load, one
    tensor at a time), or float numpy arrays for experts kept float; None (and `problems`
    extended, one entry per bad expert tensor) when some expert cannot be converted."""
    _, i, hdim = entry.shape
    parts: dict[str, list] = {p: [] for p in _PROJS}
    ok = True
    for j in experts:
        for proj in _PROJS:
            prefix = f"{entry.name}.{j}.{proj}"
            try:
                if form == "quantized":
                    part = wj.formats.from_quantization_config(ckpt, qcfg, prefix)
                else:
                    part = _float_weight(cfg, ckpt, qcfg, prefix, form, "experts")
                parts[proj].append(part)
            except ValueError as err:
                problems.append(f"{prefix}: {err}")
                ok = False
    if not ok:
        return None
    if isinstance(parts["gate_proj"][0], wj.QuantizedExperts):
        # GPTQ act-order: w13 reads one input order per expert; down_proj's folds into w13.
        pairs = zip(experts, parts["gate_proj"], parts["up_proj"], strict=True)
        unlike = [j for j, gate, up in pairs if not _same_order(gate, up)]
        for j in unlike:
            problems.append(
                f"{entry.name}.{j}.up_proj: its act-order g_idx orders the inputs unlike "
                f"gate_proj's (one input order per expert: the same g_idx)"
            )
        if unlike:
            return None
        gate, up, down = (wj.QuantizedExperts.concatenate(parts[p], axis=0) for p in _PROJS)
        w13 = wj.QuantizedExperts.concatenate([gate, up], axis=1).astype(cfg.dtype)  # [gate; up]
        w13, w2 = wj.formats.fold_w2_act_order(w13, down.astype(cfg.dtype))
    else:
        w13 = np.concatenate([np.stack(parts["gate_proj"]), np.stack(parts["up_proj"])], axis=1)
        w2 = np.stack(parts["down_proj"])
    n = len(experts)
    if w13.shape != (n, 2 * i, hdim) or w2.shape != (n, hdim, i):
        raise ValueError(
            f"experts have w13 {w13.shape} / w2 {w2.shape}, expected "
            f"{(n, 2 * i, hdim)} / {(n, hdim, i)}"
        )
    return w13, w2


def _same_order(a: wj.QuantizedExperts, b: wj.QuantizedExperts) -> bool:
    """Whether two layers [1, N, K] take their inputs in the same order (perm, act-order)."""
    if a.perm is None or b.perm is None:
        return a.perm is None and b.perm is None
    return bool(np.array_equal(np.asarray(a.perm), np.asarray(b.perm)))


def _experts_module(
    cfg, ckpt, qcfg, entry: WeightEntry, form: str, implementation, problems, activation_quant
):
    """Stacks the E experts of a layer into one module (None when some cannot be converted);
    quantized experts run `activation_quant` (None: 16-bit activations)."""
    read = _read_experts(cfg, ckpt, qcfg, entry, form, range(entry.shape[0]), problems)
    if read is None:
        return None
    return _experts(cfg, *read, implementation, activation_quant)


def _experts(cfg, w13, w2, implementation, activation_quant):
    """RoutedExperts of quantized w13 and w2 (on `implementation`, with `activation_quant`),
    else FloatExperts."""
    if isinstance(w13, wj.QuantizedExperts):
        return RoutedExperts(
            cfg,
            rngs=None,
            w13=w13,
            w2=w2,
            implementation=implementation,
            activation_quant=activation_quant,
        )
    return FloatExperts(cfg, rngs=None, w13=w13, w2=w2)


def _sharded_experts_module(
    cfg, ckpt, qcfg, entry: WeightEntry, form: str, implementation, ms, problems, activation_quant
):
    """The experts of a layer placed on the mesh block by block: each device receives only its
    slice, and the host holds one block of E/n experts (one expert shard) at a time. Only the
    blocks of this process's devices are read (several hosts)."""
    e, _, _ = entry.shape
    mesh, ea, ta = ms.mesh, ms.expert_axis, ms.tensor_axis
    n_e, n_t = ms.expert_shards, ms.tensor_shards
    if e % n_e:
        raise ValueError(f"E={e} experts are not divisible by the {n_e} expert shards")
    per = e // n_e
    by_expert = NamedSharding(mesh, P(ea)).addressable_devices_indices_map((e,))
    blocks = sorted({(idx[0].start or 0) // per for idx in by_expert.values()})
    layout = None  # (leaves' global shapes, shardings, treedef), known after the first block
    shards: dict = {}  # (leaf number, device) -> single-device array

    for b in blocks:
        read = _read_experts(cfg, ckpt, qcfg, entry, form, range(b * per, (b + 1) * per), problems)
        if read is None:
            return None
        w13, w2 = read
        if isinstance(w13, wj.QuantizedExperts):
            w13 = jax.tree.map(np.asarray, w13)
            w2 = jax.tree.map(np.asarray, w2)
            specs = (
                wj.sharding.expert_specs(w13, expert_axis=ea, n_axis=ta),
                wj.sharding.expert_specs(w2, expert_axis=ea, k_axis=ta),
            )
        else:
            w13 = np.asarray(w13, jnp.dtype(cfg.dtype))
            w2 = np.asarray(w2, jnp.dtype(cfg.dtype))
            specs = (P(ea, ta, None), P(ea, None, ta))
        w13 = reorder_w13(w13, 1, n_t)  # tensor shard s holds rows [gate_s; up_s]
        leaves, treedef = jax.tree.flatten((w13, w2))
        if layout is None:
            spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
            shapes = [(e,) + a.shape[1:] for a in leaves]
            layout = (shapes, [NamedSharding(mesh, sp) for sp in spec_leaves], treedef)
        shapes, shardings, _ = layout
        for n, (host, shape, sh) in enumerate(zip(leaves, shapes, shardings, strict=True)):
            for device, idx in sh.addressable_devices_indices_map(shape).items():
                start = idx[0].start or 0
                stop = e if idx[0].stop is None else idx[0].stop
                if start // per != b or (n, device) in shards:
                    continue
                local = (slice(start - b * per, stop - b * per),) + tuple(idx[1:])
                shards[(n, device)] = jax.device_put(np.ascontiguousarray(host[local]), device)
    shapes, shardings, treedef = layout
    arrays = [
        jax.make_array_from_single_device_arrays(
            shape, sh, [shards[(n, d)] for d in sh.addressable_devices_indices_map(shape)]
        )
        for n, (shape, sh) in enumerate(zip(shapes, shardings, strict=True))
    ]
    w13, w2 = jax.tree.unflatten(treedef, arrays)
    module = _experts(cfg, w13, w2, implementation, activation_quant)
    module.w13_tp_shards = n_t
    return module


def load_pretrained(
    names: NameTable,
    path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    dtype=jnp.bfloat16,
    implementation=None,
    mesh: Mesh | None = None,
    quantize: str | QuantSpec | None = None,
    progress: bool = True,
    specs=None,
    moe_mode: str = "replicated",
    mtp: bool = False,
):
    """Loads a Hugging Face checkpoint of the family whose table `names` is: a local directory
    or a Hub id (a family's `load_pretrained` is this with its table bound).

    Args:
        names: the family's NameTable.
        path: directory with config.json and model.safetensors (or sharded safetensors with
            model.safetensors.index.json), or a Hub repository id ("org/name", fetched by
            `resolve_checkpoint`). Float (bf16/f16/f32), AWQ, GPTQ or compressed-tensors
            weights, or FP8 with block scales (DeepSeek-V3 / R1's release), as config.json's
            quantization_config says.
        revision, cache_dir: for a Hub id: the revision (default main) and the cache directory
            (default the Hub's; HF_HUB_OFFLINE=1 reads only the cache).
        dtype: activations, float weights and quantization scales.
        implementation: fused_moe backend of the routed experts (None = automatic).
        mesh: a mesh (`models.common.sharding.make_mesh`) to load onto. Where the family
            places tensors as they are read (`NameTable.sharded_loading`) every tensor goes
            straight to its shards (converted on the host, each device sent only its slice;
            the routed experts read one expert shard at a time, so neither the host nor any
            device ever holds a layer's experts whole; with several hosts each reads only
            the experts of its own devices); otherwise the model is loaded on one device and
            placed by the family's `shard_model`. None: one device.
        quantize: quantize float weights on load: "int4", "int8" (asymmetric, group 128) or a
            QuantSpec (its targets say which linears). Already-quantized weights stay as stored.
            An FP8 checkpoint (quant_method "fp8") is dequantized tensor by tensor and
            quantized again: None means "int4" there (logged as a warning); a QuantSpec
            whose targets leave a linear out keeps that linear float, in `dtype`.
        progress: show a tqdm bar over the tensors read, once the load has run
            PROGRESS_DELAY_S seconds (a tiny checkpoint's load prints nothing).
        specs: the family's partition specs for the mesh (default: its defaults).
        moe_mode: the sharded MoE's token mode (`wna16_jax.sharding.fused_moe_ep`'s).
        mtp: also load the family's draft layer (`NameTable.draft`: DeepSeek's
            multi-token-prediction layer num_hidden_layers, the draft head of
            generate(speculative="mtp")) into `model.mtp`, in its own format as the other
            layers (quantize applies to it likewise). One device only (mesh None). False:
            the layer's tensors are not read.

    Returns:
        the family's model (`names.model_class`).

    Raises:
        FileNotFoundError: no such directory or Hub repository (`resolve_checkpoint`), or a
            file the checkpoint needs is missing (named).
        ValueError: listing every problem at once (missing tensor, wrong shape or dtype,
            unsupported quantization_config or config value); a malformed file (named).
        TypeError: mesh is not a jax.sharding.Mesh.
    """
    path = resolve_checkpoint(path, revision=revision, cache_dir=cache_dir)
    quant = QuantSpec.parse(quantize)
    log = names.log
    cfg = names.config_class.from_json(
        os.path.join(path, CONFIG_FILE), dtype=jnp.dtype(dtype).name, quant=quant
    )
    qcfg = cfg.quantization_config
    if quant_method(qcfg) == "fp8" and quant is None:
        cfg = dataclasses.replace(cfg, quant=QuantSpec.parse(FP8_DEFAULT_QUANTIZE))
        log.warning(
            "%s holds FP8 weights and quantize=None: quantizing them to %s (asymmetric, group "
            "%d) while loading; pass quantize='int8' (or a QuantSpec) for another choice",
            path,
            FP8_DEFAULT_QUANTIZE,
            cfg.quant.group_size,
        )
    if mtp:
        if names.draft is None:
            raise ValueError(f"mtp=True: {names.model_class.__name__} has no draft layer")
        names.draft.check(cfg)
        if mesh is not None:
            raise ValueError("mtp=True loads onto one device: pass mesh=None")
    ms = place = None
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (see make_mesh), got {type(mesh)}")
        if names.sharded_loading is not None:
            ms, place = names.sharded_loading(mesh, cfg, specs=specs, moe_mode=moe_mode)
        elif specs is not None:
            raise ValueError(f"specs=: {names.model_class.__name__} loads with its default specs")
    ckpt = Checkpoint(path)
    plans, problems = check_checkpoint(names, cfg, ckpt, qcfg, mtp=mtp)
    problems += tied_weight_problems(cfg, ckpt)
    acts = activation_plan(ckpt, qcfg, plans, problems)
    _raise_problems(path, problems)
    _report_unused(log, cfg, ckpt, plans, read=acts.read, explained=acts.linears)
    _warn_16_bit_linears(log, path, cfg, acts.linears)

    # An abstract model (no memory) whose parts are replaced by the loaded ones.
    model = names.model_class.abstract(cfg)
    if mtp:
        model.mtp = nnx.eval_shape(lambda: names.draft.build(cfg, rngs=nnx.Rngs(0)))
    total = sum(p.num_tensors for p in plans)
    bar = progress_bar(
        total=total, unit="tensor", desc=f"loading {os.path.basename(path)}", enabled=progress
    )
    ckpt.on_read = lambda name: bar.update(1)
    # With a mesh, conversions run on the host's CPU device; only slices reach the mesh.
    host = host_device() if ms is not None else None
    try:
        with jax.default_device(host) if host is not None else contextlib.nullcontext():
            for plan in plans:
                entry = plan.entry
                aq = acts.experts.get(entry.name)
                try:
                    _install(names, model, cfg, ckpt, qcfg, plan, implementation, problems, ms, aq)
                    if ms is not None:
                        place(model, entry.path, ms)
                except ValueError as err:
                    problems.append(f"{entry.name}: {err}")
    finally:
        bar.close()
        ckpt.close()
    _raise_problems(path, problems)
    if cfg.tie_word_embeddings:
        model.lm_head = None
    if ms is not None:
        model.set_sharding(ms)
    left = [
        jax.tree_util.keystr(p)
        for p, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if left:  # a name table without a row for a weight: a bug in the family, not the checkpoint
        raise RuntimeError(f"weights never loaded: {left}")
    if mesh is not None and ms is None:
        names.shard_model(model, mesh, moe_mode=moe_mode)
    method = quant_method(qcfg)
    schemes = sorted({aq.scheme for aq in acts.experts.values()})
    log.info(
        "loaded %s: %d tensors, %d layers, quantization %s%s",
        path,
        ckpt.reads,
        cfg.num_hidden_layers,
        f"fp8 -> {cfg.quant}" if method == "fp8" else method or quantize or "none",
        f", routed experts with {schemes[0]} activations (W8A8)" if schemes else "",
    )
    return model


def _install(
    names: NameTable,
    model,
    cfg,
    ckpt,
    qcfg,
    plan: _Plan,
    implementation,
    problems,
    ms=None,
    activation_quant=None,
) -> None:
    """Reads one plan entry and puts it into the (abstract) model; with a ModelSharding `ms`,
    placed on its mesh; routed experts run `activation_quant` (None: 16-bit activations)."""
    entry = plan.entry
    if entry.kind in names.kinds:
        value = names.kinds[entry.kind].read(ckpt, entry, cfg, qcfg, implementation)
        if isinstance(value, nnx.Module):
            set_module(model, entry.path, value)
        else:
            module_at(model, entry.path).set_value(value)
        return
    if entry.kind == "experts" and ms is not None:
        module = _sharded_experts_module(
            cfg, ckpt, qcfg, entry, plan.form, implementation, ms, problems, activation_quant
        )
        if module is not None:
            set_module(model, entry.path, module)
        return
    if entry.kind in ("weight", "param", "param_f32"):
        name = f"{entry.name}.weight" if entry.kind == "weight" else entry.name
        var = module_at(model, entry.path)
        var = var.weight if entry.kind == "weight" else var
        var.set_value(jnp.asarray(np.asarray(ckpt[name]), var.get_value().dtype))
    elif entry.kind == "linear":
        value = _load_linear(cfg, ckpt, qcfg, entry.name, plan.form, entry.target)
        set_module(model, entry.path, _linear_module(cfg, value, entry.shape))
    elif entry.kind == "experts":
        module = _experts_module(
            cfg, ckpt, qcfg, entry, plan.form, implementation, problems, activation_quant
        )
        if module is not None:
            set_module(model, entry.path, module)
    else:  # pragma: no cover
        raise AssertionError(entry.kind)


def _report_unused(
    log: logging.Logger,
    cfg,
    ckpt: Checkpoint,
    plans: list[_Plan],
    *,
    read=frozenset(),
    explained=(),
) -> None:
    """Logs the tensors loading leaves unread: a planned weight's tensors are its prefix's,
    but a linear's input quantization (_ACTIVATION_TENSORS) only where `read`, or under a
    linear of `explained` (named by `_warn_16_bit_linears` instead)."""
    used_prefixes = tuple(p.entry.name + "." for p in plans)
    used = {p.entry.name for p in plans}
    explained_prefixes = tuple(name + "." for name in explained)
    layer = re.compile(r"model\.layers\.(\d+)\.")
    extra_layers, unknown = 0, []
    for name in ckpt:
        if name.rpartition(".")[2] in _ACTIVATION_TENSORS:
            if name in read or name.startswith(explained_prefixes):
                continue
        elif name in used or name.startswith(used_prefixes):
            continue
        m = layer.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            extra_layers += 1  # e.g. DeepSeek-V3's multi-token-prediction layer 61
        elif not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            unknown.append(name)
    if extra_layers:
        log.info(
            "ignoring %d tensors of layers >= num_hidden_layers=%d",
            extra_layers,
            cfg.num_hidden_layers,
        )
    if unknown:
        log.warning("ignoring %d tensors the model does not use: %s", len(unknown), unknown[:10])


# ---- saving ---------------------------------------------------------------------------------

SAVE_FORMATS = ("bf16", "awq", "gptq", "compressed-tensors")


def _quant_key(qe: wj.QuantizedExperts) -> tuple[int, int, bool]:
    return (qe.bits, qe.group_size, qe.has_zeros)


def _named_linears(names: NameTable, model) -> Iterator[tuple[str, object]]:
    """(HF prefix, float [N, K] array or QuantizedExperts [1, N, K]) for every linear (the
    parts of a FusedLinear under their own names)."""
    for entry in weight_table(names, model.cfg, mtp=model.mtp is not None):
        if entry.kind == "linear":
            mod = linear_at(model, entry.path)
            if isinstance(mod, QuantizedLinear):
                yield entry.name, mod.canonical_weight()
            else:
                yield entry.name, mod.weight.get_value()
        elif entry.kind == "experts":
            mod = module_at(model, entry.path)
            e, i, _ = entry.shape
            if isinstance(mod, RoutedExperts):
                # Canonical layout, rows [gate; up], whatever the kernel layout and TP order.
                w13, w2 = mod.canonical_w13(), wj.layouts.to_canonical_layout(mod.w2.get())
                for j in range(e):
                    w13_j = w13.slice(j, j + 1, axis=0)
                    yield f"{entry.name}.{j}.gate_proj", w13_j.slice(0, i, axis=1)
                    yield f"{entry.name}.{j}.up_proj", w13_j.slice(i, 2 * i, axis=1)
                    yield f"{entry.name}.{j}.down_proj", w2.slice(j, j + 1, axis=0)
            else:
                w13, w2 = mod.canonical_w13(), mod.w2.get_value()
                for j in range(e):
                    yield f"{entry.name}.{j}.gate_proj", w13[j, :i]
                    yield f"{entry.name}.{j}.up_proj", w13[j, i:]
                    yield f"{entry.name}.{j}.down_proj", w2[j]


# The config group of a W8A8 model's routed experts (compressed-tensors "re:" targets match a
# module name from its start); the other quantized linears keep class-name targets.
EXPERTS_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def _input_activations(aq: wj.ActivationQuant) -> dict:
    """compressed-tensors input_activations for an ActivationQuant (what
    `formats.activation_quant_from_config` reads back)."""
    static = aq.scheme == "int8_static"
    return {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "tensor" if static else "token",
        "dynamic": not static,
    }


def _quantization_config(
    fmt: str,
    key: tuple[int, int, bool],
    float_linears: list[str],
    act_order: bool = False,
    experts_aq: wj.ActivationQuant | None = None,
):
    bits, group_size, has_zeros = key
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "version": "gemm",
            "bits": bits,
            "group_size": group_size,
            "zero_point": True,
            "modules_to_not_convert": float_linears or None,
        }
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "sym": not has_zeros,
            "desc_act": act_order,  # to_gptq writes act-order layers' g_idx
            "checkpoint_format": "gptq",
            "dynamic": {f"-:^{re.escape(n)}$": {} for n in float_linears if n != "lm_head"} or None,
        }
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": not has_zeros,
        "strategy": "group" if group_size > 0 else "channel",
        "group_size": group_size if group_size > 0 else None,
        "dynamic": False,
        "actorder": None,
    }
    groups = {
        "group_0": {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": None,
            "output_activations": None,
        }
    }
    if experts_aq is not None:  # W8A8 experts: their own group (regex targets match first)
        groups = {
            "group_0": {
                "targets": [EXPERTS_TARGET],
                "weights": weights,
                "input_activations": _input_activations(experts_aq),
                "output_activations": None,
            },
            "group_1": groups["group_0"],
        }
    return {
        "quant_method": "compressed-tensors",
        # W8A8 checkpoints hold unpacked int8 weights ("int-quantized"); weight-only ones
        # packed words.
        "format": "pack-quantized" if experts_aq is None else "int-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": float_linears,
    }


def _experts_activation_quant(names: NameTable, model, fmt: str) -> wj.ActivationQuant | None:
    """The routed experts' activation quantization one config can say: their scheme (static
    scales cleared: each layer writes its own input_scale tensors), or None (16-bit).

    Raises:
        ValueError: layers with different schemes, or int8 activations in a weight-only
            format (awq, gptq).
    """
    by_scheme: dict[str, list[str]] = {}
    for entry in weight_table(names, model.cfg, mtp=model.mtp is not None):
        mod = module_at(model, entry.path) if entry.kind == "experts" else None
        if isinstance(mod, RoutedExperts):
            by_scheme.setdefault(_scheme_name(mod.activation_quant), []).append(entry.name)
    if len(by_scheme) > 1:
        listed = "; ".join(f"{k}: {', '.join(names)}" for k, names in by_scheme.items())
        raise ValueError(
            f"the routed experts' activation quantization differs between layers ({listed}); "
            f"one quantization_config cannot say so"
        )
    scheme = next(iter(by_scheme), None)
    if scheme is None or scheme == _scheme_name(None):
        return None
    if fmt in ("awq", "gptq"):
        raise ValueError(
            f"format={fmt!r} is weight-only: it cannot say that the routed experts run {scheme} "
            f"activations (W8A8); save as 'compressed-tensors', or call "
            f"model.set_activation_quant(None) first"
        )
    return wj.ActivationQuant(scheme)


def save_pretrained(
    names: NameTable,
    model,
    path: str | os.PathLike,
    *,
    format: str = "bf16",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes an HF directory: config.json (+ quantization_config) and safetensors.

    Args:
        model: the model.
        path: output directory (created).
        format: "bf16" (every weight as bfloat16; quantized ones dequantized: a float
            checkpoint, without activation quantization either), or "awq", "gptq",
            "compressed-tensors" (quantized linears in that format, float ones in their own
            dtype). All quantized linears must share bits / group size / zero points. Routed
            experts with int8 activations (W8A8) need "compressed-tensors" (or "bf16"): their
            config group says input_activations, with each layer's static scales as
            {expert}.input_scale tensors, and the weights are written unpacked
            ("int-quantized"); the other linears run 16-bit activations and are written so.
        max_shard_bytes: when set, shards the weights into files of about this size (bytes, or
            a Hugging Face size string: "5GB", "500MiB") with a model.safetensors.index.json
            (else one model.safetensors).

    Crash-safe (`models.common.checkpoint.write_checkpoint`): killed at any instant, `path`
    loads as the whole old checkpoint or the whole new one; the index and weight files of an
    earlier save into `path` that this save does not write are removed at the end.

    Raises:
        ValueError: unknown format, or weights (or activation quantization) the format cannot
            express.
    """
    if format not in SAVE_FORMATS:
        raise ValueError(f"format={format!r} is not one of {SAVE_FORMATS}")
    cfg = model.cfg
    experts_aq = None if format == "bf16" else _experts_activation_quant(names, model, format)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}

    def put(name, arr, dtype=None):
        arr = np.asarray(arr)
        tensors[name] = np.ascontiguousarray(arr if dtype is None else arr.astype(dtype))

    float_dtype = ml_dtypes.bfloat16 if format == "bf16" else None
    kind_qcfg = None  # what a family's own kind of rows says its tensors are
    for entry in weight_table(names, model.cfg, mtp=model.mtp is not None):
        if entry.kind == "weight":
            put(
                f"{entry.name}.weight", module_at(model, entry.path).weight.get_value(), float_dtype
            )
        elif entry.kind in ("param", "param_f32"):
            dtype = np.float32 if entry.kind == "param_f32" else float_dtype
            put(entry.name, module_at(model, entry.path).get_value(), dtype)
        elif entry.kind in names.kinds:
            kind = names.kinds[entry.kind]
            if kind.write is None:
                raise ValueError(f"{entry.name}: its kind {entry.kind!r} is not saved")
            for name, arr in kind.write(model, entry, format).items():
                put(name, arr)
            if kind.quantization_config is not None:
                kind_qcfg = kind.quantization_config(model, entry) or kind_qcfg
        elif entry.kind == "experts" and experts_aq is not None:
            aq = module_at(model, entry.path).activation_quant
            if aq.scheme == "int8_static":  # this layer's scales, on each of its experts
                for _, proj, prefix in entry.expert_names(entry.shape[0]):
                    scale = aq.gemm2_scale if proj == "down_proj" else aq.gemm1_scale
                    put(f"{prefix}.input_scale", np.array([scale], np.float32))
    if model.mtp is not None and names.draft.saved_copies is not None:
        for name, arr in names.draft.saved_copies(model).items():
            put(name, arr, float_dtype)
    keys, float_linears, act_order = set(), [], False
    for name, value in _named_linears(names, model):
        if not isinstance(value, wj.QuantizedExperts):
            put(f"{name}.weight", value, float_dtype)
            float_linears.append(name)
        elif format == "bf16":
            put(f"{name}.weight", wj.dequantize_experts(value, jnp.float32)[0], ml_dtypes.bfloat16)
        else:
            keys.add(_quant_key(value))
            act_order |= value.has_perm
            writer = {
                "awq": wj.formats.to_awq,
                "gptq": wj.formats.to_gptq,
                "compressed-tensors": wj.formats.to_compressed_tensors
                if experts_aq is None
                else wj.formats.to_compressed_tensors_int,
            }[format]
            for suffix, arr in writer(value).items():
                put(f"{name}.{suffix}", arr)
    hf = cfg.to_hf_dict()
    hf.pop("quantization_config", None)
    if len(keys) > 1:
        raise ValueError(
            f"format={format!r}: quantized linears differ in (bits, group_size, "
            f"zero points): {sorted(keys)}; one quantization_config cannot say so"
        )
    if keys and kind_qcfg is not None:
        raise ValueError(
            f"format={format!r}: quantized linears beside tensors whose quantization_config "
            f"is {kind_qcfg}; one quantization_config cannot say both"
        )
    if keys:
        hf["quantization_config"] = _quantization_config(
            format, keys.pop(), float_linears, act_order, experts_aq
        )
    elif kind_qcfg is not None:
        hf["quantization_config"] = kind_qcfg
    if format == "bf16":
        hf["torch_dtype"] = "bfloat16"
    write_checkpoint(path, tensors, hf, max_shard_bytes=max_shard_bytes)
