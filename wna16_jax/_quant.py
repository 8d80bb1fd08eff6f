"""Packing, unpacking, round-to-nearest quantization and dequantization of expert weights."""

from __future__ import annotations

import jax.numpy as jnp

from wna16_jax._types import SUPPORTED_BITS, QuantizedExperts


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported (supported: 4, 8)")


def implicit_zero(bits: int) -> int:
    """The zero point of symmetric weights (zeros=None): 8 for int4, 128 for int8."""
    _check_bits(bits)
    return 1 << (bits - 1)


def pack_k(q, bits: int):
    """Packs unsigned quantized values along the last axis into uint32 words.

    Args:
        q: integer array [..., K] with values in [0, 2**bits).
        bits: 4 (8 values per word, k = 8j+i in bits 4i..4i+3) or 8 (k = 4j+i in byte i).

    Returns:
        uint32 [..., K * bits // 32].
    """
    _check_bits(bits)
    per_word = 32 // bits
    q = jnp.asarray(q)
    if q.shape[-1] % per_word:
        raise ValueError(f"K={q.shape[-1]} is not a multiple of {per_word} (bits={bits})")
    words = q.astype(jnp.uint32).reshape(*q.shape[:-1], q.shape[-1] // per_word, per_word)
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    # The fields are disjoint, so a sum is the bitwise or.
    return jnp.sum(words << shifts, axis=-1, dtype=jnp.uint32)


def unpack_k(qweight, bits: int):
    """Inverse of `pack_k`: uint32 [..., W] -> uint8 [..., W * 32 // bits]."""
    _check_bits(bits)
    per_word = 32 // bits
    qweight = jnp.asarray(qweight, dtype=jnp.uint32)
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
    vals = (qweight[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)
    return vals.reshape(*qweight.shape[:-1], qweight.shape[-1] * per_word).astype(jnp.uint8)


def pack_zeros(z, bits: int):
    """Packs zero points [E, N, G] (values < 2**bits) into the canonical zeros layout.

    int4: uint8 [E, N//2, G] with even n in the low nibble; int8: uint8 [E, N, G].
    """
    _check_bits(bits)
    z = jnp.asarray(z).astype(jnp.uint8)
    if bits == 8:
        return z
    e, n, g = z.shape
    if n % 2:
        raise ValueError(f"int4 zero points need an even N, got N={n}")
    pairs = z.reshape(e, n // 2, 2, g)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(jnp.uint8)


def unpack_zeros(zeros, bits: int):
    """Inverse of `pack_zeros`: -> uint8 [E, N, G]."""
    _check_bits(bits)
    zeros = jnp.asarray(zeros, dtype=jnp.uint8)
    if bits == 8:
        return zeros
    e, half_n, g = zeros.shape
    lo = zeros & 0xF
    hi = zeros >> 4
    return jnp.stack([lo, hi], axis=2).reshape(e, half_n * 2, g)


def zero_points(qw: QuantizedExperts):
    """The per-group zero points of `qw` as uint8 [E, N, K//G] (implicit ones filled in)."""
    if qw.zeros is not None:
        return unpack_zeros(qw.zeros, qw.bits)
    e, n, _ = qw.shape
    return jnp.full((e, n, qw.num_groups), implicit_zero(qw.bits), jnp.uint8)


def dequantize_experts(qw: QuantizedExperts, dtype=jnp.float32):
    """Dequantizes to [E, N, K]: w = (q - z) * scale[e, n, k // G], computed in f32.

    Args:
        qw: quantized experts in the canonical layout.
        dtype: output dtype (the arithmetic is f32 whatever it is).

    Returns:
        [E, N, K] array of `dtype`.
    """
    qw.validate()
    e, n, k = qw.shape
    q = unpack_k(qw.qweight, qw.bits).astype(jnp.float32)  # [E, N, K]
    z = zero_points(qw).astype(jnp.float32)  # [E, N, G]
    s = qw.scales.astype(jnp.float32)  # [E, N, G]
    g = qw.group
    w = (q.reshape(e, n, k // g, g) - z[..., None]) * s[..., None]
    return w.reshape(e, n, k).astype(dtype)


def quantize_experts(
    w,
    *,
    bits: int = 4,
    group_size: int = 128,
    has_zp: bool = True,
    scale_dtype=None,
) -> QuantizedExperts:
    """Round-to-nearest quantization of float expert weights.

    With zero points each group maps [min, max] onto [0, 2**bits - 1]; without them the grid is
    symmetric around the implicit zero (8 or 128) with scale = absmax / (2**(bits-1) - 0.5).
    Every value dequantizes to within half a step of its group's scale (exactly so when the
    scales are stored in f32; a 16-bit scale dtype adds its own rounding).

    Args:
        w: float [E, N, K].
        bits: 4 or 8.
        group_size: G dividing K, or -1 for one group per output row.
        has_zp: asymmetric (zero points stored) or symmetric (zeros=None).
        scale_dtype: dtype of the stored scales; default w's dtype.

    Returns:
        QuantizedExperts in the canonical layout.
    """
    _check_bits(bits)
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"w must be [E, N, K], got shape {tuple(w.shape)}")
    e, n, k = w.shape
    g = k if group_size == -1 else group_size
    if g <= 0 or k % g:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    if k % (32 // bits):
        raise ValueError(f"K={k} is not a multiple of {32 // bits} (bits={bits})")
    if has_zp and bits == 4 and n % 2:
        raise ValueError(f"int4 zero points need an even N, got N={n}")
    scale_dtype = scale_dtype or w.dtype
    qmax = (1 << bits) - 1
    wg = w.astype(jnp.float32).reshape(e, n, k // g, g)
    if has_zp:
        lo = jnp.minimum(wg.min(-1), 0.0)
        hi = jnp.maximum(wg.max(-1), 0.0)
        scale = (hi - lo) / qmax
        scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype)
        sf = scale.astype(jnp.float32)
        zero = jnp.clip(jnp.round(-lo / sf), 0, qmax)
    else:
        absmax = jnp.abs(wg).max(-1)
        scale = absmax / ((1 << (bits - 1)) - 0.5)
        scale = jnp.where(scale > 0, scale, 1.0).astype(scale_dtype)
        sf = scale.astype(jnp.float32)
        zero = jnp.full(scale.shape, implicit_zero(bits), jnp.float32)
    q = jnp.clip(jnp.round(wg / sf[..., None] + zero[..., None]), 0, qmax)
    q = q.reshape(e, n, k).astype(jnp.uint8)
    zeros = pack_zeros(zero.astype(jnp.uint8), bits) if has_zp else None
    return QuantizedExperts(
        qweight=pack_k(q, bits), scales=scale, zeros=zeros, bits=bits, group_size=group_size
    )
