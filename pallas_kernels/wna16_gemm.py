"""Dequant-fused grouped matmul over block-sorted token slots (int4/int8 weights, split-K)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _dequant
from wna16_jax import _configs
from wna16_jax._quant import implicit_zero
from wna16_jax._types import AlignedRouting, BlockConfig, QuantizedExperts


def _operand_pairs(a_ref, qw_ref, e, row, n_idx, k0, *, bits, block_k, unpack):
    """The k-tile as (a [bm, W], v [bn, W] uint32 values, k [W] feature indices) pairs.

    unpack="slices": the [bn, bk // per_word] word tile is loaded once and value slice i of the
    words meets activation columns k0 + per_word * j + i: per_word pairs, W = bk // per_word.
    unpack="tile": each word is loaded once per value it holds (the repeats hit L1) and shifted
    in place: one pair with W = bk, so the tensor cores see one dot of K = bk.
    """
    per_word = 32 // bits
    if unpack == "tile":
        kk = k0 + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
        words = plgpu.load(qw_ref.at[e, n_idx[:, None], (kk // per_word)[None, :]])  # [bn, bk]
        shift = ((kk % per_word) * bits).astype(jnp.uint32)
        v = (words >> shift[None, :]) & jnp.uint32((1 << bits) - 1)
        a = plgpu.load(a_ref.at[row[:, None], kk[None, :]])  # [bm, bk]
        return [(a, v, kk)]
    j = jnp.arange(block_k // per_word, dtype=jnp.int32)
    words = plgpu.load(qw_ref.at[e, n_idx[:, None], (k0 // per_word + j)[None, :]])  # [bn, W]
    pairs = []
    for i in range(per_word):
        kk = k0 + per_word * j + i  # [W]
        a = plgpu.load(a_ref.at[row[:, None], kk[None, :]])  # [bm, W]
        pairs.append((a, _dequant.value_slice(words, i, bits=bits), kk))
    return pairs


def _tile_product(
    a_ref, qw_ref, s_ref, z_ref, e, row, n_idx, k0, *, bits, block_k, group, has_zeros, unpack
):
    """f32 [bm, bn] = a[row, k0:k0+bk] @ dequant(w[e, n_idx, k0:k0+bk]).T for one k-tile."""
    dtype = a_ref.dtype
    dot = functools.partial(
        jax.lax.dot_general,
        dimension_numbers=(((1,), (1,)), ((), ())),
        # DEFAULT lowers f32 dots to TF32 on the GPU (measured rel err 2.6e-4); HIGHEST is IEEE.
        # 16-bit operands are exact products either way.
        precision=jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None,
        preferred_element_type=jnp.float32,
    )
    pairs = _operand_pairs(
        a_ref, qw_ref, e, row, n_idx, k0, bits=bits, block_k=block_k, unpack=unpack
    )
    if block_k > group:
        # Several groups per tile: scale (and shift) each value before the dot.
        acc = None
        for a, v, kk in pairs:
            g_idx = (kk // group)[None, :]  # [1, W]
            s = plgpu.load(s_ref.at[e, n_idx[:, None], g_idx]).astype(jnp.float32)  # [bn, W]
            z = _zero_points(z_ref, e, n_idx[:, None], g_idx, bits=bits, has_zeros=has_zeros)
            part = dot(a, (_dequant.to_f32_minus_zero(v, z) * s).astype(dtype))
            acc = part if acc is None else acc + part
        return acc

    # One group per tile: the scale multiplies the [bm, bn] product, not the [bn, bk] tile.
    g = k0 // group
    s = plgpu.load(s_ref.at[e, n_idx, g]).astype(jnp.float32)  # [bn]
    z = _zero_points(z_ref, e, n_idx, g, bits=bits, has_zeros=has_zeros)  # [bn] or int
    offset = _dequant.half_magic_offset(bits, dtype)
    acc = None
    rowsum = None
    for a, v, _ in pairs:
        if offset is None:  # exact (v - z) through f32
            w = _dequant.to_f32_minus_zero(v, z[:, None] if has_zeros else z).astype(dtype)
            part = dot(a, w)
        else:  # offset + v exactly in the 16-bit dtype; the offset and z come off below
            part = dot(a, _dequant.to_half_plus_offset(v, dtype))
            rs = jnp.sum(a.astype(jnp.float32), axis=1)  # [bm]
            rowsum = rs if rowsum is None else rowsum + rs
        acc = part if acc is None else acc + part
    if offset is not None:
        zf = (z.astype(jnp.float32) if has_zeros else jnp.float32(z)) + jnp.float32(offset)
        acc = acc - rowsum[:, None] * zf[None, :] if has_zeros else acc - rowsum[:, None] * zf
    return acc * s[None, :]


def _zero_points(z_ref, e, n_idx, g, *, bits, has_zeros):
    """Zero points (int32, broadcast shape of n_idx and g), or the implicit int when absent."""
    if not has_zeros:
        return implicit_zero(bits)
    return _load_zeros(z_ref, e, n_idx, g, bits=bits)


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
                return acc + _tile_product(
                    a_ref,
                    qw_ref,
                    s_ref,
                    z_ref,
                    e,
                    row,
                    n_idx,
                    k0,
                    bits=bits,
                    block_k=bk,
                    group=group,
                    has_zeros=has_zeros,
                    unpack=config.unpack,
                )

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
    _, n, k = qw.shape
    shape = _configs.GemmShape(
        m=0,
        n=n,
        k=k,
        num_experts=qw.num_experts,
        bits=qw.bits,
        group=qw.group,
        group_size=qw.group_size,
    )
    _configs.check_config(config, shape)


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
