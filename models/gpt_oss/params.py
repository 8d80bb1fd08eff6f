"""gpt-oss checkpoints (the layout openai/gpt-oss-20b and -120b ship) -> the NNX model and back:
one name table, every problem reported at once.

The routed experts are MXFP4 (config.json quantization_config {quant_method: mxfp4,
modules_to_not_convert}): `mlp.experts.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] with
`_scales` uint8 [E, 2I, H/32] and `down_proj_blocks` [E, H, I/32, 16] with theirs, gate and up
rows interleaved (row 2j gate j, row 2j+1 up j), biases `gate_up_proj_bias` [E, 2I] (interleaved
alike) and `down_proj_bias` [E, H]. A dequantized checkpoint holds the experts as transformers
keeps them, float `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]. Everything else is float
(bfloat16): attention q/k/v/o with biases and `sinks` [n], the router with its bias, norms,
embedding and head.
"""

from __future__ import annotations

import fnmatch
import logging
import os

import jax.numpy as jnp
import numpy as np

import wna16_jax as wj
from models.common import loader
from models.common.checkpoint import (
    CONFIG_FILE,
    FLOAT_DTYPES,
    Checkpoint,
    fmt_shape,
    quant_method,
    resolve_checkpoint,
    write_json,
    write_safetensors,
)
from models.common.config import QuantSpec
from models.common.modules import module_at, set_module
from models.common.progress import progress_bar
from models.gpt_oss.config import GptOssConfig
from models.gpt_oss.modeling import Experts, GptOssForCausalLM, shard_model
from wna16_jax.formats import mxfp4

logger = logging.getLogger("models.gpt_oss")

QUANT_METHODS = ("mxfp4",)  # quantization_config.quant_method values read (None: float)
MXFP4_GROUP = 32  # values per scale; a block row holds 16 bytes of two e2m1 codes
# What the released checkpoints leave unquantized (their quantization_config's list).
MODULES_TO_NOT_CONVERT = (
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
)

# The float tensors, as models.common.loader's rows (name, kind, shape letters, present when,
# quantization target): "weight" a module's `{name}.weight`, "param" the tensor `name` itself
# (biases, sinks). "layer." stands for "model.layers.{i}."; a projection's bias
# "self_attn.q_proj.bias" lives on the attention as "self_attn.q_bias". The routed experts
# ("layer.mlp.experts", EXPERTS: MXFP4 blocks and scales, or float) are read apart.
# fmt: off
NAME_TABLE: tuple[loader.Row, ...] = (
    ("model.embed_tokens",             "weight", "V H",   "always", None),
    ("model.norm",                     "weight", "H",     "always", None),
    ("lm_head",                        "weight", "V H",   "untied", None),
    ("layer.input_layernorm",          "weight", "H",     "always", None),
    ("layer.post_attention_layernorm", "weight", "H",     "always", None),
    ("layer.self_attn.q_proj",         "weight", "Nq H",  "always", None),
    ("layer.self_attn.k_proj",         "weight", "Nkv H", "always", None),
    ("layer.self_attn.v_proj",         "weight", "Nkv H", "always", None),
    ("layer.self_attn.o_proj",         "weight", "H Nq",  "always", None),
    ("layer.self_attn.q_proj.bias",    "param",  "Nq",    "bias",   None),
    ("layer.self_attn.k_proj.bias",    "param",  "Nkv",   "bias",   None),
    ("layer.self_attn.v_proj.bias",    "param",  "Nkv",   "bias",   None),
    ("layer.self_attn.o_proj.bias",    "param",  "H",     "bias",   None),
    ("layer.self_attn.sinks",          "param",  "n",     "always", None),
    ("layer.mlp.router",               "weight", "E H",   "always", None),
    ("layer.mlp.router.bias",          "param",  "E",     "always", None),
)
# fmt: on
EXPERTS = "mlp.experts"
NAMES = loader.NameTable(
    rows=NAME_TABLE,
    dims={
        "V": lambda c: c.vocab_size,
        "H": lambda c: c.hidden_size,
        "E": lambda c: c.num_local_experts,
        "n": lambda c: c.num_attention_heads,
        "Nq": lambda c: c.num_attention_heads * c.head_dim,
        "Nkv": lambda c: c.num_key_value_heads * c.head_dim,
    },
    present={
        "always": lambda c, i: True,
        "untied": lambda c, i: not c.tie_word_embeddings,
        "bias": lambda c, i: c.attention_bias,
    },
    model_class=GptOssForCausalLM,
    config_class=GptOssConfig,
    logger="models.gpt_oss",
    module_path=lambda name: loader.hf_module_path(name.replace("_proj.bias", "_bias")),
)


def _variable(model, entry: loader.WeightEntry):
    """The nnx variable a float row fills: its module's `weight`, or the param itself."""
    var = module_at(model, entry.path)
    return var.weight if entry.kind == "weight" else var


def _tensor_name(entry: loader.WeightEntry) -> str:
    return f"{entry.name}.weight" if entry.kind == "weight" else entry.name


def _not_converted(module: str, patterns) -> str | None:
    """The modules_to_not_convert pattern that covers `module` (itself or a parent), if any."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*"):
            return pattern
    return None


class _Reader:
    """Reads the checkpoint's tensors for a config, recording every problem."""

    def __init__(self, cfg: GptOssConfig, ckpt: Checkpoint, quant: QuantSpec | None):
        self.cfg, self.ckpt, self.quant = cfg, ckpt, quant
        self.problems: list[str] = []
        qcfg = cfg.quantization_config
        self.method = quant_method(qcfg)
        if qcfg is not None and self.method not in QUANT_METHODS:  # nothing else reads right
            raise ValueError(
                f"{os.path.join(ckpt.path, CONFIG_FILE)}: quantization_config.quant_method="
                f"{self.method!r} is not supported (supported: {list(QUANT_METHODS)})"
            )
        patterns = (qcfg or {}).get("modules_to_not_convert") or ()
        self.not_converted = tuple(patterns) if self.method == "mxfp4" else ()
        self._check_mxfp4_placement()

    def _check_mxfp4_placement(self) -> None:
        """MXFP4 tensors only where the config says: on the routed experts of an mxfp4
        checkpoint, never on a module modules_to_not_convert lists (one problem a module)."""
        modules: dict[str, list[str]] = {}
        for name in self.ckpt:
            if name.endswith(("_blocks", "_scales")):
                module, _, leaf = name.rpartition(".")
                modules.setdefault(module, []).append(leaf)
        self.misplaced = set()
        for module, leaves in modules.items():
            tensors = f"{module}.{{{', '.join(sorted(leaves))}}}"
            if pattern := _not_converted(module, self.not_converted):
                why = f"quantization_config.modules_to_not_convert lists {module} ({pattern!r})"
            elif self.method != "mxfp4":
                why = f"quantization_config.quant_method is {self.method!r}, not 'mxfp4'"
            elif not module.endswith("." + EXPERTS):
                why = f"MXFP4 is read on the routed experts ({EXPERTS}) only"
            else:
                continue
            self.misplaced.add(module)
            self.problems.append(f"{tensors}: MXFP4 tensors, but {why}")

    def float(self, name: str, shape) -> np.ndarray | None:
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

    def _mxfp4(self, prefix: str, n: int, k: int):
        """{prefix}_blocks / _scales of one projection [E, N, K] -> (blocks, scales) numpy in
        the checkpoint's row order (None on a problem, recorded)."""
        e = self.cfg.num_local_experts
        ok = True
        blocks_name, scales_name = f"{prefix}_blocks", f"{prefix}_scales"
        for name in (blocks_name, scales_name):
            if name not in self.ckpt:
                self.problems.append(f"{name}: missing")
                ok = False
        if not ok:
            return None
        (bshape, bdtype), (sshape, sdtype) = map(self.ckpt.meta, (blocks_name, scales_name))
        if bdtype != "U8" or len(bshape) != 4 or bshape[-1] * 2 != MXFP4_GROUP:
            self.problems.append(
                f"{blocks_name}: {bdtype} {fmt_shape(bshape)}, expected uint8 [E, N, K/32, 16] "
                f"(MXFP4 groups of {MXFP4_GROUP} values, two a byte)"
            )
            return None
        want = (e, n, k // MXFP4_GROUP)
        if k % MXFP4_GROUP or tuple(bshape[:3]) != want:
            self.problems.append(
                f"{blocks_name}: shape {fmt_shape(bshape)}, expected {fmt_shape((*want, 16))} "
                f"for [E, N, K] = [{e}, {n}, {k}]"
            )
            return None
        if sdtype != "U8" or tuple(sshape) != want:
            self.problems.append(
                f"{scales_name}: {sdtype} {fmt_shape(sshape)}, expected uint8 {fmt_shape(want)} "
                f"(one exponent per group of {MXFP4_GROUP} of {blocks_name})"
            )
            return None
        return np.asarray(self.ckpt[blocks_name]), np.asarray(self.ckpt[scales_name])

    def experts(self, layer: int):
        """-> (w13 [E, 2I, H], w2 [E, H, I], w13_bias [E, 2I], w2_bias [E, H]), rows [gate; up]:
        QuantizedExperts (MXFP4, or float quantized by `quant`) or float numpy; None on a
        problem."""
        cfg = self.cfg
        e, i, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
        pre = f"model.layers.{layer}.{EXPERTS}"
        b13 = self.float(f"{pre}.gate_up_proj_bias", (e, 2 * i))
        b2 = self.float(f"{pre}.down_proj_bias", (e, h))
        if f"{pre}.gate_up_proj_blocks" in self.ckpt or f"{pre}.gate_up_proj" not in self.ckpt:
            if pre in self.misplaced:
                return None  # reported by _check_mxfp4_placement
            if self.method != "mxfp4":
                self.problems.append(
                    f"{pre}.gate_up_proj: missing (a float checkpoint holds the experts as "
                    f"gate_up_proj [E, H, 2I] and down_proj [E, I, H])"
                )
                return None
            up = self._mxfp4(f"{pre}.gate_up_proj", 2 * i, h)
            down = self._mxfp4(f"{pre}.down_proj", h, i)
            if up is None or down is None or b13 is None or b2 is None:
                return None
            try:
                w13 = mxfp4.from_blocks(*(mxfp4.deinterleave_gate_up(a) for a in up))
                w2 = mxfp4.from_blocks(*down)
            except ValueError as err:
                self.problems.append(f"{pre}: {err}")
                return None
        else:
            gate_up = self.float(f"{pre}.gate_up_proj", (e, h, 2 * i))
            down = self.float(f"{pre}.down_proj", (e, i, h))
            if gate_up is None or down is None or b13 is None or b2 is None:
                return None
            w13 = mxfp4.deinterleave_gate_up(gate_up.transpose(0, 2, 1))
            w2 = down.transpose(0, 2, 1)
            if self.quant is not None:
                w13, w2 = (quantize(w, self.quant, cfg.dtype) for w in (w13, w2))
        return w13, w2, mxfp4.deinterleave_gate_up(b13), b2


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


def load_pretrained(
    path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    dtype=jnp.bfloat16,
    implementation=None,
    quantize: str | QuantSpec | None = None,
    progress: bool = True,
    mesh=None,
    moe_mode: str = "replicated",
    mtp: bool = False,
) -> GptOssForCausalLM:
    """Loads a gpt-oss checkpoint: a local directory or a Hub id ("openai/gpt-oss-20b").

    Args:
        path: a directory with config.json and safetensors (one file or sharded with
            model.safetensors.index.json), or a Hub id (`resolve_checkpoint`).
        revision, cache_dir: for a Hub id.
        dtype: activations and float weights.
        implementation: fused_moe backend of the routed experts (None = automatic).
        quantize: quantize float experts on load ("mxfp4", "int4", "int8" or a QuantSpec);
            MXFP4 ones stay as stored.
        progress: a tqdm bar over the tensors read, once the load has run PROGRESS_DELAY_S.
        mesh, moe_mode: the registry's placement arguments; gpt-oss loads onto one device
            (a mesh raises NotImplementedError: `modeling.shard_model`).
        mtp: gpt-oss has no draft layer (True raises ValueError).

    Raises:
        FileNotFoundError: no such directory or Hub repository, or a missing file (named).
        ValueError: every problem at once, each naming its tensor or config key (a missing
            tensor, a wrong shape or dtype, MXFP4 blocks not in groups of 32 or scales of
            another shape, an unknown quant_method, MXFP4 on a module the config lists in
            modules_to_not_convert).
    """
    if mtp:
        raise ValueError("mtp=True: gpt-oss has no multi-token-prediction layer")
    shard_model(None, mesh, moe_mode=moe_mode)  # one device only
    path = resolve_checkpoint(path, revision=revision, cache_dir=cache_dir)
    spec = QuantSpec.parse(quantize)
    cfg = GptOssConfig.from_json(os.path.join(path, CONFIG_FILE), dtype=jnp.dtype(dtype).name)
    ckpt = Checkpoint(path)
    reader = _Reader(cfg, ckpt, spec)
    model = GptOssForCausalLM.abstract(cfg)
    table = loader.weight_table(NAMES, cfg)
    bar = progress_bar(
        range(len(table) + cfg.num_hidden_layers),
        desc=f"loading {os.path.basename(path)}",
        unit="weight",
        enabled=progress,
    )
    try:
        for entry in table:
            value = reader.float(_tensor_name(entry), entry.shape)
            if value is not None:
                _variable(model, entry).set_value(jnp.asarray(value, cfg.dtype))
            bar.update(1)
        for layer in range(cfg.num_hidden_layers):
            read = reader.experts(layer)
            if read is not None:
                w13, w2, b13, b2 = read
                experts = Experts(cfg, rngs=None, w13=w13, w2=w2, w13_bias=b13, w2_bias=b2,
                                  implementation=implementation)  # fmt: skip
                set_module(model, ("model", "layers", layer, "mlp", "experts"), experts)
            bar.update(1)
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
        "loaded %s: gpt_oss, %d layers, experts %s",
        path,
        cfg.num_hidden_layers,
        reader.method or quantize or "float",
    )
    return model


SAVE_FORMATS = ("mxfp4",)


def save_pretrained(
    model: GptOssForCausalLM,
    path: str | os.PathLike,
    *,
    format: str = "mxfp4",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes the checkpoints' layout into the directory `path` (created): config.json, float
    tensors in the model dtype, MXFP4 experts as blocks and scales with gate and up rows
    interleaved (quantization_config {quant_method: mxfp4, modules_to_not_convert}), float
    experts as transformers keeps them; sharded with an index when `max_shard_bytes` is set.

    `format` is the registry's argument: "mxfp4", the layout the checkpoints ship.

    Raises:
        ValueError: another format, or quantized experts that are not MXFP4 (the Hub layout
            has no int4 / int8).
    """
    if format not in SAVE_FORMATS:
        raise ValueError(f"format={format!r} is not one of {SAVE_FORMATS} (gpt-oss's layout)")
    cfg = model.cfg
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for entry in loader.weight_table(NAMES, cfg):
        tensors[_tensor_name(entry)] = np.asarray(_variable(model, entry).get_value())
    wrote_mxfp4 = False
    for layer in range(cfg.num_hidden_layers):
        pre = f"model.layers.{layer}.{EXPERTS}"
        experts = model.model.layers[layer].mlp.experts
        tensors[f"{pre}.gate_up_proj_bias"] = mxfp4.interleave_gate_up(
            np.asarray(experts.w13_bias.get_value())
        )
        tensors[f"{pre}.down_proj_bias"] = np.asarray(experts.w2_bias.get_value())
        if experts.quantized:
            wrote_mxfp4 = True
            w13 = experts.weights.canonical_w13()
            w2 = wj.layouts.to_canonical_layout(experts.weights.w2.get())
            for proj, qe, rows in (("gate_up_proj", w13, True), ("down_proj", w2, False)):
                blocks, scales = mxfp4.to_blocks(qe)
                if rows:
                    blocks, scales = map(mxfp4.interleave_gate_up, (blocks, scales))
                tensors[f"{pre}.{proj}_blocks"], tensors[f"{pre}.{proj}_scales"] = blocks, scales
        else:
            w13 = np.asarray(experts.weights.canonical_w13())
            tensors[f"{pre}.gate_up_proj"] = mxfp4.interleave_gate_up(w13).transpose(0, 2, 1)
            tensors[f"{pre}.down_proj"] = np.asarray(experts.weights.w2.get_value()).transpose(
                0, 2, 1
            )
    config = cfg.to_hf_dict()
    config["torch_dtype"] = cfg.dtype
    if wrote_mxfp4:
        config["quantization_config"] = {
            "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT),
            "quant_method": "mxfp4",
        }
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    write_safetensors(path, tensors, max_shard_bytes)
    write_json(os.path.join(path, CONFIG_FILE), config)
