"""Kernel configs: the one resolver (the caller's config, else the tuned table's, else the
heuristic's) that each backend calls with its own rules, the tuned tables (package JSON), and
the BlockConfig GEMMs' validity rules and heuristic (the Pallas-Triton and Triton kernels')."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

import jax
import jax.numpy as jnp

from wna16_jax._types import BlockConfig

logger = logging.getLogger("wna16_jax")


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One grouped GEMM: M token slots, E experts of [N, K] weights."""

    m: int  # rows (token slots = T*k)
    n: int
    k: int
    num_experts: int
    bits: int
    group: int  # effective group size along K
    group_size: int  # as stored (-1 = per channel)
    scale_bytes: int = 2  # bytes of a scale: 2 (bfloat16, float16), 4 (float32), 1 (E8M0)
    codes: str = "int"  # QuantizedExperts.codes: "int" or "e2m1" (MXFP4)

    @classmethod
    def of_weights(cls, qw, m: int = 0) -> GemmShape:
        """The GEMM of `m` token slots over QuantizedExperts `qw` ([E, N, K])."""
        e, n, k = qw.shape
        return cls(
            m=m, n=n, k=k, num_experts=e, bits=qw.bits, group=qw.group,
            group_size=qw.group_size, scale_bytes=jnp.dtype(qw.scales.dtype).itemsize,
            codes=qw.codes,
        )  # fmt: skip

    def table_problem(self) -> dict:
        """The problem keys of this GEMM's entries in a tuned table."""
        return dict(
            E=self.num_experts, N=self.n, K=self.k, bits=self.bits, group_size=self.group_size
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


# ---- tuned tables ----------------------------------------------------------------------------
#
# One JSON file per device kind, data/tuned/<device kind>.json, written by examples/tune.py:
#
#     {"device": "NVIDIA H200",
#      "tables": {"<table>": {"about": "...", "entries": [
#          {"problem": {...}, "M": 8, "config": {...}, ...}, ...]}}}
#
# A table holds one kernel's configs, named by the kernel's ConfigRules.table (its config class
# is the rules' config_type): e.g. "pallas" (the Pallas-Triton grouped GEMM's BlockConfig per
# GEMM; problem E, N, K, bits, group_size (`GemmShape.table_problem`); M the GEMM's rows, T*k
# token slots), "mgpu" (the Mosaic GPU layer's MgpuConfig; problem E, H, I, bits, group, and
# activations="int8" for W8A8's int8 rows; M the layer's T*k token slots) and "mgpu_gemm" (the
# Mosaic GPU GEMM on its own; problem and M as "pallas"'s). An entry serves the problem it
# names exactly (the same keys, the same values), at the nearest M (ties: the smaller M) within
# a factor of TUNED_M_RATIO of its own (a config's blocks are sized for its rows); elsewhere the
# heuristic decides. An entry exists only where a measurement beat the heuristic: an entry equal
# to the heuristic's choice is a copy of the rules (tests/test_configs.py keeps the shipped
# tables free of them).

TUNED_DIR = "data/tuned"
# The most a tuned entry's M and the served M differ by, as a factor: a Mosaic GPU GEMM entry of
# M=1 (8-row blocks) applied at M=64 made a decode step of 64 rows 32% slower on the H200
# (docs/performance.md, 'Quantized linears').
TUNED_M_RATIO = 2


def device_file_name(device_kind: str) -> str:
    """The package file name of a device kind: "NVIDIA H200" -> "nvidia_h200.json"."""
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") + ".json"


def device_file(folder: str, device_kind: str) -> dict | None:
    """The parsed JSON of the package file `folder`/<device kind>.json, or None if absent."""
    try:
        text = resources.files("wna16_jax").joinpath(folder, device_file_name(device_kind))
        return json.loads(text.read_text())
    except (FileNotFoundError, OSError):
        return None


@functools.cache
def tuned_entries(
    device_kind: str, table: str, config_type: type
) -> tuple[tuple[dict, int, Any], ...]:
    """A device's entries of `table`: ((problem, M, config_type(**config)), ...); empty if it
    has none."""
    data = device_file(TUNED_DIR, device_kind)
    if data is None:
        return ()
    entries = data.get("tables", {}).get(table, {}).get("entries", ())
    return tuple((dict(e["problem"]), int(e["M"]), config_type(**e["config"])) for e in entries)


def lookup_tuned(
    table: str, config_type: type, problem: dict, m: int, device_kind: str,
    within: float | None = None,
):  # fmt: skip
    """The config of `table`'s entry for exactly `problem` at the M nearest to `m` (ties: the
    smaller M), or None when the device's table has no entry for the problem; within: only
    entries whose M is at most that factor from m (max(M, m) / min(M, m) <= within)."""
    matches = [
        (em, cfg)
        for p, em, cfg in tuned_entries(device_kind, table, config_type)
        if p == problem and (within is None or max(em, m) <= within * max(min(em, m), 1))
    ]
    if not matches:
        return None
    return min(matches, key=lambda mc: (abs(mc[0] - m), mc[0]))[1]


# ---- the resolver ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConfigRules:
    """How one kernel picks its config (`resolve`), for problems of its own type (a GemmShape, a
    Mosaic GPU layer's shape, ...).

    Attributes:
        config_type: the kernel's config class (frozen, hashable; the tuned entries' type).
        heuristic: problem -> the untuned config (ValueError naming why, where none fits).
        table: the kernel's tuned table in data/tuned/<device>.json, or None: no table.
        table_key: problem -> (the problem keys of its entries, M); with `table`.
        check: (config, problem) -> None, raising ValueError quoting the values where a
            caller's config cannot run the problem; None: the kernel checks when it runs.
        usable: (tuned config, problem) -> whether a tuned entry may run the problem (a tuned
            entry never overrides the validity rules); None: every entry may.
        converters: {other config class: its conversion to config_type} for callers' configs
            of another kernel's class.
        within: a tuned entry serves only Ms within this factor of its own (None: any M).
        entry_problem: (problem keys, M) -> the problem of a tuned entry, for the check that no
            entry equals the heuristic's choice (tests/test_configs.py).
    """

    config_type: type
    heuristic: Callable[[Any], Any]
    table: str | None = None
    table_key: Callable[[Any], tuple[dict, int]] | None = None
    check: Callable[[Any, Any], None] | None = None
    usable: Callable[[Any, Any], bool] | None = None
    converters: Mapping[type, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)
    within: float | None = TUNED_M_RATIO
    entry_problem: Callable[[dict, int], Any] | None = None


def resolve(rules: ConfigRules, problem, config=None) -> tuple[Any, str]:
    """The config for `problem` under `rules`: the caller's, else the device's tuned table's
    (the nearest M of exactly this problem), else the heuristic's.

    Returns:
        (config, source) where source is "caller", "tuned:<device>" or "heuristic".

    Raises:
        ValueError: a caller's config of a type the rules do not take, or one that cannot run
            the problem (`rules.check`), or no config fits (the heuristic's reason).
    """
    if config is not None:
        if not isinstance(config, rules.config_type):
            convert = next((f for t, f in rules.converters.items() if isinstance(config, t)), None)
            if convert is None:
                names = " or ".join(t.__name__ for t in (rules.config_type, *rules.converters))
                raise ValueError(f"config must be a {names} or None, got {config!r}")
            config = convert(config)
        if rules.check is not None:
            rules.check(config, problem)
        return config, "caller"
    if rules.table is not None:
        kind = device_kind()
        keys, m = rules.table_key(problem)
        tuned = lookup_tuned(rules.table, rules.config_type, keys, m, kind, within=rules.within)
        if tuned is not None and (rules.usable is None or rules.usable(tuned, problem)):
            return tuned, f"tuned:{kind}"
    return rules.heuristic(problem), "heuristic"


_logged: set = set()


def log_once(key, message: str, *args) -> None:
    """Logs `message` % args at INFO the first time `key` (hashable) is seen: each new choice
    of a config or backend is named once."""
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


def _largest_pow2_divisor(x: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and x % (p * 2) == 0:
        p *= 2
    return p


def min_block_k(bits: int) -> int:
    """The smallest block_k of the kernels: each dot contracts block_k // (32 // bits) >= 16."""
    return 16 * (32 // bits)


def heuristic_config(shape: GemmShape, *, allow_fma: bool = True) -> BlockConfig:
    """An untuned config that is valid for `shape` and reasonable on a Hopper GPU.

    block_k is the group size when that is allowed (one scale per k-tile: the scale multiplies
    the product, not the tile), else the smallest allowed multiple of the group. With at most
    a quarter of a row per expert (decode), the CUDA-core product over one-row blocks with
    split-K (`few_rows_config`), unless allow_fma is False (kernels with tensor-core dots only).
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
    return dataclasses.replace(
        base, block_m=1, block_n=block_n, split_k=split_k, num_stages=2, dot="fma"
    )


def device_kind() -> str:
    """The kind of the first device ("NVIDIA H200", "cpu"): the name of its tuned files."""
    return jax.devices()[0].device_kind


def gemm_table_key(shape: GemmShape) -> tuple[dict, int]:
    """A GEMM's problem keys and M in a tuned table ("pallas", "mgpu_gemm")."""
    return shape.table_problem(), shape.m


def gemm_entry_shape(problem: dict, m: int) -> GemmShape:
    """The GemmShape of a tuned table's GEMM entry (`GemmShape.table_problem`'s keys) at M=m."""
    k, group_size = problem["K"], problem["group_size"]
    return GemmShape(
        m=m, n=problem["N"], k=k, num_experts=problem["E"], bits=problem["bits"],
        group=k if group_size == -1 else group_size, group_size=group_size,
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
