"""Tunes the kernels' configs and writes the tuned tables wna16_jax reads.

A device's tables (wna16_jax/data/tuned/<device kind>.json) hold, per kernel, configs for exact
problems at token-slot counts M (T*k); fused_moe takes the entry at the nearest M:
- "pallas": the Pallas-Triton grouped GEMM's BlockConfig, per GEMM (w13, w2) and M. A
  coordinate search from the config the backend runs today (`wj.gemm_config`), each
  candidate timed through `wj.grouped_matmul` (GEMM1 with its silu fused, as fused_moe runs
  it); the best is written.
- "mgpu": the Mosaic GPU layer's MgpuConfig per M. A coordinate search over MgpuConfigs, each
  timed through `wj.fused_moe`; the best is written where it beat the layer without a config
  (its tuned entry or heuristic today). With --activation-quant int8_per_token the layer runs
  W8A8 (int8 per-token activations, int8 per-channel symmetric weights) and its entries are
  keyed activations="int8", apart from the W8A16 entries of the same weights.
- "mgpu_gemm": the Mosaic GPU GEMM's MgpuConfig per quantized linear (one expert: N, K, bits,
  group_size) and rows M. A coordinate search from the config the linear runs today, each
  candidate timed as benchmark_linear.py times a linear (a model step of calls on copies of
  the weight that do not fit in L2 together); the best, timed again in turn with the config
  the linear runs today, is written where it beat it. An entry serves rows within a factor of
  2 of its own: tune each row count the model runs. --linears names the shapes
  (benchmark_linear.py's).
Candidates that do not compile or run (shared memory, registers, validity rules) are skipped;
each winner is checked against the 'xla' reference (under the same activation quantization)
before it is written.

Example (GPU):
    python examples/tune.py --backends pallas mgpu --m 1 16 256 4096 \\
        --out wna16_jax/data/tuned/nvidia_h200.json
    python examples/tune.py --backends mgpu --activation-quant int8_per_token \\
        --m 1 16 256 4096 --out wna16_jax/data/tuned/nvidia_h200.json    # W8A8
    python examples/tune.py --backends mgpu_gemm --linears qkv_a o_proj --m 1 8 \\
        --out wna16_jax/data/tuned/nvidia_h200.json    # DeepSeek-V3's linears
On a CPU the default is a tiny problem in the Pallas interpreter ('pallas_interpret'; with
--backends mgpu also 'mgpu_interpret'): a smoke test, no file written unless --out is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arg_types  # noqa: E402
import benchmark  # noqa: E402
import benchmark_linear  # noqa: E402

import wna16_jax as wj  # noqa: E402

logger = logging.getLogger("tune")

# The tables this script tunes, by the backend that runs them (its interpreter on a CPU).
TABLES = {
    "pallas": ("pallas", "pallas_interpret"),
    "mgpu": ("mgpu", "mgpu_interpret"),
    "mgpu_gemm": ("mgpu", "mgpu_interpret"),
}

# The axes of the GEMM search and their values (the validity rules drop what cannot run a
# shape), in the order the coordinate search visits them: the ones that change the work in
# flight most first, so that a search cut short by its time budget has tried them.
AXES = {
    "split_k": (1, 2, 4, 8),
    "block_n": (16, 32, 64, 128, 256),
    "block_k": (64, 128, 256, 512),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4, 5),
    "block_m": (1, 2, 4, 8, 16, 32, 64, 128),
    "unpack": ("slices", "join", "tile"),
    "dot": ("mma", "fma"),
}
QUICK_AXES = {
    "dot": ("mma", "fma"),
    "block_n": (32, 64, 128),
    "split_k": (1, 2, 4),
    "num_stages": (2, 3, 4),
    "unpack": ("slices", "join", "tile"),
}
# The axes of the layer search (MgpuConfig's fields).
MGPU_AXES = {
    "block_m": (8, 16, 32, 64, 128),
    "block_k": (64, 128, 256),
    "consumers": (0, 2),
    "stages": (2, 3, 4),
    "block_n": (64, 128),
    "down_block_n": (None, 128),
    "down_stages": (None, 2, 3),
    "block_halvings": (0, 1, 2, 3),
    "bf16_weights": (False, True),
}
MGPU_QUICK_AXES = {"block_m": (8, 16), "stages": (2, 3), "block_halvings": (0, 1)}
# The axes of a linear's GEMM search (blocks of at most twice its rows, at least 16: `tune_linear`).
LINEAR_AXES = {
    "stages": (2, 3, 4, 5, 6),
    "block_k": (128, 256, 512),
    "block_m": (8, 16, 32, 64, 128),
    "block_n": (64, 128),
    "consumers": (0, 2),
    "splits": (None, 1, 2, 4, 7, 8),  # None: the linear's rule (a value must divide the k-steps)
}
LINEAR_QUICK_AXES = {"stages": (2, 3), "block_m": (8, 16)}
# Seconds each linear's timing runs it before timing (the GPU's clocks up to speed).
LINEAR_WARMUP_S = 0.2
# Rounds of the final match of a linear's best config against today's, timed in turn: one
# timing of a decode linear (10-60 us) varied by up to 2x on the H200, and a search at M=1
# ranked configs by that noise (docs/performance.md, 'Quantized linears').
CONFIRM_ROUNDS = 3
# The most relative error (norm-wise) of a winner against 'xla' on bf16 outputs: the tests'
# tolerance of the kernels against the reference (tests/helpers.py: TOLERANCES; W8A8 under the
# same activation quantization: tests/test_w8a8.py: W8A8_VS_ORACLE), the output's bf16 rounding.
MAX_RELATIVE_ERROR = 1e-2
# The problem key of the mgpu table's W8A8 entries (pallas_kernels/mgpu/config.py:
# LayerShape.table_problem, which the layer's lookup builds): int8 rows, whatever their scheme.
INT8_ROWS_PROBLEM = {"activations": "int8"}


def coordinate_search(starts, time_config, *, axes, valid, passes=2, budget_s=None):
    """From each starting config, tries every value of one axis at a time keeping the best, for
    `passes` sweeps over the axes (stopping early when a sweep improves nothing).

    time_config(cfg) -> seconds or None (failed); valid(cfg) -> bool (tried first). Returns
    {cfg: seconds} of all that ran. budget_s: wall-clock seconds for the whole search; each
    starting point gets an equal share (what has run when its share is spent is kept).
    """
    times = {}
    share = None if budget_s is None else budget_s / max(len(starts), 1)

    def search_from(best, deadline):
        for _ in range(passes):
            improved = False
            for axis, values in axes.items():
                for v in values:
                    try:
                        cfg = dataclasses.replace(best, **{axis: v})
                    except ValueError:  # a field value the config class refuses
                        continue
                    if cfg in times or not valid(cfg):
                        continue
                    if deadline is not None and time.monotonic() > deadline:
                        logger.info("time budget spent (%d configs ran)", len(times))
                        return
                    t = time_config(cfg)
                    if t is None:
                        continue
                    times[cfg] = t
                    if t < times[best]:
                        best, improved = cfg, True
            if not improved:
                return

    for start in starts:
        deadline = None if share is None else time.monotonic() + share
        if start not in times:
            t = time_config(start)
            if t is None:
                continue
            times[start] = t
        search_from(start, deadline)
    return times


def _measured(measure, what):
    """measure() (seconds per call), or None where it does not compile or run on this device."""
    try:
        t = measure()
    except Exception as err:  # does not compile or run here: skip it
        logger.info("skip %s: %s", what, str(err).splitlines()[0][:200])
        return None
    logger.info("%10.1f us  %s", t * 1e6, what)
    return t


def _timed(run, sets, *, consts, iters, repeats, what):
    """Seconds per call of run(*consts, *set) (the benchmark's jitted loop), or None where it
    does not compile or run on this device."""
    return _measured(
        lambda: benchmark.time_loop(
            run, sets, iters=iters, repeats=repeats, consts=consts, host=False
        )[0],
        what,
    )


def _timed_step(fn, sets, *, repeats, what):
    """Seconds per call of fn(*set) in a model step (benchmark.time_model_step), or None where
    it does not compile or run on this device."""
    warmup_s = LINEAR_WARMUP_S if jax.default_backend() == "gpu" else 0.0
    return _measured(
        lambda: benchmark.time_model_step(fn, sets, repeats=repeats, warmup_s=warmup_s), what
    )


def with_bar(time_config, bar):
    """time_config counted on the tqdm `bar` (one step per config timed), the best time so far
    shown beside it."""
    best = math.inf

    def timed(cfg):
        nonlocal best
        t = time_config(cfg)
        bar.update(1)
        if t is not None and t < best:
            best = t
            bar.set_postfix_str(f"best {t * 1e6:.1f} us")
        return t

    return timed


def _relative_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ---- the Pallas-Triton GEMMs ("pallas") -------------------------------------------------------


def gemm_starting_points(w, m, impl, num_experts) -> list:
    """The config the backend runs today (`wj.gemm_config`: tuned table or heuristic); its
    tensor-core variant (for decode it may be the CUDA-core "fma" product) and that with
    unpack="join" (one dot per group instead of one per value slice); and for few rows per
    expert the "fma" product with one row per block (a 16-row tensor-core tile would hold
    mostly padding)."""
    base = wj.gemm_config(w, m, implementation=impl)
    mma = base if base.dot == "mma" else dataclasses.replace(base, dot="mma", block_m=16)
    candidates = [base, mma, dataclasses.replace(mma, unpack="join")]
    if m <= 4 * num_experts:
        candidates.append(dataclasses.replace(mma, dot="fma", block_m=1))
    return list(dict.fromkeys(candidates))


def tune_gemm(
    w, m, top_k, *, impl, full, iters, repeats, gated, budget_s=None, progress=True, desc="gemm"
):
    """Searches BlockConfigs of the grouped GEMM over `w` at m tokens (m * top_k slots).

    gated: time GEMM1 the way fused_moe runs it (silu(gate) * up fused where the kernel can).
    progress: a tqdm bar (named `desc`) over the configs timed.
    Returns (best, {config: seconds} of every config that ran, relative error of the best).
    """
    e, _, k = w.shape
    slots = m * top_k
    key = jax.random.key(m)
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    _, ids = benchmark.random_routing(jax.random.fold_in(key, 1), m, e, top_k, 1)
    routings = {}

    def routing_for(block_m):
        if block_m not in routings:
            routings[block_m] = wj.moe_align_block_size(
                ids[0], num_experts=e, block_m=block_m, implementation=impl
            )
        return routings[block_m]

    def valid(cfg) -> bool:
        try:
            wj.gemm_config(w, slots, implementation=impl, config=cfg)
        except ValueError:
            return False
        return True

    def time_config(cfg):
        def run(w, a, routing, cfg=cfg):
            return wj.grouped_matmul(
                a, w, routing, top_k=top_k, config=cfg, implementation=impl,
                activation="silu" if gated else None,
            )  # fmt: skip

        sets = [(a, routing_for(cfg.block_m))]
        return _timed(run, sets, consts=(w,), iters=iters, repeats=repeats, what=str(cfg))

    grid = None
    if full:
        grid = [
            c
            for values in itertools.product(*AXES.values())
            if valid(c := wj.BlockConfig(**dict(zip(AXES, values, strict=True))))
        ]
    # A coordinate search's length is known only when it ends: the bar counts without a total.
    total = None if grid is None else len(grid)
    with tqdm(desc=desc, unit=" configs", total=total, disable=not progress) as bar:
        timed = with_bar(time_config, bar)
        if full:
            times = {c: t for c in grid if (t := timed(c)) is not None}
        else:
            axes = AXES if jax.default_backend() == "gpu" else QUICK_AXES
            if slots >= 16 * e:  # many rows per expert: tiles of at least 16
                axes = dict(axes, block_m=tuple(b for b in axes.get("block_m", ()) if b >= 16))
            starts = [c for c in gemm_starting_points(w, slots, impl, e) if valid(c)]
            times = coordinate_search(starts, timed, axes=axes, valid=valid, budget_s=budget_s)
    if not times:
        raise RuntimeError(f"no candidate config ran for the GEMM {w.shape} at M={slots}")
    best = min(times, key=times.get)
    routing = routing_for(best.block_m)
    gemm = dict(top_k=top_k, config=best, out_dtype=jnp.float32)
    out = wj.grouped_matmul(a, w, routing, implementation=impl, **gemm)
    ref = wj.grouped_matmul(a, w, routing, implementation="xla", **gemm)
    err = _relative_error(out, ref)
    if not err < MAX_RELATIVE_ERROR:
        raise RuntimeError(f"best config {best} is wrong: relative error {err}")
    return best, times, err


# ---- the Mosaic GPU layer ("mgpu") ------------------------------------------------------------


def layer_starting_points(slots: int, num_experts: int, group: int) -> list:
    """One config per block size from half to twice the mean rows per expert (at least 8):
    each with k-steps of one group (at most 128 inputs), 3 stages, and two consumer
    warpgroups from 64 rows (128 rows on bf16 weights, whose exact group sums do not fit in
    registers)."""
    rows = slots / num_experts
    block_k = 128 if group % 128 == 0 else 64
    starts = []
    for block_m in MGPU_AXES["block_m"]:
        if block_m > max(8, 2 * rows):
            break
        if 2 * block_m < rows:
            continue
        big = block_m >= 64
        starts.append(
            wj.MgpuConfig(
                block_m,
                block_k,
                stages=3,
                consumers=2 if big else 0,
                block_halvings=2 if big else 1,
                bf16_weights=block_m == 128,
            )  # fmt: skip
        )
    return starts


def tune_layer(
    w13, w2, m, top_k, *, impl, iters, repeats, budget_s=None, progress=True, desc="layer",
    activation_quant=None,
):  # fmt: skip
    """Searches MgpuConfigs of the Mosaic GPU layer over canonical w13, w2 at m tokens;
    `progress`: a tqdm bar (named `desc`) over the configs timed; activation_quant: None
    (16-bit activations) or "int8_per_token" (W8A8, on symmetric int8 weights).

    Returns (best, {config: seconds}, seconds of the layer without a config (its tuned entry
    or heuristic today), relative error of the best against 'xla').
    """
    e, _, h = w13.shape
    key = jax.random.key(m)
    x = jax.random.normal(key, (m, h), jnp.bfloat16)
    tw, ids = benchmark.random_routing(jax.random.fold_in(key, 1), m, e, top_k, 1)
    sets = [(x, tw[0], ids[0])]
    kernel_weights = tuple(wj.layouts.to_kernel_layout(w, f"mgpu_int{w.bits}") for w in (w13, w2))

    def layer(config):
        def run(w13, w2, x, tw, ids):
            return wj.fused_moe(
                x, w13, w2, tw, ids, implementation=impl, config=config,
                activation_quant=activation_quant,
            )  # fmt: skip

        return run

    def time_config(cfg):
        return _timed(
            layer(cfg), sets, consts=kernel_weights, iters=iters, repeats=repeats, what=str(cfg)
        )

    today = _timed(
        layer(None), sets, consts=kernel_weights, iters=iters, repeats=repeats,
        what="the layer without a config",
    )  # fmt: skip
    group = math.gcd(w13.group, w2.group)
    starts = layer_starting_points(m * top_k, e, group)
    axes = MGPU_AXES if jax.default_backend() == "gpu" else MGPU_QUICK_AXES
    with tqdm(desc=desc, unit=" configs", disable=not progress) as bar:
        times = coordinate_search(
            starts, with_bar(time_config, bar), axes=axes, valid=lambda cfg: True,
            budget_s=budget_s,
        )  # fmt: skip
    if not times:
        raise RuntimeError(f"no candidate config ran for the layer at M={m}")
    best = min(times, key=times.get)
    out = layer(best)(*kernel_weights, *sets[0])
    ref = wj.fused_moe(
        x, w13, w2, tw[0], ids[0], implementation="xla", activation_quant=activation_quant
    )
    err = _relative_error(out, ref)
    if not err < MAX_RELATIVE_ERROR:
        raise RuntimeError(f"best config {best} is wrong: relative error {err}")
    return best, times, today, err


# ---- the Mosaic GPU linear ("mgpu_gemm") -------------------------------------------------------


def tune_linear(
    n, k, activation, m, *, impl, bits, group_size, has_zeros, repeats, step_bytes,
    budget_s=None, progress=True, desc="linear",
):  # fmt: skip
    """Searches MgpuConfigs of the quantized linear [1, N, K] (activation "silu": [gate; up],
    silu(gate) * up fused as the model runs it) at m rows, from the config it runs today
    (`wj.gemm_config`), over LINEAR_AXES with blocks of at most max(16, 2m) rows. Each
    candidate is timed on copies of the weight making `step_bytes` (benchmark_linear.py's
    method); the search's best and today's config are then timed again in turn,
    CONFIRM_ROUNDS times each, and the better median wins. Returns (best, {config: seconds},
    seconds of today's config (None: it did not run), the best's relative error against
    'xla').
    """
    key = jax.random.key(m)
    canonical = benchmark_linear.random_weights(
        key, n, k, bits=bits, group_size=group_size, has_zeros=has_zeros, step_bytes=step_bytes
    )
    held = [benchmark_linear.weights_for(impl, w, jnp.bfloat16) for w in canonical]
    sets = list(zip(benchmark_linear.random_rows(key, m, k, len(held)), held, strict=True))

    def time_config(cfg):
        fn = benchmark_linear.linear_fn(impl, activation, cfg)
        return _timed_step(fn, sets, repeats=repeats, what=str(cfg))

    start = wj.gemm_config(held[0], m, implementation=impl)  # what the linear runs today
    axes = LINEAR_AXES if jax.default_backend() == "gpu" else LINEAR_QUICK_AXES
    most_rows = max(16, 2 * m)
    with tqdm(desc=desc, unit=" configs", disable=not progress) as bar:
        times = coordinate_search(
            [start], with_bar(time_config, bar), axes=axes,
            valid=lambda cfg: cfg.block_m <= most_rows, budget_s=budget_s,
        )  # fmt: skip
    if not times:
        raise RuntimeError(f"no candidate config ran for the linear [{n}, {k}] at M={m}")
    best = min(times, key=times.get)
    if best != start and start in times:  # the final match, each timed again in turn
        rounds = {start: [], best: []}
        for _ in range(CONFIRM_ROUNDS):
            for cfg, seconds in rounds.items():
                if (t := time_config(cfg)) is not None:
                    seconds.append(t)
        for cfg, seconds in rounds.items():
            times[cfg] = statistics.median(seconds) if seconds else math.inf
        best = min(rounds, key=times.get)
    today = times.get(start)
    x = sets[0][0]
    out = wj.linear.quantized_matmul(
        x, held[0], activation=activation, implementation=impl, config=best
    )
    ref = wj.linear.quantized_matmul(x, canonical[0], activation=activation, implementation="xla")
    err = _relative_error(out, ref)
    if not err < MAX_RELATIVE_ERROR:
        raise RuntimeError(f"best config {best} is wrong: relative error {err}")
    return best, times, today, err


# ---- the tables -------------------------------------------------------------------------------


def merge_table(path: str, device: str, table: str, entries: list[dict], *, about: str) -> None:
    """Writes `entries` into `table` of the tuned JSON at `path` (the format
    wna16_jax._configs.tuned_entries reads), replacing entries of the same problem and M;
    `about` describes a table the file did not hold yet."""
    data = {"device": device, "tables": {}}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    body = data["tables"].setdefault(table, {"about": about, "entries": []})

    def key(entry):
        return json.dumps(entry["problem"], sort_keys=True), entry["M"]

    new = {key(e) for e in entries}
    body["entries"] = [e for e in body["entries"] if key(e) not in new] + entries
    tables = []
    for name, t in data["tables"].items():
        rows = ",\n".join("    " + json.dumps(e) for e in t["entries"])
        tables.append(
            f'  "{name}": {{\n   "about": {json.dumps(t["about"])},\n'
            f'   "entries": [\n{rows}\n   ]\n  }}'
        )
    text = f'{{\n "device": {json.dumps(data["device"])},\n "tables": {{\n'
    text += ",\n".join(tables) + "\n }\n}\n"
    json.loads(text)  # the file is valid JSON before it replaces the old one
    with open(path, "w") as f:
        f.write(text)


def _about(table: str, device: str) -> str:
    """The description of a table this script starts."""
    what = {
        "pallas": "The Pallas-Triton grouped GEMM's BlockConfig per GEMM (microseconds: the "
        "GEMM alone)",
        "mgpu": "The Mosaic GPU layer's MgpuConfig (microseconds: the layer; "
        "default_microseconds: the layer without a config)",
        "mgpu_gemm": "The Mosaic GPU GEMM's MgpuConfig per quantized linear (microseconds: "
        "the linear in a model step; default_microseconds: the linear at the config it ran "
        "before)",
    }[table]
    return (
        f"{what}; M: {'rows' if table == 'mgpu_gemm' else 'token slots (T*k)'}. Measured on "
        f"{device}, jax {jax.__version__}, by examples/tune.py."
    )


def main(argv=None) -> dict[str, list[dict]]:
    """Runs the searches; returns the entries written (or, without --out, found) per table."""
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--backends",
        nargs="+",
        choices=sorted(TABLES),
        default=None,
        help="the tables to tune: pallas (the Pallas-Triton GEMMs), mgpu (the Mosaic GPU "
        "layer, sm_90), mgpu_gemm (the Mosaic GPU GEMM of the quantized linears); on a CPU "
        "their interpreters run (default: pallas; mgpu with --activation-quant)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(benchmark.PRESETS),
        default="deepseek-v3" if on_gpu else "tiny",
        help="problem sizes (benchmark.py presets; default deepseek-v3 on GPU, tiny on CPU)",
    )
    p.add_argument(
        "--m", type=arg_types.positive_int, nargs="+", default=None,
        help="token counts (mgpu_gemm: the linear's rows; default 1 16 256 4096 on a GPU, 1 on "
        "a CPU)",
    )  # fmt: skip
    p.add_argument(
        "--linears", nargs="+", default=None,
        choices=sorted(benchmark_linear.SHAPES | benchmark_linear.TINY_SHAPES),
        help="mgpu_gemm: the linears to tune, benchmark_linear.py's shapes (default: "
        "DeepSeek-V3's on a GPU, the tiny ones on a CPU)",
    )  # fmt: skip
    p.add_argument(
        "--bits",
        type=int,
        choices=(4, 8),
        default=None,
        help="int4 or int8 weights (mgpu: in the mgpu_int4 / mgpu_int8 layout; default 4, 8 "
        "with --activation-quant)",
    )
    p.add_argument(
        "--group-size",
        type=arg_types.group_size,
        default=None,
        help="quantization group along K (default: the preset's; -1: per channel)",
    )
    p.add_argument("--no-zp", action="store_true", help="symmetric weights")
    p.add_argument(
        "--activation-quant",
        choices=("int8_per_token",),
        default=None,
        help="mgpu: W8A8, int8 per-token activations with int8 per-channel symmetric weights "
        "(implies --bits 8 --group-size -1 --no-zp; other values are refused); its entries "
        'are keyed activations="int8"',
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="pallas: every config of the grid (slow); default: a coordinate search",
    )
    p.add_argument(
        "--gemms", nargs="+", choices=("w13", "w2"), default=("w13", "w2"), help="pallas GEMMs"
    )
    p.add_argument(
        "--iters", type=arg_types.positive_int, default=None, help="calls per timed loop"
    )
    p.add_argument(
        "--repeats",
        type=arg_types.positive_int,
        default=3,
        help="timed runs per config, median taken (default 3)",
    )
    p.add_argument(
        "--budget-s",
        type=arg_types.positive_float,
        default=None,
        help="wall-clock seconds per search (default: no limit); the search keeps the best "
        "config found when it runs out",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (default: a bar per search on stderr, counting the configs "
        "timed, with the best time so far)",
    )
    p.add_argument("--out", type=str, default=None, help="tuned JSON to write (merged)")
    p.add_argument(
        "--trials",
        type=str,
        default=None,
        help="also write every config timed, per search, to this JSON",
    )
    args = p.parse_args(argv)
    if args.activation_quant:
        args.backends = args.backends or ["mgpu"]
        if set(args.backends) - {"mgpu"}:
            p.error(
                f"--activation-quant {args.activation_quant} tunes the mgpu table only; the "
                f"pallas and mgpu_gemm tables hold configs of weight-only GEMMs (--backends mgpu)"
            )
        for flag, value, want in (("--bits", args.bits, 8), ("--group-size", args.group_size, -1)):
            if value not in (None, want):
                p.error(
                    f"--activation-quant {args.activation_quant} runs int8 per-channel symmetric "
                    f"weights ({flag} {want}), got {flag} {value}"
                )
        args.bits, args.group_size, args.no_zp = 8, -1, True
    args.backends = args.backends or ["pallas"]
    args.bits = args.bits or 4
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with logging_redirect_tqdm():  # log lines printed above the bars, not through them
        return tune(args)


def searches(args, table: str, m: int, scheme: dict, w13=None, w2=None):
    """Each search of `table` at m tokens (rows of a linear), as it ends: (name, problem, M,
    best, {config: seconds}, relative error, seconds of today's config or None). scheme: the
    weights' bits, group_size, has_zeros; w13, w2: the layer's experts (not for mgpu_gemm)."""
    on_gpu = jax.default_backend() == "gpu"
    impl = TABLES[table][0 if on_gpu else 1]
    progress = not args.no_progress
    e, top_k, h, i, _ = benchmark.PRESETS[args.preset]  # the layer's (w13, w2: its weights)
    iters = args.iters or (10 if on_gpu else 1)
    if table == "pallas":
        for name in args.gemms:
            w = w13 if name == "w13" else w2
            best, times, err = tune_gemm(
                w, m, top_k, impl=impl, full=args.full, iters=iters,
                repeats=args.repeats, gated=name == "w13", budget_s=args.budget_s,
                progress=progress, desc=f"{table} {name} M={m}",
            )  # fmt: skip
            shape = dict(E=e, N=w.n, K=w.k, bits=w.bits, group_size=w.group_size)
            yield name, shape, m * top_k, best, times, err, None
    elif table == "mgpu":
        best, times, today, err = tune_layer(
            w13, w2, m, top_k, impl=impl, iters=iters, repeats=args.repeats,
            budget_s=args.budget_s, progress=progress, desc=f"{table} layer M={m}",
            activation_quant=args.activation_quant,
        )  # fmt: skip
        shape = dict(E=e, H=h, I=i, bits=w13.bits, group=math.gcd(w13.group, w2.group))
        if args.activation_quant:
            shape |= INT8_ROWS_PROBLEM
        yield "layer", shape, m * top_k, best, times, err, today
    else:  # "mgpu_gemm": the linears, m rows each
        shapes = benchmark_linear.SHAPES | benchmark_linear.TINY_SHAPES
        step_bytes = benchmark_linear.STEP_WEIGHT_BYTES if on_gpu else 0
        for name in args.linears:
            n, k, activation = shapes[name]
            best, times, today, err = tune_linear(
                n, k, activation, m, impl=impl, **scheme, repeats=args.repeats,
                step_bytes=step_bytes, budget_s=args.budget_s, progress=progress,
                desc=f"{table} {name} M={m}",
            )  # fmt: skip
            shape = dict(E=1, N=n, K=k, bits=scheme["bits"], group_size=scheme["group_size"])
            yield name, shape, m, best, times, err, today


def tune(args: argparse.Namespace) -> dict[str, list[dict]]:
    """main() after parsing its arguments."""
    on_gpu = jax.default_backend() == "gpu"
    e, _, h, i, g = benchmark.PRESETS[args.preset]
    if args.group_size is not None:
        g = args.group_size
    ms = args.m or ([1, 16, 256, 4096] if on_gpu else [1])
    device = jax.devices()[0].device_kind
    key = jax.random.key(0)
    args.linears = args.linears or sorted(
        benchmark_linear.SHAPES if on_gpu else benchmark_linear.TINY_SHAPES
    )
    entries, trials = {}, []
    print(f"{'table':>6} {'gemm':>5} {'M':>6} {'us':>10} {'default us':>10} {'rel err':>8}  config")
    for table in args.backends:
        scheme = dict(bits=args.bits, group_size=g, has_zeros=not args.no_zp)
        experts = {}  # the layer's experts: the linears' searches make weights of their own
        if table != "mgpu_gemm":
            experts = dict(
                w13=wj.random_quantized_experts(
                    jax.random.fold_in(key, 1), (e, 2 * i, h), **scheme
                ),
                w2=wj.random_quantized_experts(jax.random.fold_in(key, 2), (e, h, i), **scheme),
            )
        written = []
        for m in ms:
            for name, shape, slots, best, times, err, today in searches(
                args, table, m, scheme, **experts
            ):
                t = times[best]
                trials.append(
                    dict(
                        table=table,
                        gemm=name,
                        problem=shape,
                        M=slots,
                        tried=[
                            dict(config=dataclasses.asdict(c), microseconds=s * 1e6)
                            for c, s in sorted(times.items(), key=lambda cs: cs[1])
                        ],
                    )  # fmt: skip
                )
                if args.trials:  # after each search, as the entries
                    with open(args.trials, "w") as f:
                        json.dump(trials, f, indent=1)
                shown = "-" if today is None else f"{today * 1e6:.1f}"
                print(
                    f"{table:>6} {name:>5} {m:>6} {t * 1e6:>10.1f} {shown:>10} {err:>8.1e}  "
                    f"{best}  ({len(times)} ran)",
                    flush=True,
                )
                if today is not None and not t < today:
                    print(f"{'':>6} no candidate beat the {name}'s own config at M={m}: kept")
                    continue
                entry = dict(
                    problem=shape, M=slots, config=dataclasses.asdict(best),
                    microseconds=round(t * 1e6, 1),
                )  # fmt: skip
                if today is not None:
                    entry["default_microseconds"] = round(today * 1e6, 1)
                written.append(entry)
                if args.out:  # after each search: a run cut short keeps what it found
                    merge_table(args.out, device, table, [entry], about=_about(table, device))
        entries[table] = written
    if args.out:
        print(f"wrote {sum(map(len, entries.values()))} entries to {args.out}")
    return entries


if __name__ == "__main__":
    main()
