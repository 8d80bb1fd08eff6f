"""The MoE activations and the int8 quantization of a GEMM's input rows (W8A8)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def silu_and_mul(h):
    """[.., 2I] -> [.., I]: silu(gate) * up with gate = first half."""
    i = h.shape[-1] // 2
    return jax.nn.silu(h[..., :i]) * h[..., i:]


ACTIVATIONS = {"silu": silu_and_mul}


def activate(h, activation: str, dtype=None):
    """ACTIVATIONS[activation] of GEMM1's sums h [R, 2I], computed in f32 -> [R, I] in dtype
    (None: left in f32)."""
    act = ACTIVATIONS[activation](h.astype(jnp.float32))
    return act if dtype is None else act.astype(dtype)


def weighted_rows(rows, routed_weights, dtype):
    """rows [R, N] times each row's routed weight (f32 [R]; None: unweighted), multiplied in
    f32, -> dtype."""
    if routed_weights is not None:
        rows = rows.astype(jnp.float32) * routed_weights.astype(jnp.float32)[:, None]
    return rows.astype(dtype)


def activate_then_weight(h, activation: str, routed_weights, dtype):
    """A grouped GEMM's activation applied after it: ACTIVATIONS[activation] of the f32 sums
    h [R, 2I], then each row's routed weight (`weighted_rows`) -> [R, I] in dtype."""
    return weighted_rows(activate(h, activation), routed_weights, dtype)


# ---- int8 activations (W8A8) ----------------------------------------------------------------

# Symmetric int8 activations use [-127, 127] (the grid is symmetric around 0).
INT8_ACTIVATION_MAX = 127


class Int8Rows(NamedTuple):
    """A GEMM's input quantized to int8: x ~= q * scale[:, None]."""

    q: jax.Array  # int8 [R, K]
    scale: jax.Array  # f32 [R]


def quantize_activations_per_token(x) -> Int8Rows:
    """Dynamic symmetric int8 quantization of each row (token).

    scale_t = max|x_t| * (1/127) and q = clip(round(x * (1 / scale_t)), -127, 127), round half
    to even, all in f32 (0 scale and q for an all-zero row). The divisions are written as
    products with reciprocals because that is what XLA compiles them to (it rewrites a / b by
    a broadcast or constant b as a * (1/b)): so written, numpy reproduces the result bitwise.

    Args:
        x: [T, K] float.

    Returns:
        Int8Rows (q int8 [T, K], scale f32 [T]).
    """
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) * jnp.float32(1.0 / INT8_ACTIVATION_MAX)  # [T]
    inv = jnp.float32(1.0) / jnp.where(scale > 0, scale, jnp.float32(1.0))  # [T]
    q = jnp.clip(jnp.round(xf * inv[:, None]), -INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX)
    return Int8Rows(q.astype(jnp.int8), scale)


def quantize_activations_static(x, scale: float) -> Int8Rows:
    """Static symmetric int8 quantization with one given scale for the whole tensor.

    Args:
        x: [T, K] float.
        scale: positive float (a static Python float).

    Returns:
        Int8Rows (q int8 [T, K] = clip(round(x * (1 / scale)), -127, 127) in f32, scale f32 [T]
        filled with `scale`).
    """
    s = np.float32(scale)
    inv = np.float32(1.0) / s  # on the host, IEEE f32
    q = jnp.clip(jnp.round(x.astype(jnp.float32) * inv), -INT8_ACTIVATION_MAX, INT8_ACTIVATION_MAX)
    return Int8Rows(q.astype(jnp.int8), jnp.full((x.shape[0],), s, jnp.float32))


def quantize_activations(x, activation_quant, gemm: int) -> Int8Rows:
    """The int8 input of GEMM `gemm` (1 or 2) under an ActivationQuant."""
    if activation_quant.scheme == "int8_per_token":
        return quantize_activations_per_token(x)
    scale = activation_quant.gemm1_scale if gemm == 1 else activation_quant.gemm2_scale
    return quantize_activations_static(x, scale)
