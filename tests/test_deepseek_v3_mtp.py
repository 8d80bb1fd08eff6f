"""The MTP draft layer: its forward against a float64 numpy pass of DeepSeek's math, its cache,
and its loading from every checkpoint format (FP8 included)."""

from __future__ import annotations

import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from test_deepseek_v3_common import assert_close, random_ids, tiny_config
from test_deepseek_v3_fp8 import FP8_CONFIG, FP8_LINEAR, _write, fp8_quantize, fp8_reference
from test_deepseek_v3_reference import _attention, _moe, _rms, _w, _yarn

from models.deepseek_v3 import QuantSpec, init_random, load_pretrained, save_pretrained
from models.deepseek_v3.modeling import FloatExperts, Linear, QuantizedLinear, dequantize_model
from models.deepseek_v3.mtp import MultiTokenPredictor, draft_logits, mtp_decode, mtp_prefill


@functools.cache
def mtp_model(seed: int = 0, **overrides):
    """A random tiny model with its MTP layer, cached (read-only in tests)."""
    return init_random(tiny_config(num_nextn_predict_layers=1, **overrides), seed=seed)


@functools.partial(nnx.jit, static_argnames="max_len")
def _mtp_prefill(model, hidden, next_ids, mask, *, max_len):
    g, cache = mtp_prefill(model, hidden, next_ids, mask, max_len=max_len)
    return g, draft_logits(model, g), cache


@nnx.jit
def _mtp_decode(model, hidden, next_ids, cache):
    g, cache = mtp_decode(model, hidden, next_ids, cache)
    return g, draft_logits(model, g), cache


def _mtp_inputs(rng, cfg, b=2, s=7):
    hidden = rng.standard_normal((b, s, cfg.hidden_size)).astype(np.float32)
    return hidden, random_ids(rng, (b, s), cfg)


def reference_mtp(model, hidden, next_ids) -> tuple[np.ndarray, np.ndarray]:
    """float64 (g [B, S, H], logits [B, S, V]) of a float model's MTP layer (no quantized
    modules), DeepSeek's math: eh_proj([enorm(embed(next)); hnorm(hidden)]), one decoder layer,
    then the shared head's norm and the model's head."""
    cfg, m = model.cfg, model.mtp
    eps = cfg.rms_norm_eps
    inv_freq, factor = _yarn(cfg)
    freqs = np.arange(next_ids.shape[1])[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * factor, np.sin(emb) * factor
    e = _w(model.model.embed_tokens)[next_ids]
    h = np.asarray(hidden, np.float64)
    x = np.concatenate([_rms(e, _w(m.enorm), eps), _rms(h, _w(m.hnorm), eps)], -1)
    x = x @ _w(m.eh_proj).T
    x = x + _attention(cfg, m.self_attn, _rms(x, _w(m.input_layernorm), eps), cos, sin)
    y = _rms(x, _w(m.post_attention_layernorm), eps)
    b, s, hd = y.shape
    x = x + _moe(cfg, m.mlp, y.reshape(b * s, hd)).reshape(b, s, hd)
    logits = _rms(x, _w(m.shared_head.norm), eps) @ _w(model.lm_head).T
    return x, logits


def test_mtp_layer_matches_numpy_reference(rng):
    model = mtp_model()
    assert isinstance(model.mtp, MultiTokenPredictor)
    assert isinstance(model.mtp.self_attn.o_proj, QuantizedLinear)  # quantized as cfg.quant
    fmodel = dequantize_model(model)  # the MTP layer's weights as float arrays too
    assert isinstance(fmodel.mtp.mlp.experts, FloatExperts)
    hidden, next_ids = _mtp_inputs(rng, model.cfg)
    mask = np.ones(next_ids.shape, bool)
    g, logits, _ = _mtp_prefill(model, hidden, next_ids, mask, max_len=8)
    want_g, want_logits = reference_mtp(fmodel, hidden, next_ids)
    assert_close(g, want_g, "f32_vs_f64")
    assert_close(logits, want_logits, "f32_vs_f64")


def test_mtp_decode_continues_its_prefill(rng):
    """The layer's cache: a prefill of 4 positions, then 3 decoded at once, gives the outputs
    of a prefill of all 7 (absorbed against expanded attention: f32 reordering)."""
    model = mtp_model()
    hidden, next_ids = _mtp_inputs(rng, model.cfg)
    mask = np.ones(next_ids.shape, bool)
    g_all, logits_all, _ = _mtp_prefill(model, hidden, next_ids, mask, max_len=8)
    _, _, cache = _mtp_prefill(model, hidden[:, :4], next_ids[:, :4], mask[:, :4], max_len=8)
    g, logits, cache = _mtp_decode(model, hidden[:, 4:], next_ids[:, 4:], cache)
    assert int(cache.index) == 7
    assert_close(g, g_all[:, 4:], "f32_reordered")
    assert_close(logits, logits_all[:, 4:], "f32_reordered")


# ---- loading --------------------------------------------------------------------------------

# format -> tiny model overrides: the round trips of test_deepseek_v3_params, with the layer.
FORMATS = {
    "bf16": dict(dtype="bfloat16", quant=None),
    "awq": dict(),
    "gptq": dict(quant=QuantSpec(bits=8, group_size=32, has_zp=False)),
    "compressed-tensors": dict(),
}


def _draft_logits_of(model, rng):
    hidden, next_ids = _mtp_inputs(rng, model.cfg)
    hidden = jnp.asarray(hidden, model.cfg.dtype)
    _, logits, _ = _mtp_prefill(model, hidden, next_ids, np.ones(next_ids.shape, bool), max_len=8)
    return np.asarray(logits)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_mtp_layer_round_trips_through_each_format(fmt, tmp_path, rng):
    """save_pretrained writes the layer as layer num_hidden_layers in the format; loading it
    with mtp=True gives the same layer (identical draft logits), without mtp none."""
    model = mtp_model(**FORMATS[fmt])
    save_pretrained(model, tmp_path, format=fmt)
    n = model.cfg.num_hidden_layers
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    for name in ("eh_proj", "embed_tokens", "shared_head.head"):  # the last two: copies
        assert f"model.layers.{n}.{name}.weight" in names
    assert any(name.startswith(f"model.layers.{n}.mlp.experts.15.down_proj.") for name in names)
    loaded = load_pretrained(tmp_path, dtype=model.cfg.dtype, mtp=True, progress=False)
    assert type(loaded.mtp.self_attn.o_proj) is type(model.mtp.self_attn.o_proj)
    assert type(loaded.mtp.mlp.experts) is type(model.mtp.mlp.experts)
    rng_state = rng.bit_generator.state
    want = _draft_logits_of(model, rng)
    rng.bit_generator.state = rng_state
    np.testing.assert_array_equal(_draft_logits_of(loaded, rng), want)
    assert load_pretrained(tmp_path, dtype=model.cfg.dtype, progress=False).mtp is None


def test_mtp_layer_loads_from_fp8(tmp_path, rng):
    """An FP8 checkpoint (the official layout; the layer's linears, eh_proj included, in FP8)
    loads the layer with its linears kept float: the float64 products rounded once; quantized
    on load (int4) its linears and experts become WNA16 modules."""
    model = mtp_model(dtype="bfloat16", quant=None)
    save_pretrained(model, tmp_path / "bf16", format="bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    n = model.cfg.num_hidden_layers
    eh = f"model.layers.{n}.eh_proj"
    fp8_names = [name for name in tensors if FP8_LINEAR.search(name)] + [f"{eh}.weight"]
    assert sum(name.startswith(f"model.layers.{n}.") for name in fp8_names) > 50
    for name in fp8_names:
        q, s = fp8_quantize(tensors[name])
        tensors[name] = q
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = s
    hf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    hf["quantization_config"] = FP8_CONFIG
    _write(tmp_path / "fp8", tensors, hf)

    kept = load_pretrained(
        tmp_path / "fp8",
        dtype=jnp.float32,
        quantize=QuantSpec(targets=()),
        mtp=True,
        progress=False,
    )
    for prefix, module in [
        (eh, kept.mtp.eh_proj),
        (f"model.layers.{n}.self_attn.q_b_proj", kept.mtp.self_attn.q_b_proj),
    ]:
        assert isinstance(module, Linear)
        want = fp8_reference(tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_inv"])
        np.testing.assert_array_equal(
            np.asarray(module.weight.get_value()), want.astype(np.float32)
        )
    w2 = np.asarray(kept.mtp.mlp.experts.w2.get_value())  # [E, H, I]
    prefix = f"model.layers.{n}.mlp.experts.5.down_proj"
    want = fp8_reference(tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_inv"])
    np.testing.assert_array_equal(w2[5], want.astype(np.float32))

    quantized = load_pretrained(tmp_path / "fp8", dtype=jnp.float32, mtp=True, progress=False)
    assert isinstance(quantized.mtp.self_attn.q_b_proj, QuantizedLinear)
    assert quantized.mtp.mlp.experts.w13.get().bits == 4
    assert isinstance(quantized.mtp.eh_proj, Linear)  # not a quantization target: float


def test_mtp_loading_refuses_a_config_without_the_layer(tmp_path):
    save_pretrained(init_random(tiny_config(), seed=0), tmp_path, format="awq")
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        load_pretrained(tmp_path, mtp=True, progress=False)


def test_mtp_loading_names_the_missing_tensors(tmp_path):
    """A config that says the layer exists, a checkpoint without it: every missing tensor of
    layer num_hidden_layers is named at once."""
    model = init_random(tiny_config(), seed=0)
    save_pretrained(model, tmp_path, format="awq")
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.enorm\.weight: missing") as err:
        load_pretrained(tmp_path, mtp=True, progress=False)
    assert "model.layers.3.eh_proj.weight: missing" in str(err.value)
    assert load_pretrained(tmp_path, progress=False).mtp is None  # opt-in: loads without it
