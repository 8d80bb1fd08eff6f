"""The MoE activations and the int8 quantization of a GEMM's input rows (W8A8)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def silu_and_mul(h):
    """[.., 2I] -> [.., I]: silu(gate) * up with gate = first half."""
    i = h.shape[-1] // 2
    return jax.nn.silu(h[..., :i]) * h[..., i:]


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated activation (OpenAI's `swiglu`; transformers' GptOssExperts), frozen and
    hashable: [.., 2I] -> [.., I] with gate = first half, up = second half (the library's
    [gate; up] rows; `formats.mxfp4.deinterleave_gate_up` converts the checkpoint's
    interleaved rows once, at load):

        gate = min(gate, limit);  up = clip(up, -limit, limit)
        out = (up + 1) * gate * sigmoid(alpha * gate)

    Its name "swiglu_oai" as fused_moe's `activation` means ClampedSwiGLU() (alpha 1.702,
    limit 7.0, gpt-oss's values).
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        for f in ("alpha", "limit"):
            v = getattr(self, f)
            try:
                fv = float(v)  # numpy scalars become hashable Python floats
            except (TypeError, ValueError):
                raise ValueError(f"ClampedSwiGLU.{f}={v!r} must be a float") from None
            if not (np.isfinite(fv) and fv > 0):
                raise ValueError(f"ClampedSwiGLU.{f}={v!r} must be positive and finite")
            object.__setattr__(self, f, fv)

    def __call__(self, h):
        i = h.shape[-1] // 2
        gate = jnp.minimum(h[..., :i], self.limit)
        up = jnp.clip(h[..., i:], -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(self.alpha * gate)


ACTIVATIONS = {"silu": silu_and_mul, "swiglu_oai": ClampedSwiGLU()}


def normalize_activation(activation):
    """fused_moe's `activation` as the backends see it: "silu", or a ClampedSwiGLU (its name
    "swiglu_oai" gives the defaults). Returns None for anything else."""
    if isinstance(activation, ClampedSwiGLU):
        return activation
    if isinstance(activation, str) and activation in ACTIVATIONS:
        return ACTIVATIONS[activation] if activation != "silu" else activation
    return None


def activation_fn(activation):
    """The function of a normalized activation ("silu" or a ClampedSwiGLU)."""
    return ACTIVATIONS[activation] if isinstance(activation, str) else activation


def activate(h, activation, dtype=None):
    """The activation ("silu", "swiglu_oai" or a ClampedSwiGLU) of GEMM1's sums h [R, 2I],
    computed in f32 -> [R, I] in dtype (None: left in f32)."""
    act = activation_fn(activation)(h.astype(jnp.float32))
    return act if dtype is None else act.astype(dtype)


def weighted_rows(rows, routed_weights, dtype):
    """rows [R, N] times each row's routed weight (f32 [R]; None: unweighted), multiplied in
    f32, -> dtype."""
    if routed_weights is not None:
        rows = rows.astype(jnp.float32) * routed_weights.astype(jnp.float32)[:, None]
    return rows.astype(dtype)


def activate_then_weight(h, activation, routed_weights, dtype):
    """A grouped GEMM's activation applied after it: `activate` of the f32 sums h [R, 2I],
    then each row's routed weight (`weighted_rows`) -> [R, I] in dtype."""
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
