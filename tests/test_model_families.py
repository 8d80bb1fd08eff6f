"""Every family against HF transformers' own model classes, through `models.load_pretrained`.

The fixtures (tests/fixtures/<family>/{float,int4}, made by tests/fixtures/make_fixtures.py
from transformers' Qwen2MoeForCausalLM, Qwen3MoeForCausalLM and DeepseekV3ForCausalLM) hold a
tiny random checkpoint in the family's released layout, its int4 twin in the family's released
format (GPTQ float16 scales with g_idx; compressed-tensors pack-quantized group 32 symmetric
routed experts for Kimi-K2), and transformers' f32 logits and greedy tokens; the twins' on the
exactly dequantized weights.
"""

from __future__ import annotations

import json
import pathlib

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.common.modules import FloatExperts, Linear, QuantizedLinear, RoutedExperts
from models.qwen_moe import QwenMoeConfig, QwenMoeForCausalLM, init_random, route

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
FAMILIES = ("qwen2_moe", "qwen3_moe", "kimi_k2")


def _load(family: str, kind: str):
    path = FIXTURES / family / kind
    return models.load_pretrained(path, dtype=jnp.float32, progress=False), np.load(
        path / "reference.npz"
    )


def _assert_logits(got, want):
    """Within 1e-3 of the reference's largest logit (f32 against f32)."""
    err = np.abs(np.asarray(got) - want).max() / np.abs(want).max()
    assert err < 1e-3, err


@pytest.mark.parametrize("kind", ["float", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_transformers(family, kind):
    model, ref = _load(family, kind)
    _assert_logits(model(ref["ids"]), ref["logits"])
    steps = ref["greedy"].shape[1] - ref["ids"].shape[1]
    tokens = models.generate(model, ref["ids"], max_new_tokens=steps, eos_id=())
    np.testing.assert_array_equal(np.asarray(tokens), ref["greedy"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_int4_twin_runs_its_quantized_layers(family):
    """The twin's routed experts run fused_moe on the checkpoint's int4 weights; what its
    format quantizes (Qwen's GPTQ: every projection, Kimi-K2: the routed experts only) loads as
    QuantizedLinear, the rest as float layers."""
    model, _ = _load(family, "int4")
    experts = [
        m for _, m in nnx.iter_modules(model) if isinstance(m, (RoutedExperts, FloatExperts))
    ]
    assert experts and all(isinstance(m, RoutedExperts) for m in experts)
    assert {(m.w13.bits, m.w13.group_size) for m in experts} == {(4, 32)}
    quantized = {
        ".".join(map(str, p)) for p, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)
    }
    float_linears = {
        ".".join(map(str, p)) for p, m in nnx.iter_modules(model) if isinstance(m, Linear)
    }
    assert "lm_head" in float_linears
    if family == "kimi_k2":
        assert not quantized
    else:
        assert "model.layers.0.self_attn.q_proj" in quantized
    if family == "qwen2_moe":  # layer 1 is dense (mlp_only_layers); the others share an expert
        assert "model.layers.1.mlp.down_proj" in quantized
        assert "model.layers.0.mlp.shared_expert.up_proj" in quantized
        assert "model.layers.0.mlp.shared_expert_gate" in float_linears


def test_family_dispatch_by_model_type_and_architectures():
    assert models.family_of({"model_type": "kimi_k2"}) == "deepseek_v3"
    assert models.family_of({"model_type": "qwen3_moe"}) == "qwen_moe"
    assert models.family_of({"architectures": ["Qwen2MoeForCausalLM"]}) == "qwen_moe"
    with pytest.raises(ValueError, match=r"'llama'.*supported model types: \['deepseek_v2'"):
        models.family_of({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_an_unsupported_checkpoint_is_refused_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(ValueError, match="mixtral.*qwen3_moe"):
        models.load_pretrained(tmp_path)


def test_sparse_layers_follow_mlp_only_layers_and_the_step():
    cfg = QwenMoeConfig.tiny(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


def test_route_renormalizes_only_with_norm_topk_prob():
    logits = jax.random.normal(jax.random.key(0), (5, 8))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    for norm in (False, True):
        cfg = QwenMoeConfig.tiny(num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        w, ids = route(logits, cfg=cfg)
        want_ids = np.argsort(-probs, axis=-1)[:, :3]
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        want = np.take_along_axis(probs, want_ids, axis=-1)
        if norm:
            want = want / want.sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_decode_continues_the_prefill(model_type):
    """Prefill then decode of the rest gives the full forward's logits (left padding
    included): the key/value cache holds what the full pass attends to."""
    cfg = QwenMoeConfig.tiny(model_type=model_type, mlp_only_layers=(1,))
    model = init_random(cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7))
    mask = np.ones(ids.shape, bool)
    mask[1, :2] = False  # row 1 left-padded
    full = np.asarray(model(ids, mask))
    logits, cache = model.prefill(ids[:, :5], mask[:, :5], max_len=16)
    rest, _ = model.decode(ids[:, 5:], cache)
    np.testing.assert_allclose(np.asarray(logits), full[:, 4], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rest), full[:, 5:], rtol=1e-5, atol=1e-5)


def test_gptq_like_preset_is_int4_g128_symmetric_with_float16_scales():
    """The Qwen3-30B-A3B preset (full width, few layers here): int4 group 128 symmetric routed
    experts and linears with float16 scales, as the GPTQ-Int4 release."""
    cfg = QwenMoeConfig.preset("qwen3-30b-a3b", num_hidden_layers=1, vocab_size=512)
    model = nnx.eval_shape(lambda: QwenMoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, RoutedExperts)
    assert experts.w13.shape == (128, 2 * 768, 2048)
    assert (experts.w13.bits, experts.w13.group_size, experts.w13.zeros) == (4, 128, None)
    assert experts.w13.scales.get_value().dtype == jnp.float16
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.weight.shape == (1, 32 * 128, 2048)


# ---- on a mesh: 8 fake CPU devices (this file re-runs itself with them) ----------------------

NUM_DEVICES = 8


@pytest.fixture
def devices8():
    """The 8 devices, or a skip (the test below then re-runs this file with 8 CPU devices)."""
    return helpers.require_devices(NUM_DEVICES)


def test_rerun_the_mesh_tests_with_8_cpu_devices():
    print(helpers.run_file_with_cpu_devices(__file__, NUM_DEVICES, "-k", "on_a_mesh")[-2000:])


# (family, fixture, mesh): experts over `expert`; heads and the experts' I over `tensor` where
# the int4 groups of 32 allow it (the twins' I = 32 holds one group: no tensor split).
MESHES = [
    ("qwen2_moe", "float", dict(expert=2, tensor=2, data=2)),
    ("qwen2_moe", "int4", dict(expert=4, data=2)),
    ("qwen3_moe", "float", dict(expert=2, tensor=2, data=2)),
    ("qwen3_moe", "int4", dict(expert=4, data=2)),
    ("kimi_k2", "float", dict(expert=2, tensor=2, data=2)),
    ("kimi_k2", "int4", dict(expert=4, data=2)),
]


@pytest.mark.parametrize("family,kind,axes", MESHES, ids=lambda v: str(v))
def test_family_on_a_mesh(devices8, family, kind, axes):
    """Sharded (experts over `expert`, heads over `tensor`, batch over `data`), each family
    gives the unsharded model's logits and transformers' greedy tokens."""
    from models.common.sharding import make_mesh

    model, ref = _load(family, kind)
    want = np.asarray(model(ref["ids"]))
    mesh = make_mesh(**axes, devices=devices8)
    models.prepare(model, mesh=mesh)  # the family's shard_model, from the registry
    experts = next(
        m for _, m in nnx.iter_modules(model) if isinstance(m, (RoutedExperts, FloatExperts))
    )
    for leaf in jax.tree.leaves(nnx.state(experts)):  # every device holds a slice of E
        assert len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(model(ref["ids"])), want, rtol=1e-5, atol=1e-5)
    steps = ref["greedy"].shape[1] - ref["ids"].shape[1]
    tokens = models.generate(model, ref["ids"], max_new_tokens=steps, eos_id=())
    np.testing.assert_array_equal(np.asarray(tokens), ref["greedy"])


EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "generate.py"


@pytest.mark.parametrize("family", FAMILIES)
def test_example_generates_with_every_family(family, capsys):
    """examples/generate.py --model reads each family's int4 checkpoint (by its model_type)
    and generates."""
    example = helpers.load_script(EXAMPLE, "example_generate", [EXAMPLE.parent])
    path = FIXTURES / family / "int4"
    argv = ["--model", str(path), "--dtype", "float32", "--max-new-tokens", "2", "--no-warmup"]
    assert example.main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"model: {path}" in out and "[0] tokens:" in out and "fused_moe backend: 'xla'" in out


def test_example_presets_are_the_released_sizes():
    """--preset qwen3-30b-a3b is Qwen3-30B-A3B's config with GPTQ-like int4 (a config only:
    nothing is drawn), --layers keeps fewer layers."""
    example = helpers.load_script(EXAMPLE, "example_generate", [EXAMPLE.parent])
    args = example.parse_args(["--preset", "qwen3-30b-a3b", "--layers", "2"])
    cfg = example.PRESETS[args.preset](num_hidden_layers=args.layers)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim) == (
        "qwen3_moe",
        128,
        8,
        128,
    )
    assert cfg.num_hidden_layers == 2 and cfg.quant == models.qwen_moe.GPTQ_INT4
    kimi = example.PRESETS["kimi-k2"]()
    assert (kimi.n_routed_experts, kimi.n_group, kimi.first_k_dense_replace) == (384, 1, 1)


# ---- the registry and the serving call ------------------------------------------------------


def test_every_registered_family_describes_itself():
    """Each package of models.registry.FAMILY_PACKAGES registers a Family whose model is a
    CausalLM, whose model types and architectures lead back to it, and whose presets make its
    own config (a config only: nothing is drawn)."""
    from models import registry
    from models.common.causal_lm import CausalLM

    families = registry.families()
    assert tuple(families) == registry.FAMILY_PACKAGES
    for name, family in families.items():
        assert issubclass(family.model_class, CausalLM), name
        for model_type in family.model_types:
            assert models.family_of({"model_type": model_type}) == name
        for arch in family.architectures:
            assert models.family_of({"model_type": "unknown", "architectures": [arch]}) == name
        for preset, make in family.presets.items():
            cfg = make(num_hidden_layers=2)
            assert isinstance(cfg, family.config_class), preset
            assert registry.family_of_model(cfg) is family
        cfg = family.config_class.tiny()
        assert registry.family_of_model(family.model_class.abstract(cfg)) is family


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_prepare_is_the_ordered_calls(model_type):
    """models.prepare(model, ...) leaves the model as the four ordered calls it replaces
    (quantize_lm_head, set_batch_invariant, set_implementation, set_linear_implementation,
    set_expert_layout): the same modules and layouts, and logits equal to the last bit."""
    from models.common.config import QuantSpec

    cfg = QwenMoeConfig.tiny(model_type=model_type, quant=QuantSpec(bits=4, group_size=32))
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 6))
    prepared = models.prepare(
        init_random(cfg, seed=4),
        implementation="xla",
        linear_implementation="xla",
        expert_layout="canonical",
        quantize_lm_head="int8",
        progress=False,
    )
    by_hand = init_random(cfg, seed=4)
    by_hand.quantize_lm_head("int8")
    by_hand.set_batch_invariant(False)
    by_hand.set_implementation("xla")
    by_hand.set_linear_implementation("xla", progress=False)
    by_hand.set_expert_layout("canonical", progress=False)
    assert isinstance(prepared.lm_head, QuantizedLinear)
    assert prepared.lm_head.weight.bits == 8
    assert {m.implementation for m in prepared.routed_experts()} == {"xla"}
    assert nnx.graphdef(prepared) == nnx.graphdef(by_hand)
    np.testing.assert_array_equal(np.asarray(prepared(ids)), np.asarray(by_hand(ids)))


def test_prepare_converts_the_experts_layer_by_layer_losslessly():
    """A named kernel layout converts every routed-expert layer (one at a time) and back
    bit for bit; an unknown layout is refused with the known ones named."""
    import wna16_jax as wj
    from models.common.config import QuantSpec

    cfg = QwenMoeConfig.tiny(quant=QuantSpec(bits=4, group_size=32))
    model = init_random(cfg, seed=5)
    before = [jax.tree.map(np.asarray, m.w13.get()) for m in model.routed_experts()]
    layout = wj.backend_layout("mgpu_interpret", bits=4)
    models.prepare(model, expert_layout=layout, progress=False)
    assert {m.layout for m in model.routed_experts()} == {layout}
    for m, want in zip(model.routed_experts(), before, strict=True):
        got = jax.tree.map(np.asarray, m.canonical_w13())
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="expert_layout='tiles'.*canonical"):
        models.prepare(model, expert_layout="tiles")


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_save_pretrained_round_trips_every_family(family, fmt, tmp_path):
    """The loader engine writes any family's model (its name table read backwards): loading
    the saved directory gives the same quantized weights, hence the same logits exactly."""
    model, ref = _load(family, "int4")
    models.save_pretrained(model, tmp_path, format=fmt)
    again = models.load_pretrained(tmp_path, dtype=jnp.float32, progress=False)
    assert models.family_of(json.loads((tmp_path / "config.json").read_text())) == "qwen_moe"
    np.testing.assert_array_equal(np.asarray(again(ref["ids"])), np.asarray(model(ref["ids"])))
