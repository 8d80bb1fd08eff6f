"""The BlockConfig GEMMs' config rules (the Pallas-Triton and Triton kernels'): their validity
rules, heuristic and ConfigRules, and the BlockConfigs of a MoE layer's two GEMMs (each GEMM's
config under its kernel's ConfigRules, both with GEMM1's block_m)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from wna16_jax.backend_api import (
    BATCH_INVARIANT_M,
    BlockConfig,
    ConfigRules,
    GemmShape,
    QuantizedExperts,
    batch_invariant_config,
    gemm_entry_shape,
    gemm_table_key,
    log_once,
    resolve,
)


def config_problems(config: BlockConfig, shape: GemmShape) -> list[str]:
    """Why `config` cannot run `shape` (empty when it can)."""
    problems = []
    bk, g, k = config.block_k, shape.group, shape.k
    if k % bk:
        problems.append(f"K={k} is not a multiple of block_k={bk}")
    if bk % g and g % bk:
        problems.append(
            f"block_k={bk} is incompatible with group_size={g}: a k-tile must lie inside one "
            f"group or hold a whole number of groups"
        )
    if bk < 32 // shape.bits:
        problems.append(f"block_k={bk} is smaller than one packed word ({32 // shape.bits})")
    # Kernel rules: tensor-core tiles are at least 16 wide, and a "slices" dot contracts
    # block_k // values-per-word features (measured on the H200: a contraction of 8, int4 with
    # block_k=64, returned garbage). The "fma" products use no tensor cores.
    if config.dot == "mma" and min(config.block_m, config.block_n) < 16:
        problems.append(
            f"block_m={config.block_m} and block_n={config.block_n} must be >= 16 for "
            f"tensor-core dots (dot='mma')"
        )
    if config.dot == "fma" and (config.block_m > 16 or config.block_n < 16):
        problems.append(
            f"dot='fma' is for few rows per expert: block_m={config.block_m} must be <= 16 and "
            f"block_n={config.block_n} >= 16"
        )
    if shape.n % config.block_n:
        problems.append(f"N={shape.n} is not a multiple of block_n={config.block_n}")
    min_k = min_block_k(shape.bits) if config.unpack == "slices" and config.dot == "mma" else 16
    if bk < min_k:
        problems.append(
            f"block_k={bk} is below {min_k} for int{shape.bits} with unpack={config.unpack!r}: "
            f"each tensor-core dot must contract at least 16 features"
        )
    num_k_tiles = k // bk if k % bk == 0 else -(-k // bk)
    if num_k_tiles % config.split_k:
        problems.append(
            f"split_k={config.split_k} does not divide the {num_k_tiles} k-tiles "
            f"(K={k}, block_k={bk})"
        )
    return problems


def check_config(config: BlockConfig, shape: GemmShape, what: str = "config") -> None:
    """Raises ValueError quoting the values when `config` cannot run `shape`."""
    problems = config_problems(config, shape)
    if problems:
        raise ValueError(
            f"{what} {config} cannot run the GEMM (N={shape.n}, K={shape.k}): "
            + "; ".join(problems)
        )


def check_gemm_operands(config: BlockConfig, routing, k: int, qw) -> None:
    """Raises ValueError unless `routing` was aligned with config.block_m and the activations'
    K equals the weights' ([E, N, K] QuantizedExperts `qw`)."""
    if routing.block_m != config.block_m:
        raise ValueError(
            f"routing was aligned with block_m={routing.block_m} but config.block_m="
            f"{config.block_m}"
        )
    if qw.shape[2] != k:
        raise ValueError(f"activations have K={k} but the weights have K={qw.shape[2]}")


def _largest_pow2_divisor(x: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and x % (p * 2) == 0:
        p *= 2
    return p


def min_block_k(bits: int) -> int:
    """The smallest "slices" block_k: each dot contracts block_k // (32 // bits) >= 16."""
    return 16 * (32 // bits)


# The narrowest k-tile the heuristic gives and the Pallas backend runs: int8's smallest "slices"
# tile, and for int4 a "join" tile of 8 words (each converted once, its value slices joined back
# into feature order: one dot per group in the tile, >= 16 features). It serves K a multiple of
# 64 but not of 128 (gpt-oss: H = I = 2880 = 45 x 64).
NARROWEST_BLOCK_K = 64


def heuristic_config(shape: GemmShape, *, allow_fma: bool = True) -> BlockConfig:
    """An untuned config that is valid for `shape` and reasonable on a Hopper GPU.

    block_k is the group size when that is allowed (one scale per k-tile: the scale multiplies
    the product, not the tile), else the smallest allowed multiple of the group; where no
    "slices" tile fits but 64 does (int4, K a multiple of 64 and not of 128), a 64-wide "join"
    tile (NARROWEST_BLOCK_K). With at most a quarter of a row per expert (decode), the
    CUDA-core product over one-row blocks with split-K (`few_rows_config`), unless allow_fma is
    False (kernels with tensor-core dots only).
    """
    rows_per_expert = max(1, shape.m // max(1, shape.num_experts))
    if rows_per_expert <= 16:
        block_m = 16
    elif rows_per_expert <= 64:
        block_m = 32
    else:
        block_m = 64
    block_n = 64 if block_m <= 32 else 128
    block_n = max(16, min(block_n, _largest_pow2_divisor(shape.n, 128)))
    g, lo = shape.group, min_block_k(shape.bits)
    fits = [
        bk
        for bk in (256, 128, 64, 32, 16, 8)
        if bk >= 32 // shape.bits and shape.k % bk == 0 and (g % bk == 0 or bk % g == 0)
    ]
    # With 64-row tiles, a 256-wide k-tile's pipelined stages overflow the H200's 227 KiB of
    # shared memory (int8 per channel: 245,760 bytes requested, measured).
    cap = 128 if block_m >= 64 else 256
    inside_group = [bk for bk in fits if lo <= bk <= cap and g % bk == 0]
    whole_groups = [bk for bk in fits if bk >= lo]
    unpack = "slices"
    if inside_group:
        block_k = inside_group[0]  # the largest
    elif whole_groups:
        block_k = whole_groups[-1]  # the smallest
    elif NARROWEST_BLOCK_K in fits:
        # No "slices" tile (int4, K a multiple of 64 but not of 128): a 64-wide "join" tile.
        unpack, block_k = "join", NARROWEST_BLOCK_K
    else:
        # K or the group too short for "slices" (16 values per dot): one dot over the tile.
        unpack = "tile"
        block_k = next((bk for bk in fits if bk >= 16), fits[0] if fits else lo)
    # float32 scales on k-tiles of several groups take 64-row tiles to 2 stages: at 3, int4
    # g64 at 4096 rows asked 348,160 bytes of shared memory (sm_90 build), at 2 184,320.
    f32_groups = shape.scale_bytes > 2 and block_k > g
    config = BlockConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        split_k=1,
        group_m=1,
        num_warps=4,
        num_stages=2 if block_m <= 32 or f32_groups else 3,
        unpack=unpack,
    )
    # Only a group size that is not a multiple of a packed word (e.g. int4 with G=12) leaves
    # no power-of-two block_k; say so instead of returning a config the kernels cannot run.
    check_config(config, shape, what="no block config fits; the nearest")
    if allow_fma and 4 * shape.m <= shape.num_experts:
        few = few_rows_config(config, shape)
        if not config_problems(few, shape):
            return few
    return config


def few_rows_config(base: BlockConfig, shape: GemmShape) -> BlockConfig:
    """`base` turned into the decode config: one row per block, CUDA-core products ("fma"),
    128 output columns per program and split-K into chunks of at least 4 k-tiles.

    For DeepSeek-V3 at one token (8 slots over 256 experts) this family beat the best 16-row
    tensor-core config in each GEMM on the H200; at half a row per expert the tensor-core tiles
    won, hence the bound of a quarter row per expert (docs/performance.md, 'Pallas GEMM
    configs').
    """
    tiles = shape.k // base.block_k
    split_k = next((s for s in (8, 4, 2) if tiles % s == 0 and tiles // s >= 4), 1)
    block_n = max(16, _largest_pow2_divisor(shape.n, 128))
    # CUDA-core products need no 16-wide dot: a "join" tile reads its value slices as they are.
    unpack = "slices" if base.unpack == "join" else base.unpack
    return dataclasses.replace(
        base, block_m=1, block_n=block_n, split_k=split_k, num_stages=2, dot="fma",
        unpack=unpack,
    )  # fmt: skip


def block_config_rules(
    *, table: str | None, allow_fma: bool = True, check: Callable | None = None
) -> ConfigRules:
    """The ConfigRules of a BlockConfig GEMM: `heuristic_config`, the validity rules
    (`check_config`, then `check` where given: a kernel's own rules), and `table`'s entries
    where they keep them. allow_fma=False (kernels with tensor-core dots only): the heuristic
    gives a tensor-core config and a tuned CUDA-core ("fma") entry is passed over."""

    def check_all(config: BlockConfig, shape: GemmShape) -> None:
        check_config(config, shape)
        if check is not None:
            check(config, shape)

    def usable(config: BlockConfig, shape: GemmShape) -> bool:
        return not config_problems(config, shape) and (allow_fma or config.dot != "fma")

    return ConfigRules(
        config_type=BlockConfig,
        heuristic=functools.partial(heuristic_config, allow_fma=allow_fma),
        table=table,
        table_key=gemm_table_key,
        check=check_all,
        usable=usable,
        entry_problem=gemm_entry_shape,
    )


def block_configs(
    num_slots: int,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    config: BlockConfig | None,
    *,
    rules: ConfigRules,
    name: str = "WNA16",
    shape_of: Callable[[QuantizedExperts, int], GemmShape] = GemmShape.of_weights,
    batch_invariant: bool = False,
) -> tuple[BlockConfig, BlockConfig]:
    """The BlockConfigs of GEMM1 (w13) and GEMM2 (w2) for num_slots rows: each GEMM's own
    (`resolve` under `rules`, looked up by shape_of(w, num_slots)), GEMM2 with GEMM1's
    block_m (one alignment) and dot="fma" where that block_m is below a tensor-core tile. Logs
    each new choice once at INFO with where it came from (`name`: the GEMM in the line).
    batch_invariant: both resolved at a fixed M without a K split
    (`backend_api.batch_invariant_config`), so the configs depend on the weights only."""
    shapes = [shape_of(w, num_slots) for w in (w13, w2)]
    resolve_for = functools.partial(resolve, rules)
    if batch_invariant:
        resolve_for = functools.partial(batch_invariant_config, resolve_for)
        name = f"{name} batch-invariant (the configs of M={BATCH_INVARIANT_M}, no K split)"
    (c1, src1), (c2, src2) = (resolve_for(s, config) for s in shapes)
    c2 = dataclasses.replace(c2, block_m=c1.block_m)
    if c1.block_m < 16 and c2.dot == "mma":  # rows GEMM1 aligned below a tensor-core tile
        c2 = dataclasses.replace(c2, dot="fma")
    log_once(
        (name, shapes[0], shapes[1], c1, c2),
        "wna16_jax: fused_moe %s M=%d GEMM1 (N=%d, K=%d) %s [%s]; GEMM2 (N=%d, K=%d) %s [%s]",
        name, num_slots, w13.n, w13.k, c1, src1, w2.n, w2.k, c2, src2,
    )  # fmt: skip
    return c1, c2
