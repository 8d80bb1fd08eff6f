"""Pallas kernels shared by the backends: block-aligned token sorting, row gathers."""
