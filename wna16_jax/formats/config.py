"""One layer loaded as an HF quantization_config says; the W8A8 activation settings."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from wna16_jax._types import SUPPORTED_BITS, ActivationQuant, QuantizedExperts
from wna16_jax.formats._common import (
    CT_INT_STRATEGIES,
    CT_STRATEGIES,
    GPTQ_FORMATS,
    as_int,
    trivial_g_idx,
)
from wna16_jax.formats.awq import from_awq
from wna16_jax.formats.compressed_tensors import (
    from_compressed_tensors,
    from_compressed_tensors_int,
)
from wna16_jax.formats.gptq import from_gptq


def _take(tensors: Mapping[str, Any], prefix: str, required, optional, what: str):
    names = {s: f"{prefix}.{s}" for s in (*required, *optional)}
    missing = [names[s] for s in required if names[s] not in tensors]
    if missing:
        have = sorted(name for name in tensors if name.startswith(prefix + "."))
        raise ValueError(f"{what}: missing tensors {missing} (tensors under {prefix!r}: {have})")
    return {s: tensors[names[s]] for s in names if names[s] in tensors}


def _require(cfg: Mapping[str, Any], keys: Sequence[str], what: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    raise ValueError(f"{what}: quantization_config has no {' / '.join(map(repr, keys))}")


def _load_awq(tensors, cfg, prefix) -> QuantizedExperts:
    what = f"awq layer {prefix!r}"
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"{what}: AWQ version={cfg.get('version')!r} is not supported (supported: 'gemm')"
        )
    bits = _require(cfg, ("bits", "w_bit"), what)
    if bits != 4:
        raise ValueError(f"{what}: AWQ bits={bits!r} is not supported (supported: 4)")
    if cfg.get("zero_point", True) is not True:
        raise ValueError(
            f"{what}: AWQ zero_point={cfg.get('zero_point')!r} is not supported (AWQ GEMM "
            f"checkpoints need zero_point=true)"
        )
    skipped = [m for m in cfg.get("modules_to_not_convert") or () if m in prefix]
    if skipped:
        raise ValueError(
            f"{what}: the layer matches modules_to_not_convert {skipped}; it is not quantized"
        )
    group_size = _require(cfg, ("group_size", "q_group_size"), what)
    t = _take(tensors, prefix, ("qweight", "qzeros", "scales"), (), what)
    return from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=group_size)


def _matches(pattern: str, prefix: str, rule: str, what: str) -> bool:
    """re.match(pattern, prefix); an invalid regex is a ValueError naming the rule it came from."""
    try:
        return re.match(pattern, prefix) is not None
    except re.error as err:
        raise ValueError(f"{what}: {rule} is not a valid regular expression: {err}") from None


def _gptq_dynamic(cfg: Mapping[str, Any], prefix: str, what: str) -> dict[str, Any]:
    """GPTQModel's per-module overrides: {"-:regex": {}} skips, {"+:regex"|"regex": {...}}."""
    for pattern, override in (cfg.get("dynamic") or {}).items():
        if pattern.startswith("-:"):
            if _matches(pattern[2:], prefix, f"GPTQ dynamic rule {pattern!r}", what):
                raise ValueError(
                    f"{what}: the layer matches dynamic exclusion {pattern!r}; it is not quantized"
                )
            continue
        rule = f"GPTQ dynamic rule {pattern!r}"
        if _matches(pattern.removeprefix("+:"), prefix, rule, what):
            return {**cfg, **override}
    return dict(cfg)


def _load_gptq(tensors, cfg, prefix) -> QuantizedExperts:
    what = f"gptq layer {prefix!r}"
    cfg = _gptq_dynamic(cfg, prefix, what)
    bits = _require(cfg, ("bits",), what)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: GPTQ bits={bits!r} is not supported (supported: 4, 8)")
    group_size = _require(cfg, ("group_size",), what)
    fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise ValueError(
            f"{what}: GPTQ checkpoint_format={fmt!r} is not supported (supported: "
            f"{', '.join(GPTQ_FORMATS)})"
        )
    t = _take(tensors, prefix, ("qweight", "qzeros", "scales"), ("g_idx",), what)
    return from_gptq(
        t["qweight"],
        t["qzeros"],
        t["scales"],
        t.get("g_idx"),
        bits=bits,
        group_size=group_size,
        sym=bool(cfg.get("sym", True)),
        desc_act=bool(cfg.get("desc_act", False)),
        checkpoint_format=fmt,
    )


def _ct_scheme(cfg: Mapping[str, Any], prefix: str, what: str) -> Mapping[str, Any]:
    """The config group whose targets cover `prefix` (regex targets first, then class names)."""
    groups = {
        name: grp
        for name, grp in (cfg.get("config_groups") or {}).items()
        if grp and grp.get("weights")
    }
    if not groups:
        raise ValueError(f"{what}: quantization_config has no config_groups with weights")
    if len(groups) == 1:
        return next(iter(groups.values()))
    by_regex = [
        name
        for name, grp in groups.items()
        if any(
            t.startswith("re:")
            and _matches(t[3:], prefix, f"compressed-tensors target {t!r} of {name!r}", what)
            for t in grp.get("targets", ())
        )
    ]
    by_class = [
        name
        for name, grp in groups.items()
        if any(not t.startswith("re:") for t in grp.get("targets", ()))
    ]
    for matches in (by_regex, by_class):
        if len(matches) == 1:
            return groups[matches[0]]
        if len(matches) > 1:
            break
    raise ValueError(
        f"{what}: cannot tell which of config_groups {sorted(groups)} applies "
        f"(regex matches: {by_regex}, class-name targets: {by_class})"
    )


def _load_compressed_tensors(tensors, cfg, prefix) -> QuantizedExperts:
    what = f"compressed-tensors layer {prefix!r}"
    scheme = _ct_scheme(cfg, prefix, what)
    weights = scheme["weights"]
    fmt = scheme.get("format") or cfg.get("format")
    if weights.get("type", "int") != "int":
        raise ValueError(
            f"{what}: weights type={weights.get('type')!r} is not supported (supported: 'int')"
        )
    bits = weights.get("num_bits")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: weights num_bits={bits!r} is not supported (supported: 4, 8)")
    strategy = weights.get("strategy", "group")
    supported = CT_INT_STRATEGIES if fmt in ("int-quantized", "naive-quantized") else CT_STRATEGIES
    if strategy not in supported:
        raise ValueError(
            f"{what}: weights strategy={strategy!r} is not supported for format={fmt!r} "
            f"(supported: {', '.join(map(repr, supported))})"
        )
    kwargs = dict(
        num_bits=bits,
        group_size=weights.get("group_size"),
        symmetric=bool(weights.get("symmetric", True)),
        strategy=strategy,
    )
    if fmt == "pack-quantized":
        required, optional = ("weight_packed", "weight_scale"), ("weight_zero_point",)
        optional += ("weight_shape", "weight_g_idx")
    elif fmt in ("int-quantized", "naive-quantized"):
        required, optional = ("weight", "weight_scale"), ("weight_zero_point", "weight_g_idx")
    else:
        raise ValueError(
            f"{what}: format={fmt!r} is not supported (supported: 'pack-quantized', "
            f"'int-quantized', 'naive-quantized')"
        )
    t = _take(tensors, prefix, required, optional, what)
    if "weight_g_idx" in t:
        g_idx = np.asarray(t["weight_g_idx"])
        k = g_idx.shape[0] if g_idx.ndim == 1 else -1
        group = kwargs["group_size"] if strategy == "group" else -1  # channel, tensor
        if k < 0 or not trivial_g_idx(g_idx, k, as_int(group, "group_size", what)):
            raise ValueError(
                f"{what}: activation ordering with a non-trivial {prefix}.weight_g_idx is not "
                f"supported (actorder={weights.get('actorder')!r}); the canonical layout needs "
                f"contiguous groups"
            )
    if fmt == "pack-quantized":
        return from_compressed_tensors(
            t["weight_packed"],
            t["weight_scale"],
            t.get("weight_zero_point"),
            t.get("weight_shape"),
            **kwargs,
        )
    return from_compressed_tensors_int(
        t["weight"], t["weight_scale"], t.get("weight_zero_point"), **kwargs
    )


_LOADERS = {
    "awq": _load_awq,
    "gptq": _load_gptq,
    "compressed-tensors": _load_compressed_tensors,
}


def from_quantization_config(
    tensors: Mapping[str, Any], quantization_config: Mapping[str, Any], prefix: str
) -> QuantizedExperts:
    """Loads one quantized linear layer as described by an HF `quantization_config`.

    Recognized (`quant_method`):
      - "awq": version "gemm" only; keys bits (or w_bit) = 4, group_size (or q_group_size),
        zero_point (must be true), modules_to_not_convert (a matching prefix is refused).
        Tensors {prefix}.qweight, .qzeros, .scales.
      - "gptq": keys bits (4, 8), group_size, sym, desc_act, checkpoint_format (or format;
        "gptq" or "gptq_v2"), dynamic (GPTQModel per-module overrides: "-:" excludes refuse,
        other matches override keys). Tensors .qweight, .qzeros, .scales, optional .g_idx
        (act-order: a non-trivial g_idx loads with an input permutation, see `from_gptq`).
      - "compressed-tensors": the config group whose targets match (regex "re:..." targets
        first; otherwise the single group with class-name targets); weights type "int",
        num_bits 4/8, strategy group/channel (and tensor for int-quantized), group_size,
        symmetric; format (per group or
        top-level) "pack-quantized" (.weight_packed, .weight_scale, optional
        .weight_zero_point, .weight_shape) or "int-quantized" / "naive-quantized" (.weight,
        .weight_scale, optional .weight_zero_point). A non-trivial .weight_g_idx is refused.
        The "ignore" list is not consulted: an ignored layer is a float layer, which the
        caller must not pass here (it fails for lack of the quantized tensors). Only weights
        are read here: `activation_quant_from_config` reads input_activations (W8A8 schemes),
        which fused_moe takes as its activation_quant.

    Args:
        tensors: mapping name -> numpy or jax array (e.g. one safetensors file's contents).
        quantization_config: the "quantization_config" dict of the model's config.json.
        prefix: the linear layer's name, e.g. "model.layers.3.mlp.experts.7.up_proj".

    Returns:
        QuantizedExperts of shape [1, N, K].

    Raises:
        ValueError: naming the missing tensors or the unsupported key and value.
    """
    method = quantization_config.get("quant_method")
    if method not in _LOADERS:
        raise ValueError(
            f"layer {prefix!r}: quant_method={method!r} is not supported (supported: "
            f"{', '.join(map(repr, _LOADERS))})"
        )
    return _LOADERS[method](tensors, quantization_config, prefix)


def activation_quant_from_config(
    quantization_config: Mapping[str, Any], prefix: str
) -> ActivationQuant | None:
    """The activation quantization (W8A8) a checkpoint's config asks for at one layer.

    compressed-tensors' input_activations of the config group covering `prefix`:
      - absent / null: None (weight-only: 16-bit activations).
      - int, 8 bits, symmetric, strategy "token", dynamic true: ActivationQuant("int8_per_token").
      - int, 8 bits, symmetric, strategy "tensor", dynamic false: ActivationQuant("int8_static")
        without scales: the scales are tensors ({prefix}.input_scale); set them with
        `static_input_scale`, e.g. dataclasses.replace(aq, gemm1_scale=static_input_scale(
        tensors, gate_and_up_prefixes), gemm2_scale=static_input_scale(tensors, down_prefixes)).
    AWQ and GPTQ are weight-only: None.

    Args:
        quantization_config: the "quantization_config" dict of the model's config.json.
        prefix: a linear layer's name, e.g. "model.layers.3.mlp.experts.7.up_proj".

    Returns:
        None or an ActivationQuant for fused_moe's activation_quant.

    Raises:
        ValueError: an unknown quant_method, or input_activations that fused_moe cannot run
            (naming the key and value: e.g. asymmetric, float, 4-bit, dynamic per-tensor).
    """
    method = quantization_config.get("quant_method")
    if method in ("awq", "gptq"):
        return None
    if method != "compressed-tensors":
        raise ValueError(
            f"layer {prefix!r}: quant_method={method!r} is not supported (supported: "
            f"{', '.join(map(repr, _LOADERS))})"
        )
    what = f"compressed-tensors layer {prefix!r}"
    acts = _ct_scheme(quantization_config, prefix, what).get("input_activations")
    if not acts:
        return None
    facts = {
        "type": acts.get("type", "int"),
        "num_bits": acts.get("num_bits"),
        "symmetric": acts.get("symmetric", True),
    }
    want = {"type": "int", "num_bits": 8, "symmetric": True}
    for key, value in facts.items():
        if value != want[key]:
            raise ValueError(
                f"{what}: input_activations {key}={value!r} is not supported (int8 activations "
                f"need type='int', num_bits=8, symmetric=true)"
            )
    strategy, dynamic = acts.get("strategy", "tensor"), acts.get("dynamic", False)
    if strategy == "token" and dynamic is True:
        return ActivationQuant(scheme="int8_per_token")
    if strategy == "tensor" and dynamic is False:
        return ActivationQuant(scheme="int8_static")
    raise ValueError(
        f"{what}: input_activations strategy={strategy!r} with dynamic={dynamic!r} is not "
        f"supported (supported: strategy='token' with dynamic=true, strategy='tensor' with "
        f"dynamic=false)"
    )


def static_input_scale(tensors: Mapping[str, Any], prefixes: Sequence[str]) -> float:
    """The static activation scale shared by several layers: max of their input_scale tensors.

    One GEMM of fused_moe reads one scale for every expert, so the largest of the experts'
    (and, for GEMM1, gate's and up's) scales is used, as vLLM does: no activation clips.

    Args:
        tensors: mapping name -> array holding {prefix}.input_scale for each prefix.
        prefixes: the layers, e.g. every expert's gate_proj and up_proj for gemm1_scale.

    Returns:
        A positive float.

    Raises:
        ValueError: naming missing tensors, or a scale that is not one positive finite value.
    """
    what = "static_input_scale"
    if not prefixes:
        raise ValueError(f"{what}: needs at least one layer prefix")
    names = [f"{p}.input_scale" for p in prefixes]
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"{what}: missing tensors {missing[:8]} ({len(missing)} in all)")
    values = []
    for name in names:
        a = np.asarray(tensors[name], dtype=np.float32)
        if a.size != 1 or not np.isfinite(a).all() or float(a.reshape(())) <= 0:
            raise ValueError(
                f"{what}: {name} must be one positive finite value (per-tensor), got shape "
                f"{a.shape} values {a.ravel()[:4].tolist()}"
            )
        values.append(float(a.reshape(())))
    return max(values)
