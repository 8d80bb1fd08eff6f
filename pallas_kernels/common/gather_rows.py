"""Rows of x in a given order, as a Pallas Triton kernel: the 'mgpu' layer's rows in block order.

out[p] = x[rows[p]] where 0 <= rows[p] < T, else zeros: a tile of block_rows rows x block_cols
columns per program, each row one contiguous load (faster than XLA's gather and select on the
H200: docs/performance.md, 'Mosaic GPU layer').
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(rows_ref, x_ref, o_ref, *, num_rows: int, block_rows: int, block_cols: int):
    i, j = pl.program_id(0), pl.program_id(1)
    rows = plgpu.load(rows_ref.at[pl.ds(i * block_rows, block_rows)])  # [block_rows]
    valid = (rows >= 0) & (rows < num_rows)
    cols = j * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
    tile = plgpu.load(
        x_ref.at[jnp.where(valid, rows, 0)[:, None], cols[None, :]],
        mask=valid[:, None],
        other=0,
    )
    o_ref[...] = tile.astype(o_ref.dtype)


def tile_shape(num_out: int, hidden: int) -> tuple[int, int] | None:
    """(block_rows, block_cols) for [num_out, hidden] outputs: 8 or 16 rows, and a power of two
    of 128..1024 columns dividing hidden; None where none fits (the caller gathers with XLA)."""
    block_rows = 16 if num_out % 16 == 0 else 8 if num_out % 8 == 0 else None
    block_cols = math.gcd(hidden, 1024)
    if block_rows is None or block_cols < 128:
        return None
    return block_rows, block_cols


@functools.partial(jax.jit, static_argnames=("interpret",))
def gather_rows(x: jax.Array, rows: jax.Array, *, interpret: bool = False) -> jax.Array:
    """out[p] = x[rows[p]] for 0 <= rows[p] < T, and for any other index zeros; [P, H] in x's
    dtype (leaving the other rows unwritten measured no faster in the layer).

    P must be a multiple of 8 and H a multiple of 128 (`tile_shape`); raises ValueError
    otherwise."""
    t, h = x.shape
    (p,) = rows.shape
    shape = tile_shape(p, h)
    if shape is None:
        raise ValueError(f"gather_rows needs P % 8 == 0 and H % 128 == 0, got P={p}, H={h}")
    block_rows, block_cols = shape
    return pl.pallas_call(
        functools.partial(_kernel, num_rows=t, block_rows=block_rows, block_cols=block_cols),
        out_shape=jax.ShapeDtypeStruct((p, h), x.dtype),
        grid=(p // block_rows, h // block_cols),
        in_specs=[
            pl.BlockSpec((p,), lambda i, j: (0,)),
            pl.BlockSpec((t, h), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gather_rows",
    )(rows.astype(jnp.int32), x)
