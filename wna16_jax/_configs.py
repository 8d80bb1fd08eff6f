"""Kernel configs: the one resolver (the caller's config, else the tuned table's, else the
heuristic's) that each backend calls with its own rules (its ConfigRules, in its folder), and
the tuned tables (package JSON)."""

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


# The M (token slots) every batch-invariant call resolves its configs at: the blocks, k-tiles
# and tile order a row sees then depend on the weights' shape only, never on how many rows the
# call has (wna16_jax.fused_moe(..., batch_invariant=True)).
BATCH_INVARIANT_M = 256


def batch_invariant_config(resolve_for: Callable[[Any, Any], tuple[Any, str]], shape, config):
    """`resolve_for(shape, config)` at M = BATCH_INVARIANT_M, without a K split: a split sums its
    partial tiles with atomic adds (an order that varies run to run, and its count is chosen by
    M). A tuned or heuristic config's split is dropped (split_k=1 runs every shape).

    Args:
        resolve_for: a GEMM's (GemmShape, config) -> (config, source) (GroupedMatmul.config).
        shape: the call's GemmShape (its m is replaced).  config: the caller's, or None.

    Returns:
        (config, source) as `resolve_for`'s.

    Raises:
        ValueError: a caller's config with split_k > 1 (quoted), or one that cannot run.
    """
    split = getattr(config, "split_k", 1)
    if split != 1:
        raise ValueError(
            f"batch_invariant=True needs a config without a K split, got split_k={split} in "
            f"{config}: split-K sums partial tiles with atomic adds in a varying order"
        )
    chosen, source = resolve_for(dataclasses.replace(shape, m=BATCH_INVARIANT_M), config)
    if getattr(chosen, "split_k", 1) != 1:
        chosen = dataclasses.replace(chosen, split_k=1)
    return chosen, source


_logged: set = set()


def log_once(key, message: str, *args) -> None:
    """Logs `message` % args at INFO the first time `key` (hashable) is seen: each new choice
    of a config or backend is named once."""
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


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
