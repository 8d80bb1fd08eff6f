"""DeepSeek-V3 with W8A8 routed experts: the model's activation_quant, W8A8 checkpoints.

The routed experts of a W8A8 model pass their `activation_quant` to fused_moe: the kernels'
logits are compared with the same model on the 'xla' oracle under the same activation
quantization (tests/test_w8a8.py's tolerances), and with the W8A16 model (the same weights,
16-bit activations) to show the quantization is applied. Checkpoints are synthetic
compressed-tensors W8A8 directories written as llm-compressor writes them: one config group
over every Linear with int8 weights per channel and input_activations, unpacked int8 weights,
static schemes with an input_scale per linear.
"""

from __future__ import annotations

import json
import logging
import re

import helpers
import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_deepseek_v3_common import logits_of, random_ids, tiny_config, tiny_model
from test_w8a8 import ELEMENT_SLACK, W8A8_VS_ORACLE, W8A8_VS_W8A16

import wna16_jax as wj
from models.deepseek_v3 import QuantSpec, load_pretrained, save_pretrained
from models.deepseek_v3.modeling import QuantizedLinear, RoutedExperts, dequantize_model

# The weights W8A8 kernels take: int8, one scale per output channel, symmetric.
W8A8_QUANT = QuantSpec(bits=8, group_size=-1, has_zp=False)
PER_TOKEN = wj.ActivationQuant("int8_per_token")
# About max|input| / 127 of the tiny model's experts (seed 0: x up to 3.9 entering GEMM1,
# silu(gate) * up up to 10 entering GEMM2), so that few activations clip; exact in float32 (the
# input_scale tensors' dtype: saved and loaded unchanged).
STATIC = wj.ActivationQuant("int8_static", gemm1_scale=0.03125, gemm2_scale=0.078125)
SCHEMES = {"per_token": PER_TOKEN, "static": STATIC}
MGPU = "mgpu" if jax.default_backend() == "gpu" else "mgpu_interpret"
PALLAS = "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"


def w8a8_model(aq, implementation="xla"):
    """The tiny model with int8 per-channel symmetric weights, its experts running `aq` on
    `implementation` (a copy: tiny_model is cached), in the layout that backend reads."""
    model = nnx.clone(tiny_model(quant=W8A8_QUANT))
    model.set_activation_quant(aq)
    model.set_implementation(implementation)
    layout = model.resolve_expert_layout("auto", implementation)
    if layout != "canonical":
        model.set_expert_layout(layout, progress=False)
    return model


def logits(model, rng) -> np.ndarray:
    ids = random_ids(rng, (2, 8), model.cfg)
    return np.asarray(logits_of(model, ids, np.ones(ids.shape, bool)))


def experts_of(model) -> list[RoutedExperts]:
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)]


# ---- the model ------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("implementation", [PALLAS, MGPU])
def test_w8a8_model_kernels_match_the_oracle(implementation, scheme):
    """The kernels' W8A8 logits equal the 'xla' oracle's under the same activation
    quantization, and differ from the W8A16 model's by the activation quantization error."""
    aq = SCHEMES[scheme]
    rng = np.random.default_rng(11)
    want = logits(w8a8_model(aq), rng)
    got = logits(w8a8_model(aq, implementation), np.random.default_rng(11))
    helpers.assert_finite_and_close(
        got, want, W8A8_VS_ORACLE[np.dtype(np.float32)], f"{implementation} W8A8 vs xla W8A8",
        slack=ELEMENT_SLACK, require_signal=True,
    )  # fmt: skip
    w8a16 = logits(w8a8_model(None), np.random.default_rng(11))
    rel = helpers.relative_error(want, w8a16)
    assert 0 < rel < W8A8_VS_W8A16, rel


def test_set_activation_quant():
    """None restores the W8A16 model exactly; the model refuses what fused_moe cannot run."""
    model = w8a8_model(PER_TOKEN)
    assert {m.activation_quant for m in experts_of(model)} == {PER_TOKEN}
    model.set_activation_quant(None)
    want = logits(tiny_model(quant=W8A8_QUANT), np.random.default_rng(3))
    np.testing.assert_array_equal(logits(model, np.random.default_rng(3)), want)
    with pytest.raises(ValueError, match="needs both static scales"):
        model.set_activation_quant(wj.ActivationQuant("int8_static"))
    with pytest.raises(ValueError, match="scheme='int8_per_tensor' is not one of"):
        model.set_activation_quant("int8_per_tensor")
    with pytest.raises(ValueError, match="has no quantized routed experts"):
        dequantize_model(model).set_activation_quant(PER_TOKEN)


def test_preferred_expert_layout_of_a_w8a8_model(monkeypatch):
    """The f32 model's W8A8 experts prefer mgpu_int8 where the Mosaic GPU backend runs W8A8
    (its GEMMs read int8 rows, whatever x's dtype; the interpreter stands in for 'mgpu', which
    needs an sm_90 GPU), as automatic selection then runs them; with 16-bit activations the
    same f32 experts stay canonical (the mgpu GEMM takes bfloat16 rows only)."""
    model = nnx.clone(tiny_model(quant=W8A8_QUANT))
    assert model.cfg.dtype == "float32"
    monkeypatch.setattr(
        wj._dispatch, "preferred_layouts", lambda: (("mgpu_int8", "mgpu_interpret"),)
    )
    assert model.preferred_expert_layout() == "canonical"
    model.set_activation_quant(PER_TOKEN)
    assert model.preferred_expert_layout() == "mgpu_int8"
    assert model.resolve_expert_layout("auto") == "mgpu_int8"


# ---- checkpoints ----------------------------------------------------------------------------


def _input_activations(aq) -> dict:
    static = aq.scheme == "int8_static"
    strategy = "tensor" if static else "token"
    return dict(num_bits=8, type="int", symmetric=True, strategy=strategy, dynamic=not static)


def write_w8a8_checkpoint(path, aq, rng) -> dict[str, wj.ActivationQuant]:
    """The tiny W8A8 model as an llm-compressor W8A8 checkpoint: one config group over every
    Linear with `aq`'s input_activations; a static scheme gets a random input_scale on every
    quantized linear. Returns {experts layer name: the ActivationQuant loading should give}."""
    model = w8a8_model(PER_TOKEN)
    save_pretrained(model, path, format="compressed-tensors")  # int-quantized, two groups
    hf = json.loads((path / "config.json").read_text())
    qcfg = hf["quantization_config"]
    group = qcfg["config_groups"]["group_1"]  # the class-name group: every Linear
    group["input_activations"] = _input_activations(aq)
    qcfg["config_groups"] = {"group_0": group}
    (path / "config.json").write_text(json.dumps(hf))
    tensors = load_file(path / "model.safetensors")
    want = {}
    for layer in range(tiny_config().first_k_dense_replace, tiny_config().num_hidden_layers):
        want[f"model.layers.{layer}.mlp.experts"] = aq
    if aq.scheme == "int8_static":
        scales = {}
        for name in [n.removesuffix(".weight_scale") for n in tensors if "weight_scale" in n]:
            scales[name] = rng.uniform(0.02, 0.05) * (2 if name.endswith("down_proj") else 1)
            tensors[f"{name}.input_scale"] = np.array([scales[name]], np.float32)
        for name in want:
            layer = {k: np.float32(v) for k, v in scales.items() if k.startswith(name + ".")}
            want[name] = wj.ActivationQuant(
                "int8_static",
                gemm1_scale=max(v for k, v in layer.items() if not k.endswith("down_proj")),
                gemm2_scale=max(v for k, v in layer.items() if k.endswith("down_proj")),
            )
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return want


def quantized_linears(model) -> list[str]:
    return [".".join(map(str, p)) for p, m in nnx.iter_modules(model)
            if isinstance(m, QuantizedLinear)]  # fmt: skip


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_w8a8_checkpoint_loads_and_round_trips(scheme, tmp_path, caplog):
    """Every MoE layer gets the checkpoint's ActivationQuant (static: the layer's largest
    input_scale of gate and up for GEMM1, of down for GEMM2), the non-expert linears are named
    in one warning, nothing is reported unused, and load(save(model)) gives the same model."""
    rng = np.random.default_rng(5)
    want = write_w8a8_checkpoint(tmp_path / "ckpt", SCHEMES[scheme], rng)
    with caplog.at_level(logging.WARNING, logger="models.deepseek_v3"):
        model = load_pretrained(tmp_path / "ckpt", dtype="float32", progress=False)
    got = {".".join(map(str, p)): m.activation_quant for p, m in nnx.iter_modules(model)
           if isinstance(m, RoutedExperts)}  # fmt: skip
    assert got == want
    linears = quantized_linears(model)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    found = re.search(
        rf"{len(linears)} quantized linears run with float32 activations although the "
        rf"checkpoint's quantization_config quantizes their inputs .* e\.g\. (\S+)$",
        warnings[0],
    )
    assert found and found.group(1) in linears, warnings[0]
    # The same weights in memory with the loaded activation quantization: identical logits.
    ref = w8a8_model(None)
    for m, aq in zip(experts_of(ref), want.values(), strict=True):
        m.activation_quant = aq
    logits_loaded = logits(model, np.random.default_rng(2))
    np.testing.assert_array_equal(logits_loaded, logits(ref, np.random.default_rng(2)))

    save_pretrained(model, tmp_path / "again", format="compressed-tensors")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="models.deepseek_v3"):
        again = load_pretrained(tmp_path / "again", dtype="float32", progress=False)
    assert not caplog.records  # written as run: the other linears with 16-bit activations
    assert [m.activation_quant for m in experts_of(again)] == list(want.values())
    np.testing.assert_array_equal(logits(again, np.random.default_rng(2)), logits_loaded)


def _edit_groups(path, groups: dict) -> None:
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"]["config_groups"] = groups
    (path / "config.json").write_text(json.dumps(hf))


@pytest.fixture(scope="module")
def per_token_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("w8a8")
    write_w8a8_checkpoint(path, PER_TOKEN, None)
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize(
    "target, message",
    [
        (
            r"re:model\.layers\.1\.mlp\.experts\..*",
            r"the routed experts' input_activations differ between layers \(int8_per_token: "
            r"model\.layers\.1\.mlp\.experts; none \(16-bit activations\): "
            r"model\.layers\.2\.mlp\.experts\)",
        ),
        (
            r"re:model\.layers\.2\.mlp\.experts\.3\.down_proj$",
            r"model\.layers\.2\.mlp\.experts: its experts' input_activations differ "
            r"\(none \(16-bit activations\) at model\.layers\.2\.mlp\.experts\.0\.gate_proj, "
            r"int8_per_token at model\.layers\.2\.mlp\.experts\.3\.down_proj\)",
        ),
    ],
    ids=["layers", "experts"],
)
def test_disagreeing_activation_schemes_are_refused(per_token_dir, tmp_path, target, message):
    """One activation scheme per model: layers (or one layer's experts) that differ are
    refused, named, before any weight is read."""
    path = _copy(per_token_dir, tmp_path / "ckpt")
    group = json.loads((path / "config.json").read_text())["quantization_config"]
    group = group["config_groups"]["group_0"]
    w8a8 = dict(group, targets=[target])
    w8a16 = dict(group, targets=["Linear"], input_activations=None)
    _edit_groups(path, {"group_0": w8a8, "group_1": w8a16})
    with pytest.raises(ValueError, match=message):
        load_pretrained(path, dtype="float32", progress=False)


def test_static_scheme_without_input_scale_names_it(per_token_dir, tmp_path):
    path = _copy(per_token_dir, tmp_path / "ckpt")
    group = json.loads((path / "config.json").read_text())["quantization_config"]
    group = group["config_groups"]["group_0"]
    _edit_groups(path, {"group_0": dict(group, input_activations=_input_activations(STATIC))})
    with pytest.raises(ValueError) as err:
        load_pretrained(path, dtype="float32", progress=False)
    msg = str(err.value)
    assert "2 problem(s)" in msg, msg  # one per MoE layer
    assert "model.layers.1.mlp.experts: static_input_scale: missing tensors" in msg
    assert "'model.layers.1.mlp.experts.0.gate_proj.input_scale'" in msg


def test_unread_input_scale_is_reported(per_token_dir, tmp_path, caplog):
    """An input_scale the model does not read (a dynamic scheme has no static scales) is
    reported as unused, as any other tensor would be: it is not covered by its layer's
    prefix."""
    path = _copy(per_token_dir, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.0.up_proj.input_scale"] = np.ones(1, np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="models.deepseek_v3"):
        load_pretrained(path, dtype="float32", progress=False)
    assert (
        "ignoring 1 tensors the model does not use: "
        "['model.layers.1.mlp.experts.0.up_proj.input_scale']" in caplog.text
    )


def test_save_refuses_what_the_format_cannot_say(tmp_path):
    model = w8a8_model(PER_TOKEN)
    for fmt in ("awq", "gptq"):
        with pytest.raises(ValueError, match=f"format='{fmt}' is weight-only"):
            save_pretrained(model, tmp_path / fmt, format=fmt)
    experts_of(model)[0].activation_quant = STATIC
    with pytest.raises(ValueError, match="activation quantization differs between layers"):
        save_pretrained(model, tmp_path / "mixed", format="compressed-tensors")
