"""Dequant-fused grouped matmul over block-sorted token slots (int4/int8/MXFP4 weights, split-K)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl  # noqa: F401  (tests patch wna16_gemm.pl.pallas_call)
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import block_configs
from pallas_kernels.pallas import _dequant
from pallas_kernels.pallas._common import (
    grouped_gemm_call,
    grouped_gemm_program,
    operand_pairs,
    slice_activations,
    slice_major,
    slice_major_columns,
    slice_words,
)
from wna16_jax import backend_api
from wna16_jax.backend_api import (
    AlignedRouting,
    BlockConfig,
    QuantizedExperts,
    implicit_zero,
    normalize_activation,
)


def _dot(a, w):
    """f32 [bm, bn] = a [bm, W] . w [bn, W] (contracting W) on the tensor cores."""
    return jax.lax.dot_general(
        a,
        w,
        dimension_numbers=(((1,), (1,)), ((), ())),
        # DEFAULT lowers f32 dots to TF32 on the GPU (measured rel err 2.6e-4); HIGHEST is IEEE.
        # 16-bit operands are exact products either way.
        precision=jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None,
        preferred_element_type=jnp.float32,
    )


def _fma(a, w):
    """f32 [bm, bn, W] products a[m, j] * w[n, j] on the CUDA cores (summed by the caller)."""
    return a.astype(jnp.float32)[:, None, :] * w.astype(jnp.float32)[None, :, :]


def _product(a, w, dot: str):
    """f32 [bm, bn] = a [bm, W] . w [bn, W]: tensor cores ("mma") or CUDA-core FMAs ("fma")."""
    return _dot(a, w) if dot == "mma" else jnp.sum(_fma(a, w), axis=2)


def scales_per_group(*, block_k, unpack, dot, bits, group, dtype, codes="int") -> bool:
    """Whether the kernel takes its exact fast path: values as 16-bit (offset + v) products,
    the scale applied to each group's [bm, bn] product; else the general path, which scales
    each value in f32 and rounds it to `dtype` when a k-tile holds several groups.

    The fast path needs unpack="slices" or "join", values exact in `dtype` (int4, or int8 in
    fp16; E2M1 values in any dtype) and, for tensor-core dots, at least 16 features per dot (a
    group's slice, or with "join" the group's part of the tile).
    """
    exact = codes == "e2m1" or _dequant.half_magic_offset(bits, dtype) is not None
    if unpack == "tile" or not exact:
        return False
    if unpack == "join":  # one dot over a group's (part of the tile's) features
        return min(block_k, group) >= 16
    return dot == "fma" or min(block_k, group) // (32 // bits) >= 16


def _tile_products(
    a_ref,
    qw_ref,
    s_ref,
    z_ref,
    e,
    row,
    n_idxs,
    k0,
    *,
    bits,
    block_k,
    group,
    has_zeros,
    unpack,
    asm,
    dot,
    codes="int",
):
    """f32 [bm, bn] = a[row, k0:k0+bk] @ dequant(w[e, n_idx, k0:k0+bk]).T for each n_idx."""
    if scales_per_group(block_k=block_k, unpack=unpack, dot=dot, bits=bits, group=group,
                        dtype=a_ref.dtype, codes=codes):  # fmt: skip
        return _half_slices_per_group(
            a_ref, qw_ref, s_ref, z_ref, e, row, n_idxs, k0, bits=bits, block_k=block_k,
            group=group, has_zeros=has_zeros, asm=asm, dot=dot, joined=unpack == "join",
            offset=_dequant.half_magic_offset(bits, a_ref.dtype), codes=codes,
        )  # fmt: skip
    return tuple(
        _tile_product_general(
            a_ref,
            qw_ref,
            s_ref,
            z_ref,
            e,
            row,
            n_idx,
            k0,
            bits=bits,
            block_k=block_k,
            group=group,
            has_zeros=has_zeros,
            unpack=unpack,
            dot=dot,
            codes=codes,
        )
        for n_idx in n_idxs
    )


def _half_slices_per_group(
    a_ref, qw_ref, s_ref, z_ref, e, row, n_idxs, k0, *, bits, block_k, group, has_zeros, asm,
    offset, dot, joined, codes="int",
):  # fmt: skip
    """The fast path: values exact in the 16-bit activation dtype, one group at a time.

    The k-tile holds one group, part of one, or several whole groups. For each group in it,
    each value slice converts to offset + v (two values per instruction with asm) and meets
    its contiguous activation columns in one dot; the group scale multiplies that product, and
    the offset and zero point come off through the activations' row sums:
    s * sum_k a (offset + v) - s * (offset + z) * sum_k a.
    With dot="fma" the products stay [bm, bn, W] f32 FMAs, scaled per group and reduced over W
    once per k-tile (a cross-lane reduction costs more than the scaling FMA).
    joined (unpack="join", a_ref in natural order): the converted slices are joined back into
    feature order and meet the group's activations in one dot (no sum of per-slice products).
    codes "e2m1" (MXFP4): each slice is decoded to its E2M1 values (exact in the activation
    dtype) and the group's power-of-two E8M0 scale multiplies the product: no offset or zero
    point to take off.
    """
    e2m1 = codes == "e2m1"
    per_word = 32 // bits
    group_k = min(block_k, group)
    count = group_k // per_word
    products = [None] * len(n_idxs)  # mma: [bm, bn]; fma: [bm, bn, W]; scaled, over groups
    corrections = [None] * len(n_idxs)  # [bm, bn]: s * (offset + z) * rowsum, over groups
    for part in range(block_k // group_k):
        words = (part * count, count)
        if joined:
            kk = k0 + part * group_k + jnp.arange(group_k, dtype=jnp.int32)
            slices = [(plgpu.load(a_ref.at[row[:, None], kk[None, :]]), kk)]  # [bm, group_k]
        else:
            slices = slice_activations(a_ref, row, k0, bits=bits, block_k=block_k, words=words)
        if not e2m1:  # the slices summed elementwise first: one cross-lane reduction per group
            columns = None
            for a, _ in slices:
                columns = a.astype(jnp.float32) if columns is None else columns + a
            rowsum = jnp.sum(columns, axis=1)  # [bm]
        g = (k0 + part * group_k) // group
        for r, n_idx in enumerate(n_idxs):
            tile = slice_words(qw_ref, e, n_idx, k0, bits=bits, block_k=block_k, words=words)
            if e2m1:
                halves = _dequant.e2m1_value_slices(tile, a_ref.dtype)  # the values
            else:
                halves = _dequant.half_value_slices(tile, bits=bits, dtype=a_ref.dtype, asm=asm)
            if joined:
                halves = [_dequant.join_value_slices(halves)]  # [bn, group_k]
            acc = None
            for (a, _), w in zip(slices, halves, strict=True):
                p = _dot(a, w) if dot == "mma" else _fma(a, w)
                acc = p if acc is None else acc + p
            if e2m1:
                s = _dequant.e8m0_to_f32(plgpu.load(s_ref.at[e, n_idx, g]))  # [bn]
            else:
                s = plgpu.load(s_ref.at[e, n_idx, g]).astype(jnp.float32)  # [bn]
            scaled = acc * (s[None, :] if dot == "mma" else s[None, :, None])
            products[r] = scaled if products[r] is None else products[r] + scaled
            if e2m1:
                continue
            z = _zero_points(z_ref, e, n_idx, g, bits=bits, has_zeros=has_zeros)  # [bn] or int
            zs = _offset_plus_zero(z, offset=offset, has_zeros=has_zeros) * s  # [bn]
            corr = rowsum[:, None] * zs[None, :]
            corrections[r] = corr if corrections[r] is None else corrections[r] + corr
    sums = tuple(jnp.sum(p, axis=2) if dot == "fma" else p for p in products)
    if e2m1:
        return sums
    return tuple(p - c for p, c in zip(sums, corrections, strict=True))


def _offset_plus_zero(z, *, offset: float, has_zeros: bool):
    """f32 offset + z: [bn] for zero points z (int32 [bn]), a scalar for the implicit int."""
    return (z.astype(jnp.float32) if has_zeros else jnp.float32(z)) + jnp.float32(offset)


def _minus_offset_and_zero(acc, rowsum, z, *, offset: float, has_zeros: bool):
    """sum_k a * (offset + v) -> sum_k a * (v - z): subtracts (offset + z) * sum_k a.

    acc: f32 [bm, bn]; rowsum: f32 [bm] activation sums; z: int32 [bn] zero points, or the
    implicit int without them.
    """
    zf = _offset_plus_zero(z, offset=offset, has_zeros=has_zeros)
    return acc - rowsum[:, None] * (zf[None, :] if has_zeros else zf)


def _tile_product_general(
    a_ref, qw_ref, s_ref, z_ref, e, row, n_idx, k0, *, bits, block_k, group, has_zeros, unpack,
    dot, codes="int",
):  # fmt: skip
    """One n_idx, any mode: exact (v - z) through f32, or several groups per tile."""
    dtype = a_ref.dtype
    pairs = operand_pairs(
        a_ref, qw_ref, e, row, n_idx, k0, bits=bits, block_k=block_k, unpack=unpack
    )
    if codes == "e2m1":
        return _e2m1_tile_product(
            s_ref, e, n_idx, k0, pairs, block_k=block_k, group=group, dot=dot, dtype=dtype
        )
    if block_k > group:
        # Several groups per tile: scale (and shift) each value before the dot.
        acc = None
        for a, v, kk in pairs:
            g_idx = (kk // group)[None, :]  # [1, W]
            s = plgpu.load(s_ref.at[e, n_idx[:, None], g_idx]).astype(jnp.float32)  # [bn, W]
            z = _zero_points(z_ref, e, n_idx[:, None], g_idx, bits=bits, has_zeros=has_zeros)
            part = _product(a, (_dequant.to_f32_minus_zero(v, z) * s).astype(dtype), dot)
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
            part = _product(a, w, dot)
        else:  # offset + v exactly in the 16-bit dtype; the offset and z come off below
            part = _product(a, _dequant.to_half_plus_offset(v, dtype), dot)
            rs = jnp.sum(a.astype(jnp.float32), axis=1)  # [bm]
            rowsum = rs if rowsum is None else rowsum + rs
        acc = part if acc is None else acc + part
    if offset is not None:
        acc = _minus_offset_and_zero(acc, rowsum, z, offset=offset, has_zeros=has_zeros)
    return acc * s[None, :]


def _e2m1_tile_product(s_ref, e, n_idx, k0, pairs, *, block_k, group, dot, dtype):
    """`_tile_product_general` for MXFP4: where a k-tile holds several groups, E2M1 values
    times their power-of-two scales in f32 (exact), rounded to `dtype`; within one group the
    values meet the activations and the scale multiplies the [bm, bn] product."""
    several = block_k > group
    acc = None
    for a, v, kk in pairs:
        w = _dequant.e2m1_to_f32(v)  # [bn, W]
        if several:
            s = plgpu.load(s_ref.at[e, n_idx[:, None], (kk // group)[None, :]])  # [bn, W]
            w = w * _dequant.e8m0_to_f32(s)
        part = _product(a, w.astype(dtype), dot)
        acc = part if acc is None else acc + part
    if several:
        return acc
    s = _dequant.e8m0_to_f32(plgpu.load(s_ref.at[e, n_idx, k0 // group]))  # [bn]
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
    a_ref,  # [R, K] activations (slice_major order when config.unpack == "slices")
    qw_ref,  # [E, N, K // per_word] uint32
    s_ref,  # [E, N, K // G]
    z_ref,  # zeros or None
    rw_ref,  # [num_slots] f32 routed weights or None
    bias_ref,  # [E, N] per-expert biases or None
    out_ref,  # [num_slots + 1, N_out]; row num_slots is a spare row for padding
    *,
    num_slots,
    top_k,
    n_out,
    k,
    bits,
    group,
    has_zeros,
    config: BlockConfig,
    gated: bool,
    out_slice_major,
    asm: bool,
    codes: str = "int",
    activation="silu",
):
    def tile_products(e, row, n_idxs, k0):
        return _tile_products(
            a_ref, qw_ref, s_ref, z_ref, e, row, n_idxs, k0, bits=bits, block_k=config.block_k,
            group=group, has_zeros=has_zeros, unpack=config.unpack, asm=asm, dot=config.dot,
            codes=codes,
        )  # fmt: skip

    out_columns = None
    if out_slice_major is not None:
        out_bk, out_bits = out_slice_major
        out_columns = functools.partial(slice_major_columns, block_k=out_bk, bits=out_bits)
    grouped_gemm_program(
        ids_ref,
        eids_ref,
        ntpp_ref,
        rw_ref,
        out_ref,
        num_slots=num_slots,
        top_k=top_k,
        n=n_out,
        k=k,
        config=config,
        tile_product=tile_products,
        gate_offset=n_out if gated else None,
        out_columns=out_columns,
        bias_ref=bias_ref,
        activation=activation,
    )


def check_gemm_config(config: BlockConfig, qw: QuantizedExperts) -> None:
    """Raises ValueError when `config` cannot run a GEMM over `qw` ([E, N, K])."""
    shape = backend_api.GemmShape.of_weights(qw)
    block_configs.check_config(config, shape)


@functools.partial(
    jax.jit,
    static_argnames=(
        "top_k",
        "config",
        "out_dtype",
        "interpret",
        "activation",
        "a_slice_major",
        "out_slice_major",
        "asm",
    ),
)
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
    activation: str | None = None,
    a_slice_major: bool = False,
    out_slice_major: tuple[int, int] | None = None,
    asm: bool | None = None,
    bias=None,
):
    """Grouped matmul of gathered activation rows with dequantized expert weights.

    out[s] = (a[s // top_k] @ dequant(qw[e(s)]).T) * routed_weights[s] for each slot s of the
    routing, where e(s) is the expert of the block holding s (zeros for expert -1).

    Args:
        a: [R, K] bf16/f16/f32 activations; the routing's slots number R * top_k.
        qw: QuantizedExperts [E, N, K], integer codes or MXFP4 (E8M0 scale bytes 0 and 255,
            2^-127 and NaN, read as 0 and inf).
        routing: AlignedRouting with block_m == config.block_m.
        routed_weights: optional f32 [R * top_k] per-slot multipliers.
        top_k: slots per activation row.
        config: BlockConfig (block_k compatible with the group size; split_k > 1 accumulates
            partial tiles with atomic adds into a zeroed f32 buffer).
        out_dtype: output dtype (default a.dtype; split-K always accumulates in f32).
        interpret: run under the Pallas interpreter (any platform).
        activation: None, or "silu" or a ClampedSwiGLU for GEMM1 of an MoE layer: the weights'
            first N/2 rows are the gate, the last N/2 the up projection, and the kernel returns
            silu(gate) * up (or the clamped SwiGLU) ([R * top_k, N/2], computed in f32 from the
            unrounded sums; split_k must be 1).
        a_slice_major: `a` is already in `_common.slice_major` order for config.block_k (e.g.
            written so by the previous GEMM); only with unpack="slices".
        out_slice_major: (block_k, bits) of the GEMM that reads this output: store its columns
            in that GEMM's slice_major order.
        asm: convert int4/int8 with PTX (two values per instruction) on the fast path; default:
            when compiled (never in the interpreter).
        bias: optional [E, N] float per-expert biases, added to the f32 sums before the
            activation and the routed weights.

    Returns:
        [R * top_k, N] (N/2 with activation) of out_dtype. Rows of slots that sit in no block
        (ids the alignment dropped) are not written when split_k == 1 and are zero when
        split_k > 1: callers mask them (fused_moe does, in its reduction).
    """
    check_gemm_config(config, qw)
    r, k = a.shape
    block_configs.check_gemm_operands(config, routing, k, qw)
    e, n, _ = qw.shape
    if activation is not None and normalize_activation(activation) is None:
        raise ValueError(f"activation={activation!r} is not None, 'silu' or a ClampedSwiGLU")
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"bias must be [E, N] = {[e, n]}, got {tuple(bias.shape)}")
    gated = activation is not None
    n_out = n // 2 if gated else n
    if gated and (n % 2 or n_out % config.block_n or config.split_k != 1):
        raise ValueError(
            f"activation={activation!r} needs an even N with N/2 a multiple of block_n and "
            f"split_k=1; got N={n}, {config}"
        )
    if a_slice_major and config.unpack != "slices":
        raise ValueError(f"a_slice_major=True needs unpack='slices', got {config}")
    if out_slice_major is not None and n_out % out_slice_major[0]:
        raise ValueError(f"out_slice_major={out_slice_major} does not tile N_out={n_out}")
    if asm is None:
        asm = not interpret
    if asm and interpret:
        raise ValueError("asm=True runs only compiled (interpret=False)")
    if config.unpack == "slices" and not a_slice_major:
        a = slice_major(a, block_k=config.block_k, bits=qw.bits)
    num_slots = r * top_k
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    kernel = functools.partial(
        _gemm_kernel,
        num_slots=num_slots,
        top_k=top_k,
        n_out=n_out,
        k=k,
        bits=qw.bits,
        group=qw.group,
        has_zeros=qw.has_zeros,
        config=config,
        gated=gated,
        out_slice_major=out_slice_major,
        asm=asm,
        codes=qw.codes,
        activation=normalize_activation(activation) if gated else "silu",
    )
    out = grouped_gemm_call(
        kernel,
        [a, qw.qweight, qw.scales, qw.zeros, routed_weights, bias],
        routing=routing,
        num_slots=num_slots,
        n=n_out,
        out_dtype=out_dtype,
        config=config,
        interpret=interpret,
        name="wna16_gemm_mxfp4" if qw.is_mxfp4 else f"wna16_gemm_int{qw.bits}",
    )
    return out.astype(out_dtype)
