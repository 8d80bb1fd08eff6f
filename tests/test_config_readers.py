"""config.json readers of every family: any JSON value in a field reads or is refused by name."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.deepseek_v3.config import DeepseekV3Config
from models.gpt_oss.config import GptOssConfig
from models.qwen_moe.config import QwenMoeConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
READERS = {
    "gpt_oss": GptOssConfig,
    "kimi_k2": DeepseekV3Config,
    "qwen2_moe": QwenMoeConfig,
    "qwen3_moe": QwenMoeConfig,
}
# Fields a config.json may lack that the readers read, beside those the fixtures hold.
EXTRA_FIELDS = ("rope_scaling", "rope_parameters", "quantization_config", "mlp_only_layers",
                "decoder_sparse_step", "eos_token_id", "use_sliding_window")  # fmt: skip

JSON_SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8)
    | st.floats(allow_nan=True, allow_infinity=True)
)  # fmt: skip
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3)
    ),
    max_leaves=6,
)
ROPE = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["yarn", "default", "linear"]) | JSON_SCALARS,
        "rope_type": st.sampled_from(["yarn", "default"]) | JSON_SCALARS,
        "factor": JSON_SCALARS,
        "original_max_position_embeddings": JSON_SCALARS,
        "mscale": JSON_SCALARS,
        "mscale_all_dim": JSON_SCALARS,
        "beta_fast": JSON_SCALARS,
        "rope_theta": JSON_SCALARS,
    },
)


def _base(name: str) -> dict:
    float_checkpoint = FIXTURES / name / "float"  # beside a quantized one; else the one
    root = float_checkpoint if float_checkpoint.is_dir() else FIXTURES / name
    return json.loads((root / "config.json").read_text())


def _read(cls, d: dict):
    """The config of `d`, used as the model reads it, or the ValueError that refuses it."""
    try:
        cfg = cls.from_hf_dict(d)
    except ValueError as err:
        assert str(err), "an empty message names nothing"
        return err
    layers = [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    assert all(isinstance(x, bool) for x in layers)
    assert math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0
    return cfg


@pytest.mark.parametrize("name", sorted(READERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_json_value_reads_or_is_refused_by_name(name, data):
    d = _base(name)
    keys = sorted(set(d) | set(EXTRA_FIELDS))
    for key in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)):
        rope = key in ("rope_scaling", "rope_parameters") and data.draw(st.booleans())
        d[key] = data.draw(ROPE if rope else JSON_VALUES)
    _read(READERS[name], d)


@pytest.mark.parametrize("name", sorted(READERS))
@pytest.mark.parametrize(
    "key, value, match",
    [("mlp_only_layers", 1, "mlp_only_layers=1 must be a list of integers"),
     ("rope_scaling", "yarn", "rope_scaling='yarn' must be an object"),
     ("rope_parameters", "yarn", "rope_parameters='yarn' must be an object"),
     ("quantization_config", "gptq", "quantization_config='gptq' must be an object"),
     ("tie_word_embeddings", "yes", "tie_word_embeddings='yes' must be true or false"),
     ("num_hidden_layers", "2", "num_hidden_layers='2' must be an integer")],
)  # fmt: skip
def test_wrong_types_are_named(name, key, value, match):
    if key == "mlp_only_layers" and READERS[name] in (DeepseekV3Config, GptOssConfig):
        pytest.skip(f"{name} configs have no mlp_only_layers (every layer's MLP is named)")
    d = _base(name)
    d[key] = value
    with pytest.raises(ValueError, match=match):
        READERS[name].from_hf_dict(d)
