"""gpt-oss against HF transformers' own GptOssForCausalLM, through `models.load_pretrained`.

tests/fixtures/gpt_oss (made by tests/fixtures/make_gpt_oss.py) holds a tiny checkpoint in the
layout openai/gpt-oss-20b and -120b ship (MXFP4 routed experts, sharded index), its tokenizer
and chat template, and transformers' f32 logits and greedy tokens on it (loaded with
Mxfp4Config(dequantize=True)) and its rendering of a conversation.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend_cases import ALL_SCHEMES_ENV
from flax import nnx
from safetensors.numpy import load_file, save_file

import models
from models.common import tokenizer as tokenizer_module
from models.common.checkpoint import Checkpoint
from models.common.config import MXFP4
from models.common.modules import QuantizedLinear, RoutedExperts
from models.gpt_oss import GptOssConfig, GptOssForCausalLM, dequantize_model, init_random, route
from models.gpt_oss.modeling import window_mask
from models.gpt_oss.params import save_pretrained

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "gpt_oss"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(FIXTURE / "reference.npz"))


def _prompts(ref) -> list[list[int]]:
    """The reference's rows without their left padding."""
    mask = ref["attention_mask"].astype(bool)
    return [list(row[m]) for row, m in zip(ref["ids"], mask, strict=True)]


def _assert_logits(got, ref):
    """Within 1e-3 of the reference's largest logit on the real tokens (f32 against f32; the
    padded row's pad positions are not compared: transformers masks them differently)."""
    mask = ref["attention_mask"].astype(bool)
    want = ref["logits"][mask]
    err = np.abs(np.asarray(got)[mask] - want).max() / np.abs(want).max()
    assert err < 1e-3, err


def test_the_fixture_is_what_the_checks_need(ref):
    """Both kinds of layers, a window shorter than the prompts, I != H, experts past the clamp."""
    cfg = GptOssConfig.from_json(FIXTURE / "config.json")
    assert cfg.num_hidden_layers >= 4
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert cfg.sliding_window < ref["ids"].shape[1] - 3  # shorter than the padded row too
    assert cfg.intermediate_size != cfg.hidden_size
    assert ref["clamped_gate"] > 0.02 and ref["clamped_up"] > 0.02
    assert len(json.loads((FIXTURE / "model.safetensors.index.json").read_text())["weight_map"])


# ---- against transformers -------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_logits_and_greedy_tokens_match_transformers(ref, implementation):
    """The MXFP4 experts on each backend, served as models.prepare sets them up (a kernel
    that does not decode MXFP4 or add biases skips with the reason its selection gives). The
    Mosaic GPU kernels take bfloat16 activations only: `test_bf16_model_on_mgpu_matches_xla`
    and `test_bf16_checkpoint_on_mgpu_matches_xla_and_transformers`."""
    model = models.load_pretrained(FIXTURE, dtype=jnp.float32, progress=False)
    try:
        models.prepare(model, implementation=implementation, progress=False)
        logits = model(ref["ids"], ref["attention_mask"])
    except NotImplementedError as err:
        pytest.skip(str(err))
    _assert_logits(logits, ref)
    steps = ref["greedy"].shape[1] - ref["ids"].shape[1]
    tokens = models.generate(model, _prompts(ref), max_new_tokens=steps, eos_id=())
    np.testing.assert_array_equal(np.asarray(tokens)[:, -steps:], ref["greedy"][:, -steps:])


def test_decode_continues_the_prefill():
    """Prefill then decode of the rest gives the full forward's logits (left padding
    included), past the sliding window: the sliding layers' cache reads keep to the window."""
    cfg = GptOssConfig.tiny(sliding_window=3)
    model = GptOssForCausalLM(cfg, rngs=np.random.default_rng(3))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    mask = np.ones(ids.shape, bool)
    mask[1, :2] = False  # row 1 left-padded
    full = np.asarray(model(ids, mask))
    logits, cache = model.prefill(ids[:, :5], mask[:, :5], max_len=16)
    rest, _ = model.decode(ids[:, 5:], cache)
    np.testing.assert_allclose(np.asarray(logits), full[:, 4], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rest), full[:, 5:], rtol=1e-5, atol=1e-5)


def test_window_mask_keeps_the_last_window_slots(rng):
    mask = rng.random((2, 4, 9)) < 0.8
    for first in (0, 5):
        got = np.asarray(window_mask(jnp.asarray(mask), 3, first))
        q = first + np.arange(4)[:, None]
        k = np.arange(9)[None]
        np.testing.assert_array_equal(got, mask & (k > q - 3) & True)


def test_a_dominant_sink_silences_the_head(rng):
    """The sink takes its share of each head's softmax: a sink far above every score leaves the
    attention output at o_proj's bias."""
    cfg = GptOssConfig.tiny()
    model = GptOssForCausalLM(cfg, rngs=np.random.default_rng(1))
    attn = model.model.layers[0].self_attn
    x = jnp.asarray(rng.standard_normal((1, 6, cfg.hidden_size)), jnp.float32)
    mask = jnp.tril(jnp.ones((6, 6), bool))[None]
    cos = sin = jnp.ones((1, 6, cfg.head_dim), jnp.float32)
    attn.sinks.set_value(jnp.full((cfg.num_attention_heads,), 1e4, jnp.float32))
    out, _ = attn(x, cos=cos, sin=sin, mask=mask, mode="full")
    want = np.broadcast_to(np.asarray(attn.o_bias.get_value()), out.shape)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-6)


def test_route_is_a_softmax_over_the_top_k_logits(rng):
    cfg = GptOssConfig.tiny(num_local_experts=8, num_experts_per_tok=3)
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    w, ids = route(jnp.asarray(logits), cfg=cfg)
    want_ids = np.argsort(-logits, axis=-1)[:, :3]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    top = np.take_along_axis(logits, want_ids, axis=-1).astype(np.float64)
    want = np.exp(top - top.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(w), want / want.sum(-1, keepdims=True), rtol=1e-6)


# ---- loading and saving -----------------------------------------------------------------------


def test_save_pretrained_writes_the_checkpoint_back(tmp_path):
    """Loaded in the checkpoint's dtype and saved (sharded), every tensor comes back bit for bit:
    the MXFP4 blocks and scales with their gate / up rows interleaved again."""
    model = models.load_pretrained(FIXTURE, dtype=jnp.bfloat16, progress=False)
    save_pretrained(model, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    src, out = Checkpoint(FIXTURE), Checkpoint(tmp_path)
    assert sorted(src) == sorted(out)
    for name in src:
        a, b = np.asarray(src[name]), np.asarray(out[name])
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "mxfp4"
    assert GptOssConfig.from_hf_dict(saved) == GptOssConfig.from_json(FIXTURE / "config.json")


def test_a_hub_id_loads_the_model_and_its_tokenizer(ref, monkeypatch):
    """models.load_pretrained / load_tokenizer("openai/gpt-oss-20b") read what the Hub download
    returns (here the fixture: no network)."""
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kw):
        calls.append(repo_id)
        return str(FIXTURE)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model = models.load_pretrained("openai/gpt-oss-20b", dtype=jnp.float32, progress=False)
    _assert_logits(model(ref["ids"], ref["attention_mask"]), ref)
    tok = models.load_tokenizer("openai/gpt-oss-20b")
    assert tok.decode(tok.encode("The capital of France", add_bos=False)) == "The capital of France"
    assert calls == ["openai/gpt-oss-20b"] * 2


def _broken_copy(tmp_path, *, tensors=None, qcfg=None) -> pathlib.Path:
    """The fixture copied to tmp_path, with `tensors` (name -> array) replaced in their shard
    and quantization_config updated by `qcfg`."""
    out = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, value in (tensors or {}).items():
        shard = out / index[name]
        data = load_file(str(shard))
        data[name] = value
        save_file(data, str(shard), metadata={"format": "pt"})
    if qcfg is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"].update(qcfg)
        (out / "config.json").write_text(json.dumps(config))
    return out


def _bad_checkpoints():
    cfg = GptOssConfig.from_json(FIXTURE / "config.json")
    e, h, g = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size // 32  # down_proj
    name = "model.layers.1.mlp.experts.down_proj"
    u8 = lambda *s: np.zeros(s, np.uint8)  # noqa: E731
    return {
        "scales of the wrong shape": (
            dict(tensors={f"{name}_scales": u8(e, h, g + 1)}),
            rf"{name}_scales: U8 \[{e}, {h}, {g + 1}\], expected uint8 \[{e}, {h}, {g}\]",
        ),
        "blocks of a group of 64": (
            dict(
                tensors={f"{name}_blocks": u8(e, h, g // 2, 32), f"{name}_scales": u8(e, h, g // 2)}
            ),
            rf"{name}_blocks: U8 \[{e}, {h}, {g // 2}, 32\], expected uint8 \[E, N, K/32, 16\]",
        ),
        "an unknown quant_method": (
            dict(qcfg={"quant_method": "mxfp8"}),
            r"1 problem\(s\):\n  - quantization_config: quant_method='mxfp8' is not supported "
            r"\(supported: \['awq', 'compressed-tensors', 'fp8', 'gptq', 'mxfp4'\]\)$",
        ),
        "MXFP4 on a module not converted": (
            dict(qcfg={"modules_to_not_convert": ["model.layers.*.mlp.experts", "lm_head"]}),
            r"model.layers.0.mlp.experts.\{down_proj_blocks, down_proj_scales, "
            r"gate_up_proj_blocks, gate_up_proj_scales\}: MXFP4 tensors, but quantization_config."
            r"modules_to_not_convert lists model.layers.0.mlp.experts "
            r"\('model.layers.\*.mlp.experts'\)",
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_checkpoints()))
def test_a_checkpoint_that_is_not_what_it_says_is_refused(tmp_path, case):
    change, message = _bad_checkpoints()[case]
    path = _broken_copy(tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        models.load_pretrained(path, dtype=jnp.float32, progress=False)


# ---- tokenizer and chat template --------------------------------------------------------------


def test_the_chat_template_renders_as_transformers_does(monkeypatch):
    chat = json.loads((FIXTURE / "chat.json").read_text())
    date = datetime.date.fromisoformat(chat["date"])
    monkeypatch.setattr(tokenizer_module, "strftime_now", lambda fmt: date.strftime(fmt))
    template = tokenizer_module.load_chat_template(FIXTURE)
    assert template.render(chat["messages"]) == chat["text"]
    low = template.render(chat["messages"][1:2], reasoning_effort="low")
    assert low == chat["low_effort"]
    tok = models.load_tokenizer(FIXTURE)
    assert tok.encode(chat["text"], add_bos=False) == chat["ids"]
    assert tok.eos_id == GptOssConfig.from_json(FIXTURE / "config.json").eos_token_id[0]


# ---- presets ------------------------------------------------------------------------------------


def _param_count(cfg: GptOssConfig) -> int:
    """Parameters of the abstract model (nothing allocated), float experts."""
    cfg = dataclasses.replace(cfg, quant=None)
    model = nnx.eval_shape(lambda: GptOssForCausalLM(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize("name,billions", [("gpt-oss-20b", 20.91), ("gpt-oss-120b", 116.83)])
def test_presets_have_the_released_parameter_counts(name, billions):
    """The presets' shapes add up to the released models' parameter counts (OpenAI's model
    card: 20.91B and 116.83B, embedding and head included)."""
    assert round(_param_count(GptOssConfig.preset(name)) / 1e9, 2) == billions


# ---- MXFP4 routed experts in another family -------------------------------------------------


def test_a_deepseek_v3_model_with_mxfp4_experts_runs_the_same_path():
    """DeepSeek-V3's shape with MXFP4 routed experts (as DeepSeek-V4 ships them; the rest
    float): drawn at random, its experts run fused_moe on the E2M1 codes and match the model
    with the same weights dequantized."""
    from models.deepseek_v3 import DeepseekV3Config, init_random
    from models.deepseek_v3.modeling import dequantize_model

    cfg = DeepseekV3Config.tiny(quant=MXFP4)
    model = init_random(cfg, seed=4, on_device=False, progress=False)
    experts = [m for _, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)]
    assert len(experts) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert all(m.w13.get().is_mxfp4 and m.w2.get().is_mxfp4 for m in experts)
    assert not any(isinstance(m, QuantizedLinear) for _, m in nnx.iter_modules(model))
    ids = np.random.default_rng(5).integers(3, cfg.vocab_size, (2, 7))
    got, want = np.asarray(model(ids)), np.asarray(dequantize_model(model)(ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    tokens = models.generate(model, ids, max_new_tokens=3, eos_id=())
    assert np.asarray(tokens).shape == (2, 10)


def test_the_presets_draw_mxfp4_experts_at_full_width():
    """gpt-oss-20b's preset (two layers here): MXFP4 routed experts [32, 2 * 2880, 2880] with
    uint8 scales, everything else float."""
    cfg = GptOssConfig.preset("gpt-oss-20b", num_hidden_layers=2)
    model = nnx.eval_shape(lambda: GptOssForCausalLM(cfg, rngs=nnx.Rngs(0)))
    w13 = model.model.layers[0].mlp.experts.weights.w13
    assert (w13.shape, w13.codes, w13.group_size) == ((32, 5760, 2880), "e2m1", 32)
    assert w13.scales.get_value().dtype == jnp.uint8
    assert not any(isinstance(m, QuantizedLinear) for _, m in nnx.iter_modules(model))


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_mxfp4_experts_match_their_dequantized_twin(implementation):
    """A random MXFP4 model on each backend against the same weights dequantized (float
    experts, `float_moe`): fused_moe's biases and clamped swiglu on the E2M1 codes. H and I are
    multiples of 128 (the kernels' widest k-tile); a kernel that does not take MXFP4 or biases
    skips with its selection's reason."""
    cfg = GptOssConfig.tiny(hidden_size=128, intermediate_size=256, quant=MXFP4)
    model = init_random(cfg, seed=6)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, 9))
    want = np.asarray(dequantize_model(model)(ids))
    try:
        models.prepare(model, implementation=implementation, progress=False)
        got = np.asarray(model(ids))
    except NotImplementedError as err:
        pytest.skip(str(err))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---- the Mosaic GPU kernels (interpreted): bfloat16 activations only -----------------------

# A bf16 model on the Mosaic GPU kernels against the same model on 'xla', norm-wise: the kernels
# round GEMM1's activation to bf16 before GEMM2 ('xla' keeps it in f32) and the roundings compound
# over the layers (the bf16 model tolerance of tests/test_deepseek_v3_common.py; measured 0.6%
# on the 2-layer model below, 1.1% on the fixture).
BF16_MODEL_TOL = 5e-2


def test_bf16_model_on_mgpu_matches_xla():
    """A random bf16 model with MXFP4 experts on 'mgpu_interpret' (the mgpu_int4 layout;
    the experts' biases and clamped SwiGLU in the GEMMs' epilogues) against the same model
    on 'xla'."""
    cfg = GptOssConfig.tiny(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, quant=MXFP4,
        dtype="bfloat16",
    )  # fmt: skip
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 5))
    logits = {}
    for implementation in ("xla", "mgpu_interpret"):
        model = init_random(cfg, seed=6)
        models.prepare(model, implementation=implementation, progress=False)
        logits[implementation] = np.asarray(model(ids), np.float64)
    experts = model.model.layers[0].mlp.experts
    assert experts.weights.layout == "mgpu_int4"
    for bias in (experts.w13_bias, experts.w2_bias):
        assert np.abs(np.asarray(bias.get_value(), np.float32)).min() > 0
    want, got = logits["xla"], logits["mgpu_interpret"]
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < BF16_MODEL_TOL, err


@pytest.mark.skipif(
    os.environ.get(ALL_SCHEMES_ENV) != "1",
    reason=f"the fixture on the Mosaic GPU interpreter takes ~2 min ({ALL_SCHEMES_ENV}=1 runs it)",
)
def test_bf16_checkpoint_on_mgpu_matches_xla_and_transformers(ref):
    """The checkpoint in bf16 on 'mgpu_interpret' against the same bf16 model on 'xla' (logits
    norm-wise, greedy tokens equal) and against transformers' f32 logits (norm-wise: a bf16
    model's distance from its f32 twin, measured 3.5% on both backends)."""
    mask = ref["attention_mask"].astype(bool)
    steps = ref["greedy"].shape[1] - ref["ids"].shape[1]
    logits, tokens = {}, {}
    for implementation in ("xla", "mgpu_interpret"):
        model = models.load_pretrained(FIXTURE, dtype=jnp.bfloat16, progress=False)
        models.prepare(model, implementation=implementation, progress=False)
        logits[implementation] = np.asarray(model(ref["ids"], ref["attention_mask"]))[mask]
        out = models.generate(model, _prompts(ref), max_new_tokens=steps, eos_id=())
        tokens[implementation] = np.asarray(out)[:, -steps:]
    want, got = logits["xla"].astype(np.float64), logits["mgpu_interpret"].astype(np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < BF16_MODEL_TOL
    hf = ref["logits"][mask]
    assert np.linalg.norm(got - hf) / np.linalg.norm(hf) < BF16_MODEL_TOL
    np.testing.assert_array_equal(tokens["mgpu_interpret"], tokens["xla"])


EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "generate.py"


def test_example_generates_from_the_checkpoint_with_its_presets(capsys):
    """examples/generate.py --model reads the gpt-oss checkpoint and generates; its --preset
    choices hold gpt-oss-20b and -120b at their released config with MXFP4 experts."""
    import helpers

    example = helpers.load_script(EXAMPLE, "example_generate", [EXAMPLE.parent])
    argv = ["--model", str(FIXTURE), "--dtype", "float32", "--max-new-tokens", "2"]
    assert example.main([*argv, "--no-warmup", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"model: {FIXTURE}" in out and "[0] tokens:" in out
    args = example.parse_args(["--preset", "gpt-oss-120b", "--layers", "2"])
    cfg = example.PRESETS[args.preset](num_hidden_layers=args.layers)
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers) == (128, 4, 2)
    assert cfg.quant == MXFP4 and example.PRESETS["gpt-oss-20b"]().num_local_experts == 32


def test_a_dequantized_checkpoint_loads_float_or_quantized_again(ref, tmp_path):
    """The experts dequantized and saved as transformers keeps float ones (gate_up_proj
    [E, H, 2I] interleaved, down_proj [E, I, H]) load back to the same logits, float or
    quantized again with quantize="mxfp4" (the weights are MXFP4 values: exact again)."""
    model = models.load_pretrained(FIXTURE, dtype=jnp.float32, progress=False)
    want = np.asarray(model(ref["ids"], ref["attention_mask"]))
    save_pretrained(dequantize_model(model), tmp_path)
    names = set(Checkpoint(tmp_path))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(n.endswith("_blocks") for n in names)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    for quantize in (None, "mxfp4"):
        again = models.load_pretrained(
            tmp_path, dtype=jnp.float32, quantize=quantize, progress=False
        )
        experts = again.model.layers[0].mlp.experts
        assert experts.quantized == (quantize == "mxfp4")
        got = np.asarray(again(ref["ids"], ref["attention_mask"]))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
