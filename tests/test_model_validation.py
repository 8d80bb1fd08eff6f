"""Bad values at the model's boundaries: generate's arguments against the model, sampling at
extreme temperatures, checkpoint paths outside the checkpoint, a save over an earlier save."""

from __future__ import annotations

import json
import os

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_deepseek_v3_common import random_ids, tiny_model

from models.common.tokenizer import load_tokenizer
from models.deepseek_v3 import generate, load_pretrained, save_pretrained
from models.deepseek_v3.generate import MIN_TEMPERATURE, sample, sampling_kind

SETTINGS = hypothesis.settings(max_examples=20, deadline=None, derandomize=True)


# ---- generate's arguments ---------------------------------------------------------------------


def test_max_new_tokens_past_the_context_is_refused_before_compiling(monkeypatch):
    """Far past max_position_embeddings: a ValueError naming both, before any compile."""
    model = tiny_model()
    limit = model.cfg.max_position_embeddings
    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("compiled"))
    for new in (limit, 10**9, np.int64(limit - 1)):
        with pytest.raises(ValueError, match=f"max_new_tokens={new} .* max_position_embeddings="):
            generate(model, [[5, 6, 7]], max_new_tokens=new)


@pytest.mark.parametrize("name", ["eos_id", "pad_id"])
@pytest.mark.parametrize("value", [2.7, "2", True, [2.0]])
def test_a_non_integer_eos_or_pad_id_is_refused(name, value):
    with pytest.raises(TypeError, match=f"{name}.* must be an int"):
        generate(tiny_model(), [[5, 6, 7]], max_new_tokens=2, **{name: value})


@SETTINGS
@hypothesis.given(
    value=st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=2)),
)
def test_max_new_tokens_and_seed_refuse_non_integers(value):
    for name in ("max_new_tokens", "seed"):
        kwargs = dict(max_new_tokens=2) | {name: value}
        with pytest.raises(TypeError, match=f"{name}.* must be an int"):
            generate(tiny_model(), [[5, 6, 7]], **kwargs)


def test_numpy_integer_arguments_act_as_python_ints(rng):
    model = tiny_model()
    ids = random_ids(rng, (1, 4), model.cfg)
    want = generate(model, ids, max_new_tokens=3, eos_id=2, seed=1, pad_id=0)
    got = generate(
        model, ids, max_new_tokens=np.int64(3), eos_id=np.int32(2), seed=np.uint8(1),
        pad_id=np.int16(0),
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)


# ---- sampling at any temperature -------------------------------------------------------------


@SETTINGS
@hypothesis.given(
    temperature=st.one_of(
        st.floats(min_value=1e-45, max_value=MIN_TEMPERATURE, exclude_max=True),
        st.sampled_from((1e-45, 1e-38, 1e-30, 1e-10)),
    ),
    seed=st.integers(0, 2**16),
)
def test_a_tiny_temperature_samples_greedily(temperature, seed):
    """Below MIN_TEMPERATURE the choice is the argmax (never a sample from NaN)."""
    logits = jax.random.normal(jax.random.key(seed), (3, 50), jnp.float32) * 30
    kind = sampling_kind(temperature, 1.0)
    got = sample(logits, jax.random.key(seed + 1), temperature, 1.0, **kind)
    np.testing.assert_array_equal(got, jnp.argmax(logits, axis=-1))


def test_generate_at_temperature_1e_45_gives_the_greedy_tokens(rng):
    model = tiny_model()
    ids = random_ids(rng, (2, 4), model.cfg)
    greedy = generate(model, ids, max_new_tokens=3)
    np.testing.assert_array_equal(generate(model, ids, max_new_tokens=3, temperature=1e-45), greedy)


@SETTINGS
@hypothesis.given(
    temperature=st.floats(min_value=MIN_TEMPERATURE, max_value=1e30),
    top_p=st.sampled_from((1.0, 0.9, 1e-6)),
)
def test_sampling_stays_in_the_vocabulary_for_any_temperature(temperature, top_p):
    logits = jax.random.normal(jax.random.key(0), (4, 50), jnp.float32) * 30
    kind = sampling_kind(temperature, top_p)
    got = np.asarray(sample(logits, jax.random.key(1), temperature, top_p, **kind))
    assert ((got >= 0) & (got < 50)).all()


# ---- checkpoint paths ------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    save_pretrained(tiny_model(), path, format="awq", max_shard_bytes=40_000)
    return path


def _point_first_entry_at(path, target: str) -> str:
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = target
    index_path.write_text(json.dumps(index))
    return name


@pytest.mark.parametrize("kind", ["parent", "absolute", "symlink"])
def test_a_weight_map_entry_outside_the_checkpoint_is_refused(saved, tmp_path, kind):
    """A downloaded index cannot make loading read a file outside its directory."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    first = sorted(p.name for p in saved.glob("*.safetensors"))[0]
    (outside / "x.safetensors").write_bytes((saved / first).read_bytes())
    if kind == "parent":
        target = "../elsewhere/x.safetensors"
    elif kind == "absolute":
        target = str(outside / "x.safetensors")
    else:
        os.symlink(outside / "x.safetensors", saved / "link.safetensors")
        target = "link.safetensors"
    name = _point_first_entry_at(saved, target)
    with pytest.raises(ValueError, match=f"{name}.*{target}.* outside the checkpoint directory"):
        load_pretrained(saved, progress=False)


def test_a_symlink_inside_the_checkpoint_is_followed(saved, tmp_path):
    first = sorted(p.name for p in saved.glob("*.safetensors"))[0]
    os.rename(saved / first, saved / "real.safetensors")
    os.symlink(saved / "real.safetensors", saved / first)
    load_pretrained(saved, progress=False)


# ---- saving over an earlier save -------------------------------------------------------------


def test_an_unsharded_save_over_a_sharded_one_loads_the_new_weights(tmp_path, rng):
    path = tmp_path / "ckpt"
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    save_pretrained(old, path, format="awq", max_shard_bytes=40_000)
    assert (path / "model.safetensors.index.json").exists()
    save_pretrained(new, path, format="awq")
    files = sorted(p.name for p in path.iterdir())
    assert "model.safetensors.index.json" not in files
    assert [f for f in files if f.endswith(".safetensors")] == ["model.safetensors"]
    ids = random_ids(rng, (1, 4), new.cfg)
    loaded = load_pretrained(path, progress=False)
    np.testing.assert_array_equal(
        generate(loaded, ids, max_new_tokens=2), generate(new, ids, max_new_tokens=2)
    )


def test_a_sharded_save_over_another_removes_its_extra_shards(tmp_path):
    path = tmp_path / "ckpt"
    save_pretrained(tiny_model(), path, format="awq", max_shard_bytes=20_000)
    many = len(list(path.glob("*.safetensors")))
    save_pretrained(tiny_model(), path, format="awq", max_shard_bytes=80_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in path.glob("*.safetensors")) == sorted(
        set(index["weight_map"].values())
    )
    assert len(set(index["weight_map"].values())) < many
    assert not list(path.glob("*.tmp*"))  # no temporary left


def test_a_hub_cache_snapshot_reads_its_blobs(saved, tmp_path):
    """The Hugging Face cache's layout: snapshots/<revision>/<file> links to ../../blobs/<hash>,
    outside the snapshot's directory but inside the repository's cache folder."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for n, f in enumerate(sorted(saved.iterdir())):
        os.rename(f, blobs / f"blob{n}")
        os.symlink(f"../../blobs/blob{n}", snapshot / f.name)
    load_pretrained(snapshot, progress=False)


# ---- tokenizer files ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"model": 3}', "[]", ""],
    ids=["not_json", "no_model", "list", "empty"],
)
def test_a_malformed_tokenizer_json_names_the_file(tmp_path, content):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path} cannot be read as a tokenizer.json: "):
        load_tokenizer(tmp_path)


def test_a_quick_load_shows_no_progress_bar(saved, monkeypatch, capsys):
    """The loading bar appears only once a load has run PROGRESS_DELAY_S: none for a tiny
    checkpoint's, one when the delay is 0."""
    from models.common import progress

    load_pretrained(saved)
    assert "loading ckpt" not in capsys.readouterr().err
    monkeypatch.setattr(progress, "PROGRESS_DELAY_S", 0.0)
    load_pretrained(saved)
    assert "loading ckpt" in capsys.readouterr().err
