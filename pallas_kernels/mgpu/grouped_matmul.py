"""The 'mgpu' backend's grouped GEMM on its own (wna16_dispatch.GroupedMatmul) on weights in the
mgpu_int4 or mgpu_int8 layout: `grouped_matmul` on any AlignedRouting, and `linear`, the
quantized linear's GEMM (wna16_jax.linear: one expert).

grouped_matmul gathers the rows in block order (as the MoE layer does), the GEMM writes rows in
block order, and each slot's row is read back from its block position. A linear needs neither
gather: its rows in order are already in block order (a decode step's few rows fill part of
one block). A linear's rows are the small wgmma operand (8..256 per block), so a decode step
of one row reads the weight once; K splits give a narrow weight (kv_a_proj, N = 576) programs
for every SM (config.gemm_splits).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.mgpu.config import (
    MgpuConfig,
    default_config,
    fitted_stages,
    from_block_config,
    gemm_plan,
    gemm_rows_in_use,
    linear_splits,
    tile_n,
)
from pallas_kernels.mgpu.fused_moe import (
    block_gemm,
    block_positions,
    rows_in_block_order,
    used_blocks,
)
from pallas_kernels.mgpu.wna16_gemm import group_reason, mgpu_wna16_gemm, takes_rows
from wna16_jax import backend_api
from wna16_jax.backend_api import BlockConfig, GemmShape, normalize_activation, weighted_rows

# The name of the GEMM's table in the tuned files (wna16_jax/data/tuned/<device>.json): configs
# per GEMM (the quantized linear's, wj.grouped_matmul's), written by examples/tune.py.
TUNED_TABLE = "mgpu_gemm"

# The Mosaic GPU GEMM's output features per program and k-tile: a multiple of this tiles N and
# the group (the mgpu layouts' tiles are 64 x 64).
SPAN = 64

# A linear of 8-row blocks (decode) streams its weight: from this many k-steps its programs keep
# 4 in flight, not the layer's 3 (one H200, M=1, 256-wide k-steps: o_proj 26.0 -> 18.4 us,
# q_a + kv_a 17.2 -> 13.1, the shared expert's gate + up 16.2 -> 9.6; shorter K, q_b's 1536
# and the shared down's 2048, measured no better).
DEEP_PIPELINE_MIN_STEPS = 16
DEEP_PIPELINE_STAGES = 4


def gemm_shape_reason(shape: GemmShape, dtype: str) -> str | None:
    """Why the Mosaic GPU GEMM cannot run a GEMM of `shape` on activations of `dtype` (any
    platform; the layout, int4 or int8 in 64 x 64 tiles, is checked by selection)."""
    if dtype != "bfloat16":
        return f"activation dtype {dtype} is not bfloat16"
    return group_reason(shape.group)


def linear_config(shape: GemmShape) -> MgpuConfig:
    """The heuristic config of a GEMM of `shape` (a linear: shape.m rows on one expert):
    `default_config` at its rows per expert, with a program's features narrowed (block_n 64,
    then one consumer) until they tile N (e.g. kv_a_proj's 576 = 9 x 64 at 128-row blocks);
    8-row blocks over DEEP_PIPELINE_MIN_STEPS k-steps or more keep DEEP_PIPELINE_STAGES in
    flight (where they fit)."""
    cfg = default_config(max(shape.m, 1), shape.num_experts, shape.group, bits=shape.bits)
    if cfg.block_m == 8 and shape.k // cfg.block_k >= DEEP_PIPELINE_MIN_STEPS:
        deep = dataclasses.replace(cfg, stages=max(cfg.stages, DEEP_PIPELINE_STAGES))
        cfg = fitted_stages(deep, shape.group, shape.bits)
    if shape.n % tile_n(cfg):
        cfg = dataclasses.replace(cfg, block_n=SPAN)
    if shape.n % tile_n(cfg) and cfg.consumers > 1:
        cfg = dataclasses.replace(cfg, consumers=1)
    return cfg


# The GEMM's ConfigRules: a caller's MgpuConfig (or BlockConfig: `from_block_config`), else the
# device's TUNED_TABLE entry for exactly this GEMM at the nearest M (within
# backend_api.TUNED_M_RATIO), else
# `linear_config`. The GEMM checks a config against the shapes when it runs (mgpu_wna16_gemm's
# check_config).
GEMM_RULES = backend_api.ConfigRules(
    config_type=MgpuConfig,
    heuristic=linear_config,
    table=TUNED_TABLE,
    table_key=backend_api.gemm_table_key,
    converters={BlockConfig: from_block_config},
    entry_problem=backend_api.gemm_entry_shape,
)


def grouped_matmul(
    a, w, routing, routed_weights=None, *, top_k, config: MgpuConfig, out_dtype=None,
    activation=None, interpret=False,
):  # fmt: skip
    """GroupedMatmul.run on the Mosaic GPU GEMM: [R * top_k, N] (N/2 with an activation, "silu"
    or a ClampedSwiGLU, applied in the GEMM's epilogue where it tiles, `config.fuses_activation`)
    in out_dtype (default a's), from the f32 sums; routed weights multiply after the activation,
    in f32."""
    num_slots = a.shape[0] * top_k
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    slots, block_experts = used_blocks(routing, num_slots, config.block_m)
    x_rows = rows_in_block_order(a, slots, top_k, interpret=interpret)
    position, in_use = block_positions(slots, num_slots, config.block_m)
    gemm = block_gemm(config, interpret)
    if activation is None:
        out = gemm(x_rows, w, block_experts, gemm_rows_in_use(config, in_use))  # f32
    else:
        activation_dtype = out_dtype if routed_weights is None else jnp.float32
        out = gemm(
            x_rows, w, block_experts, gemm_rows_in_use(config, in_use),
            activation_dtype=activation_dtype, activation=_gated(activation),
        )  # fmt: skip
    return weighted_rows(out[position], routed_weights, out_dtype)


def _gated(activation):
    """A GEMM's gated activation as the GEMM takes it: "silu" or a ClampedSwiGLU."""
    gated = normalize_activation(activation)
    if gated is None:
        raise ValueError(f"activation={activation!r} is not 'silu' or a ClampedSwiGLU")
    return gated


def linear(x, w, *, config: MgpuConfig, out_dtype=None, activation=None, interpret=False):
    """GroupedMatmul.linear: x [R, K] @ dequant(w[0]).T -> [R, N] in out_dtype (default x's),
    rounded once from the f32 sums (in the GEMM where it is not K-split); with activation
    ("silu" or a ClampedSwiGLU) w's rows are [gate; up] and the result activation(gate, up)
    [R, N/2] (in the GEMM's epilogue where it fuses it, as GEMM1). x's rows are the GEMM's
    rows in block order, all of expert 0: as they are where the GEMM takes them
    (`takes_rows`: fewer than 8, part of one block: no padded copy of x, no slice of the
    output, a decode step's two kernels fewer per linear), else padded to whole blocks. The
    rows in use per block are static (all, the last block's remainder). K splits:
    config.splits, else `linear_splits` (a split gated GEMM applies the activation to the
    summed f32 partial products)."""
    if config.splits is None:
        splits = linear_splits(config, w, gated=activation is not None)
        config = dataclasses.replace(config, splits=splits)
    rows, block_m = x.shape[0], config.block_m
    blocks = -(-rows // block_m)
    x_rows = x
    if not takes_rows(rows, block_m):
        x_rows = jnp.pad(x, ((0, blocks * block_m - rows), (0, 0)))
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    in_use = np.minimum(block_m, rows - block_m * np.arange(blocks)).astype(np.int32)
    in_use = gemm_rows_in_use(config, jnp.asarray(in_use))
    experts = jnp.zeros(blocks, jnp.int32)
    if activation is not None:
        out = block_gemm(config, interpret)(
            x_rows, w, experts, in_use, activation_dtype=out_dtype, activation=_gated(activation)
        )
        return out[:rows]
    _, splits, _, options = gemm_plan(config, w, blocks, out_dtype=out_dtype)
    out = mgpu_wna16_gemm(x_rows, w, experts, in_use, **options, interpret=interpret)
    if splits > 1:
        out = out.sum(axis=0)
    return out[:rows].astype(out_dtype)
