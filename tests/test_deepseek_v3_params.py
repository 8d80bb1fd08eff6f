"""HF checkpoint loading and saving: round trips per format, quantize-on-load, one error."""

from __future__ import annotations

import json
import logging
import os

import helpers
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_deepseek_v3_common import (
    assert_close,
    logits_of,
    random_ids,
    tiny_model,
    v2_lite_tiny,
)

import wna16_jax as wj
from models.deepseek_v3 import (
    ByteTokenizer,
    QuantSpec,
    init_random,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
)
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.modeling import FloatExperts, Linear, QuantizedLinear, RoutedExperts

# (format, model variant, shard the files): every format, int4 / int8, with and without zero
# points, single-file and sharded checkpoints.
ROUND_TRIPS = {
    "awq-int4-zp": ("awq", dict(), False),
    "gptq-int4-zp-sharded": ("gptq", dict(), True),
    "ct-int4-zp": ("compressed-tensors", dict(), False),
    "gptq-int8-sym": ("gptq", dict(quant=QuantSpec(bits=8, group_size=32, has_zp=False)), False),
    "ct-int8-sym-sharded": (
        "compressed-tensors",
        dict(quant=QuantSpec(bits=8, group_size=32, has_zp=False)),
        True,
    ),
    "bf16-float": ("bf16", dict(dtype="bfloat16", quant=None), False),
    "awq-int4-tied-embeddings": ("awq", dict(tie_word_embeddings=True), False),
}


def _logits(model, ids):
    return np.asarray(logits_of(model, ids, np.ones(ids.shape, bool)))


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_save_load_round_trip_gives_identical_logits(case, tmp_path, rng):
    fmt, overrides, sharded = ROUND_TRIPS[case]
    model = tiny_model(**overrides)
    save_pretrained(model, tmp_path, format=fmt, max_shard_bytes=40_000 if sharded else None)
    files = sorted(os.listdir(tmp_path))
    if sharded:
        assert "model.safetensors.index.json" in files and len(files) > 3
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "deepseek_v3"
    if fmt != "bf16":
        assert hf["quantization_config"]["quant_method"] == fmt
    loaded = load_pretrained(tmp_path, dtype=model.cfg.dtype, progress=False)
    assert loaded.cfg == model.cfg
    assert type(loaded.model.layers[1].mlp.experts) is type(model.model.layers[1].mlp.experts)
    assert (loaded.lm_head is None) == model.cfg.tie_word_embeddings
    ids = random_ids(rng, (2, 8), model.cfg)
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(model, ids))


def _act_order_gptq(model, path, rng, *, unlike_up: bool = False):
    """`model` saved as GPTQ at `path`, then every quantized linear made act-order (desc_act):
    a random g_idx of G inputs per group, one per expert's gate and up (unless unlike_up),
    down its own. Returns the tensors."""
    save_pretrained(model, path, format="gptq")
    tensors = load_file(str(path / "model.safetensors"))
    hf = json.loads((path / "config.json").read_text())
    group = hf["quantization_config"]["group_size"]
    for name in sorted(n for n in tensors if n.endswith(".g_idx")):  # gate_proj before up_proj
        gate = name.replace("up_proj", "gate_proj")
        if name != gate and not unlike_up:
            tensors[name] = tensors[gate]
        else:
            k = tensors[name].shape[0]
            tensors[name] = rng.permutation(np.arange(k) // group).astype(np.int32)
    hf["quantization_config"]["desc_act"] = True
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf))
    return tensors


def test_gptq_act_order_checkpoint(tmp_path, rng):
    """A GPTQ desc_act checkpoint, every linear act-order: it loads (the routed experts' down
    order folded into w13's rows, w13's kept as its input permutation) and computes what the
    float model of its weights, decoded straight from the tensors, computes."""
    model = tiny_model()
    tensors = _act_order_gptq(model, tmp_path / "gptq", rng)
    hf = json.loads((tmp_path / "gptq" / "config.json").read_text())
    bits = hf.pop("quantization_config")["bits"]
    floats = {n: v for n, v in tensors.items() if not n.endswith(("qweight", "qzeros", "scales"))}
    floats = {n: v for n, v in floats.items() if not n.endswith(".g_idx")}
    for name in (n for n in tensors if n.endswith(".qweight")):
        prefix = name.removesuffix(".qweight")
        parts = (tensors[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx"))
        floats[f"{prefix}.weight"] = helpers.numpy_gptq_weight(*parts, bits).astype(np.float32)
    (tmp_path / "float").mkdir()
    save_file(floats, str(tmp_path / "float" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "float" / "config.json").write_text(json.dumps(hf))

    loaded = load_pretrained(tmp_path / "gptq", dtype=jnp.float32, progress=False)
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, RoutedExperts)
    assert experts.w13.get().has_perm and not experts.w2.get().has_perm
    want = load_pretrained(tmp_path / "float", dtype=jnp.float32, progress=False)
    assert isinstance(want.model.layers[1].mlp.experts, FloatExperts)
    ids = random_ids(rng, (2, 8), model.cfg)
    assert_close(_logits(loaded, ids), _logits(want, ids), "f32_reordered")
    # Saved again (desc_act, the input orders as g_idx), it loads the same model.
    save_pretrained(loaded, tmp_path / "again", format="gptq")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["quantization_config"]["desc_act"] is True
    again = load_pretrained(tmp_path / "again", dtype=jnp.float32, progress=False)
    np.testing.assert_array_equal(_logits(again, ids), _logits(loaded, ids))


def test_gptq_act_order_errors_name_the_tensor(tmp_path, rng):
    """An expert whose up_proj g_idx differs from its gate_proj's (w13 reads one input order)
    and a g_idx whose groups are not G inputs each are refused, naming the tensor."""
    tensors = _act_order_gptq(tiny_model(), tmp_path, rng, unlike_up=True)
    bad = "model.layers.2.self_attn.o_proj.g_idx"
    tensors[bad][tensors[bad] == 0] = 1
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path, dtype=jnp.float32, progress=False)
    msg = str(err.value)
    assert "model.layers.1.mlp.experts.0.up_proj: its act-order g_idx orders the inputs" in msg
    assert "model.layers.2.self_attn.o_proj: " in msg and "g_idx must assign exactly" in msg


def test_v2_lite_style_checkpoint(tmp_path, rng):
    """q_proj without LoRA, softmax greedy routing without a bias, 2 shared experts."""
    model = init_random(v2_lite_tiny(), seed=3)
    save_pretrained(model, tmp_path, format="awq")
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["q_lora_rank"] is None and hf["topk_method"] == "greedy"
    names = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.self_attn.q_proj.qweight" in names
    assert not any("e_score_correction_bias" in n for n in names)
    loaded = load_pretrained(tmp_path, dtype=jnp.float32, progress=False)
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias is None
    ids = random_ids(rng, (2, 8), model.cfg)
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(model, ids))


def test_hub_id_downloads_only_the_files_loading_reads(tmp_path, monkeypatch):
    """load_pretrained("org/name"): huggingface_hub.snapshot_download with the revision, the
    cache directory and only the config, safetensors, generation and tokenizer files; the
    model loads from the directory it returns."""
    import huggingface_hub

    model = tiny_model()
    save_pretrained(model, tmp_path / "snapshot", format="awq")
    calls = []

    def fake_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    loaded = load_pretrained(
        "org/tiny-v3", revision="v1", cache_dir=tmp_path / "c", dtype=jnp.float32, progress=False
    )
    ((repo_id, kw),) = calls
    assert repo_id == "org/tiny-v3" and kw["revision"] == "v1" and kw["cache_dir"] == tmp_path / "c"
    assert set(kw["allow_patterns"]) == {
        "config.json", "model.safetensors.index.json", "*.safetensors",
        "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tiktoken.model",
        "chat_template.jinja",
    }  # fmt: skip
    ids = random_ids(np.random.default_rng(0), (1, 6), model.cfg)
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(model, ids))


def test_hub_id_offline_reads_the_cache(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1: a repository in the Hub's cache layout loads without the network; one
    that is not cached fails naming the id; a path that is neither a directory nor an id says
    so."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    commit = "0" * 40
    repo = tmp_path / "models--org--tiny"
    save_pretrained(tiny_model(), repo / "snapshots" / commit, format="awq")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    loaded = load_pretrained("org/tiny", cache_dir=tmp_path, dtype=jnp.float32, progress=False)
    assert loaded.cfg == tiny_model().cfg
    with pytest.raises(FileNotFoundError, match="org/absent: not a local directory"):
        load_pretrained("org/absent", cache_dir=tmp_path, progress=False)
    with pytest.raises(FileNotFoundError, match="no such directory, and not a Hugging Face"):
        load_pretrained(tmp_path / "no" / "such" / "dir", progress=False)


def _saved(tmp_path):
    save_pretrained(tiny_model(), tmp_path, format="awq")
    return tmp_path


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (lambda d: d.write_text("{not json"), ValueError, r"config\.json is not valid JSON"),
        (lambda d: d.write_text("[1, 2]"), ValueError, r"config\.json holds a JSON list"),
        (
            lambda d: d.write_text(
                json.dumps(json.loads(d.read_text()) | {"hidden_size": "64", "use_x": 1})
            ),
            ValueError,
            r"config\.json: invalid DeepSeek config: hidden_size='64' must be an int",
        ),
        (
            lambda d: d.write_text(json.dumps(json.loads(d.read_text()) | {"rms_norm_eps": True})),
            ValueError,
            "rms_norm_eps=True must be a number",
        ),
    ],
    ids=["not_json", "not_object", "string_int", "bool_float"],
)
def test_malformed_config_names_the_file(tmp_path, edit, error, message):
    """A config.json that is not JSON, not an object, or has a field of the wrong type: one
    error naming the file and the field, before any weight is read."""
    path = _saved(tmp_path)
    edit(path / "config.json")
    with pytest.raises(error, match=message):
        load_pretrained(path, progress=False)
    with pytest.raises(error, match=message):
        DeepseekV3Config.from_json(path)


def test_truncated_or_missing_shard_names_the_file(tmp_path):
    """A safetensors file cut short (an interrupted download) or listed in the index but
    missing: the error names the file."""
    path = _saved(tmp_path)
    (shard,) = path.glob("*.safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{shard.name} cannot be read as safetensors"):
        load_pretrained(path, progress=False)
    shard.write_bytes(data)
    index = {"metadata": {}, "weight_map": {name: "model-00002.safetensors"
                                            for name in load_file(shard)}}  # fmt: skip
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002.safetensors is missing"):
        load_pretrained(path, progress=False)
    (path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="has no 'weight_map' object"):
        load_pretrained(path, progress=False)


@pytest.mark.parametrize(
    "tensor",
    ["model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.0.self_attn.q_a_proj.weight"],
)
def test_quantize_on_load_names_a_non_finite_tensor(tmp_path, tensor):
    """A NaN in a float checkpoint's tensor that is quantized on load: the error names the
    tensor (int4 would hide it in a finite scale); loading it unquantized keeps the NaN."""
    save_pretrained(tiny_model(dtype="bfloat16", quant=None), tmp_path, format="bf16")
    (path,) = [p for p in tmp_path.glob("*.safetensors") if tensor in load_file(p)]
    tensors = load_file(path)
    tensors[tensor] = tensors[tensor].copy()
    tensors[tensor].flat[7] = np.nan
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{tensor!r} holds 1 non-finite value"):
        load_pretrained(tmp_path, dtype=jnp.float32, quantize="int4", progress=False)


def test_quantize_on_load(tmp_path):
    """A bf16 checkpoint quantized to int4 while loading: the targeted linears become WNA16,
    holding exactly the round-to-nearest codes of the float weights."""
    save_pretrained(tiny_model(dtype="bfloat16", quant=None), tmp_path, format="bf16")
    ref = load_pretrained(tmp_path, dtype=jnp.float32, progress=False)
    q = load_pretrained(tmp_path, dtype=jnp.float32, quantize="int4", progress=False)
    assert isinstance(ref.model.layers[1].mlp.experts, FloatExperts)
    assert isinstance(q.model.layers[1].mlp.experts, RoutedExperts)
    assert isinstance(q.model.layers[0].mlp.gate_proj, QuantizedLinear)
    assert isinstance(q.model.layers[0].self_attn.kv_b_proj, QuantizedLinear)
    assert isinstance(q.lm_head, Linear)  # embeddings, lm_head and router stay float
    # "int4" = asymmetric, group 128 (= H here): round to nearest, so every weight is within
    # half a step of its float value, with the scales / zero points of quantize_experts.
    w13 = q.model.layers[1].mlp.experts.w13.get()
    w = np.asarray(ref.model.layers[1].mlp.experts.w13.get_value())
    want = wj.quantize_experts(w, bits=4, group_size=128, has_zp=True)
    assert (w13.bits, w13.group_size) == (4, 128)
    np.testing.assert_array_equal(w13.zeros, want.zeros)
    np.testing.assert_array_equal(w13.scales, want.scales)
    err = np.abs(np.asarray(wj.dequantize_experts(w13)) - w)
    half_step = np.repeat(np.asarray(w13.scales), 128, axis=-1) / 2
    assert np.all(err <= half_step * (1 + 1e-5))
    kv_b = q.model.layers[0].self_attn.kv_b_proj.weight.get()
    # K = kv_lora_rank = 32 is not a multiple of 128: one group per row.
    assert kv_b.group_size == -1 and kv_b.shape == (1, 128, 32)


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("awq")
    save_pretrained(tiny_model(), path, format="awq")
    return path


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    hf = json.loads(open(os.path.join(src, "config.json")).read())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(hf)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)


def test_loading_errors_list_every_problem(awq_dir, tmp_path):
    def corrupt(t):
        del t["model.norm.weight"]  # missing float tensor
        del t["model.layers.2.mlp.experts.5.up_proj.qzeros"]  # missing quantized part
        t["model.layers.0.self_attn.kv_a_layernorm.weight"] = np.ones(7, np.float32)  # shape
        t["model.layers.1.mlp.gate.weight"] = t["model.layers.1.mlp.gate.weight"].astype(
            np.int32
        )  # dtype
        qw = t["model.layers.1.self_attn.o_proj.qweight"]
        t["model.layers.1.self_attn.o_proj.qweight"] = qw[:-8]  # K rows missing
        del t["model.layers.2.mlp.shared_experts.down_proj.qweight"]
        del t["model.layers.2.mlp.shared_experts.down_proj.qzeros"]
        del t["model.layers.2.mlp.shared_experts.down_proj.scales"]  # the whole layer gone

    _rewrite(awq_dir, tmp_path, corrupt)
    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path, progress=False)
    msg = str(err.value)
    assert "6 problem(s)" in msg, msg
    for name in (
        "model.norm.weight",
        "model.layers.2.mlp.experts.5.up_proj.qzeros",
        "model.layers.0.self_attn.kv_a_layernorm.weight: shape [7], expected [32]",
        "model.layers.1.mlp.gate.weight: dtype I32",
        "model.layers.1.self_attn.o_proj.qweight: shape [56, 16]",
        "model.layers.2.mlp.shared_experts.down_proj.weight: missing",
    ):
        assert name in msg, f"{name!r} not in:\n{msg}"


def test_unsupported_quantization_config(awq_dir, tmp_path):
    def bnb(hf):
        hf["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}

    _rewrite(awq_dir, tmp_path, edit_config=bnb)
    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path, progress=False)
    msg = str(err.value)
    assert "quant_method='bitsandbytes' is not supported" in msg
    assert "model.layers.1.mlp.experts.0.gate_proj" in msg  # and the layers it affects


def test_converter_errors_are_collected(awq_dir, tmp_path):
    """Problems only the format converter sees (scales of the wrong group count) are also
    reported together, naming each layer."""

    def bad_scales(t):
        for name in ("model.layers.1.self_attn.q_a_proj", "model.layers.2.mlp.experts.3.up_proj"):
            t[f"{name}.scales"] = np.concatenate([t[f"{name}.scales"]] * 2)

    _rewrite(awq_dir, tmp_path, bad_scales)
    with pytest.raises(ValueError) as err:
        load_pretrained(tmp_path, progress=False)
    msg = str(err.value)
    assert "2 problem(s)" in msg, msg
    assert "model.layers.1.self_attn.q_a_proj" in msg and "experts.3.up_proj" in msg


def test_mesh_must_be_a_mesh(awq_dir):
    # Loading onto a real mesh: tests/test_deepseek_v3_sharding.py (8 CPU devices).
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        load_pretrained(awq_dir, mesh=object(), progress=False)


def test_tokenizers(tmp_path, caplog):
    byte = ByteTokenizer()
    ids = byte.encode("héllo")
    assert ids[0] == byte.bos_id and byte.decode(ids) == "héllo"
    with caplog.at_level(logging.WARNING, logger="models.deepseek_v3"):
        assert isinstance(load_tokenizer(None), ByteTokenizer)  # a random model's: no warning
        assert not caplog.records
        assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # no tokenizer.json
    assert "has no tokenizer.json: using the byte-level fallback" in caplog.text
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    hf = load_tokenizer(tmp_path)
    assert hf.encode("hello world") == [2, 3]  # the file's post-processor adds no bos
    assert hf.encode("hello world", add_bos=True) == [0, 2, 3]
    assert hf.eos_id == 1 and hf.decode([2, 3]) == "hello world"
