"""The Mosaic GPU backend (Hopper wgmma + TMA): the int4 grouped GEMM and its MoE layer; its
config class, MgpuConfig (also wna16_jax.MgpuConfig)."""

from pallas_kernels.mgpu.config import MgpuConfig

__all__ = ["MgpuConfig"]
