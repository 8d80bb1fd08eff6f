"""Kernel-private weight layouts behind QuantizedExperts, made once (e.g. at load) and lossless.

    mgpu = wj.layouts.to_kernel_layout(qw, "mgpu_int4")    # for implementation="mgpu"
    qw_again = wj.layouts.to_canonical_layout(mgpu)        # bit-identical to qw

Which layout runs fastest here: wj.preferred_layout(w13, w2, dtype=jnp.bfloat16).

"mgpu_int4" (pallas_kernels/mosaic_gpu/wna16_gemm.py's operands; int4 only):
  qweight  int4 [E, N/64, K/64, 64, 64]: the canonical nibbles minus 8 (xor 8), in 64x64
           tiles (features x inputs), the k-tiles of each row of tiles consecutive: a k-step of
           the GEMM reads one contiguous run of memory (copied in TMA rows of 256 nibbles, a
           free reshape of the tiles). N and K must be multiples of 64.
           Within a tile the 4096 nibbles are in wgmma register order (`TILE_ORDER`): thread t
           of the converting warpgroup reads its 32 weights as the 16 bytes at 16 t, and
           nibbles p and p + 4 of its word i are the two bf16 of its register 4 i + p of the
           wgmma A operand (WGMMA_LAYOUT), so one shift and one lop3 make a bf16 pair: no
           shuffles, no permutes (pallas_kernels/mosaic_gpu/wna16_gemm.py).
  scales   [E, K//G, N]: a group's scales for consecutive features are one TMA row.
  zeros    None, or 8 - z as [E, K//G, N] in the scales' dtype (exact: small integers),
           so that w = (qweight + zeros) * scales is the canonical (q - z) * scale.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from wna16_jax._types import LAYOUTS, MGPU_TILE, QuantizedExperts

_XOR_8 = 0x88888888  # flips bit 3 of each nibble: u -> u - 8 read as signed int4


def to_kernel_layout(qw: QuantizedExperts, layout: str) -> QuantizedExperts:
    """`qw` (canonical) in `layout`, one of LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if qw.layout == layout:
        return qw
    if qw.layout != "canonical":
        qw = to_canonical_layout(qw)
    if layout == "canonical":
        return qw
    qw.validate("weights")
    if qw.bits != 4:
        raise ValueError(f"the {layout} layout holds int4 weights, not int{qw.bits}")
    e, n, k = qw.shape
    if n % MGPU_TILE or k % MGPU_TILE:
        raise ValueError(
            f"the {layout} layout holds {MGPU_TILE}x{MGPU_TILE} tiles: N={n} and K={k} must be "
            f"multiples of {MGPU_TILE}"
        )
    q = lax.bitcast_convert_type(qw.qweight ^ jnp.uint32(_XOR_8), jnp.int4).reshape(e, n, k)
    q = tiled(q)
    offset = None
    if qw.zeros is not None:
        z = jnp.stack([qw.zeros & 0xF, qw.zeros >> 4], axis=2).reshape(e, n, -1)
        offset = jnp.swapaxes((8 - z.astype(jnp.int32)).astype(qw.scales.dtype), 1, 2)
    return QuantizedExperts(
        qweight=q,
        scales=jnp.swapaxes(qw.scales, 1, 2),
        zeros=offset,
        bits=4,
        group_size=qw.group_size,
        layout=layout,
    )


def to_canonical_layout(qw: QuantizedExperts) -> QuantizedExperts:
    """`qw` in the canonical layout (docs/design.md); the inverse of to_kernel_layout."""
    if qw.layout == "canonical":
        return qw
    qw.validate("weights")
    e, n, k = qw.shape
    words = untiled(qw.qweight).reshape(e, n, k // 8, 8)
    words = lax.bitcast_convert_type(words, jnp.uint32)
    zeros = None
    if qw.zeros is not None:
        z = (8 - jnp.swapaxes(qw.zeros, 1, 2).astype(jnp.int32)).astype(jnp.uint8)  # [E, N, g]
        zeros = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(jnp.uint8)
    return QuantizedExperts(
        qweight=words ^ jnp.uint32(_XOR_8),
        scales=jnp.swapaxes(qw.scales, 1, 2),
        zeros=zeros,
        bits=4,
        group_size=qw.group_size,
    )


# A 64x64 tile (row r, column c) as the indices of the wgmma A operand's registers
# (WGMMA_LAYOUT: thread 32 w + 4 lr + lc holds rows 16 w + 8 rh + lr, columns 8 ct + 2 lc + v,
# register 2 ct + rh holding v = 0, 1) with ct = 2 i + ct_lo:
#   r = (w, rh, lr) [4, 2, 8],  c = (i, ct_lo, lc, v) [4, 2, 4, 2].
_TILE_AXES = (4, 2, 8, 4, 2, 4, 2)
# Stored order (major to minor): thread (w, lr, lc), its word i, then the nibble p = s + 4 v of
# that word, s = 2 ct_lo + rh: the register 4 i + s = 2 ct + rh.
_TO_STORED = (0, 2, 5, 3, 6, 4, 1)
_FROM_STORED = tuple(int(a) for a in np.argsort(_TO_STORED))
_STORED_AXES = tuple(_TILE_AXES[a] for a in _TO_STORED)


def _tile_order() -> np.ndarray:
    tile = np.arange(MGPU_TILE * MGPU_TILE).reshape(_TILE_AXES)
    return tile.transpose(_TO_STORED).reshape(-1)


# TILE_ORDER[f]: the row-major index (64 r + c) of the weight at nibble f of a stored tile.
TILE_ORDER = _tile_order()


def to_tile_order(tiles):
    """[..., 64, 64] tiles (features x inputs) -> the same tiles in wgmma register order."""
    lead = tiles.shape[:-2]
    t = tiles.reshape(lead + _TILE_AXES).transpose(
        tuple(range(len(lead))) + tuple(len(lead) + a for a in _TO_STORED)
    )
    return t.reshape(lead + (MGPU_TILE, MGPU_TILE))


def from_tile_order(tiles):
    """The inverse of `to_tile_order`."""
    lead = tiles.shape[:-2]
    t = tiles.reshape(lead + _STORED_AXES).transpose(
        tuple(range(len(lead))) + tuple(len(lead) + a for a in _FROM_STORED)
    )
    return t.reshape(lead + (MGPU_TILE, MGPU_TILE))


def tiled(q):
    """int4 [E, N, K] -> [E, N/64, K/64, 64, 64]: the mgpu_int4 qweight (tiles in register
    order)."""
    e, n, k = q.shape
    t = MGPU_TILE
    return to_tile_order(q.reshape(e, n // t, t, k // t, t).transpose(0, 1, 3, 2, 4))


def untiled(q):
    """The inverse of `tiled`: [E, N/64, K/64, 64, 64] -> [E, N, K]."""
    e, n_tiles, k_tiles, tn, tk = q.shape
    q = from_tile_order(q)
    return q.transpose(0, 1, 3, 2, 4).reshape(e, n_tiles * tn, k_tiles * tk)
