"""Public entry points: validate the inputs, then dispatch to a backend."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from wna16_jax import _activations, _dispatch, _pipeline
from wna16_jax._checks import (
    as_int,
    check_array,
    check_config,
    check_expert_map,
    check_out_dtype,
    check_values_in,
    ids_as_int32,
)
from wna16_jax._configs import GemmShape, batch_invariant_config
from wna16_jax._inference_only import inference_only
from wna16_jax._routing import slot_experts
from wna16_jax._types import (
    ACTIVATION_QUANT_SCHEMES,
    MAX_ARRAY_ELEMENTS,
    ActivationQuant,
    AlignedRouting,
    BlockConfig,
    QuantizedExperts,
)

ClampedSwiGLU = _activations.ClampedSwiGLU
ACTIVATION_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _shape(a) -> tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def _check_elements(name: str, a) -> None:
    n = int(np.prod(_shape(a)))
    if n > MAX_ARRAY_ELEMENTS:
        raise ValueError(
            f"{name} has {n} elements, over the 2^31 limit of int32 kernel indexing; "
            f"shard the experts or the tokens so each device holds fewer"
        )


def _check_topk_ids(topk_ids) -> None:
    check_array("topk_ids", topk_ids)
    if topk_ids.ndim != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {_shape(topk_ids)}")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids has shape {_shape(topk_ids)}: each token needs k >= 1 experts")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(
            f"topk_ids must be an integer array, got {topk_ids.dtype} (float ids are refused, "
            f"not rounded)"
        )
    _check_elements("topk_ids", topk_ids)


def normalize_activation_quant(activation_quant) -> ActivationQuant | None:
    """None, "int8_per_token" or an ActivationQuant -> ActivationQuant or None.

    Raises:
        ValueError: any other value, or an "int8_static" ActivationQuant without both scales.
    """
    if activation_quant is None:
        return None
    if isinstance(activation_quant, str) and activation_quant == "int8_per_token":
        return ActivationQuant(scheme="int8_per_token")
    if not isinstance(activation_quant, ActivationQuant):
        hint = ""
        if isinstance(activation_quant, str) and activation_quant in ACTIVATION_QUANT_SCHEMES:
            hint = (
                " (static scales: pass wj.ActivationQuant('int8_static', gemm1_scale=..., "
                "gemm2_scale=...))"
            )
        raise ValueError(
            f"activation_quant={activation_quant!r} is not supported; accepted: None (16-bit "
            f"activations), 'int8_per_token', or a wj.ActivationQuant with scheme in "
            f"{ACTIVATION_QUANT_SCHEMES}{hint}"
        )
    if not activation_quant.has_scales:
        raise ValueError(
            f"activation_quant={activation_quant}: scheme 'int8_static' needs both gemm1_scale "
            f"and gemm2_scale (e.g. the checkpoint's input_scale, max over experts)"
        )
    return activation_quant


def _check_activation(activation):
    """The activation as the backends see it (`_activations.normalize_activation`)."""
    normalized = _activations.normalize_activation(activation)
    if normalized is None:
        raise ValueError(
            f"activation={activation!r} is not supported (supported: "
            f"{sorted(_activations.ACTIVATIONS)} or a wj.ClampedSwiGLU)"
        )
    return normalized


def _check_bias(name: str, bias, want: tuple[int, int]) -> None:
    """A per-expert bias: float [E, N] (`want`)."""
    check_array(name, bias)
    if _shape(bias) != want:
        raise ValueError(f"{name} must be [E, N] = {list(want)}, got shape {_shape(bias)}")
    if bias.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name} dtype must be bfloat16, float16 or float32, got {bias.dtype}")


def validate_fused_moe_inputs(
    x, w13, w2, topk_weights, topk_ids, expert_map, activation, *, w13_bias=None, w2_bias=None
):
    """Raises ValueError naming the values for any malformed fused_moe input (TypeError for a
    non-array); returns expert_map checked against the local expert count (`check_expert_map`)."""
    check_array("x", x)
    check_array("topk_weights", topk_weights)
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {_shape(x)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x dtype must be bfloat16, float16 or float32, got {x.dtype}")
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, QuantizedExperts):
            raise ValueError(f"{name} must be a QuantizedExperts, got {type(w).__name__}")
        w.validate(name)
    if w13.layout != w2.layout:
        raise ValueError(f"w13 is in the {w13.layout!r} layout but w2 in {w2.layout!r}")
    if w2.has_perm:
        raise ValueError(
            "w2 has an input permutation (perm, act-order): fused_moe applies w13's only; move "
            "w2's into w13's rows once, at load (wna16_jax.formats.fold_w2_act_order)"
        )
    t, h = _shape(x)
    e, two_i, h13 = w13.shape
    if h13 != h:
        raise ValueError(f"w13 has K={h13} input features but x has H={h}")
    if two_i % 2:
        raise ValueError(f"w13 must have an even number of rows (gate and up), got N={two_i}")
    i = two_i // 2
    if w2.shape != (e, h, i):
        raise ValueError(
            f"w2 shape {w2.shape} != expected (E, H, I) = {(e, h, i)} from w13 {w13.shape} "
            f"and x {_shape(x)}"
        )
    _check_topk_ids(topk_ids)
    if topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows but x has T={t}")
    if _shape(topk_weights) != _shape(topk_ids):
        raise ValueError(
            f"topk_weights shape {_shape(topk_weights)} != topk_ids shape {_shape(topk_ids)}"
        )
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if expert_map is not None:
        expert_map = check_expert_map(expert_map, num_global=None, num_local=e)
        if expert_map.shape[0] < e:
            raise ValueError(
                f"expert_map has {expert_map.shape[0]} entries, fewer than the {e} local experts"
            )
    _check_activation(activation)
    if w13_bias is not None:
        _check_bias("w13_bias", w13_bias, (e, two_i))
    if w2_bias is not None:
        _check_bias("w2_bias", w2_bias, (e, h))
    _check_elements("x", x)
    return expert_map


def _moe_problem(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    expert_map,
    activation,
    activation_quant,
    batch_invariant=False,
    w13_bias=None,
    w2_bias=None,
):
    """Validates the inputs; returns (MoEProblem, normalized activation_quant, checked
    expert_map)."""
    expert_map = validate_fused_moe_inputs(
        x, w13, w2, topk_weights, topk_ids, expert_map, activation,
        w13_bias=w13_bias, w2_bias=w2_bias,
    )  # fmt: skip
    activation = _check_activation(activation)
    activation_quant = normalize_activation_quant(activation_quant)
    t, h = _shape(x)
    e, two_i, _ = w13.shape
    problem = _dispatch.MoEProblem(
        platform=_dispatch.current_platform(),
        num_tokens=t,
        hidden=h,
        intermediate=two_i // 2,
        num_experts=e,
        num_global_experts=int(expert_map.shape[0]) if expert_map is not None else e,
        top_k=int(topk_ids.shape[1]),
        bits=w13.bits,
        group_size=w13.group_size,
        w13_group=w13.group,
        w2_group=w2.group,
        has_zeros=w13.has_zeros,
        dtype=jnp.dtype(x.dtype).name,
        activation=activation,
        w2_bits=w2.bits,
        w2_group_size=w2.group_size,
        w2_has_zeros=w2.has_zeros,
        activation_quant=None if activation_quant is None else activation_quant.scheme,
        layout=w13.layout,
        act_order=w13.has_perm,
        codes=w13.codes,
        w2_codes=w2.codes,
        has_bias=w13_bias is not None or w2_bias is not None,
        batch_invariant=_check_flag("batch_invariant", batch_invariant),
    )
    return problem, activation_quant, expert_map


def _check_flag(name: str, value) -> bool:
    """A static boolean argument: True or False (a traced or non-bool value is refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False (a static argument), got {value!r}")
    return bool(value)


_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def fused_moe(
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    expert_map=None,
    activation: str | ClampedSwiGLU = "silu",
    implementation: str | Sequence[str] | None = None,
    config: BlockConfig | object | None = None,
    activation_quant: str | ActivationQuant | None = None,
    out_dtype=None,
    batch_invariant: bool = False,
    w13_bias=None,
    w2_bias=None,
):
    """A whole MoE layer with weight-only quantized experts (docs/design.md, steps 1-5).

    out[t] = sum_j topk_weights[t, j] * w2[e] @ act(w13[e] @ x[t]),  e = topk_ids[t, j],
    where act splits its input into gate (rows 0..I-1) and up (rows I..2I-1). With biases
    (gpt-oss): out[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) +
    b2[e]), the bias added to each expert's output before its routing weight multiplies it.

    With activation_quant (W8A8) both GEMM inputs (x, and act's output) are quantized to
    symmetric int8 with one scale per row (per token, or the given static scales), the GEMMs
    multiply int8 x int8 into int32 and apply activation and weight scales in the epilogue.
    The Pallas kernels need int8 per-channel symmetric weights for it (bits=8,
    group_size=-1, zeros=None: `quantize_experts(w, bits=8, group_size=-1, has_zp=False)` or
    a compressed-tensors int8 channel/tensor checkpoint); the 'xla' backend takes any weights.

    Args:
        x: [T, H] bf16, f16 or f32 activations.
        w13: QuantizedExperts [E, 2I, H] (gate rows, then up rows).
        w2: QuantizedExperts [E, H, I].
        topk_weights: [T, k] float routing weights.
        topk_ids: [T, k] global expert ids of any integer dtype; ids outside [0, E_global)
            are dropped (compared in their own dtype: an int64 2**32 is dropped, not wrapped).
        expert_map: optional integer [E_global]: global id -> local id in [0, E), -1 for
            experts on other shards (they contribute exactly zero). An entry outside [-1, E) is
            a ValueError for a concrete map; a traced one is checked only under
            `jax.experimental.checkify.checkify` (no host sync inside jit), else its slots are
            dropped.
        activation: "silu" (silu(gate) * up), "swiglu_oai" (gpt-oss's clamped SwiGLU with its
            defaults) or a wj.ClampedSwiGLU(alpha=, limit=).
        implementation: None (automatic), a backend name ("xla", "pallas",
            "pallas_interpret", "mgpu", "triton", ...: `registered_backends()`), or names
            tried in order.
        config: optional BlockConfig for the kernels; None = the device's tuned table for the
            problem (nearest M), then the backend's heuristic. The 'mgpu' backend also takes
            its own MgpuConfig (a BlockConfig gives it block_m, block_k and num_stages).
        activation_quant: None (16-bit activations: WNA16), "int8_per_token" (dynamic
            per-token int8), or a wj.ActivationQuant (e.g. static per-tensor scales).
        out_dtype: the output dtype, default x.dtype. Every backend sums the top-k slots in
            f32 and rounds once to it; float32 keeps partial layers exact for a later sum
            (the sharded layer adds its shards' partials in f32 this way).
        w13_bias: optional [E, 2I] float (bf16, f16 or f32) per-expert bias of GEMM1, rows in
            w13's [gate; up] order, added to GEMM1's f32 sums before the activation.
        w2_bias: optional [E, H] float per-expert bias of GEMM2, added to each expert's output
            row before its routing weight multiplies it. A backend without biases says so
            and is skipped.
        batch_invariant: static; True computes each token's row in an order that does not
            depend on the other tokens of the call (how many, or where the token sits): configs
            fixed for the weights' shape (not chosen by T), no K split, the k slots summed in
            order, the same padding for every T. Row t of a call then equals the same token's
            call alone bit for bit, and every run gives the same bits. A backend that cannot
            guarantee it is refused with its reason (docs/design.md, 'Batch invariance').

    Returns:
        [T, H] in out_dtype.

    Raises:
        TypeError: an array argument that is not an array (a Python list: convert it first).
        ValueError: malformed inputs or a config that cannot run these shapes.
        NotImplementedError: no requested backend can run the problem (reasons listed).
    """
    problem, activation_quant, expert_map = _moe_problem(
        x, w13, w2, topk_weights, topk_ids, expert_map, activation, activation_quant,
        batch_invariant, w13_bias, w2_bias,
    )  # fmt: skip
    check_out_dtype(out_dtype)
    check_config(config)
    if out_dtype is not None and jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(
            f"out_dtype={out_dtype!r} must be one of {[d.name for d in _OUT_DTYPES]} (or None)"
        )
    backend = _dispatch.select_backend(problem, implementation)
    # Only W8A8 calls pass activation_quant, and only callers asking another output dtype
    # pass out_dtype: a backend that never accepts them needs no such args.
    extra = {} if activation_quant is None else {"activation_quant": activation_quant}
    if out_dtype is not None and jnp.dtype(out_dtype) != jnp.dtype(x.dtype):
        extra["out_dtype"] = jnp.dtype(out_dtype)
    # Only calls with biases pass them: a backend without biases needs no such args.
    for name, bias in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        if bias is not None:
            extra[name] = inference_only(bias)
    if problem.batch_invariant:
        extra["batch_invariant"] = True
    # A kernel backend's stages run in the library's pipeline; the reference is its own layer.
    layer = backend.fused_moe
    if backend.stages is not None:
        layer = functools.partial(_pipeline.run, backend.stages)
    return layer(
        inference_only(x),
        w13,
        w2,
        inference_only(topk_weights),
        ids_as_int32(topk_ids, problem.num_global_experts),
        expert_map=expert_map,
        activation=problem.activation,
        config=config,
        **extra,
    )


def select_implementation(
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    expert_map=None,
    activation: str = "silu",
    implementation: str | Sequence[str] | None = None,
    activation_quant=None,
    batch_invariant: bool = False,
    w13_bias=None,
    w2_bias=None,
) -> str:
    """The name of the backend `fused_moe` would use for these arguments (nothing runs).

    Takes the same arguments as `fused_moe`; arrays may be jax.ShapeDtypeStruct.

    Raises:
        The errors `fused_moe` raises before running anything.
    """
    problem, _, _ = _moe_problem(
        x, w13, w2, topk_weights, topk_ids, expert_map, activation, activation_quant,
        batch_invariant, w13_bias, w2_bias,
    )  # fmt: skip
    return _dispatch.select_backend(problem, implementation).name


def moe_align_block_size(
    topk_ids,
    *,
    num_experts: int,
    block_m: int,
    expert_map=None,
    implementation: str | Sequence[str] | None = None,
) -> AlignedRouting:
    """Sorts the T*k (token, slot) pairs into per-expert runs padded to block_m.

    Args:
        topk_ids: [T, k] global expert ids of any integer dtype; ids outside
            [0, num_experts) are dropped (compared in their own dtype, never wrapped).
        num_experts: E, the global number of experts (an int or numpy integer).
        block_m: the padding multiple (a power of two).
        expert_map: optional integer [num_experts] global -> local id, -1 off-shard; entries
            outside [-1, num_experts) are refused as for `fused_moe`.
        implementation: as for `fused_moe`.

    Returns:
        AlignedRouting (sorted_token_ids, expert_ids, num_tokens_post_padded); docs/design.md gives
        the layout.

    Raises:
        TypeError: a non-array topk_ids or expert_map, a non-integer num_experts or block_m.
        ValueError: bad shapes or dtypes, out-of-range counts, a concrete expert_map entry
            out of range.
    """
    _check_topk_ids(topk_ids)
    num_experts = as_int("num_experts", num_experts, minimum=1)
    block_m = as_int("block_m", block_m)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two")
    if expert_map is not None:
        expert_map = check_expert_map(expert_map, num_global=num_experts, num_local=num_experts)
    problem = _dispatch.AlignProblem(
        platform=_dispatch.current_platform(),
        num_slots=int(np.prod(_shape(topk_ids))),
        num_experts=num_experts,
        block_m=block_m,
    )
    backend = _dispatch.select_backend(problem, implementation)
    return backend.moe_align_block_size(
        ids_as_int32(topk_ids, num_experts),
        num_experts=num_experts,
        block_m=block_m,
        expert_map=None if expert_map is None else expert_map.astype(jnp.int32),
    )


def _gemm_problem(
    w: QuantizedExperts, num_slots: int, dtype, batch_invariant=False
) -> _dispatch.GemmProblem:
    if not isinstance(w, QuantizedExperts):
        raise ValueError(f"w must be a QuantizedExperts, got {type(w).__name__}")
    w.validate("w")
    if jnp.dtype(dtype) not in ACTIVATION_DTYPES:
        raise ValueError(f"the activation dtype must be bfloat16, float16 or float32, got {dtype}")
    return _dispatch.GemmProblem(
        platform=_dispatch.current_platform(),
        shape=GemmShape.of_weights(w, m=num_slots),
        dtype=jnp.dtype(dtype).name,
        has_zeros=w.has_zeros,
        layout=w.layout,
        batch_invariant=_check_flag("batch_invariant", batch_invariant),
    )


def gemm_config_for(backend, problem: _dispatch.GemmProblem, config):
    """(config, source) of `backend`'s grouped GEMM for `problem`: GroupedMatmul.config, at a
    fixed M without a K split where the problem is batch-invariant (`batch_invariant_config`)."""
    if problem.batch_invariant:
        return batch_invariant_config(backend.grouped_matmul.config, problem.shape, config)
    return backend.grouped_matmul.config(problem.shape, config)


def gemm_config(
    w: QuantizedExperts,
    num_slots: int,
    *,
    dtype=jnp.bfloat16,
    implementation: str | Sequence[str] | None = None,
    config: BlockConfig | None = None,
    batch_invariant: bool = False,
) -> BlockConfig:
    """The BlockConfig a backend's grouped GEMM runs for `num_slots` rows over `w` (nothing runs).

    Args:
        w: QuantizedExperts [E, N, K].
        num_slots: M, the GEMM's rows (token slots, T*k).
        dtype: the activations' dtype.
        implementation: as for `grouped_matmul`.
        config: a BlockConfig to check against the shapes (returned when it fits).
        batch_invariant: the config `grouped_matmul(..., batch_invariant=True)` runs: the
            same for every num_slots, without a K split.

    Returns:
        config, else the device's tuned table's (nearest M of this problem), else the
        backend's heuristic.

    Raises:
        ValueError: a config that cannot run the shapes (the problems quoted), bad inputs.
        NotImplementedError: no requested backend has a grouped GEMM that runs it.
    """
    num_slots = as_int("num_slots", num_slots, minimum=0)
    problem = _gemm_problem(w, num_slots, dtype, batch_invariant)
    backend = _dispatch.select_backend(problem, implementation)
    return gemm_config_for(backend, problem, config)[0]


def grouped_matmul(
    a,
    w: QuantizedExperts,
    routing: AlignedRouting,
    routed_weights=None,
    *,
    top_k: int,
    config: BlockConfig | None = None,
    implementation: str | Sequence[str] | None = None,
    out_dtype=None,
    activation: str | None = None,
    batch_invariant: bool = False,
):
    """The grouped GEMM of fused_moe (its steps 2 and 4) on its own, through a backend's kernel.

    out[s] = a[s // top_k] @ dequant(w[e(s)]).T * routed_weights[s] for each slot s of the
    routing, e(s) the expert of the block holding s (zeros for blocks of expert -1); with
    activation, out[s] = activation(a[s // top_k] @ dequant(w[e(s)]).T) * routed_weights[s].
    dequant is `dequantize_experts` (an input permutation w.perm is applied to each slot's row).

    Args:
        a: [R, K] bf16, f16 or f32 rows; the routing's slots number R * top_k.
        w: QuantizedExperts [E, N, K].
        routing: AlignedRouting of the R * top_k slots (`moe_align_block_size`); a block's
            expert outside [-1, E) is refused as `fused_moe` refuses such an expert_map entry.
        routed_weights: optional float [R * top_k] multiplied into each slot's row.
        top_k: slots per row of `a`.
        config: a BlockConfig with block_m == routing.block_m; None: the backend's
            (`gemm_config`), which must then have the routing's block_m.
        implementation: None (automatic), a backend name with a grouped GEMM ("xla", "pallas",
            "pallas_interpret", "triton"), or names tried in order.
        out_dtype: the output dtype (default a.dtype), rounded once from the f32 sums.
        activation: None, or "silu": w's rows are [gate; up] (w13) and the result is
            silu(gate) * up of the f32 sums, [R * top_k, N/2].
        batch_invariant: static; each slot's row computed in an order that does not depend on
            the number of slots (the config of `gemm_config(..., batch_invariant=True)`: fixed
            for w's shape, no K split; align the routing with its block_m).

    Returns:
        [R * top_k, N] (N/2 with activation) in out_dtype. Rows of slots that sit in no block
        (ids the alignment dropped) are unspecified.

    Raises:
        ValueError: malformed inputs, or a config that cannot run the shapes.
        NotImplementedError: no requested backend can run the GEMM (reasons listed).
    """
    check_array("a", a)
    if a.ndim != 2:
        raise ValueError(f"a must be [R, K], got shape {_shape(a)}")
    top_k = as_int("top_k", top_k, minimum=1)
    problem = _gemm_problem(w, int(a.shape[0]) * top_k, a.dtype, batch_invariant)
    if a.shape[1] != w.k:
        raise ValueError(f"a has K={a.shape[1]} input features but w has K={w.k}")
    if not isinstance(routing, AlignedRouting):
        raise ValueError(f"routing must be an AlignedRouting, got {type(routing).__name__}")
    expert_ids = check_values_in(
        "routing.expert_ids", routing.expert_ids, w.shape[0], "experts of w"
    )
    routing = dataclasses.replace(routing, expert_ids=expert_ids)
    check_out_dtype(out_dtype)
    num_slots = int(a.shape[0]) * top_k
    if routed_weights is not None:
        check_array("routed_weights", routed_weights)
    if routed_weights is not None and _shape(routed_weights) != (num_slots,):
        raise ValueError(
            f"routed_weights must be [R * top_k] = [{num_slots}], got {_shape(routed_weights)}"
        )
    if activation is not None:
        activation = _check_activation(activation)
        if w.n % 2:
            raise ValueError(f"activation needs w's rows as [gate; up]: N={w.n} is odd")
    _check_elements("a", a)
    backend = _dispatch.select_backend(problem, implementation)
    config, _ = gemm_config_for(backend, problem, config)
    if config.block_m != routing.block_m:
        raise ValueError(
            f"the routing was aligned with block_m={routing.block_m} but the config has "
            f"block_m={config.block_m} ({config}); align with the config's block_m "
            f"(gemm_config) or pass a config"
        )
    if w.has_perm:  # act-order: each slot's row in its block's expert's input order
        experts = slot_experts(routing, num_slots)
        a = _pipeline.rows_in_input_order(jnp.repeat(a, top_k, axis=0), experts, w.perm)
        w, top_k = dataclasses.replace(w, perm=None), 1
    return backend.grouped_matmul.run(
        inference_only(a),
        w,
        routing,
        routed_weights,
        top_k=top_k,
        config=config,
        out_dtype=out_dtype,
        activation=activation,
    )


def preferred_layout(
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    *,
    dtype,
    activation: str = "silu",
    activation_quant: str | ActivationQuant | None = None,
    batch_invariant: bool = False,
) -> str:
    """The layout to convert these experts to once (at load) for the fastest backend that runs
    them on this platform: the first of _dispatch.preferred_layouts() that holds their bits and
    whose backend accepts the fused_moe problem of these arguments here, else "canonical".

    For mgpu_int4 / mgpu_int8 (the 'mgpu' backend) that is an sm_90 GPU, int4 / int8 for both
    weights, silu, feature counts in multiples of 64, groups of 16, 32 or multiples of 64
    (scales in bfloat16, float16 or float32), and either bfloat16
    activations or, with activation_quant (W8A8), symmetric int8 weights and any x dtype (the
    GEMMs read int8 rows).

    Args:
        w13, w2: the experts, as fused_moe takes them (arrays may be jax.ShapeDtypeStruct).
        dtype: the activation dtype x will have.
        activation: fused_moe's activation.
        activation_quant: fused_moe's activation_quant (None: 16-bit activations).
        batch_invariant: fused_moe's (a backend that refuses it is passed over).

    Raises:
        ValueError: experts (or a dtype, activation, activation_quant) that fused_moe itself
            would refuse.
    """
    top_k = 1
    x = jax.ShapeDtypeStruct((1, w13.shape[2]), dtype)
    ids = jax.ShapeDtypeStruct((1, top_k), jnp.int32)
    weights = jax.ShapeDtypeStruct((1, top_k), jnp.float32)
    problem, _, _ = _moe_problem(
        x, w13, w2, weights, ids, None, activation, activation_quant, batch_invariant
    )
    for layout, name in _dispatch.preferred_layouts():
        bits = _dispatch.layout_bits(layout)
        if (w13.bits, w2.bits) != (bits, bits):  # a kernel layout holds one bit width
            continue
        candidate = dataclasses.replace(problem, layout=layout)
        backend = _dispatch.get_backend(name)
        if _dispatch.backend_reason(backend, candidate) is None:
            return layout
    return "canonical"
