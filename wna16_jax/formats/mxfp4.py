"""MXFP4 checkpoints (gpt-oss's `*_blocks` / `*_scales` tensors) <-> QuantizedExperts."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from wna16_jax._quant import pack, unpack
from wna16_jax._types import MXFP4_GROUP, QuantizedExperts

# Bytes of one block of 32 E2M1 codes (two codes a byte).
BLOCK_BYTES = MXFP4_GROUP // 2


def from_blocks(blocks, scales) -> QuantizedExperts:
    """MXFP4 weights in the Hub layout (gpt-oss, transformers' Mxfp4GptOssExperts) ->
    QuantizedExperts (codes "e2m1"), exactly.

    The Hub's rows are output features and its blocks run along the inputs, as the canonical
    layout's: `gate_up_proj_blocks` [E, 2I, H/32, 16] (N = 2I, its gate and up rows
    interleaved: `deinterleave_gate_up`), `down_proj_blocks` [E, H, I/32, 16]. Byte b of block
    g holds input 32g + 2b in its low nibble and 32g + 2b + 1 in its high nibble, so the
    blocks' bytes read as little-endian 32-bit words are the canonical qweight.

    Args:
        blocks: uint8 [E, N, K/32, 16] (or [N, K/32, 16] for one layer: E = 1).
        scales: uint8 [E, N, K/32] (or [N, K/32]) E8M0 bytes, 2^(X - 127).

    Returns:
        QuantizedExperts [E, N, K] (bits 4, group_size 32, zeros None, scales uint8).

    Raises:
        ValueError: dtypes other than uint8, or shapes that do not match (the values quoted).
    """
    what = "formats.mxfp4.from_blocks"
    b, s = np.asarray(blocks), np.asarray(scales)
    if b.ndim == 3:
        b, s = b[None], s[None]
    for name, a in (("blocks", b), ("scales", s)):
        if a.dtype != np.uint8:
            raise ValueError(f"{what}: {name} must be uint8, got dtype {a.dtype}")
    if b.ndim != 4 or b.shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"{what}: blocks must be [E, N, K/32, {BLOCK_BYTES}], got shape {tuple(b.shape)}"
        )
    if s.shape != b.shape[:3]:
        raise ValueError(
            f"{what}: scales shape {tuple(s.shape)} != blocks' [E, N, K/32] {tuple(b.shape[:3])}"
        )
    e, n, groups, _ = b.shape
    words = pack(b.reshape(e, n, groups * BLOCK_BYTES), 8, axis=-1)  # [E, N, K/8] uint32
    qw = QuantizedExperts(
        qweight=jnp.asarray(words),
        scales=jnp.asarray(np.ascontiguousarray(s)),
        zeros=None,
        bits=4,
        group_size=MXFP4_GROUP,
        codes="e2m1",
    )
    qw.validate(what)
    return qw


def to_blocks(qw: QuantizedExperts) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `from_blocks`: MXFP4 QuantizedExperts -> (blocks uint8 [E, N, K/32, 16],
    scales uint8 [E, N, K/32]), numpy, exactly.

    Raises:
        ValueError: weights that are not MXFP4 in the canonical layout.
    """
    what = "formats.mxfp4.to_blocks"
    if not isinstance(qw, QuantizedExperts):
        raise ValueError(f"{what}: expected a QuantizedExperts, got {type(qw).__name__}")
    qw.validate(what)
    if not qw.is_mxfp4:
        raise ValueError(f"{what}: the weights have codes={qw.codes!r}, not MXFP4 ('e2m1')")
    if qw.has_perm:
        raise ValueError(f"{what}: MXFP4 checkpoints store no input permutation (perm)")
    e, n, k = qw.shape
    data = unpack(np.asarray(qw.qweight), 8, axis=-1)  # [E, N, K/2] bytes
    return data.reshape(e, n, k // MXFP4_GROUP, BLOCK_BYTES), np.asarray(qw.scales, np.uint8)


def deinterleave_gate_up(x: Any, *, axis: int = 1):
    """The checkpoint's interleaved gate/up rows (gate = even rows, up = odd rows along `axis`)
    -> the library's [gate; up] order (w13's rows 0..I-1 gate, I..2I-1 up).

    For gpt-oss's `gate_up_proj_blocks` [E, 2I, H/32, 16], `gate_up_proj_scales` [E, 2I, H/32]
    and `gate_up_proj_bias` [E, 2I] (axis=1 for each), before `from_blocks`.

    Args:
        x: array with an even size along `axis` (numpy stays numpy, else jax).
        axis: the rows' axis.

    Returns:
        x with rows [0, 2, 4, ..., 1, 3, 5, ...] along `axis`.

    Raises:
        ValueError: an odd number of rows.
    """
    xp = np if isinstance(x, np.ndarray) else jnp
    a = xp.asarray(x)
    rows = a.shape[axis]
    if rows % 2:
        raise ValueError(f"deinterleave_gate_up: {rows} rows along axis {axis} is odd")
    order = np.concatenate([np.arange(0, rows, 2), np.arange(1, rows, 2)])
    return xp.take(a, order, axis=axis)


def interleave_gate_up(x: Any, *, axis: int = 1):
    """The inverse of `deinterleave_gate_up`: [gate; up] rows -> gate even, up odd."""
    xp = np if isinstance(x, np.ndarray) else jnp
    a = xp.asarray(x)
    rows = a.shape[axis]
    if rows % 2:
        raise ValueError(f"interleave_gate_up: {rows} rows along axis {axis} is odd")
    order = np.arange(rows).reshape(2, rows // 2).T.reshape(-1)  # gate 0, up 0, gate 1, ...
    return xp.take(a, order, axis=axis)
