"""examples/generate.py smoke test (tiny model, few tokens) and the optional HF parity check."""

from __future__ import annotations

from pathlib import Path

import helpers
import jax
import numpy as np
import pytest
from test_deepseek_v3_common import assert_close, logits_of, random_ids, tiny_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "generate.py"


def _load_example():
    return helpers.load_script(EXAMPLE, "example_generate", [EXAMPLE.parent])


def test_example_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load_example().main(["--help"])
    assert exit_info.value.code == 0
    assert "--full-width-layers" in capsys.readouterr().out


def test_example_main_tiny(capsys):
    assert _load_example().main(["--max-new-tokens", "3", "--batch-size", "1", "2"]) == 0
    out = capsys.readouterr().out
    if jax.default_backend() == "cpu":
        assert "fused_moe backend: 'xla'" in out and "quantized linears: 24 on 'xla'" in out
    assert "[1] tokens:" in out and "tokens/s" in out and "ms per step" in out


def _tokens(out: str) -> list[str]:
    return [line for line in out.splitlines() if "] tokens:" in line]


def test_example_float_weights_give_the_same_tokens(capsys):
    """--float-weights: the dequantized model on XLA, greedy, the quantized model's tokens."""
    argv = ["--max-new-tokens", "3", "--no-warmup", "--linear-implementation", "xla"]
    assert _load_example().main(argv) == 0
    quantized = capsys.readouterr().out
    assert _load_example().main([*argv, "--float-weights"]) == 0
    dense = capsys.readouterr().out
    assert "quantized linears: none (float linears)" in dense
    assert "fused_moe backend: none (float experts)" in dense
    assert _tokens(dense) == _tokens(quantized) and _tokens(dense)


def test_example_distinct_prompts(capsys):
    """--distinct-prompts: each row starts with its own token, so rows differ."""
    argv = ["--max-new-tokens", "2", "--batch-size", "3", "--distinct-prompts", "--no-warmup"]
    assert _load_example().main(argv) == 0
    out = capsys.readouterr().out
    assert all(f"[{b}] tokens:" in out for b in range(3))
    example = _load_example()
    from models.deepseek_v3.config import DeepseekV3Config

    class Model:
        cfg = DeepseekV3Config.tiny()

    class Tokenizer:
        pad_id = 0

    firsts = example.first_tokens(Model, Tokenizer, 3, seed=0)
    assert len(set(firsts)) == 3 and 0 not in firsts
    assert firsts == example.first_tokens(Model, Tokenizer, 3, seed=0)


def test_hf_transformers_parity(tmp_path, rng):
    """Our logits against transformers' DeepseekV3ForCausalLM on the same float checkpoint."""
    torch = pytest.importorskip("torch", reason="needs torch for the HF parity check")
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV3ForCausalLM")
    from models.deepseek_v3 import load_pretrained, save_pretrained

    # A float model with bf16-exact weights, compared in f32 on both sides.
    save_pretrained(tiny_model(dtype="bfloat16", quant=None), tmp_path, format="bf16")
    ours = load_pretrained(tmp_path, dtype="float32", progress=False)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    ids = random_ids(rng, (2, 8), ours.cfg)
    with torch.no_grad():
        want = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    got = logits_of(ours, ids, np.ones(ids.shape, bool))
    # transformers masks dropped groups with 0 rather than -inf; with sigmoid scores plus a
    # small bias that picks the same experts here.
    assert_close(got, want, "f32_reordered")
