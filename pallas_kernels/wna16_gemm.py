"""Dequant-fused grouped matmul over block-sorted token slots (int4/int8 weights, split-K)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from wna16_jax._quant import implicit_zero
from wna16_jax._types import AlignedRouting, BlockConfig, QuantizedExperts


def _dequant_tile(qw_ref, s_ref, z_ref, e, n_idx, k0, *, bits, block_k, group, has_zeros):
    """Loads one [bn, bk] weight tile of expert e and returns (q - z) and its scales.

    When a k-tile lies inside one group the scale is returned per row ([bn]) so the caller can
    apply it to the [bm, bn] product instead of the [bn, bk] tile; otherwise the tile is
    returned already scaled (f32 [bn, bk]) and the scale is None.
    """
    per_word = 32 // bits
    kk = k0 + jnp.arange(block_k, dtype=jnp.int32)  # [bk] input features
    # [bn, bk] uint32: each word is loaded once per value it holds (served from L1).
    words = plgpu.load(qw_ref.at[e, n_idx[:, None], (kk // per_word)[None, :]])
    shift = ((kk % per_word) * bits).astype(jnp.uint32)
    q = ((words >> shift[None, :]) & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)
    if block_k <= group:
        g = k0 // group
        s = plgpu.load(s_ref.at[e, n_idx, g]).astype(jnp.float32)  # [bn]
        if has_zeros:
            z = _load_zeros(z_ref, e, n_idx, g, bits=bits)  # [bn]
            return q - z[:, None], s
        return q - implicit_zero(bits), s
    g_idx = (kk // group)[None, :]  # [1, bk]
    s = plgpu.load(s_ref.at[e, n_idx[:, None], g_idx]).astype(jnp.float32)  # [bn, bk]
    if has_zeros:
        z = _load_zeros(z_ref, e, n_idx[:, None], g_idx, bits=bits)  # [bn, bk]
    else:
        z = implicit_zero(bits)
    return (q - z).astype(jnp.float32) * s, None


def _load_zeros(z_ref, e, n_idx, g, *, bits):
    """Zero points for rows n_idx, group(s) g as int32 (broadcast shape of n_idx and g)."""
    if bits == 8:
        return plgpu.load(z_ref.at[e, n_idx, g]).astype(jnp.int32)
    # [E, N//2, G] uint8: even n in the low nibble.
    byte = plgpu.load(z_ref.at[e, n_idx // 2, g]).astype(jnp.int32)
    return (byte >> ((n_idx % 2) * 4)) & 0xF


def _gemm_kernel(
    ids_ref,  # [max_padded] int32 sorted slot ids
    eids_ref,  # [num_blocks] int32 expert of each block
    ntpp_ref,  # [1] int32
    a_ref,  # [R, K] activations
    qw_ref,  # [E, N, K // per_word] uint32
    s_ref,  # [E, N, K // G]
    z_ref,  # zeros or None
    rw_ref,  # [num_slots] f32 routed weights or None
    out_ref,  # [num_slots + 1, N]; row num_slots is a spare row for padding
    *,
    num_slots,
    top_k,
    n,
    k,
    bits,
    group,
    has_zeros,
    config: BlockConfig,
):
    bm, bn, bk, split_k = config.block_m, config.block_n, config.block_k, config.split_k
    num_n_blocks = n // bn
    pid = pl.program_id(0)
    split = pl.program_id(1)
    m_block = pid // num_n_blocks
    n_block = pid % num_n_blocks
    ntpp = ntpp_ref[0]

    @pl.when(m_block * bm < ntpp)
    def _():
        e = eids_ref[m_block]
        slot = plgpu.load(ids_ref.at[pl.ds(m_block * bm, bm)])  # [bm]
        valid = slot < num_slots
        out_row = jnp.where(valid, slot, num_slots)  # padding -> the spare row
        n_idx = n_block * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]
        out_at = out_ref.at[out_row[:, None], n_idx[None, :]]

        if split_k == 1:
            # Blocks of off-shard experts contribute exact zeros (split-K buffers start at 0).
            @pl.when(e < 0)
            def _():
                plgpu.store(out_at, jnp.zeros((bm, bn), out_ref.dtype))

        @pl.when(e >= 0)
        def _():
            row = jnp.where(valid, slot // top_k, 0)  # [bm] activation rows
            tiles = k // bk // split_k
            first = split * tiles

            def body(t, acc):
                k0 = (first + t) * bk
                kk = k0 + jnp.arange(bk, dtype=jnp.int32)
                # Loads index with arrays only (the interpreter cannot mix arrays and slices).
                a = plgpu.load(a_ref.at[row[:, None], kk[None, :]])  # [bm, bk]
                w, s = _dequant_tile(
                    qw_ref,
                    s_ref,
                    z_ref,
                    e,
                    n_idx,
                    k0,
                    bits=bits,
                    block_k=bk,
                    group=group,
                    has_zeros=has_zeros,
                )
                w = w.astype(a.dtype)
                # [bm, bk] x [bn, bk]^T -> [bm, bn], f32 accumulation (IEEE for f32 inputs).
                part = jax.lax.dot_general(
                    a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )
                if s is not None:
                    part = part * s[None, :]
                return acc + part

            acc = jax.lax.fori_loop(0, tiles, body, jnp.zeros((bm, bn), jnp.float32))
            if rw_ref is not None:
                rw = plgpu.load(rw_ref.at[jnp.where(valid, slot, 0)])  # [bm]
                acc = acc * rw[:, None]
            if split_k == 1:
                plgpu.store(out_at, acc.astype(out_ref.dtype))
            else:
                plgpu.atomic_add(out_at, (), acc)


def check_gemm_config(config: BlockConfig, qw: QuantizedExperts) -> None:
    """Raises ValueError when `config` cannot run a GEMM over `qw` ([E, N, K])."""
    from wna16_jax._configs import GemmShape, check_config

    _, n, k = qw.shape
    shape = GemmShape(
        m=0,
        n=n,
        k=k,
        num_experts=qw.num_experts,
        bits=qw.bits,
        group=qw.group,
        group_size=qw.group_size,
    )
    check_config(config, shape)
    if n % config.block_n:
        raise ValueError(f"N={n} is not a multiple of block_n={config.block_n}")
    if min(config.block_m, config.block_n, config.block_k) < 16:
        raise ValueError(f"block sizes must be >= 16 for tensor-core dots, got {config}")


@functools.partial(jax.jit, static_argnames=("top_k", "config", "out_dtype", "interpret"))
def wna16_gemm(
    a,
    qw: QuantizedExperts,
    routing: AlignedRouting,
    routed_weights=None,
    *,
    top_k: int,
    config: BlockConfig,
    out_dtype=None,
    interpret: bool = False,
):
    """Grouped matmul of gathered activation rows with dequantized expert weights.

    out[s] = (a[s // top_k] @ dequant(qw[e(s)]).T) * routed_weights[s] for each slot s of the
    routing, where e(s) is the expert of the block holding s (zeros for expert -1).

    Args:
        a: [R, K] bf16/f16/f32 activations; the routing's slots number R * top_k.
        qw: QuantizedExperts [E, N, K].
        routing: AlignedRouting with block_m == config.block_m.
        routed_weights: optional f32 [R * top_k] per-slot multipliers.
        top_k: slots per activation row.
        config: BlockConfig (block_k compatible with the group size; split_k > 1 accumulates
            partial tiles with atomic adds into a zeroed f32 buffer).
        out_dtype: output dtype (default a.dtype; split-K always accumulates in f32).
        interpret: run under the Pallas interpreter (any platform).

    Returns:
        [R * top_k, N] of out_dtype. Rows of slots that sit in no block (ids the alignment
        dropped) are not written when split_k == 1 and are zero when split_k > 1: callers mask
        them (fused_moe does, in its reduction).
    """
    check_gemm_config(config, qw)
    if routing.block_m != config.block_m:
        raise ValueError(
            f"routing was aligned with block_m={routing.block_m} but config.block_m="
            f"{config.block_m}"
        )
    r, k = a.shape
    e, n, kq = qw.shape
    if kq != k:
        raise ValueError(f"activations have K={k} but the weights have K={kq}")
    num_slots = r * top_k
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    num_blocks = routing.expert_ids.shape[0]
    grid = (num_blocks * (n // config.block_n), config.split_k)
    kernel = functools.partial(
        _gemm_kernel,
        num_slots=num_slots,
        top_k=top_k,
        n=n,
        k=k,
        bits=qw.bits,
        group=qw.group,
        has_zeros=qw.has_zeros,
        config=config,
    )
    ntpp = routing.num_tokens_post_padded.reshape(1)
    inputs = [routing.sorted_token_ids, routing.expert_ids, ntpp, a, qw.qweight, qw.scales]
    optional = [qw.zeros, routed_weights]
    inputs += [x for x in optional if x is not None]

    def kernel_with_optionals(*refs):
        fixed, rest = refs[:6], list(refs[6:])
        z_ref = rest.pop(0) if qw.zeros is not None else None
        rw_ref = rest.pop(0) if routed_weights is not None else None
        kernel(*fixed, z_ref, rw_ref, *rest)

    out_rows = num_slots + 1  # the last row takes padding slots' stores
    if config.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((out_rows, n), out_dtype)
        aliases = {}
    else:
        inputs.append(jnp.zeros((out_rows, n), jnp.float32))
        out_shape = jax.ShapeDtypeStruct((out_rows, n), jnp.float32)
        aliases = {len(inputs) - 1: 0}

        def kernel_with_optionals(*refs, _inner=kernel_with_optionals):  # noqa: F811
            *ins, _zero_in, out = refs
            _inner(*ins, out)

    out = pl.pallas_call(
        kernel_with_optionals,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=f"wna16_gemm_int{qw.bits}",
    )(*inputs)
    return out[:num_slots].astype(out_dtype)
