"""The Triton GEMM's config rules (imports neither triton nor jax_triton): its limits, its own
BlockConfig rules and its ConfigRules."""

from __future__ import annotations

from pallas_kernels.common import block_configs
from wna16_jax.backend_api import BlockConfig, GemmShape

# Every tensor-core dot of the kernel contracts one span: a k-tile inside one group, or one
# group of a k-tile holding several; Triton's dots need K >= 16.
MIN_SPAN = 16
# The most experts the align kernel sorts (its per-expert counters).
MAX_EXPERTS = 1024


def triton_config_problems(config: BlockConfig) -> list[str]:
    """Why the Triton GEMM cannot run `config` whatever the shape (empty when it can): its
    products are tensor-core dots only, and Triton's dot takes tiles of at least 16 rows."""
    problems = []
    if config.dot != "mma":
        problems.append(f"dot={config.dot!r}: the Triton GEMM runs tensor-core dots only")
    if config.block_m < MIN_SPAN:
        problems.append(f"block_m={config.block_m} is below Triton's 16-row dot tile")
    return problems


def check_triton_config(config: BlockConfig, shape: GemmShape | None = None) -> None:
    """Raises ValueError quoting the problems where `config` breaks the Triton GEMM's own rules
    (`triton_config_problems`; the shape's are `block_configs.check_config`'s)."""
    if problems := triton_config_problems(config):
        raise ValueError(f"config {config} cannot run the Triton GEMM: " + "; ".join(problems))


# The Triton GEMM's ConfigRules: the BlockConfig heuristic with tensor-core configs only (the
# Triton GEMM has no dot="fma"), its own rules beside the BlockConfig ones, and no tuned table
# (the "pallas" table was measured on the Pallas-Triton GEMM).
RULES = block_configs.block_config_rules(table=None, allow_fma=False, check=check_triton_config)
