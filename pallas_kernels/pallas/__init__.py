"""The Pallas-Triton backend: dequant-fused grouped GEMMs (int4/int8, W8A8, split-K)."""
