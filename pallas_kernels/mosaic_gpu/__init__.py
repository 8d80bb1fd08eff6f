"""The Mosaic GPU backend (Hopper wgmma + TMA): the int4 grouped GEMM and its MoE layer."""
