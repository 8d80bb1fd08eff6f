"""Compiles Pallas (Triton lowering) kernels for an H200 (sm_90) on a machine without a GPU.

A jitted function is lowered for the "cuda" platform with Pallas told that the device is an
H200; each pallas_call's Triton IR is then compiled by the `triton` package (Triton's own
compiler and the ptxas it ships) for sm_90 with the call's num_warps / num_stages. That runs
every step of a GPU build except loading the kernel: the Pallas -> Triton lowering, Triton's
passes, inline PTX, and ptxas; and it reports each kernel's shared memory, which the H200 caps
at 227 KiB per block (a config over it fails at launch with RESOURCE_EXHAUSTED).

Needs `pip install triton` (not part of the test extra: tests using this skip without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import tempfile
from pathlib import Path

import jax

from pallas_kernels.mgpu.wna16_gemm import SM90_SHARED_MEMORY_BYTES

# cudaDevAttrMaxSharedMemoryPerBlockOptin of the H100/H200: 227 KiB.
H200_SHARED_MEMORY_BYTES = SM90_SHARED_MEMORY_BYTES


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    name: str
    num_warps: int
    num_stages: int
    shared_bytes: int
    ptx: str


def available() -> str | None:
    """None when kernels can be compiled here, else why not."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as err:
        return f"the triton package is not installed ({err})"
    return None


@contextlib.contextmanager
def _h200_lowering(captured: list[str]):
    from jax._src.pallas.triton import gpu_info, lowering

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    original_info, original_lower = gpu_info.get_gpu_info, lowering.lower_jaxpr_to_triton_module

    def lower(*args, **kwargs):
        result = original_lower(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    gpu_info.get_gpu_info = lambda: h200
    lowering.lower_jaxpr_to_triton_module = lower
    try:
        yield
    finally:
        gpu_info.get_gpu_info = original_info
        lowering.lower_jaxpr_to_triton_module = original_lower


def compile_for_sm90(fn, *args, **kwargs) -> list[CompiledKernel]:
    """Every pallas_call of jax.jit(fn)(*args, **kwargs), compiled for sm_90.

    args may be jax.ShapeDtypeStruct (nothing is allocated). Raises what the compiler raises.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    captured: list[str] = []
    with _h200_lowering(captured):
        # A fresh trace (no cache hit): the lowering must run under the patch.
        jax.clear_caches()
        lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    settings = re.findall(r'name = "([^"]*)", num_stages = (\d+) : i32, num_warps = (\d+)', text)
    if len(settings) != len(captured):
        raise RuntimeError(f"found {len(settings)} Triton calls' settings for {len(captured)} IRs")
    kernels = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (ir, (name, stages, warps)) in enumerate(zip(captured, settings, strict=True)):
            path = Path(tmp) / f"k{i}.ttir"
            path.write_text(ir)
            _run_ttir_passes(path)
            compiled = triton.compile(
                str(path),
                target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=int(warps), num_stages=int(stages)),
            )
            kernels.append(
                CompiledKernel(
                    name=name,
                    num_warps=int(warps),
                    num_stages=int(stages),
                    shared_bytes=int(compiled.metadata.shared),
                    ptx=compiled.asm["ptx"],
                )
            )
    return kernels


def _run_ttir_passes(path: Path) -> None:
    """Applies Triton's TTIR passes (inliner, canonicalizer, combine: dot(a, b, 0) + c ->
    dot(a, b, c), ...) to the IR file in place.

    triton.compile skips the passes of an IR file's own stage, but on the GPU the TTIR Pallas
    emits goes through them (XLA's Triton pipeline starts with the same passes), so without
    this the PTX here would keep adds the GPU build folds into the dots.
    """
    from triton._C.libtriton import ir
    from triton.backends.nvidia.compiler import CUDABackend

    context = ir.context()
    ir.load_dialects(context)
    CUDABackend.load_dialects(None, context)
    module = ir.parse_mlir_module(str(path), context)
    module.context = context
    CUDABackend.make_ttir(module, {}, None, 90)
    path.write_text(str(module))
