"""Sweeps BlockConfigs of the Pallas grouped GEMM per problem and M, writes the tuned table.

For each (GEMM, M) it times every candidate config with the benchmark's jitted loop, skips the
ones that fail to compile or run (shared memory, registers, validity rules), checks the winner
against the reference, and writes wna16_jax/data/tuned/<device>.json (or --out). Only this
script writes tuned tables.

Example (GPU):
    python examples/tune.py --m 1 16 256 4096 \
        --out wna16_jax/data/tuned/nvidia_h200.json
On a CPU the default is a tiny problem in the Pallas interpreter (a smoke test, no file written
unless --out is given).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchmark  # noqa: E402

import wna16_jax as wj  # noqa: E402
from wna16_jax import _configs, _reference  # noqa: E402

logger = logging.getLogger("tune")


# The axes of the search and their values (the validity rules drop what cannot run a shape),
# in the order the coordinate search visits them: the ones that change the work in flight
# most first, so that a search cut short by its time budget has tried them.
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


def _valid(cfg, shape) -> bool:
    return not _configs.config_problems(cfg, shape)


def exhaustive(shape: _configs.GemmShape):
    """Every valid config of the product of AXES (block_m: the heuristic's and neighbours)."""
    base = _configs.heuristic_config(shape)
    block_ms = sorted({base.block_m, 16} | ({32, 64, 128} if shape.m >= 256 else set()))
    axes = dict(AXES, block_m=tuple(block_ms))
    for values in itertools.product(*axes.values()):
        cfg = wj.BlockConfig(**dict(zip(axes, values, strict=True)))
        if _valid(cfg, shape):
            yield cfg


def starting_points(shape: _configs.GemmShape) -> list:
    """The heuristic's config; its tensor-core variant (for decode the heuristic gives the
    CUDA-core "fma" product) and that with unpack="join" (one dot per group instead of one per
    value slice); and for few rows per expert the "fma" product with one row per block (a
    tensor-core tile of 16 rows would hold mostly padding)."""
    base = _configs.heuristic_config(shape)
    mma = _configs.heuristic_config(shape, allow_fma=False)
    candidates = [base, mma]
    if mma.unpack == "slices":
        candidates.append(dataclasses.replace(mma, unpack="join"))
    if shape.m <= 4 * shape.num_experts:
        candidates.append(dataclasses.replace(mma, dot="fma", block_m=1))
    starts = []
    for cfg in candidates:
        if cfg not in starts and _valid(cfg, shape):
            starts.append(cfg)
    return starts


def coordinate_search(
    shape: _configs.GemmShape, time_config, *, axes, passes: int = 2, budget_s: float | None = None
):
    """From each starting point, tries every value of one axis at a time keeping the best, for
    `passes` sweeps over the axes (stopping early when a sweep improves nothing).

    time_config(cfg) -> seconds or None (failed). Returns {cfg: seconds} of all that ran.
    budget_s: wall-clock seconds for the whole search; each starting point gets an equal share
    (what has run when its share is spent is kept).
    """
    times = {}
    starts = starting_points(shape)
    share = None if budget_s is None else budget_s / len(starts)
    if shape.m >= 16 * shape.num_experts:  # many rows per expert: tiles of at least 16
        axes = dict(axes, block_m=tuple(b for b in axes.get("block_m", ()) if b >= 16))

    def search_from(best, deadline):
        for _ in range(passes):
            improved = False
            for axis, values in axes.items():
                for v in values:
                    cfg = dataclasses.replace(best, **{axis: v})
                    if cfg in times or not _valid(cfg, shape):
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


def tune_gemm(qw, m, top_k, *, interpret, full, iters, repeats, gated, asm_ab, budget_s=None):
    """Searches configs of one GEMM at m tokens; returns (shape, best, {config: seconds} of every
    config that ran, err, asm_off).

    gated: time GEMM1 the way fused_moe runs it (silu(gate) * up fused when split_k == 1).
    asm_ab: also time the winner with the PTX conversion off (seconds, or None).
    """
    from pallas_kernels.triton import fused_moe as pm
    from pallas_kernels.triton.wna16_gemm import wna16_gemm

    e, _, k = qw.shape
    shape = _configs.GemmShape.of_weights(qw, m=m * top_k)
    key = jax.random.key(m)
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    tw, ids = benchmark.random_routing(jax.random.fold_in(key, 1), m, e, top_k, 1)
    routings = {}

    def routing_for(block_m):
        if block_m not in routings:
            routings[block_m] = pm.align(
                ids[0], num_experts=e, block_m=block_m, expert_map=None, interpret=interpret
            )
        return routings[block_m]

    def time_config(cfg, asm=None):
        fuse = gated and pm.fuses_activation(cfg, qw, "silu")
        activation = "silu" if fuse else None

        def run(qw, a, routing, cfg=cfg):
            return wna16_gemm(
                a,
                qw,
                routing,
                top_k=top_k,
                config=cfg,
                interpret=interpret,
                activation=activation,
                asm=asm,
            )

        try:
            t, _ = benchmark.time_loop(
                run,
                [(a, routing_for(cfg.block_m))],
                iters=iters,
                repeats=repeats,
                consts=(qw,),
                host=False,
            )
        except Exception as err:  # does not compile or run on this device: skip it
            logger.info("skip %s: %s", cfg, str(err).splitlines()[0][:200])
            return None
        logger.info("%8.1f us  %s%s", t * 1e6, cfg, " (silu fused)" if fuse else "")
        return t

    if full:
        times = {c: t for c in exhaustive(shape) if (t := time_config(c)) is not None}
    else:
        times = coordinate_search(
            shape, time_config, axes=QUICK_AXES if interpret else AXES, budget_s=budget_s
        )
    if not times:
        raise RuntimeError(f"no candidate config ran for {shape}")
    best = min(times, key=times.get)
    asm_off = time_config(best, asm=False) if asm_ab and not interpret else None
    routing = routing_for(best.block_m)
    out = wna16_gemm(
        a, qw, routing, top_k=top_k, config=best, out_dtype=jnp.float32, interpret=interpret
    )
    ref = _reference.grouped_matmul(a, qw, routing, top_k=top_k)
    placed = np.asarray(ids[0]).reshape(-1) >= 0
    o, r = np.asarray(out)[placed], np.asarray(ref)[placed]
    err = float(np.linalg.norm(o - r) / np.linalg.norm(r))
    if not err < 1e-2:
        raise RuntimeError(f"best config {best} is wrong: relative error {err}")
    return shape, best, times, err, asm_off


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset", choices=sorted(benchmark.PRESETS), default="deepseek-v3" if on_gpu else "tiny"
    )
    p.add_argument("--m", type=int, nargs="+", default=None, help="token counts")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--no-zp", action="store_true")
    p.add_argument(
        "--full",
        action="store_true",
        help="every config of the grid (slow); default: a coordinate search from the heuristic",
    )
    p.add_argument(
        "--gemms", nargs="+", choices=("w13", "w2"), default=("w13", "w2"), help="GEMMs to tune"
    )
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock seconds per (GEMM, M) search (default: no limit); the search keeps "
        "the best config found when it runs out",
    )
    p.add_argument("--out", type=str, default=None, help="tuned JSON to write (merged)")
    p.add_argument(
        "--trials",
        type=str,
        default=None,
        help="also write every config timed, per problem, to this JSON (evidence such as "
        "the best config with and without split-K)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    e, top_k, h, i, g = benchmark.PRESETS[args.preset]
    ms = args.m or ([1, 16, 256, 4096] if on_gpu else [1])
    interpret = not on_gpu
    iters = args.iters or (10 if on_gpu else 1)
    key = jax.random.key(0)
    gemms = {
        "w13": benchmark._random_experts(
            key,
            e,
            2 * i,
            h,
            bits=args.bits,
            group_size=g,
            has_zp=not args.no_zp,
            dtype=jnp.bfloat16,
        ),
        "w2": benchmark._random_experts(
            jax.random.fold_in(key, 1),
            e,
            h,
            i,
            bits=args.bits,
            group_size=g,
            has_zp=not args.no_zp,
            dtype=jnp.bfloat16,
        ),
    }
    entries, trials = [], []
    print(f"{'gemm':>5} {'M':>6} {'us':>9} {'no-asm us':>9} {'rel err':>8}  config")
    for m in ms:
        for name in args.gemms:
            shape, best, times, err, asm_off = tune_gemm(
                gemms[name],
                m,
                top_k,
                interpret=interpret,
                full=args.full,
                iters=iters,
                repeats=args.repeats,
                gated=name == "w13",
                asm_ab=True,
                budget_s=args.budget_s,
            )
            t, n = times[best], len(times)
            trials.append(
                dict(
                    gemm=name,
                    M=shape.m,
                    N=shape.n,
                    K=shape.k,
                    tried=[
                        dict(config=dataclasses.asdict(c), microseconds=sec * 1e6)
                        for c, sec in sorted(times.items(), key=lambda ct: ct[1])
                    ],
                )
            )
            if args.trials:
                with open(args.trials, "w") as f:
                    json.dump(trials, f, indent=1)
            off = f"{asm_off * 1e6:>9.1f}" if asm_off is not None else f"{'-':>9}"
            print(
                f"{name:>5} {m:>6} {t * 1e6:>9.1f} {off} {err:>8.1e}  {best}  ({n} ran)",
                flush=True,
            )
            entries.append(
                dict(
                    E=shape.num_experts,
                    N=shape.n,
                    K=shape.k,
                    bits=shape.bits,
                    group_size=shape.group_size,
                    M=shape.m,
                    config=dataclasses.asdict(best),
                    microseconds=t * 1e6,
                    microseconds_without_asm=None if asm_off is None else asm_off * 1e6,
                    silu_fused=name == "w13" and best.split_k == 1,
                )
            )
            if args.out:  # after each problem: a run cut short keeps what it found
                merge_table(args.out, entries)
    if args.out:
        print(f"wrote {len(entries)} entries to {args.out}")
    return entries


def merge_table(path: str, entries: list[dict]) -> None:
    """Writes `entries` into the tuned JSON at `path`, replacing entries of the same problem."""
    table = {"device": jax.devices()[0].device_kind, "entries": []}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    keys = {(d["E"], d["N"], d["K"], d["bits"], d["group_size"], d["M"]) for d in entries}
    table["entries"] = [
        d
        for d in table["entries"]
        if (d["E"], d["N"], d["K"], d["bits"], d["group_size"], d["M"]) not in keys
    ] + entries
    with open(path, "w") as f:
        json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
