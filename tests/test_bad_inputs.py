"""Bad inputs are refused by name: API arguments, token ids, tokenizer files, MTP decoding."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import models
import wna16_jax as wj
from models.common.tokenizer import load_chat_template

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FAMILIES = {"qwen3_moe": "qwen3_moe/float", "kimi_k2": "kimi_k2/float"}


@pytest.fixture(scope="module")
def moe_args():
    rng = np.random.default_rng(0)
    w13 = wj.quantize_experts(rng.standard_normal((2, 64, 128), np.float32), group_size=128)
    w2 = wj.quantize_experts(rng.standard_normal((2, 128, 32), np.float32), group_size=32)
    x = jnp.asarray(rng.standard_normal((3, 128), np.float32))
    ids = jnp.asarray(rng.integers(0, 2, (3, 1)), jnp.int32)
    return x, w13, w2, jnp.ones((3, 1), jnp.float32), ids


@pytest.mark.parametrize(
    "kw, error, match",
    [(dict(implementation=5), TypeError, "implementation=5 must be None"),
     (dict(implementation=["xla", 3]), TypeError, r"implementation=\['xla', 3\]"),
     (dict(out_dtype="foo"), ValueError, "out_dtype='foo' is not a dtype"),
     (dict(config={"block_m": 16}), TypeError, r"config=\{'block_m': 16\} is a dict")],
)  # fmt: skip
def test_fused_moe_names_a_bad_argument(moe_args, kw, error, match):
    with pytest.raises(error, match=match):
        wj.fused_moe(*moe_args, **kw)


def test_quantize_experts_refuses_float16_scales_that_overflow():
    w = np.random.default_rng(1).standard_normal((1, 8, 32)).astype(np.float32) * 1e6
    with pytest.raises(ValueError, match="overflows scale_dtype=float16"):
        wj.quantize_experts(w, group_size=32, scale_dtype=jnp.float16)
    with pytest.raises(TypeError, match="scale_dtype=int8 must be a floating dtype"):
        wj.quantize_experts(w, group_size=32, scale_dtype=jnp.int8)
    q = wj.quantize_experts(w, group_size=32, scale_dtype=jnp.float32)
    assert np.isfinite(np.asarray(wj.dequantize_experts(q))).all()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    return models.load_pretrained(FIXTURES / FAMILIES[request.param], dtype=jnp.float32,
                                  progress=False)  # fmt: skip


@pytest.mark.parametrize("bad", [-1, 2**32 + 3, "vocab"])
def test_direct_model_call_refuses_ids_outside_the_vocabulary(model, bad):
    vocab = model.cfg.vocab_size
    ids = np.array([[1, 2, 3, 4]], np.int64)
    bad = vocab if bad == "vocab" else bad
    ids[0, 2] = bad
    with pytest.raises(ValueError, match=rf"input_ids\[0, 2\]={bad} is outside the vocabulary"):
        model(ids)
    # padding (attention_mask 0) may hold any id
    ids[0, 2] = 5
    ids[0, 0] = -1
    logits = model(ids, attention_mask=np.array([[0, 1, 1, 1]]))
    assert np.isfinite(np.asarray(logits)[0, 1:]).all()
    with pytest.raises(TypeError, match="input_ids are float32"):
        model(np.ones((1, 3), np.float32))


def test_generate_names_a_bad_seed_and_a_missing_mtp_layer(model):
    with pytest.raises(ValueError, match=r"seed=18446744073709551616 is outside"):
        models.generate(model, [[1, 2]], max_new_tokens=1, seed=2**64)
    with pytest.raises(ValueError, match="has no MTP layer; drop speculative='mtp'"):
        models.generate(model, [[1, 2]], max_new_tokens=1, speculative="mtp")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_pretrained_refuses_an_integer_dtype(family):
    with pytest.raises(ValueError, match="dtype='int8' is not one of bfloat16"):
        models.load_pretrained(FIXTURES / FAMILIES[family], dtype=jnp.int8, progress=False)


@pytest.fixture
def kimi(tmp_path):
    pytest.importorskip("tiktoken", reason="tiktoken.model tokenizers need tiktoken")
    shutil.copytree(FIXTURES / "kimi_tokenizer", tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_empty_tiktoken_model_is_named(kimi):
    (kimi / "tiktoken.model").write_text("")
    with pytest.raises(ValueError, match="tiktoken.model holds no tokens"):
        models.load_tokenizer(kimi)


def test_truncated_tiktoken_model_is_refused(kimi):
    """Cut at a line boundary the ranks are still 0 .. n-1: the special tokens' ids, which
    follow the ranks, give it away."""
    lines = (kimi / "tiktoken.model").read_text().splitlines(keepends=True)
    (kimi / "tiktoken.model").write_text("".join(lines[:-10]))
    with pytest.raises(ValueError, match="tiktoken.model is truncated"):
        models.load_tokenizer(kimi)


def test_non_utf8_chat_template_is_named(kimi):
    (kimi / "chat_template.jinja").write_bytes(b"{{ bos_token }}\xff\xfe caf\xe9")
    with pytest.raises(ValueError, match="chat_template.jinja is not UTF-8 text"):
        load_chat_template(kimi)


def _copy_with(src: pathlib.Path, dst: pathlib.Path, edit_tensors=None, edit_config=None):
    """The checkpoint `src` copied to `dst`, its tensors and config.json edited in place."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(dst / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((dst / "config.json").read_text())
    if edit_config:
        edit_config(hf)
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def _poison(name: str, value: float):
    def edit(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].flat[3] = value

    return edit


@pytest.mark.parametrize(
    "checkpoint, tensor, value",
    [("qwen2_moe/float", "model.layers.0.input_layernorm.weight", np.nan),
     ("qwen2_moe/int4", "model.layers.0.mlp.experts.1.up_proj.scales", np.inf),
     ("kimi_k2/float", "model.norm.weight", np.nan),
     ("kimi_k2/int4", "model.layers.1.mlp.experts.0.down_proj.weight_scale", -np.inf)],
)  # fmt: skip
def test_a_non_finite_tensor_is_refused_by_name(tmp_path, checkpoint, tensor, value):
    path = _copy_with(FIXTURES / checkpoint, tmp_path, edit_tensors=_poison(tensor, value))
    with pytest.raises(ValueError, match=rf"'{tensor}' holds 1 non-finite value"):
        models.load_pretrained(path, dtype=jnp.float32, progress=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tied_embeddings_beside_a_different_head_are_refused(tmp_path, family):
    def tie(hf):
        hf["tie_word_embeddings"] = True

    path = _copy_with(FIXTURES / FAMILIES[family], tmp_path, edit_config=tie)
    with pytest.raises(ValueError, match="tie_word_embeddings is true, but lm_head.weight"):
        models.load_pretrained(path, dtype=jnp.float32, progress=False)


def test_unused_shared_expert_tensors_are_reported(tmp_path, caplog):
    """shared_expert_intermediate_size 0 beside shared-expert tensors: the loader names the
    tensors it leaves unread."""

    def no_shared(hf):
        hf["shared_expert_intermediate_size"] = 0

    path = _copy_with(FIXTURES / "qwen2_moe/float", tmp_path, edit_config=no_shared)
    with caplog.at_level(logging.WARNING):
        models.load_pretrained(path, dtype=jnp.float32, progress=False)
    assert "tensors the model does not use" in caplog.text
    assert "shared_expert" in caplog.text
