"""The MoE layer from the Pallas kernels: align -> GEMM1 -> silu*up -> GEMM2 -> sum over top-k."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.triton import w8a8_gemm as w8a8
from pallas_kernels.triton.wna16_gemm import wna16_gemm
from wna16_jax import _configs, _reference
from wna16_jax._types import ActivationQuant, BlockConfig, QuantizedExperts

logger = logging.getLogger("wna16_jax")

# Tokens per chunk: bounds the [T*k, max(2I, H)] intermediates (and keeps them < 2^31 elements).
DEFAULT_CHUNK_TOKENS = 8192

_logged_configs: set = set()


def align(topk_ids, *, num_experts, block_m, expert_map, interpret):
    try:
        from pallas_kernels.common.align import moe_align_block_size
    except ImportError:  # pragma: no cover - the align kernel ships beside this file
        return _reference.moe_align_block_size(
            topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map
        )
    return moe_align_block_size(
        topk_ids,
        num_experts=num_experts,
        block_m=block_m,
        expert_map=expert_map,
        interpret=interpret,
    )


def gemm_configs(
    num_slots: int,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    config: BlockConfig | None,
    *,
    activation_quant: ActivationQuant | None = None,
    allow_fma: bool = True,
) -> tuple[BlockConfig, BlockConfig]:
    """The configs of GEMM1 (w13) and GEMM2 (w2); both share GEMM1's block_m (one alignment),
    and GEMM2 sums with dot="fma" when that block_m is below a tensor-core tile.

    With activation_quant the W8A8 GEMM's rules and heuristic apply (w8a8_gemm.resolve_config).
    allow_fma=False: tensor-core configs only (`_configs.resolve_config`), for GEMMs without
    the CUDA-core product (the Triton pipeline shares this function).
    Logs each new choice once at INFO with where it came from.
    """
    if activation_quant is None:
        shape_of = functools.partial(_configs.GemmShape.of_weights, m=num_slots)
        resolve = functools.partial(_configs.resolve_config, allow_fma=allow_fma)
        kind = "WNA16"
    else:
        shape_of = functools.partial(w8a8.gemm_shape, m=num_slots)
        resolve, kind = w8a8.resolve_config, f"W8A8 ({activation_quant.scheme})"
    shapes = [shape_of(w) for w in (w13, w2)]
    (c1, src1), (c2, src2) = (resolve(s, config) for s in shapes)
    c2 = dataclasses.replace(c2, block_m=c1.block_m)
    if c1.block_m < 16 and c2.dot == "mma":  # rows GEMM1 aligned below a tensor-core tile
        c2 = dataclasses.replace(c2, dot="fma")
    key = (kind, shapes[0], shapes[1], c1, c2)
    if key not in _logged_configs:
        _logged_configs.add(key)
        logger.info(
            "wna16_jax: fused_moe %s M=%d GEMM1 (N=%d, K=%d) %s [%s]; GEMM2 (N=%d, K=%d) %s [%s]",
            kind,
            num_slots,
            w13.n,
            w13.k,
            c1,
            src1,
            w2.n,
            w2.k,
            c2,
            src2,
        )
    return c1, c2


def sum_over_top_k(y, topk_ids, num_experts: int):
    """[T*k, H] per-slot outputs -> [T, H]: the sum over each token's k slots.

    Slots the alignment dropped (ids out of range) sit in no block, so their rows were never
    written: they are masked to zero here rather than read.
    """
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    placed = (flat >= 0) & (flat < num_experts)
    return jnp.where(placed[:, None], y, 0.0).reshape(t, k, -1).sum(axis=1)


def fuses_activation(c1: BlockConfig, w13: QuantizedExperts, activation: str) -> bool:
    """Whether GEMM1 computes the activation in its epilogue (not with split-K partials)."""
    return c1.split_k == 1 and activation == "silu" and (w13.n // 2) % c1.block_n == 0


def act_in_slice_major(c1: BlockConfig, c2: BlockConfig, w13, activation: str) -> bool:
    """Whether GEMM1's fused epilogue writes the activation in GEMM2's slice_major order."""
    return fuses_activation(c1, w13, activation) and c2.unpack == "slices"


def gemm1_and_activation(x, w13, w2, routing, *, top_k, c1, c2, activation, interpret):
    """[T, H] -> activation(x @ w13.T) per slot [T*k, I] in x.dtype, and whether its columns
    are in GEMM2's slice_major order (written so by GEMM1's fused epilogue)."""
    if fuses_activation(c1, w13, activation):
        to_slices = act_in_slice_major(c1, c2, w13, activation)
        act = wna16_gemm(
            x,
            w13,
            routing,
            top_k=top_k,
            config=c1,
            interpret=interpret,
            activation=activation,
            out_slice_major=(c2.block_k, w2.bits) if to_slices else None,
        )
        return act, to_slices
    # split-K partial sums: the activation runs after the whole sum.
    h = wna16_gemm(x, w13, routing, top_k=top_k, config=c1, interpret=interpret)  # [T*k, 2I]
    return _reference.ACTIVATIONS[activation](h.astype(jnp.float32)).astype(x.dtype), False


def gemm2_routed(act, w2, routing, topk_weights, *, c2, act_slice_major, interpret):
    """[T*k, I] -> f32 [T*k, H], each slot's row times its routed weight."""
    return wna16_gemm(
        act,
        w2,
        routing,
        topk_weights.reshape(-1).astype(jnp.float32),
        top_k=1,
        config=c2,
        out_dtype=jnp.float32,
        interpret=interpret,
        a_slice_major=act_slice_major,
    )


def _fused_moe_chunk(
    x, w13, w2, topk_weights, topk_ids, *, expert_map, activation, config, interpret
):
    t, k = topk_ids.shape
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    c1, c2 = gemm_configs(t * k, w13, w2, config)
    routing = align(
        topk_ids,
        num_experts=num_experts,
        block_m=c1.block_m,
        expert_map=expert_map,
        interpret=interpret,
    )
    act, act_slice_major = gemm1_and_activation(
        x, w13, w2, routing, top_k=k, c1=c1, c2=c2, activation=activation, interpret=interpret
    )  # [T*k, I]
    y = gemm2_routed(
        act, w2, routing, topk_weights, c2=c2, act_slice_major=act_slice_major, interpret=interpret
    )  # [T*k, H] f32, routed weights applied
    return sum_over_top_k(y, topk_ids, num_experts)


def _fused_moe_w8a8_chunk(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    *,
    expert_map,
    activation,
    activation_quant,
    config,
    interpret,
):
    t, k = topk_ids.shape
    num_experts = expert_map.shape[0] if expert_map is not None else w13.num_experts
    c1, c2 = gemm_configs(t * k, w13, w2, config, activation_quant=activation_quant)
    routing = align(
        topk_ids,
        num_experts=num_experts,
        block_m=c1.block_m,
        expert_map=expert_map,
        interpret=interpret,
    )
    # The quantization is _reference's own (XLA), so kernel and oracle quantize identically.
    q1, s1 = _reference.quantize_activations(x, activation_quant, 1)  # [T, H] int8, [T] f32
    h = w8a8.w8a8_gemm(q1, s1, w13, routing, top_k=k, config=c1, interpret=interpret)
    # h: [T*k, 2I] f32, kept in f32 up to the second quantization (no 16-bit rounding).
    act = _reference.ACTIVATIONS[activation](h)  # [T*k, I] f32
    q2, s2 = _reference.quantize_activations(act, activation_quant, 2)  # per slot row
    y = w8a8.w8a8_gemm(
        q2,
        s2,
        w2,
        routing,
        topk_weights.reshape(-1).astype(jnp.float32),
        top_k=1,
        config=c2,
        interpret=interpret,
    )  # [T*k, H] f32, routed weights applied
    return sum_over_top_k(y, topk_ids, num_experts)


@functools.partial(
    jax.jit,
    static_argnames=(
        "activation",
        "config",
        "interpret",
        "chunk_tokens",
        "activation_quant",
        "out_dtype",
    ),
)
def fused_moe(
    x,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    topk_weights,
    topk_ids,
    *,
    expert_map=None,
    activation: str = "silu",
    config: BlockConfig | None = None,
    interpret: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    activation_quant: ActivationQuant | None = None,
    out_dtype=None,
):
    """fused_moe (DESIGN.md steps 1-5) from the Pallas kernels; inputs already validated.

    With activation_quant (W8A8; w13 and w2 int8 per-channel symmetric): x is quantized to int8
    rows, GEMM1 runs int8 x int8 -> int32 with the scales in its epilogue (f32 out), silu(gate)
    * up in f32 is quantized again, and GEMM2 runs the same way with the routed weights.

    Args:
        x: [T, H] bf16/f16/f32.  w13: [E, 2I, H].  w2: [E, H, I].
        topk_weights: [T, k] float.  topk_ids: [T, k] int32 global ids.
        expert_map: optional int32 [E_global].  activation: "silu".
        config: BlockConfig for both GEMMs or None (tuned table, then heuristic, per GEMM).
        interpret: run the kernels under the Pallas interpreter.
        chunk_tokens: tokens per chunk for large T.
        activation_quant: None (16-bit activations) or an ActivationQuant with its scales.
        out_dtype: the output dtype (default x.dtype), rounded once from the f32 sum.

    Returns:
        [T, H] in out_dtype.
    """
    if activation_quant is None:
        chunk, extra = _fused_moe_chunk, {}
    else:
        chunk, extra = _fused_moe_w8a8_chunk, {"activation_quant": activation_quant}
    run = functools.partial(
        chunk,
        w13=w13,
        w2=w2,
        expert_map=expert_map,
        activation=activation,
        config=config,
        interpret=interpret,
        **extra,
    )
    return _reference.map_token_chunks(
        run, x, topk_weights, topk_ids, chunk_tokens=chunk_tokens, out_dtype=out_dtype
    )
