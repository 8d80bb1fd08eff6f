"""DeepSeek-V3 NNX model: MLA forms, cached generation, batching, WNA16 vs float, backends."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_deepseek_v3_common import (
    KERNEL_LINEAR_MODELS,
    MGPU,
    assert_close,
    logits_of,
    random_ids,
    tiny_config,
    tiny_model,
)

import wna16_jax as wj
from models.common import progress as progress_module
from models.deepseek_v3 import generate, init_random
from models.deepseek_v3.config import QuantSpec
from models.deepseek_v3.modeling import (
    DeepseekV3ForCausalLM,
    FloatExperts,
    Linear,
    MLAttention,
    QuantizedLinear,
    RoutedExperts,
    apply_rope,
    dequantize_model,
    rope_cos_sin,
)

# The module (the package's `generate` is the function).
generate_module = importlib.import_module("models.deepseek_v3.generate")

NEW_TOKENS = 6


def _left_padded(rows, pad_id):
    s = max(len(r) for r in rows)
    ids = np.full((len(rows), s), pad_id, np.int32)
    mask = np.zeros((len(rows), s), bool)
    for b, r in enumerate(rows):
        ids[b, s - len(r) :], mask[b, s - len(r) :] = r, True
    return ids, mask


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "q_proj"])
def test_absorbed_attention_equals_naive(q_lora, rng):
    """Scores against the latent cache (q absorbed into W_UK, [q_lat, q_pe] against [c_kv,
    k_pe] in one product, output through W_UV) equal the attention with keys and values
    expanded through kv_b_proj, left padding included; the cache's slots hold c_kv then the
    roped k_pe of the written tokens."""
    cfg = tiny_config(q_lora_rank=64 if q_lora else None)
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attn = MLAttention(cfg, rngs=rng)
    b, s, extra = 2, 7, 3
    x = jnp.asarray(rng.standard_normal((b, s, cfg.hidden_size)), jnp.float32)
    key_valid = np.ones((b, s), bool)
    key_valid[1, :3] = False  # row 1 is left-padded
    positions = jnp.maximum(jnp.cumsum(key_valid, axis=1) - 1, 0)
    cos, sin = rope_cos_sin(cfg, positions)
    causal = np.tril(np.ones((s, s), bool))
    mask = (causal[None] & key_valid[:, None, :]) | np.eye(s, dtype=bool)[None]
    # The same queries against a cache of s + extra slots (the extra ones empty).
    cache = jnp.zeros((b, s + extra, r + dr), cfg.dtype)
    mask_l = np.concatenate([mask, np.zeros((b, s, extra), bool)], axis=2)

    @nnx.jit
    def both(attn, x, cos, sin, mask, mask_l, cache):
        naive, _ = attn(x, cos=cos, sin=sin, mask=mask, mode="full")
        absorbed, new_cache = attn(
            x, cos=cos, sin=sin, mask=mask_l, mode="decode", cache=cache, index=jnp.int32(0)
        )
        kv_a = attn.kv_a_proj_with_mqa(x)  # [B, S, R + dr]
        c_kv = attn.kv_a_layernorm(kv_a[..., :r])
        k_pe = apply_rope(kv_a[..., r:], cos, sin)
        return naive, absorbed, new_cache, c_kv, k_pe

    naive, absorbed, latent, c_kv, k_pe = both(attn, x, cos, sin, mask, mask_l, cache)
    assert_close(absorbed, naive, "f32_reordered")
    assert latent.shape == (b, s + extra, r + dr) and latent.dtype == cache.dtype
    assert_close(latent[:, :s, :r], c_kv, "f32_reordered")
    assert_close(latent[:, :s, r:], k_pe, "f32_reordered")
    np.testing.assert_array_equal(np.asarray(latent[:, s:]), 0)


@pytest.fixture(scope="module")
def batched_run():
    """Greedy generation for three left-padded prompts of different lengths."""
    model = tiny_model()
    cfg = model.cfg
    rng = np.random.default_rng(1234)
    prompts = [random_ids(rng, (n,), cfg).tolist() for n in (3, 7, 12)]
    out = generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_id=())
    return model, prompts, np.asarray(out)


def test_generate_shape_and_prompt_columns(batched_run):
    model, prompts, out = batched_run
    s = max(len(p) for p in prompts)
    assert out.shape == (3, s + NEW_TOKENS) and out.dtype == np.int32
    ids, _ = _left_padded(prompts, model.cfg.pad_token_id)
    np.testing.assert_array_equal(out[:, :s], ids)


def test_cached_generation_equals_full_recompute(batched_run):
    """Every token greedy decoding produced (prefill + absorbed decode over the latent cache)
    is the argmax of a cache-free forward pass over the whole sequence."""
    model, prompts, out = batched_run
    s = max(len(p) for p in prompts)
    mask = np.zeros(out.shape, bool)
    for b, p in enumerate(prompts):
        mask[b, s - len(p) :] = True
    logits = np.asarray(logits_of(model, jnp.asarray(out), jnp.asarray(mask)))
    pred = logits[:, s - 1 : -1].argmax(-1)  # prediction for each generated column
    got = out[:, s:]
    mismatch = pred != got
    if np.any(mismatch):  # only acceptable as an f32 near-tie
        rows = logits[:, s - 1 : -1]
        gap = np.take_along_axis(rows, pred[..., None], -1) - np.take_along_axis(
            rows, got[..., None], -1
        )
        assert np.all(gap[mismatch] < 1e-4), f"cached decode diverged: {pred} vs {got}"


def test_batched_left_padding_equals_single_prompts(batched_run):
    model, prompts, out = batched_run
    for b, p in enumerate(prompts):
        alone = np.asarray(generate(model, [p], max_new_tokens=NEW_TOKENS, eos_id=()))
        np.testing.assert_array_equal(alone[0, len(p) :], out[b, -NEW_TOKENS:], err_msg=f"row {b}")


def test_eos_stops_rows_and_pads_with_eos(batched_run):
    model, prompts, out = batched_run
    s = max(len(p) for p in prompts)
    eos = int(out[0, s + 1])  # row 0's second new token
    stopped = np.asarray(generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_id=eos))
    for b in range(len(prompts)):
        row, ref = stopped[b, s:], out[b, s:]
        hits = np.flatnonzero(ref == eos)
        end = hits[0] + 1 if hits.size else NEW_TOKENS
        np.testing.assert_array_equal(row[:end], ref[:end])
        assert np.all(row[end:] == eos)
    assert np.all(stopped[0, s + 1 :] == eos)


def test_several_eos_ids_stop_a_row_on_any(batched_run):
    """eos_id=[a, b]: each row stops at the first of either (on the device, in the same fixed
    loop), and is filled with the first id from then on."""
    model, prompts, out = batched_run
    s = max(len(p) for p in prompts)
    a, b = int(out[0, s + 1]), int(out[1, s + 2])  # row 0's second and row 1's third token
    eos = [a, b]
    stopped = np.asarray(generate(model, prompts, max_new_tokens=NEW_TOKENS, eos_id=eos))
    for row in range(len(prompts)):
        got, ref = stopped[row, s:], out[row, s:]
        hits = np.flatnonzero(np.isin(ref, eos))
        end = hits[0] + 1 if hits.size else NEW_TOKENS
        np.testing.assert_array_equal(got[:end], ref[:end], err_msg=f"row {row}")
        assert np.all(got[end:] == a), f"row {row}"
    assert np.isin(stopped[0, s + 1], eos) and np.isin(stopped[1, s + 2], eos)


def test_sampling(batched_run):
    model, prompts, out = batched_run
    kw = dict(max_new_tokens=NEW_TOKENS, eos_id=())
    a = np.asarray(generate(model, prompts, temperature=1.0, top_p=0.9, seed=1, **kw))
    b = np.asarray(generate(model, prompts, temperature=1.0, top_p=0.9, seed=1, **kw))
    c = np.asarray(generate(model, prompts, temperature=1.0, top_p=0.9, seed=2, **kw))
    np.testing.assert_array_equal(a, b)  # same seed, same tokens
    assert np.any(a != c), "different seeds gave identical samples"
    # A nucleus this small holds only the most likely token: greedy again.
    g = np.asarray(generate(model, prompts, temperature=1.0, top_p=1e-6, seed=3, **kw))
    np.testing.assert_array_equal(g, out)


def test_prompt_length_bucketing_reuses_compiled_code(batched_run):
    model, _, _ = batched_run
    cfg = model.cfg
    rng = np.random.default_rng(7)
    _, first = generate(
        model, [random_ids(rng, (9,), cfg).tolist()], max_new_tokens=2, eos_id=(), return_stats=True
    )
    _, second = generate(
        model,
        [random_ids(rng, (13,), cfg).tolist()],
        max_new_tokens=2,
        eos_id=(),
        return_stats=True,
    )
    assert first.bucket_len == second.bucket_len == 16
    assert second.compile_s == 0.0
    assert second.decode_tokens_per_s > 0 and second.new_tokens == 2
    assert second.decode_steps == 1 and second.step_s == second.decode_s
    assert "ms per step" in str(second)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 0.9)], ids=["greedy", "nucleus"])
def test_decode_program_has_a_fixed_trip_count_and_no_conditional(batched_run, temperature, top_p):
    """The decode loop is one loop of a known trip count (no predicate the host reads back each
    token) and holds no conditional on a device value (greedy vs sampling is static); the cache
    is donated and returned, so the loop updates it in place."""
    model, prompts, _ = batched_run
    ids, mask = _left_padded(prompts, 0)
    graphdef, state = nnx.split(model)
    logits, cache = model.prefill(jnp.asarray(ids), jnp.asarray(mask), max_len=32)
    fn = functools.partial(
        generate_module._decode,
        graphdef=graphdef,
        steps=5,
        greedy=temperature <= 0,
        nucleus=top_p < 1,
        eos_ids=(1,),
        fill_id=1,
    )
    keys = generate_module.row_keys(0, ids.shape[0])  # one sampling key a row
    args = (state, logits, cache, keys, jnp.float32(temperature), jnp.float32(top_p))
    jaxpr = jax.make_jaxpr(fn)(*args)
    top = [e.primitive.name for e in jaxpr.eqns]
    everywhere = str(jaxpr)
    assert top.count("scan") == 1 and "while" not in top, top
    assert "cond[" not in everywhere and " cond " not in everywhere
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    assert scan.params["length"] == 4  # steps - 1 decode steps after the prefill's token
    lowered = jax.jit(fn, donate_argnums=(2,)).lower(*args).as_text()
    assert "tf.aliasing_output" in lowered or "jax.buffer_donor" in lowered


def test_decode_dequantizes_kv_b_once_before_the_loop(batched_run):
    """The decode program dequantizes kv_b_proj before its loop (the dense W_UK / W_UV of every
    layer enter the loop as invariants), and dequantize_kv_b leaves decode's logits unchanged."""
    model, prompts, _ = batched_run
    cfg = model.cfg
    ids, mask = _left_padded(prompts, 0)
    graphdef, state = nnx.split(model)
    logits, cache = model.prefill(jnp.asarray(ids), jnp.asarray(mask), max_len=32)
    fn = functools.partial(
        generate_module._decode,
        graphdef=graphdef,
        steps=3,
        greedy=True,
        nucleus=False,
        eos_ids=(),
        fill_id=0,
    )
    jaxpr = jax.make_jaxpr(fn)(
        state,
        logits,
        cache,
        generate_module.row_keys(0, ids.shape[0]),
        jnp.float32(0),
        jnp.float32(1),
    )
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    n, k = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank
    dense_kv_b = {(n, k), (1, n, k)}  # what dequantizing kv_b [1, N, K] produces

    def dequantized(jaxpr):
        return sum(
            sum(v.aval.shape in dense_kv_b and v.aval.dtype == cfg.dtype for v in e.outvars)
            + sum(
                dequantized(getattr(p, "jaxpr", p))
                for p in e.params.values()
                if hasattr(getattr(p, "jaxpr", p), "eqns")
            )
            for e in jaxpr.eqns
        )

    body = scan.params["jaxpr"]
    assert dequantized(getattr(body, "jaxpr", body)) == 0
    assert dequantized(jaxpr.jaxpr) >= cfg.num_hidden_layers  # before the loop

    tok = jnp.asarray(ids[:, -1])
    want, _ = model.decode(tok, cache)
    dense_model = nnx.clone(model)
    dense_model.dequantize_kv_b()
    assert not any(
        isinstance(m, QuantizedLinear)
        for m in (layer.self_attn.kv_b_proj for layer in dense_model.model.layers)
    )
    assert isinstance(model.model.layers[0].self_attn.kv_b_proj, QuantizedLinear)  # a copy
    got, _ = dense_model.decode(tok, cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_warmup_times_second_executions_with_the_same_tokens(batched_run):
    """warmup=True runs prefill and decode once untimed: same tokens, stats marked warm."""
    model, _, _ = batched_run
    ids = [random_ids(np.random.default_rng(11), (9,), model.cfg).tolist()]
    kw = dict(max_new_tokens=3, eos_id=(), return_stats=True)
    cold_tokens, cold = generate(model, ids, **kw)
    warm_tokens, warm = generate(model, ids, warmup=True, **kw)
    np.testing.assert_array_equal(np.asarray(warm_tokens), np.asarray(cold_tokens))
    assert warm.warm and not cold.warm
    assert "warm" in str(warm) and "first execution" in str(cold)
    assert warm.prefill_s > 0 and warm.decode_tokens_per_s > 0


def test_int4_model_equals_f32_model_on_dequantized_weights(batched_run):
    """The WNA16 model (fused_moe + dequantizing linears) against a float model holding its
    dequantized weights (ragged_dot experts, float linears): same logits, same greedy tokens."""
    model, prompts, out = batched_run
    fmodel = dequantize_model(model)
    assert isinstance(fmodel.model.layers[1].mlp.experts, FloatExperts)
    assert isinstance(fmodel.model.layers[1].self_attn.kv_b_proj, Linear)
    assert isinstance(model.model.layers[1].mlp.experts, RoutedExperts)
    assert isinstance(model.model.layers[1].self_attn.kv_b_proj, QuantizedLinear)
    # Row 2 (the longest prompt, no padding) and the int4 model's greedy continuation.
    seq = out[2:3]
    mask = np.ones(seq.shape, bool)
    q_logits = logits_of(model, seq, mask)
    f_logits = np.asarray(logits_of(fmodel, seq, mask))
    assert_close(q_logits, f_logits, "f32_reordered")
    # Teacher-forced greedy of the f32 model reproduces the int4 model's tokens, i.e. greedy
    # generation with the f32 model produces the same sequence.
    np.testing.assert_array_equal(
        f_logits[0, -NEW_TOKENS - 1 : -1].argmax(-1), seq[0, -NEW_TOKENS:]
    )


def test_pallas_interpret_matches_xla(rng):
    if "pallas_interpret" not in wj.registered_backends():
        pytest.skip(
            "fused_moe backend 'pallas_interpret' is not registered yet "
            f"(registered: {wj.registered_backends()})"
        )
    model = tiny_model(num_hidden_layers=2)
    interp = nnx.clone(model)
    interp.set_implementation("pallas_interpret")
    model_xla = nnx.clone(model)
    model_xla.set_implementation("xla")
    ids = random_ids(rng, (1, 5), model.cfg)
    mask = np.ones(ids.shape, bool)
    assert_close(logits_of(interp, ids, mask), logits_of(model_xla, ids, mask), "pallas_interpret")


@pytest.mark.parametrize("implementation", sorted(KERNEL_LINEAR_MODELS))
def test_kernel_linears_match_xla(rng, implementation):
    """The quantized non-expert linears through a backend's one-expert GEMM (interpreted), their
    weights converted to the layout it reads, give the logits of the dequantize-and-dot path;
    "xla" converts them back (bit-identical), and so does saving (the canonical weight). Each
    linear on its own (fuse=False): test_deepseek_v3_fused_linears.py runs them fused."""
    overrides, layout, kind = KERNEL_LINEAR_MODELS[implementation]
    model = tiny_model(num_hidden_layers=2, **overrides)
    linears = [m for _, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)]
    kernel = nnx.clone(model)
    kernel.set_linear_implementation(implementation, fuse=False)
    converted = [m for _, m in nnx.iter_modules(kernel) if isinstance(m, QuantizedLinear)]
    on_kernel = [m for m in converted if m.kernel(model.cfg.dtype) == implementation]
    assert len(on_kernel) >= len(linears) // 2, "most linears must run through the kernel"
    assert all(m.weight.layout == layout for m in on_kernel)
    gemms = kernel.gemm_linears().values()  # kv_b_proj stays on "xla": test_kv_b_runs_no_gemm
    assert all(m.implementation == implementation for m in gemms)
    ids = random_ids(rng, (2, 5), model.cfg)
    mask = np.ones(ids.shape, bool)
    assert_close(logits_of(kernel, ids, mask), logits_of(model, ids, mask), kind)
    for before, after in zip(linears, converted, strict=True):
        jax.tree.map(np.testing.assert_array_equal, after.canonical_weight(), before.weight.get())
    kernel.set_linear_implementation("xla")
    assert all(
        m.weight.layout == "canonical" and m.kernel(model.cfg.dtype) is None
        for _, m in nnx.iter_modules(kernel)
        if isinstance(m, QuantizedLinear)
    )
    with pytest.raises(ValueError, match="linear implementation 'tpu' is neither 'auto' nor"):
        kernel.set_linear_implementation("tpu")


def test_kv_b_runs_no_gemm():
    """kv_b_proj is read only as its dequantized weight (attention's W_UK and W_UV): a kernel's
    linears leave it canonical on "xla" (its 128 x 64 weight would fit the mgpu_int4 tiles, for
    a GEMM it never runs), its dense weight unchanged, and the model lists it apart from the
    linears it runs as GEMMs."""
    overrides, layout, _ = KERNEL_LINEAR_MODELS[MGPU]
    model = tiny_model(num_hidden_layers=2, kv_lora_rank=64, **overrides)
    dtype = model.cfg.dtype
    kernel = nnx.clone(model)
    kernel.set_linear_implementation(MGPU, progress=False)
    for before, after in zip(model.model.layers, kernel.model.layers, strict=True):
        kv_b = after.self_attn.kv_b_proj
        assert kv_b.weight.layout == "canonical"
        assert kv_b.implementation == "xla" and kv_b.kernel(dtype) is None
        np.testing.assert_array_equal(
            kv_b.dense_weight(dtype), before.self_attn.kv_b_proj.dense_weight(dtype)
        )
        assert after.self_attn.o_proj.weight.layout == layout  # the GEMMs are converted
    paths = [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(2)]
    assert list(kernel.dequantized_linears()) == paths
    gemms = kernel.gemm_linears()
    assert not set(paths) & set(gemms)
    assert set(gemms) | set(paths) == {
        ".".join(map(str, p)) for p, m in nnx.iter_modules(kernel) if isinstance(m, QuantizedLinear)
    }


@pytest.mark.parametrize("spec, bits", [("int4", 4), (QuantSpec(bits=8, group_size=-1), 8)])
def test_quantized_lm_head(rng, spec, bits):
    """quantize_lm_head: the logits are those of the float model whose lm_head holds the
    dequantized weight (f32, on the float dot), and on the Mosaic GPU GEMM (bf16, int4) those of
    the xla path; the weight holds bits / 16 of bf16's bytes."""
    model = tiny_model(num_hidden_layers=2)
    q = nnx.clone(model)
    q.quantize_lm_head(spec)
    assert isinstance(q.lm_head, QuantizedLinear) and q.lm_head.weight.bits == bits
    v, h = model.cfg.vocab_size, model.cfg.hidden_size
    assert q.lm_head.weight.qweight.get_value().nbytes == v * h * bits // 8
    ids = random_ids(rng, (2, 5), model.cfg)
    mask = np.ones(ids.shape, bool)
    out = logits_of(q, ids, mask)
    assert out.dtype == jnp.float32
    assert_close(out, logits_of(dequantize_model(q), ids, mask), "f32_reordered")
    with pytest.raises(ValueError, match="already quantized"):
        q.quantize_lm_head("int4")


def test_quantized_lm_head_on_the_kernel(rng):
    overrides, _, kind = KERNEL_LINEAR_MODELS[MGPU]
    model = nnx.clone(tiny_model(num_hidden_layers=1, **overrides))
    model.quantize_lm_head("int4")
    kernel = nnx.clone(model)
    kernel.set_linear_implementation(MGPU)
    assert kernel.lm_head.kernel(model.cfg.dtype) == MGPU
    ids = random_ids(rng, (2, 5), model.cfg)
    mask = np.ones(ids.shape, bool)
    out = logits_of(kernel, ids, mask)
    assert out.dtype == jnp.float32
    assert_close(out, logits_of(model, ids, mask), kind)


def test_quantize_lm_head_refuses_tied_embeddings():
    model = tiny_model(num_hidden_layers=1, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        model.quantize_lm_head("int4")


def test_auto_linears_take_the_platforms_choice():
    """ "auto": on CPU every linear stays canonical on the float dot (no kernel runs off a GPU
    without being named)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the automatic choice on CPU")
    model = nnx.clone(tiny_model(num_hidden_layers=2))
    model.set_linear_implementation("auto")
    linears = [m for _, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)]
    assert all(m.implementation is None for m in model.gemm_linears().values())
    assert linears and all(
        m.weight.layout == "canonical" and m.kernel(model.cfg.dtype) is None for m in linears
    )


def test_bf16_model_tracks_f32(rng):
    """The same random weights in bf16: logits stay close to the f32 model's."""
    f32 = tiny_model(num_hidden_layers=2)
    bf16 = tiny_model(num_hidden_layers=2, dtype="bfloat16")
    ids = random_ids(rng, (2, 8), f32.cfg)
    mask = np.ones(ids.shape, bool)
    out = logits_of(bf16, ids, mask)
    assert out.dtype == jnp.float32
    assert_close(out, logits_of(f32, ids, mask), "bf16")


def test_call_without_mask_equals_all_ones_mask(rng):
    model = tiny_model()
    ids = random_ids(rng, (1, 6), model.cfg)
    full = nnx.jit(lambda m, x: m(x))(model, ids)
    assert_close(full, logits_of(model, ids, np.ones(ids.shape, bool)), "f32_reordered")
    assert full.shape == (1, 6, model.cfg.vocab_size) and full.dtype == jnp.float32


def test_preferred_expert_layout(monkeypatch):
    """The model asks wna16_jax.preferred_layout: canonical on CPU (the 'mgpu' backend
    needs an sm_90 GPU); with the interpreter standing in for it, mgpu_int4 for bf16 int4
    experts and canonical for f32 ones."""
    import wna16_jax as wj
    from models.deepseek_v3.config import QuantSpec

    quant = QuantSpec(bits=4, group_size=64)
    bf16 = tiny_model(num_hidden_layers=2, dtype="bfloat16", quant=quant)
    f32 = tiny_model(num_hidden_layers=2, dtype="float32", quant=quant)
    if wj._dispatch.current_platform() == "cpu":
        assert bf16.preferred_expert_layout() == "canonical"
    monkeypatch.setattr(
        wj._dispatch, "preferred_layouts", lambda: (("mgpu_int4", "mgpu_interpret"),)
    )
    assert bf16.preferred_expert_layout() == "mgpu_int4"
    assert f32.preferred_expert_layout() == "canonical"


def test_resolve_expert_layout(monkeypatch):
    """generate.py's --expert-layout: a named layout as is; auto follows a named
    implementation (mgpu* -> mgpu_int4 or mgpu_int8 by the experts' bits, another ->
    canonical), else the preferred layout."""
    model = tiny_model(num_hidden_layers=2)
    assert model.resolve_expert_layout("mgpu_int4", "pallas") == "mgpu_int4"
    assert model.resolve_expert_layout("auto", "mgpu_interpret") == "mgpu_int4"
    assert model.resolve_expert_layout("auto", ("mgpu", "xla")) == "mgpu_int4"
    assert model.resolve_expert_layout("auto", "xla") == "canonical"
    monkeypatch.setattr(model, "preferred_expert_layout", lambda: "mgpu_int4")
    assert model.resolve_expert_layout("auto", None) == "mgpu_int4"
    int8 = tiny_model(num_hidden_layers=2, quant=QuantSpec(bits=8, group_size=32))
    assert int8.resolve_expert_layout("auto", "mgpu_interpret") == "mgpu_int8"


def test_mgpu_expert_layout_matches_canonical(rng):
    """set_expert_layout("mgpu_int4") converts every routed-expert layer losslessly: under
    'xla' the logits are bit-identical to the canonical model's, the 'mgpu' kernels
    (interpreted) match them, and converting back restores the canonical arrays."""
    from models.deepseek_v3.config import QuantSpec

    # bf16 and group 64: what the Mosaic GPU GEMM takes (H, 2I multiples of 64 in the preset).
    model = tiny_model(
        num_hidden_layers=2, dtype="bfloat16", quant=QuantSpec(bits=4, group_size=64)
    )
    model.set_implementation("xla")
    converted = nnx.clone(model)
    converted.set_expert_layout("mgpu_int4")
    experts = [m for _, m in nnx.iter_modules(converted) if isinstance(m, RoutedExperts)]
    assert experts and all(m.w13.get().layout == "mgpu_int4" for m in experts)
    ids = random_ids(rng, (2, 5), model.cfg)
    mask = np.ones(ids.shape, bool)
    want = np.asarray(logits_of(model, ids, mask), np.float32)
    np.testing.assert_array_equal(np.asarray(logits_of(converted, ids, mask), np.float32), want)
    converted.set_implementation("mgpu_interpret")
    # bf16 activations: the kernels' f32 sums differ from xla's in order only, but a flipped
    # bf16 rounding compounds over the layers: the bf16 model tolerance.
    assert_close(logits_of(converted, ids, mask), want, "bf16")
    converted.set_expert_layout("canonical")
    original = [m for _, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)]
    for a, b in zip(experts, original, strict=True):
        np.testing.assert_array_equal(np.asarray(a.w13.get().qweight), b.w13.get().qweight)
        np.testing.assert_array_equal(np.asarray(a.w2.get().scales), b.w2.get().scales)


# ---- random init and layout conversions: values and progress bars ---------------------------


def _flat(model) -> dict:
    return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_arrays(got, want) -> None:
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


@pytest.mark.parametrize("on_device", [False, True])
def test_init_random_part_by_part_draws_the_constructors_values(on_device):
    """init_random draws the model part by part (a bar can follow it; on device one program per
    kind of part) with the values of the constructor built whole from the same seed."""
    if on_device:  # one dense and one MoE layer, only the experts quantized: few random ops
        quant = QuantSpec(bits=4, group_size=32, targets=("experts",))
        cfg = tiny_config(num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None,
                          quant=quant)  # fmt: skip
        whole = nnx.jit(lambda: DeepseekV3ForCausalLM(cfg, rngs=nnx.Rngs(5)))()
    else:
        cfg = tiny_config()
        whole = DeepseekV3ForCausalLM(cfg, rngs=np.random.default_rng(5))
    _assert_same_arrays(init_random(cfg, seed=5, on_device=on_device, progress=False), whole)


def test_progress_bars(monkeypatch, capsys):
    """init_random, set_linear_implementation and set_expert_layout show a tqdm bar on stderr
    when enabled (here at once), none when disabled, and none for a step shorter than
    PROGRESS_DELAY_S (a tiny model's)."""
    cfg = tiny_config(dtype="bfloat16", quant=QuantSpec(bits=4, group_size=64))
    parts = cfg.num_hidden_layers + 3  # the embedding, each layer, the norm, the head
    monkeypatch.setattr(progress_module, "PROGRESS_DELAY_S", 0.0)
    model = init_random(cfg, on_device=False)
    linears = len(model.gemm_linears())  # kv_b_proj runs no GEMM: not converted, no step
    moe_layers = sum(isinstance(m, RoutedExperts) for _, m in nnx.iter_modules(model))
    model.set_linear_implementation("xla")
    model.set_expert_layout("mgpu_int4")
    err = capsys.readouterr().err
    assert "random weights: 100%" in err and f"{parts}/{parts}" in err
    assert "linears for xla: 100%" in err and f"{linears}/{linears}" in err
    assert "experts to mgpu_int4: 100%" in err and f"{moe_layers}/{moe_layers}" in err

    model = init_random(cfg, on_device=False, progress=False)
    model.set_linear_implementation("xla", progress=False)
    model.set_expert_layout("mgpu_int4", progress=False)
    assert capsys.readouterr().err == ""

    monkeypatch.setattr(progress_module, "PROGRESS_DELAY_S", 600.0)
    model = init_random(cfg, on_device=False)
    model.set_linear_implementation("xla")
    model.set_expert_layout("mgpu_int4")
    assert capsys.readouterr().err == ""
