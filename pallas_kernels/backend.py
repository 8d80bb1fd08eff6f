"""The 'pallas' and 'pallas_interpret' backends of wna16_jax.fused_moe (the Triton-lowered
kernels), and 'mgpu' / 'mgpu_interpret' (the Mosaic GPU GEMM, weights in the mgpu_int4 layout)."""

from __future__ import annotations

import functools

import jax

from pallas_kernels import fused_moe as pallas_moe
from pallas_kernels import mgpu_fused_moe
from pallas_kernels.w8a8_gemm import MIN_INT8_DOT_K
from wna16_jax._configs import min_block_k
from wna16_jax._dispatch import AlignProblem, Backend, MoEProblem, cuda_gpu_reason

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
    if problem.activation != "silu":
        return f"activation {problem.activation!r} is not supported (only 'silu')"
    if problem.activation_quant is not None:
        return _w8a8_reason(problem)
    lo = min_block_k(problem.bits)
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


def _align_reason(problem: AlignProblem) -> str | None:
    return _gpu_reason(problem.platform)


# The Mosaic GPU GEMM: 64 output features per program; its k-tile (64 or 128) divides the group.
MGPU_SPAN = 64


def _mgpu_shape_reason(problem: MoEProblem) -> str | None:
    # The layout (mgpu_int4 only) is checked by selection: Backend.layouts.
    if problem.dtype != "bfloat16":
        return f"activation dtype {problem.dtype} is not bfloat16"
    if problem.activation != "silu":
        return f"activation {problem.activation!r} is not supported (only 'silu')"
    if problem.activation_quant is not None:
        return f"int8 activations ({problem.activation_quant!r}) are not supported"
    for what, n in (("2I", 2 * problem.intermediate), ("H", problem.hidden)):
        if n % MGPU_SPAN:
            return f"{what}={n} output features are not a multiple of {MGPU_SPAN}"
    for what, g in (("w13", problem.w13_group), ("w2", problem.w2_group)):
        if g % MGPU_SPAN:
            return f"{what} group size {g} is not a multiple of {MGPU_SPAN} (the k-tile)"
    return None


def _mgpu_reason(problem: MoEProblem) -> str | None:
    reason = cuda_gpu_reason(
        problem.platform, " (use 'mgpu_interpret' for the Mosaic GPU interpreter)"
    )
    if reason is None:
        device = jax.devices()[0]
        if str(device.compute_capability) != "9.0":
            reason = (
                f"needs sm_90 (wgmma): {device.device_kind} has compute capability "
                f"{device.compute_capability}"
            )
    return reason or _mgpu_shape_reason(problem)


def _compiled_and_interpreted(
    name, fused_moe, reason, shape_reason, layouts=("canonical",)
) -> tuple[Backend, Backend]:
    """Backend `name` (compiled, on a CUDA GPU) and `name`_interpret (the same kernels in the
    interpreter, any platform), both aligning with the Pallas align kernel and reading weights
    in `layouts`."""
    return (
        Backend(
            name=name,
            unsupported_reason=reason,
            fused_moe=functools.partial(fused_moe, interpret=False),
            align_unsupported_reason=_align_reason,
            moe_align_block_size=functools.partial(pallas_moe.align, interpret=False),
            layouts=layouts,
        ),
        Backend(
            name=f"{name}_interpret",
            unsupported_reason=shape_reason,
            fused_moe=functools.partial(fused_moe, interpret=True),
            align_unsupported_reason=lambda problem: None,
            moe_align_block_size=functools.partial(pallas_moe.align, interpret=True),
            layouts=layouts,
        ),
    )


BACKENDS = (
    *_compiled_and_interpreted("pallas", pallas_moe.fused_moe, _pallas_reason, _shape_reason),
    *_compiled_and_interpreted(
        "mgpu", mgpu_fused_moe.fused_moe, _mgpu_reason, _mgpu_shape_reason, ("mgpu_int4",)
    ),
)
