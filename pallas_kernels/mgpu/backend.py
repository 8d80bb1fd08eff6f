"""The 'mgpu' and 'mgpu_interpret' backends (the Mosaic GPU GEMM, weights in the mgpu_int4 or
mgpu_int8 layout): their MoE stages, moe_align_block_size and the grouped GEMM (the quantized
linear's)."""

from __future__ import annotations

import functools

import jax

from pallas_kernels.common.align import moe_align_block_size
from pallas_kernels.mgpu import fused_moe as mgpu_fused_moe
from pallas_kernels.mgpu import grouped_matmul as mgpu_grouped_matmul
from pallas_kernels.mgpu import layout as mgpu_layout
from pallas_kernels.mgpu.config import MgpuConfig
from pallas_kernels.mgpu.wna16_gemm import group_reason
from wna16_jax import backend_api
from wna16_jax.backend_api import (
    CODES,
    GemmProblem,
    LayoutConversion,
    MoEProblem,
    compiled_and_interpreted,
    cuda_gpu_reason,
)

# The Mosaic GPU GEMM: 64 output features per program.
MGPU_SPAN = 64


def _mgpu_shape_reason(problem: MoEProblem) -> str | None:
    # The layout (mgpu_int4 or mgpu_int8: int4 or int8 weights) is checked by selection:
    # Backend.layouts.
    if problem.dtype != "bfloat16" and problem.activation_quant is None:
        return f"activation dtype {problem.dtype} is not bfloat16"
    if backend_api.normalize_activation(problem.activation) is None:
        return f"activation {problem.activation!r} is not 'silu' or a ClampedSwiGLU"
    if problem.activation_quant is not None and problem.has_bias:
        return "per-expert biases with int8 activations (W8A8) are not supported"
    if problem.activation_quant is not None:
        # W8A8 takes int8 weights without zero points (grouped along K in whole k-tiles, or
        # per channel: the group checks below); its rows are int8 whatever x's dtype (the
        # output is rounded from f32 sums to x's).
        bad = [
            f"{name} is int{bits}{' with zero points' if has_zeros else ''}"
            for name, bits, _, has_zeros in problem.weight_schemes()
            if bits != 8 or has_zeros
        ]
        if bad:
            return (
                f"int8 activations ({problem.activation_quant}) need symmetric int8 weights "
                f"(bits=8, zeros=None), but {'; '.join(bad)}"
            )
    for what, n in (("2I", 2 * problem.intermediate), ("H", problem.hidden)):
        if n % MGPU_SPAN:
            return f"{what}={n} output features are not a multiple of {MGPU_SPAN}"
    for what, g in (("w13", problem.w13_group), ("w2", problem.w2_group)):
        if reason := group_reason(g, int8_rows=problem.activation_quant is not None):
            return f"{what}: {reason}"
    return None


def sm90_reason(platform: str) -> str | None:
    """Why the compiled Mosaic GPU kernels cannot run on `platform` (None on an sm_90 GPU)."""
    reason = cuda_gpu_reason(platform, " (use 'mgpu_interpret' for the Mosaic GPU interpreter)")
    if reason is None:
        device = jax.devices()[0]
        if str(device.compute_capability) != "9.0":
            reason = (
                f"needs sm_90 (wgmma): {device.device_kind} has compute capability "
                f"{device.compute_capability}"
            )
    return reason


def _mgpu_reason(problem: MoEProblem) -> str | None:
    return sm90_reason(problem.platform) or _mgpu_shape_reason(problem)


def _gemm_shape_reason(problem: GemmProblem) -> str | None:
    return mgpu_grouped_matmul.gemm_shape_reason(problem.shape, problem.dtype)


BACKENDS = compiled_and_interpreted(
    "mgpu",
    mgpu_fused_moe.stages,
    _mgpu_reason,
    _mgpu_shape_reason,
    moe_align_block_size,
    mgpu_layout.LAYOUTS,
    gemm=mgpu_grouped_matmul.grouped_matmul,
    gemm_config=functools.partial(backend_api.resolve, mgpu_grouped_matmul.GEMM_RULES),
    gemm_shape_reason=_gemm_shape_reason,
    gemm_gpu_reason=sm90_reason,
    gemm_linear=mgpu_grouped_matmul.linear,
    # 'mgpu' on mgpu_int4 beat 'pallas' on the canonical layout for DeepSeek-V3 on the H200
    # (docs/performance.md, 'Mosaic GPU layer'); mgpu_int8, the same GEMM on int8 weights, is
    # preferred by the same reasoning (not yet measured).
    preferred_layouts=("mgpu_int4", "mgpu_int8"),
    config_type=MgpuConfig,
    batch_invariant_reason=(
        "does not compute rows batch-invariantly: its K splits and output tiles per program "
        "are chosen from the number of blocks, hence from the rows in the call (gemm_splits, "
        "auto_splits)"
    ),
    layout_conversion=LayoutConversion(
        bits=mgpu_layout.LAYOUT_BITS,
        reason=mgpu_layout.layout_reason,
        to_kernel=mgpu_layout.to_mgpu_layout,
        to_canonical=mgpu_layout.to_canonical,
        shape=mgpu_layout.logical_shape,
        validate=mgpu_layout.validate,
        granularity=mgpu_layout.MGPU_TILE,
    ),
    codes=CODES,
    biases=True,
)
