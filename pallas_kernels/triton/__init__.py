"""Triton kernels (align, dequant-fused grouped GEMM) through jax_triton: the triton backend."""
