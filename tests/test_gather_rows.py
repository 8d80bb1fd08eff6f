"""pallas_kernels/gather_rows.py: the 'mgpu' layer's rows in block order, against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import gather_rows as gr

# Compiled on a GPU, the Pallas interpreter elsewhere: the same tests run both ways.
INTERPRET = jax.default_backend() != "gpu"


def numpy_gather(x, rows):
    x = np.asarray(x, np.float32)
    valid = (rows >= 0) & (rows < x.shape[0])
    return np.where(valid[:, None], x[np.where(valid, rows, 0)], 0)


@pytest.mark.parametrize(
    "t,h,p,dtype",
    [(5, 256, 32, jnp.bfloat16), (3, 384, 24, jnp.float32), (40, 1024, 64, jnp.bfloat16),
     (1, 7168, 64, jnp.bfloat16)],
)  # fmt: skip
def test_rows_match_numpy(rng, t, h, p, dtype):
    """Every output row is x's row or zeros (ids < 0 or >= T): random rows, repeats and
    out-of-range ids among them; no row left from what the output held."""
    x = jnp.asarray(rng.standard_normal((t, h)) + 3.0, dtype)  # no zeros in x
    rows = rng.integers(-3, t + 3, size=p).astype(np.int32)
    rows[0], rows[-1] = t, -1  # at least one of each kind of padding
    out = gr.gather_rows(x, jnp.asarray(rows), interpret=INTERPRET)
    assert out.shape == (p, h) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), numpy_gather(x, rows))


def test_tile_shape():
    assert gr.tile_shape(4096, 7168) == (16, 1024)
    assert gr.tile_shape(24, 384) == (8, 128)
    assert gr.tile_shape(20, 1024) is None  # rows not whole tiles of 8
    assert gr.tile_shape(16, 200) is None  # columns not whole tiles of 128


def test_refuses_shapes_without_tiles(rng):
    x = jnp.ones((4, 200), jnp.bfloat16)
    with pytest.raises(ValueError, match="P % 8 == 0 and H % 128 == 0"):
        gr.gather_rows(x, jnp.zeros(16, jnp.int32), interpret=True)
