"""The MoE layer on the Mosaic GPU GEMM (the 'mgpu' backend): the pipeline's stages with x's rows
gathered in block order, GEMM1 with its bias and gated activation, GEMM2 with its bias, and the
routed weights in the top-k sum.

Unlike the Triton-lowered GEMMs, these take rows already in block order (x gathered once), write
rows in block order, and the top-k sum gathers each slot's row back and applies its routed
weight. Weights are QuantizedExperts in the "mgpu_int4" or "mgpu_int8" layout
(wna16_jax.layouts). Per-expert biases (gpt-oss's) are added to the f32 sums in the GEMMs'
epilogues: w13_bias [E, 2I] before the activation ("silu", or gpt-oss's ClampedSwiGLU), w2_bias
[E, H] to GEMM2's rows, which the top-k sum then weights, as the 'xla' reference does.

W8A8 (activation_quant, symmetric mgpu_int8 weights): x is quantized to int8 rows per the
scheme and put in the W8A8 GEMM's input order once, before its rows are gathered; GEMM1's f32
activation is quantized again for GEMM2 (the pipeline's step) and put in that order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import gather_rows
from pallas_kernels.common.align import moe_align_block_size
from pallas_kernels.mgpu.config import MgpuConfig, gemm_plan, gemm_rows_in_use, layer_config
from pallas_kernels.mgpu.convert import w8a8_input_order
from pallas_kernels.mgpu.wna16_gemm import mgpu_wna16_gemm
from wna16_jax import backend_api
from wna16_jax.backend_api import (
    ActivationQuant,
    BlockConfig,
    Int8Rows,
    activate,
    local_expert_of,
)


def rows_in_block_order(x, slots, top_k: int, *, interpret: bool = False):
    """x's row of each aligned slot ([P, H]; padding slots, ids >= T*k, get zero rows): the
    gather_rows kernel where its tiles fit (faster than XLA's gather and select: docs/
    performance.md, 'Mosaic GPU layer'), else `xla_rows_in_block_order`. Int8Rows: their rows
    and scales (a padding slot's scale 0)."""
    if isinstance(x, Int8Rows):
        placed = slots < x.scale.shape[0] * top_k
        scale = jnp.where(placed, x.scale[jnp.where(placed, slots // top_k, 0)], 0.0)
        return Int8Rows(rows_in_block_order(x.q, slots, top_k, interpret=interpret), scale)
    if gather_rows.tile_shape(slots.shape[0], x.shape[1]) is None:
        return xla_rows_in_block_order(x, slots, top_k)
    ids = jnp.where(slots < x.shape[0] * top_k, slots // top_k, -1)
    return gather_rows.gather_rows(x, ids, interpret=interpret)


def xla_rows_in_block_order(x, slots, top_k: int):
    """rows_in_block_order by XLA's gather and select."""
    placed = slots < x.shape[0] * top_k
    return jnp.where(placed[:, None], x[jnp.where(placed, slots // top_k, 0)], 0).astype(x.dtype)


def used_blocks(routing, num_slots: int, block_m: int):
    """The aligned slots [B*block_m] and block experts [B] of the B = min(blocks, num_slots)
    leading blocks: every block holding a slot is among them (each holds at least one slot and
    the runs are packed from the start, docs/design.md), so the GEMMs skip the trailing empty ones
    (at T=1, top-8, E=256, block_m=8: 8 of 225 blocks)."""
    blocks = min(routing.expert_ids.shape[0], num_slots)
    return routing.sorted_token_ids[: blocks * block_m], routing.expert_ids[:blocks]


def block_gemm(cfg: MgpuConfig, interpret: bool):
    """gemm(rows, w, block_experts, rows_in_use) -> [P, N] f32: the Mosaic GPU GEMM at cfg
    (rows_in_use: mgpu_wna16_gemm's, or None; GEMM2's config: `down_config`),
    K-split partial products summed in f32; bias (None or float [E, N]) added to the f32 sums
    in the GEMM's epilogue; with activation_dtype, w's rows are [gate; up] and the result is
    `activation` ("silu" or a ClampedSwiGLU) of them in that dtype, [P, N/2] (in GEMM1's
    epilogue where `fuses_activation`, else on the summed f32 products)."""

    def gemm(
        rows, w, block_experts, rows_in_use=None, activation_dtype=None, activation="silu",
        bias=None,
    ):  # fmt: skip
        x_scales = None
        if isinstance(rows, Int8Rows):  # W8A8: rows in the GEMM's input order
            rows, x_scales = rows.q, rows.scale
        _, splits, gated, options = gemm_plan(cfg, w, block_experts.shape[0], activation_dtype)
        extra = {} if bias is None else {"bias": bias}
        if gated and activation != "silu":
            extra["activation"] = activation
        out = mgpu_wna16_gemm(
            rows, w, block_experts, rows_in_use, x_scales=x_scales, **options, **extra,
            interpret=interpret,
        )  # fmt: skip
        if gated:
            return out
        out = out.sum(axis=0) if splits > 1 else out
        if activation_dtype is None:
            return out.astype(jnp.float32)
        return activate(out, activation, activation_dtype)

    return gemm


def block_rows(x, topk_ids, *, num_experts: int, block_m: int, expert_map, interpret: bool):
    """The aligned slots, block experts and x's rows in block order of the used blocks
    (the align kernel, used_blocks, rows_in_block_order): the GEMMs' inputs."""
    t, k = topk_ids.shape
    routing = moe_align_block_size(
        topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map,
        interpret=interpret,
    )  # fmt: skip
    # slots: t*k + j, or the sentinel t*k for padding
    slots, block_experts = used_blocks(routing, t * k, block_m)
    return slots, block_experts, rows_in_block_order(x, slots, k, interpret=interpret)


def one_token_blocks(x, topk_ids, *, num_experts: int, block_m: int, expert_map):
    """For one token's S slots (x [1, H], topk_ids [1, S]; or the pipeline's act-order rows,
    one per slot: x [S, H], topk_ids [S, 1]): the block experts [S], rows [S * block_m, H] of
    one block per slot, slot s's row (x[s // k]) first in block s (the rest zero), each slot's
    row position s * block_m and the rows in use per block (ones). No alignment kernel (at
    decode it is a large part of a small layer): a token's experts are distinct, so these are
    the blocks the alignment gives (in slot order, not expert order), and their rows are the
    same products. Slots the alignment drops (ids out of range, or off this shard through
    expert_map) get expert -1 (zero rows, not kept by the top-k sum)."""
    t, k = topk_ids.shape
    slots = t * k
    block_experts, _ = local_expert_of(topk_ids, num_experts=num_experts, expert_map=expert_map)

    def first_rows(v):  # [T, ...] -> [S * block_m, ...]: v[s // k] first in block s, zeros after
        rows = jnp.repeat(v, k, axis=0)
        blocks = jnp.zeros((slots, block_m, *v.shape[1:]), v.dtype).at[:, 0].set(rows)
        return blocks.reshape(slots * block_m, *v.shape[1:])

    x_rows = Int8Rows(*map(first_rows, x)) if isinstance(x, Int8Rows) else first_rows(x)
    position = jnp.arange(slots, dtype=jnp.int32) * block_m
    return block_experts, x_rows, position, jnp.ones(slots, jnp.int32)


def aligned_blocks(x, topk_ids, *, num_experts: int, block_m: int, expert_map, interpret):
    """The block experts [B], rows in block order [B * block_m, H] (`block_rows`), each slot's
    row position [T*k] (a slot the alignment dropped keeps position 0; the top-k sum does not
    keep it) and the rows in use per block [B] (its first ones: each expert's run is padded at
    its end)."""
    t, k = topk_ids.shape
    slots, block_experts, x_rows = block_rows(
        x, topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map,
        interpret=interpret,
    )  # fmt: skip
    position, in_use = block_positions(slots, t * k, block_m)
    return block_experts, x_rows, position, in_use


def block_positions(slots, num_slots: int, block_m: int):
    """Of the aligned `slots` ([B * block_m]: slot ids in block order, ids >= num_slots for
    padding): each slot's row position in block order [num_slots] (a slot in no block keeps 0,
    unspecified; padding points past the end and is dropped) and the rows in use per block [B]
    (each block's first ones: an expert's run is padded at its end)."""
    position = jnp.zeros(num_slots, jnp.int32)
    position = position.at[slots].set(jnp.arange(slots.shape[0], dtype=jnp.int32), mode="drop")
    in_use = (slots < num_slots).reshape(-1, block_m).sum(axis=1, dtype=jnp.int32)
    return position, in_use


# ---- the pipeline's stages --------------------------------------------------------------------


class Blocks(NamedTuple):
    """The GEMMs' blocks: each block's local expert [B] (-1: zero rows) and rows in use [B]
    (mgpu_wna16_gemm's rows_in_use, or None where the config halves no block)."""

    experts: jax.Array
    rows_in_use: jax.Array | None


def _plan(num_slots, num_experts, w13, w2, *, config, int8_rows) -> MgpuConfig:
    return layer_config(config, num_slots, num_experts, w13, w2, int8_rows=int8_rows)


def _route(
    x, topk_ids, cfg: MgpuConfig, *, num_experts, expert_map, distinct_experts, interpret,
    one_token,
):  # fmt: skip
    """The blocks, and x's rows in their order: a chunk of one token's slots (distinct
    experts) takes `one_token_blocks` (unless one_token is False), any other `aligned_blocks`.
    Only the slots on this shard are kept (their rows are the GEMMs' zeros elsewhere). Int8Rows
    (W8A8) are put in the GEMM's input order first (T rows, before they are gathered)."""
    if isinstance(x, Int8Rows):
        x = Int8Rows(w8a8_input_order(x.q), x.scale)
    blocks = dict(num_experts=num_experts, block_m=cfg.block_m, expert_map=expert_map)
    if distinct_experts and one_token:
        experts, x_rows, position, in_use = one_token_blocks(x, topk_ids, **blocks)
    else:
        experts, x_rows, position, in_use = aligned_blocks(
            x, topk_ids, **blocks, interpret=interpret
        )
    local, _ = local_expert_of(topk_ids, num_experts=num_experts, expert_map=expert_map)
    blocks = Blocks(experts, gemm_rows_in_use(cfg, in_use))
    routed = backend_api.Routed(blocks, topk_ids.shape[1], keep=local >= 0, slot_rows=position)
    return routed, x_rows


def _gemm1(x_rows, w13, routed, cfg: MgpuConfig, *, activation, interpret, bias=None):
    """[P, H] -> activation(gate, up) [P, I] in x's dtype (bias: [E, 2I], added to the f32
    sums first, or None): the activation sees unrounded f32 sums and is rounded for GEMM2's
    tensor cores, as in the 'pallas' backend (the 'xla' reference keeps it in f32); f32 from
    int8 rows (W8A8: quantized again for GEMM2). With halved blocks, a block's unused rows may
    be unwritten; GEMM2 reads none of them."""
    blocks = routed.blocks
    gemm = block_gemm(cfg, interpret)
    dtype = jnp.float32 if isinstance(x_rows, Int8Rows) else x_rows.dtype
    return gemm(
        x_rows, w13, blocks.experts, blocks.rows_in_use, activation_dtype=dtype,
        activation=activation, bias=bias,
    )  # fmt: skip


def _gemm2(act, w2, routed, cfg: MgpuConfig, routed_weights, *, interpret, bias=None):
    """[P, I] -> f32 [P, H] in block order, plus each row's expert's bias ([E, H], or None;
    the routed weights come in the top-k sum). Int8Rows (W8A8) are put in the GEMM's input
    order."""
    if isinstance(act, Int8Rows):
        act = Int8Rows(w8a8_input_order(act.q), act.scale)
    blocks = routed.blocks
    return block_gemm(cfg, interpret)(act, w2, blocks.experts, blocks.rows_in_use, bias=bias)


def stages(
    config: BlockConfig | MgpuConfig | None = None, *, activation: str = "silu",
    interpret: bool = False, one_token: bool = True,
    activation_quant: ActivationQuant | None = None,
):  # fmt: skip
    """This backend's MoeStages (Backend.stages; the library's pipeline runs them) at config:
    an MgpuConfig, a BlockConfig (`from_block_config`) or None: for each chunk the tuned table's
    config at its token slots, else `default_config`'s (`layer_config`; no choice at run time).
    activation: "silu", or gpt-oss's "swiglu_oai" / a ClampedSwiGLU; weights in the mgpu_int4 or
    mgpu_int8 layout. one_token=False: a chunk of one token takes the aligned blocks too.
    activation_quant: W8A8 on symmetric mgpu_int8 weights (both GEMMs' inputs int8). The GEMMs
    take the pipeline's biases (keyword bias) in their epilogues.

    Raises:
        NotImplementedError: an activation other than silu or a ClampedSwiGLU.
    """
    act = backend_api.normalize_activation(activation)
    if act is None:
        raise NotImplementedError(
            f"the mgpu backend runs 'silu' or a ClampedSwiGLU, not {activation!r}"
        )
    return backend_api.MoeStages(
        plan=functools.partial(_plan, config=config, int8_rows=activation_quant is not None),
        route=functools.partial(_route, interpret=interpret, one_token=one_token),
        gemm1=functools.partial(_gemm1, activation=act, interpret=interpret),
        gemm2=functools.partial(_gemm2, interpret=interpret),
        routed_weights="sum",
        activation_quant=activation_quant,
    )
