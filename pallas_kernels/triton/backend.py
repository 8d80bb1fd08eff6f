"""The 'triton' backend (Triton kernels called through jax_triton): MoE stages,
moe_align_block_size and the grouped GEMM.

Importing this module imports neither triton nor jax_triton: `unsupported_reason` tries them
(once) and the kernels are imported on the first call.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.triton.config import MAX_EXPERTS, MIN_SPAN, RULES
from wna16_jax import backend_api
from wna16_jax.backend_api import (
    CODES,
    AlignProblem,
    Backend,
    GemmProblem,
    GroupedMatmul,
    MoEProblem,
)
from wna16_jax.backend_api import cuda_gpu_reason as _gpu_reason

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")


@functools.cache
def import_reason() -> str | None:
    """Why triton or jax_triton cannot be imported (None when both can); tried once."""
    for module in ("triton", "jax_triton"):
        try:
            __import__(module)
        except Exception as err:  # any failure (ImportError, a CUDA-less jaxlib) disables it
            return (
                f"{module} is not importable ({type(err).__name__}: {err}); install it with "
                f"pip install 'wna16_jax[triton]' (jax-triton 0.3.1 for triton 3.6)"
            )
    return None


def shape_reason(problem: MoEProblem) -> str | None:
    """Why the kernels cannot run `problem`'s shapes and formats (None when they can)."""
    if problem.activation_quant is not None:
        return (
            f"int8 activations (activation_quant={problem.activation_quant!r}, W8A8) are not "
            f"supported by this backend"
        )
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"activation dtype {problem.dtype} is not one of {SUPPORTED_DTYPES}"
    if backend_api.normalize_activation(problem.activation) is None:
        names = sorted(backend_api.ACTIVATIONS)
        return f"activation {problem.activation!r} is not one of {names}"
    if problem.num_global_experts > MAX_EXPERTS:
        return f"{problem.num_global_experts} experts, over the align kernel's {MAX_EXPERTS}"
    for what, n in (("2I", 2 * problem.intermediate), ("H", problem.hidden)):
        if n % MIN_SPAN:
            return f"{what}={n} output features are not a multiple of {MIN_SPAN} (block_n)"
    for what, g in (("w13", problem.w13_group), ("w2", problem.w2_group)):
        if g % MIN_SPAN:
            return (
                f"{what} group size {g} is not a multiple of {MIN_SPAN}: each dot of the "
                f"kernel contracts whole groups or a k-tile inside one"
            )
    return None


def unsupported_reason(problem: MoEProblem) -> str | None:
    return _gpu_reason(problem.platform) or import_reason() or shape_reason(problem)


def align_unsupported_reason(problem: AlignProblem) -> str | None:
    reason = _gpu_reason(problem.platform) or import_reason()
    if reason is None and problem.num_experts > MAX_EXPERTS:
        reason = f"{problem.num_experts} experts, over the align kernel's {MAX_EXPERTS}"
    return reason


def _stages(**kwargs):
    """The kernels' MoeStages (Backend.stages), imported on first use."""
    from pallas_kernels.triton import fused_moe as triton_moe

    return triton_moe.stages(**kwargs)


def _align(topk_ids, *, num_experts, block_m, expert_map):
    from pallas_kernels.triton import align

    return align.moe_align_block_size(
        topk_ids, num_experts=num_experts, block_m=block_m, expert_map=expert_map
    )


def gemm_shape_reason(problem: GemmProblem) -> str | None:
    """Why the grouped GEMM cannot run `problem`'s shapes and formats (None when it can)."""
    shape = problem.shape
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"activation dtype {problem.dtype} is not one of {SUPPORTED_DTYPES}"
    if shape.n % MIN_SPAN:
        return f"N={shape.n} output features are not a multiple of {MIN_SPAN} (block_n)"
    if shape.group % MIN_SPAN:
        return (
            f"group size {shape.group} is not a multiple of {MIN_SPAN}: each dot of the "
            f"kernel contracts whole groups or a k-tile inside one"
        )
    try:  # the heuristic raises, naming the problems, where no config fits the shape
        RULES.heuristic(shape)
    except ValueError as err:
        return str(err)
    return None


def gemm_unsupported_reason(problem: GemmProblem) -> str | None:
    return _gpu_reason(problem.platform) or import_reason() or gemm_shape_reason(problem)


def _grouped_matmul(
    a, w, routing, routed_weights=None, *, top_k, config, out_dtype=None, activation=None
):
    from pallas_kernels.triton.wna16_gemm import wna16_gemm

    gemm = dict(top_k=top_k, config=config)
    if activation is None:
        return wna16_gemm(a, w, routing, routed_weights, out_dtype=out_dtype, **gemm)
    out = wna16_gemm(a, w, routing, out_dtype=jnp.float32, **gemm)
    return backend_api.activate_then_weight(out, activation, routed_weights, out_dtype or a.dtype)


BACKENDS = (
    Backend(
        name="triton",
        unsupported_reason=unsupported_reason,
        stages=_stages,
        align_unsupported_reason=align_unsupported_reason,
        moe_align_block_size=_align,
        batch_invariant_reason=None,  # the stages' and the GEMM's configs at a fixed M, no K split
        grouped_matmul=GroupedMatmul(
            unsupported_reason=gemm_unsupported_reason,
            config=functools.partial(backend_api.resolve, RULES),
            run=_grouped_matmul,
        ),
        codes=CODES,
        biases=True,
    ),
)
