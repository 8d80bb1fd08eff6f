"""W8A8 grouped matmul: int8 activation rows x int8 per-channel weights, int32 dots, scaled."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import block_configs
from pallas_kernels.pallas._common import (
    grouped_gemm_call,
    grouped_gemm_program,
    operand_pairs,
    slice_major,
)
from wna16_jax import backend_api
from wna16_jax.backend_api import AlignedRouting, BlockConfig, QuantizedExperts, implicit_zero

# Triton's int8 tensor-core dot (mma k32) contracts at least 32 features (16 for 16-bit types).
MIN_INT8_DOT_K = 32

_INT_DOT = functools.partial(
    jax.lax.dot_general,
    dimension_numbers=(((1,), (1,)), ((), ())),
    preferred_element_type=jnp.int32,
)


def _tile_product(a_ref, qw_ref, e, row, n_idx, k0, *, block_k, unpack):
    """int32 [bm, bn] = a_q[row, k0:k0+bk] . (q - 128)[e, n_idx, k0:k0+bk], exact."""
    acc = None
    for a, v, _ in operand_pairs(
        a_ref, qw_ref, e, row, n_idx, k0, bits=8, block_k=block_k, unpack=unpack
    ):
        # Stored byte v in [0, 255] with the implicit zero 128 -> the signed weight in int8.
        w = (v.astype(jnp.int32) - implicit_zero(8)).astype(jnp.int8)  # [bn, W]
        part = _INT_DOT(a, w)  # int8 [bm, W] x int8 [bn, W] -> int32 [bm, bn]
        acc = part if acc is None else acc + part
    return acc


def _w8a8_kernel(
    ids_ref,  # [max_padded] int32 sorted slot ids
    eids_ref,  # [num_blocks] int32 expert of each block
    ntpp_ref,  # [1] int32
    a_ref,  # [R, K] int8 activations
    as_ref,  # [R] f32 activation scale of each row
    qw_ref,  # [E, N, K // 4] uint32, byte i of word j = k 4j+i
    s_ref,  # [E, N, 1] weight scale of each output channel
    rw_ref,  # [num_slots] f32 routed weights or None
    out_ref,  # [num_slots + 1, N] f32; row num_slots is a spare row for padding
    *,
    num_slots,
    top_k,
    n,
    k,
    config: BlockConfig,
):
    def tile_product(e, row, n_idxs, k0):
        return tuple(
            _tile_product(
                a_ref, qw_ref, e, row, n_idx, k0, block_k=config.block_k, unpack=config.unpack
            )
            for n_idx in n_idxs
        )

    def epilogue(acc, e, row, n_idx):
        w_scale = plgpu.load(s_ref.at[e, n_idx, 0]).astype(jnp.float32)  # [bn]
        a_scale = plgpu.load(as_ref.at[row])  # [bm]
        # The order of _reference.grouped_matmul_int8: ((acc * w_scale) * a_scale).
        return (acc.astype(jnp.float32) * w_scale[None, :]) * a_scale[:, None]

    grouped_gemm_program(
        ids_ref,
        eids_ref,
        ntpp_ref,
        rw_ref,
        out_ref,
        num_slots=num_slots,
        top_k=top_k,
        n=n,
        k=k,
        config=config,
        tile_product=tile_product,
        acc_dtype=jnp.int32,
        epilogue=epilogue,
    )


def weight_problems(qw: QuantizedExperts) -> list[str]:
    """Why `qw` is not int8 per-channel symmetric (empty when it is)."""
    problems = []
    if qw.bits != 8:
        problems.append(f"bits={qw.bits} (needs 8)")
    if qw.group != qw.k:
        problems.append(f"group_size={qw.group_size} (needs -1: one scale per output channel)")
    if qw.has_zeros:
        problems.append("zero points (needs symmetric weights, zeros=None)")
    return problems


def gemm_shape(qw: QuantizedExperts, m: int = 0) -> backend_api.GemmShape:
    _, n, k = qw.shape
    return backend_api.GemmShape(
        m=m, n=n, k=k, num_experts=qw.num_experts, bits=8, group=k, group_size=-1
    )


def config_problems(config: BlockConfig, shape: backend_api.GemmShape) -> list[str]:
    """Why `config` cannot run the W8A8 GEMM `shape`: the WNA16 rules plus the int8 dot's."""
    problems = block_configs.config_problems(config, shape)
    if config.dot != "mma":
        problems.append(f"dot={config.dot!r}: the W8A8 GEMM runs int8 tensor-core dots only")
    per_dot = config.block_k // 4 if config.unpack == "slices" else config.block_k
    if per_dot < MIN_INT8_DOT_K:
        problems.append(
            f"block_k={config.block_k} with unpack={config.unpack!r} contracts {per_dot} "
            f"features per int8 dot, below {MIN_INT8_DOT_K} (int8 tensor-core dots)"
        )
    return problems


def check_config(config: BlockConfig, shape: backend_api.GemmShape) -> None:
    """Raises ValueError quoting the values when `config` cannot run the W8A8 GEMM `shape`."""
    problems = config_problems(config, shape)
    if problems:
        raise ValueError(
            f"config {config} cannot run the W8A8 GEMM (N={shape.n}, K={shape.k}): "
            + "; ".join(problems)
        )


def heuristic_config(shape: backend_api.GemmShape) -> BlockConfig:
    """An untuned W8A8 config: the WNA16 heuristic's, with a k-tile the int8 dot accepts.

    Per-channel weights put no group limit on block_k; when the heuristic's "slices" tile is too
    narrow for an int8 dot (K not a multiple of 128), one dot over a "tile" of 64 or 32 runs.
    """
    config = block_configs.heuristic_config(shape, allow_fma=False)  # int8 tensor-core dots only
    if config_problems(config, shape):
        bk = next((b for b in (64, 32) if shape.k % b == 0), MIN_INT8_DOT_K)
        config = dataclasses.replace(config, block_k=bk, unpack="tile")
    check_config(config, shape)
    return config


# The W8A8 GEMM's ConfigRules: its int8 dot's validity rules and heuristic, no tuned table (the
# tuned tables time the 16-bit-activation GEMM).
RULES = backend_api.ConfigRules(
    config_type=BlockConfig, heuristic=heuristic_config, check=check_config
)


@functools.partial(jax.jit, static_argnames=("top_k", "config", "interpret"))
def w8a8_gemm(
    a_q,
    a_scale,
    qw: QuantizedExperts,
    routing: AlignedRouting,
    routed_weights=None,
    *,
    top_k: int,
    config: BlockConfig,
    interpret: bool = False,
):
    """Grouped matmul of gathered int8 activation rows with int8 per-channel expert weights.

    out[s] = (a_q[r] . (q - 128)[e(s)]) * w_scale[e(s), n] * a_scale[r] * routed_weights[s]
    with r = s // top_k and e(s) the expert of the block holding s (zeros for expert -1): the
    dots are int8 x int8 -> int32 (exact), the scales are applied in f32 once per k-range.

    Args:
        a_q: int8 [R, K] quantized activations; the routing's slots number R * top_k.
        a_scale: f32 [R] scale of each row (per token, or one static value repeated).
        qw: QuantizedExperts [E, N, K] with bits=8, group_size=-1 and zeros=None.
        routing: AlignedRouting with block_m == config.block_m.
        routed_weights: optional f32 [R * top_k] per-slot multipliers.
        top_k: slots per activation row.
        config: BlockConfig (see `config_problems`; split_k > 1 accumulates the scaled partial
            tiles with f32 atomic adds into a zeroed buffer).
        interpret: run under the Pallas interpreter (any platform).

    Returns:
        f32 [R * top_k, N]. Rows of slots that sit in no block (ids the alignment dropped) are
        not written when split_k == 1 and are zero when split_k > 1: callers mask them.

    Raises:
        ValueError: weights that are not int8 per-channel symmetric, a config that cannot run,
            or mismatched shapes.
    """
    bad = weight_problems(qw)
    if bad:
        raise ValueError(
            f"w8a8_gemm needs int8 per-channel symmetric weights; got {', '.join(bad)}"
        )
    check_config(config, gemm_shape(qw))
    if a_q.dtype != jnp.int8 or a_q.ndim != 2:
        raise ValueError(f"a_q must be int8 [R, K], got {a_q.dtype} {tuple(a_q.shape)}")
    r, k = a_q.shape
    if tuple(a_scale.shape) != (r,):
        raise ValueError(f"a_scale shape {tuple(a_scale.shape)} != (R,) = {(r,)}")
    block_configs.check_gemm_operands(config, routing, k, qw)
    n = qw.n
    num_slots = r * top_k
    if config.unpack == "slices":
        a_q = slice_major(a_q, block_k=config.block_k, bits=8)
    kernel = functools.partial(
        _w8a8_kernel, num_slots=num_slots, top_k=top_k, n=n, k=k, config=config
    )
    return grouped_gemm_call(
        kernel,
        [a_q, a_scale.astype(jnp.float32), qw.qweight, qw.scales, routed_weights],
        routing=routing,
        num_slots=num_slots,
        n=n,
        out_dtype=jnp.float32,
        config=config,
        interpret=interpret,
        name="w8a8_gemm",
    )
