"""The BlockConfigs of a MoE layer's two GEMMs in the BlockConfig kernels (Pallas-Triton and
Triton): each GEMM's config under its kernel's ConfigRules, both with GEMM1's block_m."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from wna16_jax import _configs
from wna16_jax._configs import ConfigRules, GemmShape
from wna16_jax._types import BlockConfig, QuantizedExperts


def block_configs(
    num_slots: int,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    config: BlockConfig | None,
    *,
    rules: ConfigRules,
    name: str = "WNA16",
    shape_of: Callable[[QuantizedExperts, int], GemmShape] = GemmShape.of_weights,
) -> tuple[BlockConfig, BlockConfig]:
    """The BlockConfigs of GEMM1 (w13) and GEMM2 (w2) for num_slots rows: each GEMM's own
    (`_configs.resolve` under `rules`, looked up by shape_of(w, num_slots)), GEMM2 with GEMM1's
    block_m (one alignment) and dot="fma" where that block_m is below a tensor-core tile. Logs
    each new choice once at INFO with where it came from (`name`: the GEMM in the line)."""
    shapes = [shape_of(w, num_slots) for w in (w13, w2)]
    (c1, src1), (c2, src2) = (_configs.resolve(rules, s, config) for s in shapes)
    c2 = dataclasses.replace(c2, block_m=c1.block_m)
    if c1.block_m < 16 and c2.dot == "mma":  # rows GEMM1 aligned below a tensor-core tile
        c2 = dataclasses.replace(c2, dot="fma")
    _configs.log_once(
        (name, shapes[0], shapes[1], c1, c2),
        "wna16_jax: fused_moe %s M=%d GEMM1 (N=%d, K=%d) %s [%s]; GEMM2 (N=%d, K=%d) %s [%s]",
        name, num_slots, w13.n, w13.k, c1, src1, w2.n, w2.k, c2, src2,
    )  # fmt: skip
    return c1, c2
