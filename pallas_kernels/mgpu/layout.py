"""The Mosaic GPU GEMM's weight layouts, mgpu_int4 and mgpu_int8 (made once, e.g. at load, and
lossless), and their conversions, which this backend registers (wna16_jax.layouts).

"mgpu_int4" (pallas_kernels/mgpu/wna16_gemm.py's operands; int4 only):
  qweight  int4 [E, N/64, K/64, 64, 64]: the canonical nibbles minus 8 (xor 8), in 64x64
           tiles (features x inputs), the k-tiles of each row of tiles consecutive: a k-step of
           the GEMM reads one contiguous run of memory (copied in TMA rows of 128 bytes, a
           free reshape of the tiles). N and K must be multiples of 64.
           Within a tile the 4096 nibbles are in wgmma register order (`TILE_ORDER`): thread t
           of the converting warpgroup reads its 32 weights as the 16 bytes at 16 t, and
           nibbles p and p + 4 of its word i are the two bf16 of its register 4 i + p of the
           wgmma A operand (WGMMA_LAYOUT), so one shift and one lop3 make a bf16 pair: no
           shuffles, no permutes (pallas_kernels/mgpu/wna16_gemm.py).
  scales   [E, K//G, N]: a group's scales for consecutive features are one TMA row.
  zeros    None, or 8 - z as [E, K//G, N] in the scales' dtype (exact: small integers),
           so that w = (qweight + zeros) * scales is the canonical (q - z) * scale.

"mgpu_int8" (the same GEMM's; int8 only): as mgpu_int4, with
  qweight  int8 [E, N/64, K/64, 64, 64]: the canonical bytes minus 128 (xor 0x80), tiles as
           above. Within a tile the 4096 bytes are in wgmma register order (`tile_order(8)`):
           thread t reads its 32 weights as its words 0-3, the 16 bytes at 16 t, and 4-7, the
           16 at 2048 + 16 t (each half of the tile read by a warpgroup's loads as 2048
           consecutive bytes: no bank conflicts), and bytes s and s + 2 of its word i are the
           two bf16 of its register 2 i + s (word i holds the wgmma's column tile i, s its row
           half), so each pair is made from one word (shifted down by 8 bits for s = 1)
           without shuffles or permutes: two lop3 set its low-7-bit fields and its sign bits
           into the bf16 bits of 128, and one subtraction gives q - 128
           (pallas_kernels/mgpu/wna16_gemm.py).
  scales   as mgpu_int4's; per channel (group_size -1) or grouped.
  zeros    None, or 128 - z as [E, K//G, N] in the scales' dtype: w = (qweight + zeros) * scales.
  perm     as in the canonical layout (the input order is not part of the packing).

MXFP4 weights (codes "e2m1") take the mgpu_int4 layout with
  qweight  int4 tiles as above holding the E2M1 codes' bits as they are (no flip);
  scales   [E, K//32, N] bfloat16: the E8M0 scales' values 2^(X - 127), exact (bfloat16 has
           f32's exponent range; X = 0 is the subnormal 2^-127, X = 255 NaN);
  zeros    None; so that w = e2m1(qweight) * scales.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from wna16_jax.backend_api import QuantizedExperts, e8m0_to_f32, pack_zeros, unpack_zeros

# The layouts and the bits of the weights each holds.
LAYOUT_BITS = {"mgpu_int4": 4, "mgpu_int8": 8}
LAYOUTS = tuple(LAYOUT_BITS)
# The layouts' weight tiles: MGPU_TILE x MGPU_TILE (features x inputs); a shard of such weights
# holds whole tiles.
MGPU_TILE = 64

# Flips the top bit of each value of a canonical word: u -> u - 2^(bits-1) read as signed.
_FLIP_TOP_BIT = {4: 0x88888888, 8: 0x80808080}


def layout_reason(layout: str, *, bits: int, n: int, k: int) -> str | None:
    """Why `layout` cannot hold weights [E, N, K] of `bits` bits (None when it can)."""
    held = LAYOUT_BITS[layout]
    if bits != held:
        return f"the {layout} layout holds int{held} weights, not int{bits}"
    if n % MGPU_TILE or k % MGPU_TILE:
        return (
            f"the {layout} layout holds {MGPU_TILE}x{MGPU_TILE} tiles: N={n} and K={k} must be "
            f"multiples of {MGPU_TILE}"
        )
    return None


def logical_shape(qw: QuantizedExperts) -> tuple[int, int, int]:
    """[E, N, K] of `qw` in an mgpu layout (qweight [E, N/64, K/64, 64, 64])."""
    e, n_tiles, k_tiles, tile_n, tile_k = (int(d) for d in qw.qweight.shape)
    return (e, n_tiles * tile_n, k_tiles * tile_k)


def validate(qw: QuantizedExperts, name: str) -> None:
    """Raises ValueError naming `name` and the values where `qw`'s arrays do not have its mgpu
    layout's shapes and dtypes."""
    layout, bits = qw.layout, LAYOUT_BITS[qw.layout]
    if qw.bits != bits:
        raise ValueError(f"{name}: the {layout} layout holds int{bits} weights, not int{qw.bits}")
    tile = (MGPU_TILE, MGPU_TILE)
    q = qw.qweight
    if q.ndim != 5 or tuple(q.shape[3:]) != tile or q.dtype != jnp.dtype(f"int{bits}"):
        raise ValueError(
            f"{name}: {layout} qweight must be int{bits} [E, N/64, K/64, 64, 64], got "
            f"{q.dtype} {tuple(q.shape)}"
        )
    e, n, k = qw.shape
    if qw.group_size != -1 and (qw.group_size <= 0 or k % qw.group_size):
        raise ValueError(f"{name}: K={k} is not a multiple of group_size={qw.group_size}")
    want = (e, qw.num_groups, n)
    for field in ("scales", "zeros"):
        arr = getattr(qw, field)
        if arr is None and field == "zeros":
            continue
        if tuple(arr.shape) != want or not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(
                f"{name}: {layout} {field} must be float [E, K//G, N] = {want}, got "
                f"{arr.dtype} {tuple(arr.shape)}"
            )


def to_mgpu_layout(qw: QuantizedExperts, layout: str) -> QuantizedExperts:
    """Canonical `qw` (validated, held by `layout`: `layout_reason`) in `layout`."""
    e, n, k = qw.shape
    bits = LAYOUT_BITS[layout]
    stored = jnp.dtype(f"int{bits}")  # q - 2^(bits-1)
    if qw.is_mxfp4:  # the codes' bits as they are, the scales' values in bfloat16
        q = tiled(lax.bitcast_convert_type(jnp.asarray(qw.qweight), stored).reshape(e, n, k))
        scales = e8m0_to_f32(jnp.asarray(qw.scales)).astype(jnp.bfloat16)  # [E, N, K//32]
        return QuantizedExperts(
            qweight=q, scales=jnp.swapaxes(scales, 1, 2), zeros=None, bits=4,
            group_size=qw.group_size, layout=layout, perm=qw.perm, codes=qw.codes,
        )  # fmt: skip
    words = qw.qweight ^ jnp.uint32(_FLIP_TOP_BIT[bits])
    q = tiled(lax.bitcast_convert_type(words, stored).reshape(e, n, k))
    offset = None
    if qw.zeros is not None:
        z = unpack_zeros(qw.zeros, bits).astype(jnp.int32)  # [E, N, K//G]
        offset = jnp.swapaxes(((1 << (bits - 1)) - z).astype(qw.scales.dtype), 1, 2)
    return QuantizedExperts(
        qweight=q,
        scales=jnp.swapaxes(qw.scales, 1, 2),
        zeros=offset,
        bits=bits,
        group_size=qw.group_size,
        layout=layout,
        perm=qw.perm,
    )


def to_canonical(qw: QuantizedExperts) -> QuantizedExperts:
    """`qw` in an mgpu layout -> the canonical layout (the inverse of `to_mgpu_layout`)."""
    bits = qw.bits
    e, n, k = qw.shape
    words = untiled(qw.qweight).reshape(e, n, k * bits // 32, 32 // bits)
    words = lax.bitcast_convert_type(words, jnp.uint32)
    if qw.is_mxfp4:
        return QuantizedExperts(
            qweight=words, scales=_e8m0_bytes(jnp.swapaxes(qw.scales, 1, 2)), zeros=None,
            bits=4, group_size=qw.group_size, perm=qw.perm, codes=qw.codes,
        )  # fmt: skip
    zeros = None
    if qw.zeros is not None:
        z = (1 << (bits - 1)) - jnp.swapaxes(qw.zeros, 1, 2).astype(jnp.int32)  # [E, N, K//G]
        zeros = pack_zeros(z, bits)
    return QuantizedExperts(
        qweight=words ^ jnp.uint32(_FLIP_TOP_BIT[bits]),
        scales=jnp.swapaxes(qw.scales, 1, 2),
        zeros=zeros,
        bits=bits,
        group_size=qw.group_size,
        perm=qw.perm,
    )


def _e8m0_bytes(scales):
    """Powers of two 2^(X - 127) (any float dtype) -> their E8M0 bytes X (uint8), exactly."""
    f = scales.astype(jnp.float32)
    x = (lax.bitcast_convert_type(f, jnp.uint32) >> 23).astype(jnp.uint8)
    x = jnp.where(f == e8m0_to_f32(jnp.uint8(0)), jnp.uint8(0), x)  # the subnormal 2^-127
    return jnp.where(jnp.isnan(f), jnp.uint8(255), x)


# A 64x64 tile (row r, column c) as the indices of the wgmma A operand's registers
# (WGMMA_LAYOUT: thread 32 w + 4 lr + lc holds rows 16 w + 8 rh + lr, columns 8 ct + 2 lc + v,
# register 2 ct + rh holding v = 0, 1), per bits: (the tile's axes, the stored order of them).
# int4, ct = 2 i + ct_lo: r = (w, rh, lr) [4, 2, 8], c = (i, ct_lo, lc, v) [4, 2, 4, 2]; stored
# (major to minor): thread (w, lr, lc), its word i, then the nibble p = s + 4 v of that word,
# s = 2 ct_lo + rh: the register 4 i + s = 2 ct + rh.
# int8, ct = 4 h + i: r = (w, rh, lr) [4, 2, 8], c = (h, i, lc, v) [2, 4, 4, 2]; stored: the half
# h, thread (w, lr, lc), its word i of the half's 16 bytes, then the byte s + 2 v of that word,
# s = rh: the register 2 (4 h + i) + s = 2 ct + rh.
_TILE_ORDERS = {
    4: ((4, 2, 8, 4, 2, 4, 2), (0, 2, 5, 3, 6, 4, 1)),
    8: ((4, 2, 8, 2, 4, 4, 2), (3, 0, 2, 5, 4, 6, 1)),
}


def tile_order(bits: int) -> np.ndarray:
    """[f]: the row-major index (64 r + c) of the weight at position f of a stored tile of
    `bits`-bit values."""
    axes, to_stored = _TILE_ORDERS[bits]
    return np.arange(MGPU_TILE * MGPU_TILE).reshape(axes).transpose(to_stored).reshape(-1)


# TILE_ORDER[f]: the row-major index (64 r + c) of the weight at nibble f of a stored int4 tile.
TILE_ORDER = tile_order(4)


def to_tile_order(tiles, bits: int = 4):
    """[..., 64, 64] tiles (features x inputs) of `bits`-bit values -> the same tiles in wgmma
    register order."""
    axes, to_stored = _TILE_ORDERS[bits]
    lead = tiles.shape[:-2]
    t = tiles.reshape(lead + axes).transpose(
        tuple(range(len(lead))) + tuple(len(lead) + a for a in to_stored)
    )
    return t.reshape(lead + (MGPU_TILE, MGPU_TILE))


def from_tile_order(tiles, bits: int = 4):
    """The inverse of `to_tile_order`."""
    axes, to_stored = _TILE_ORDERS[bits]
    lead = tiles.shape[:-2]
    from_stored = tuple(int(a) for a in np.argsort(to_stored))
    t = tiles.reshape(lead + tuple(axes[a] for a in to_stored)).transpose(
        tuple(range(len(lead))) + tuple(len(lead) + a for a in from_stored)
    )
    return t.reshape(lead + (MGPU_TILE, MGPU_TILE))


def _bits(q) -> int:
    return jnp.iinfo(q.dtype).bits


def tiled(q):
    """int4 or int8 [E, N, K] -> [E, N/64, K/64, 64, 64]: the mgpu_int4 / mgpu_int8 qweight
    (tiles in register order)."""
    e, n, k = q.shape
    t = MGPU_TILE
    return to_tile_order(q.reshape(e, n // t, t, k // t, t).transpose(0, 1, 3, 2, 4), _bits(q))


def untiled(q):
    """The inverse of `tiled`: [E, N/64, K/64, 64, 64] -> [E, N, K]."""
    e, n_tiles, k_tiles, tn, tk = q.shape
    q = from_tile_order(q, _bits(q))
    return q.transpose(0, 1, 3, 2, 4).reshape(e, n_tiles * tn, k_tiles * tk)
