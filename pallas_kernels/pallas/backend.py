"""The 'pallas' and 'pallas_interpret' backends (the Triton-lowered kernels, weights in the
canonical layout): their MoE stages, moe_align_block_size and the grouped GEMM."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.common.align import moe_align_block_size
from pallas_kernels.common.block_configs import NARROWEST_BLOCK_K
from pallas_kernels.pallas import fused_moe as pallas_moe
from pallas_kernels.pallas.w8a8_gemm import MIN_INT8_DOT_K
from pallas_kernels.pallas.wna16_gemm import wna16_gemm
from wna16_jax import backend_api
from wna16_jax.backend_api import (
    CODES,
    GemmProblem,
    MoEProblem,
    compiled_and_interpreted,
    cuda_gpu_reason,
)

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")


def _gpu_reason(platform: str) -> str | None:
    """Why the compiled kernels cannot run on this platform (None when they can)."""
    return cuda_gpu_reason(
        platform, " (use 'pallas_interpret' to run the same kernels in the Pallas interpreter)"
    )


def _w8a8_reason(problem: MoEProblem) -> str | None:
    """Why the W8A8 kernels cannot run `problem` (int8 activations)."""
    inputs = {"w13": problem.hidden, "w2": problem.intermediate}  # each GEMM's K
    bad = []
    for name, bits, group_size, has_zeros in problem.weight_schemes():
        per_channel = group_size == -1 or group_size == inputs[name]
        if bits != 8 or not per_channel or has_zeros:
            zeros = "with zero points" if has_zeros else "symmetric"
            bad.append(f"{name} is int{bits} group_size={group_size} {zeros}")
    if bad:
        return (
            f"int8 activations ({problem.activation_quant}) need int8 per-channel symmetric "
            f"weights (bits=8, group_size=-1, zeros=None), but {'; '.join(bad)}"
        )
    for what, size in (("H", problem.hidden), ("I", problem.intermediate)):
        if size % MIN_INT8_DOT_K:
            return (
                f"{what}={size} is not a multiple of {MIN_INT8_DOT_K}, the smallest k-tile of "
                f"an int8 tensor-core dot"
            )
    return None


def _shape_reason(problem: MoEProblem) -> str | None:
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"activation dtype {problem.dtype} is not one of {SUPPORTED_DTYPES}"
    if backend_api.normalize_activation(problem.activation) is None:
        return f"activation {problem.activation!r} is not 'silu' or a ClampedSwiGLU"
    if problem.activation_quant is not None and problem.has_bias:
        return "per-expert biases with int8 activations (W8A8) are not supported"
    if problem.activation_quant is not None:
        return _w8a8_reason(problem)
    lo = NARROWEST_BLOCK_K
    for what, size in (("H", problem.hidden), ("I", problem.intermediate)):
        if size % lo:
            return (
                f"{what}={size} is not a multiple of {lo}, the smallest k-tile for "
                f"int{problem.bits} (each dot contracts at least 16 features per value slice)"
            )
    for what, g in (("w13", problem.w13_group), ("w2", problem.w2_group)):
        if g % lo and lo % g:
            return f"{what} group size {g} does not tile with the smallest k-tile {lo}"
    return None


def _pallas_reason(problem: MoEProblem) -> str | None:
    return _gpu_reason(problem.platform) or _shape_reason(problem)


def gemm_shape_reason(problem: GemmProblem) -> str | None:
    """Why the grouped GEMM cannot run `problem` on any platform (None when it can)."""
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"activation dtype {problem.dtype} is not one of {SUPPORTED_DTYPES}"
    try:  # the heuristic raises, naming the problems, where no config fits the shape
        pallas_moe.RULES.heuristic(problem.shape)
    except ValueError as err:
        return str(err)
    return None


def grouped_matmul(
    a, w, routing, routed_weights=None, *, top_k, config, out_dtype=None, activation=None,
    interpret=False,
):  # fmt: skip
    """The grouped GEMM (`wna16_gemm`) as `GroupedMatmul.run`: the activation (then the routed
    weights) in its epilogue where fused_moe fuses it (`fused_moe.fuses_activation`), else
    applied to the f32 sums after it."""
    gemm = dict(top_k=top_k, config=config, interpret=interpret)
    if activation is None or pallas_moe.fuses_activation(config, w, activation):
        return wna16_gemm(
            a, w, routing, routed_weights, out_dtype=out_dtype, activation=activation, **gemm
        )
    out = wna16_gemm(a, w, routing, out_dtype=jnp.float32, **gemm)
    return backend_api.activate_then_weight(out, activation, routed_weights, out_dtype or a.dtype)


BACKENDS = compiled_and_interpreted(
    "pallas",
    pallas_moe.stages,
    _pallas_reason,
    _shape_reason,
    moe_align_block_size,
    gemm=grouped_matmul,
    gemm_config=functools.partial(backend_api.resolve, pallas_moe.RULES),
    gemm_shape_reason=gemm_shape_reason,
    codes=CODES,
    biases=True,
    batch_invariant_reason=None,  # the stages' and the GEMM's configs at a fixed M, no K split
)
