"""examples/generate.py smoke test (tiny model, few tokens), its checkpoint defaults
(generation_config.json) and chat template, and the optional HF parity check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helpers
import jax
import numpy as np
import pytest
from flax import nnx
from test_deepseek_v3_common import assert_close, logits_of, random_ids, tiny_model

import wna16_jax as wj
from models.deepseek_v3.modeling import RoutedExperts

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "generate.py"


def _load_example():
    return helpers.load_script(EXAMPLE, "example_generate", [EXAMPLE.parent])


def test_example_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load_example().main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--full-width-layers",
        "--chat",
        "--eos-id",
        "--no-progress",
        "--activation-quant",
        "--mtp",
        "--batch-invariant",
    ):
        assert flag in out
    assert "generation_config.json" in out


def test_example_main_tiny(capsys):
    assert _load_example().main(["--max-new-tokens", "3", "--batch-size", "1", "2"]) == 0
    out = capsys.readouterr().out
    if jax.default_backend() == "cpu":
        assert "fused_moe backend: 'xla'" in out
        assert "quantized linears: 21 on 'xla'; dequantized for attention: 3 kv_b_proj" in out
    assert "[1] tokens:" in out and "tokens/s" in out and "ms per step" in out


def test_example_fuses_linears_for_a_kernel(capsys):
    """A kernel runs each MLP's gate_proj and up_proj as one GEMM (the tiny model's 3: its
    q_a_proj and kv_a_proj_with_mqa, N = 64 + 40, no kernel tiles), --no-fuse-linears keeps
    every linear apart; kv_b_proj, which attention reads only as its dequantized weight, runs
    no GEMM and stays canonical. The printed counts say so."""
    example = _load_example()
    outs = []
    for extra in ([], ["--no-fuse-linears"]):
        args = example.parse_args(["--linear-implementation", "pallas_interpret", *extra])
        model, _, _ = example.build_model(args)
        example.prepare_model(model, args, args.linear_implementation, progress=False)
        outs.append(capsys.readouterr().out)
        kv_b = [m.self_attn.kv_b_proj for m in model.model.layers]
        assert all(m.weight.layout == "canonical" and m.kernel("float32") is None for m in kv_b)
    fused, apart = outs
    dequantized = "; dequantized for attention: 3 kv_b_proj\n"
    assert (
        "quantized linears: 15 on 'pallas_interpret', 3 on 'xla'; fused: 3 gate_up_proj"
        + dequantized
    ) in fused
    assert "quantized linears: 18 on 'pallas_interpret', 3 on 'xla'" + dequantized in apart


def test_example_step_bytes_and_roofline(capsys):
    """A step's weight bytes: every weight but the embedding table and the routed experts, and
    num_experts_per_tok of each MoE layer's experts (packed weights, scales, zero points); the
    roofline line puts them against the copy ceiling, and main prints it per batch size."""
    example = _load_example()
    args = example.parse_args([])
    model, _, _ = example.build_model(args)
    cfg = model.cfg
    everything = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))  # no int4 arrays here
    embed = model.model.embed_tokens.weight.get_value().nbytes
    experts = [m for _, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)]
    assert experts
    routed = sum(a.nbytes for m in experts for a in jax.tree.leaves(nnx.state(m)))
    k_of_e = cfg.num_experts_per_tok / cfg.n_routed_experts
    want = everything - embed - routed + k_of_e * routed
    assert example.step_bytes(model) == pytest.approx(want)
    stats = type("Stats", (), dict(step_s=want / 1e9, batch=1))()
    line = example.roofline(model, stats, copy_bps=2e9)
    assert "at the copy ceiling measured now (0.00200 TB/s): the step runs at 50% of it" in line
    assert example.main(["--max-new-tokens", "3", "--batch-size", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("step reads >= ") == 2 and "rows that route apart read more experts" in out


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


def test_example_mtp_gives_the_same_tokens(capsys):
    """--mtp 2: speculative decoding with the tiny model's random MTP layer (drawn from its own
    stream: the model's weights unchanged), greedy: the tokens without it, and its figures."""
    argv = ["--max-new-tokens", "5", "--no-warmup", "--batch-size", "2"]
    assert _load_example().main(argv) == 0
    plain = capsys.readouterr().out
    assert _load_example().main([*argv, "--mtp", "2"]) == 0
    out = capsys.readouterr().out
    assert "with its MTP layer" in out
    assert "MTP with 2 drafts: acceptance" in out and "tokens per step" in out
    assert "ms per token" in out and out.count("tokens per step") == 1  # printed once
    assert _tokens(out) == _tokens(plain) and len(_tokens(out)) == 2


def test_example_quantize_lm_head(capsys):
    """--quantize-lm-head int8: the lm_head joins the quantized linears (one more on xla)."""
    argv = ["--max-new-tokens", "2", "--no-warmup", "--linear-implementation", "xla"]
    assert _load_example().main(argv) == 0
    before = capsys.readouterr().out
    assert _load_example().main([*argv, "--quantize-lm-head", "int8"]) == 0
    after = capsys.readouterr().out
    assert "lm_head quantized to int8" in after and "lm_head quantized" not in before
    count = lambda out: int(out.split("quantized linears: ")[1].split()[0])  # noqa: E731
    assert count(after) == count(before) + 1
    assert len(_tokens(after)) == 1


def test_example_activation_quant(capsys):
    """--activation-quant int8_per_token: a random model with int8 per-channel symmetric
    weights whose routed experts run W8A8 on the kernel asked for; the flags it cannot go with
    are refused, saying why."""
    example = _load_example()
    argv = ["--activation-quant", "int8_per_token", "--implementation", "pallas_interpret"]
    assert example.main([*argv, "--max-new-tokens", "2", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert "tiny random model, int8 per channel, routed experts W8A8 (int8_per_token" in out
    assert "fused_moe backend: 'pallas_interpret'" in out and len(_tokens(out)) == 1
    model, _, _ = example.build_model(example.parse_args(argv))
    experts = [m for _, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)]
    assert {m.activation_quant for m in experts} == {wj.ActivationQuant("int8_per_token")}
    w13 = experts[0].w13.get()
    assert (w13.bits, w13.group_size, w13.zeros) == (8, -1, None)
    for extra, message in [
        (["--quantize", "int4"], "W8A8 needs int8 per-channel symmetric experts"),
        (["--model", "org/name"], "a checkpoint's quantization_config says"),
        (["--float-weights"], "--float-weights runs float experts"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            example.parse_args(["--activation-quant", "int8_per_token", *extra])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_example_batch_invariant(capsys):
    """--batch-invariant: the model prepared with the flag; a row's tokens alone (batch 1) are
    those of each row of a batch of 3; with --mtp or --mesh it is refused before any build."""
    example = _load_example()
    argv = ["--max-new-tokens", "3", "--no-warmup", "--batch-invariant", "--batch-size", "1", "3"]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "batch-invariant: every row computed as it would be alone" in out
    rows = [line.split(":", 1)[1] for line in _tokens(out)]
    assert len(rows) == 4 and len(set(rows)) == 1, rows
    for extra in (["--mtp", "1"], ["--mesh", "expert=1"]):
        with pytest.raises(SystemExit) as exit_info:
            example.parse_args(["--batch-invariant", *extra])
        assert exit_info.value.code == 2
        assert "--batch-invariant runs on one device" in capsys.readouterr().err


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


# ---- a checkpoint's generation_config.json and chat template --------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model saved as an AWQ checkpoint (config.json + safetensors, no tokenizer)."""
    from models.deepseek_v3 import save_pretrained

    path = tmp_path_factory.mktemp("tiny_awq")
    save_pretrained(tiny_model(), path, format="awq")
    return path


def _with_files(checkpoint, tmp_path, **files) -> str:
    """A copy of `checkpoint` (hard links to its files: loading refuses a symlink leading out of
    the checkpoint's directory) plus `files` {name: JSON object}."""
    for f in checkpoint.iterdir():
        (tmp_path / f.name).hardlink_to(f)
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    return str(tmp_path)


def _row_tokens(out: str) -> list[int]:
    [line] = [line for line in out.splitlines() if line.startswith("[0] tokens:")]
    return json.loads(re.search(r"\[[\d, ]*\]", line.split(":", 1)[1]).group())


def test_example_takes_generation_config_defaults(checkpoint, tmp_path_factory, capsys):
    """The checkpoint's generation_config.json: its eos ids end the row at the first of them
    (the tokens are shown up to it), do_sample false decodes greedily, the keys it has no use
    for are named; --eos-id overrides the file's ids."""
    example = _load_example()
    argv = ["--max-new-tokens", "5", "--no-warmup", "--linear-implementation", "xla",
            "--no-progress", "--eos-id", "0"]  # fmt: skip
    assert example.main(["--model", str(checkpoint), *argv]) == 0
    free = _row_tokens(capsys.readouterr().out)  # greedy, no eos among them (id 0: padding)
    assert len(free) == 5 and 0 not in free
    stop = free[2]
    unseen = next(i for i in range(3, tiny_model().cfg.vocab_size) if i not in free)
    config = {"eos_token_id": [unseen, stop], "do_sample": False, "temperature": 0.7,
              "top_k": 5, "transformers_version": "4.46.3"}  # fmt: skip
    path = _with_files(checkpoint, tmp_path_factory.mktemp("gen"), generation_config=config)
    assert example.main(["--model", path, *argv[:-2]]) == 0
    out = capsys.readouterr().out
    eos = tuple(config["eos_token_id"])
    assert f"generation_config.json: eos_id={eos}, temperature=0.0" in out
    assert "not used from" in out and "generation_config.json: temperature, top_k" in out
    assert f"generation: max_new_tokens=5, eos_id={eos}, temperature=0.0" in out
    want = free[: free.index(stop) + 1]
    assert _row_tokens(out) == want and f"(stopped at eos id {stop})" in out
    # A flag wins over the file: no eos among the tokens, all 5 shown.
    assert example.main(["--model", path, *argv]) == 0
    out = capsys.readouterr().out
    assert "generation_config.json: temperature=0.0" in out and "eos_id=(0,)" in out
    assert _row_tokens(out) == free


def test_example_sampling_settings_flags_over_the_file(checkpoint, tmp_path):
    """Flags given win, the file fills the rest, the built-in max_new_tokens comes last."""
    example = _load_example()
    config = {"eos_token_id": [5, 6], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    path = _with_files(checkpoint, tmp_path, generation_config=config)
    args = example.parse_args(["--model", path, "--temperature", "0", "--eos-id", "7"])
    assert example.sampling_settings(args, path) == dict(
        temperature=0.0, eos_id=(7,), top_p=0.9, max_new_tokens=example.DEFAULT_MAX_NEW_TOKENS
    )
    args = example.parse_args(["--model", path, "--max-new-tokens", "3"])
    assert example.sampling_settings(args, path) == dict(
        max_new_tokens=3, eos_id=(5, 6), temperature=0.6, top_p=0.9
    )
    # No file: the flags given only (generate's own defaults for the rest).
    assert example.sampling_settings(example.parse_args([]), None) == dict(
        max_new_tokens=example.DEFAULT_MAX_NEW_TOKENS
    )


def test_example_malformed_generation_config_names_the_file(checkpoint, tmp_path):
    path = _with_files(checkpoint, tmp_path, generation_config={"do_sample": "yes"})
    with pytest.raises(SystemExit, match=r"generation_config.json: do_sample must be true"):
        _load_example().main(["--model", path, "--no-progress"])


def test_example_chat_renders_the_template(checkpoint, tmp_path):
    """--chat: the prompt as one user message through tokenizer_config.json's chat_template,
    the assistant's turn opened; encoded without another bos (the template writes it)."""
    pytest.importorskip("jinja2", reason="rendering a chat template needs jinja2")
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer_config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    path = _with_files(checkpoint, tmp_path, tokenizer_config=tokenizer_config)
    example = _load_example()
    args = example.parse_args(["--model", path, "--chat", "--prompt", "Hi"])
    assert example.prompt_text(args, path) == ("<s><|user|>Hi</s><|assistant|>", False)
    args = example.parse_args(["--model", path, "--prompt", "Hi"])
    assert example.prompt_text(args, path) == ("Hi", None)


@pytest.mark.parametrize(
    "files,match",
    [
        ({}, r"--chat: .*tokenizer_config.json does not exist"),
        ({"tokenizer_config": {"bos_token": "<s>"}}, r"tokenizer_config.json has no chat_templ"),
    ],
    ids=["no_tokenizer_config", "no_chat_template"],
)
def test_example_chat_without_a_template_names_the_file(checkpoint, tmp_path, files, match):
    """--chat stops before loading the weights when the checkpoint has no chat template."""
    path = _with_files(checkpoint, tmp_path, **files)
    with pytest.raises(SystemExit, match=match):
        _load_example().main(["--model", path, "--chat", "--no-progress"])
    with pytest.raises(SystemExit, match="--chat needs --model"):
        _load_example().main(["--chat"])


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
