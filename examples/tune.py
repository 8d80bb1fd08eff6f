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

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchmark  # noqa: E402

import wna16_jax as wj  # noqa: E402
from wna16_jax import _configs, _reference  # noqa: E402

logger = logging.getLogger("tune")


def candidates(shape: _configs.GemmShape, quick: bool):
    """Candidate configs valid for `shape` (block_m from the heuristic's choice and neighbours)."""
    base = _configs.heuristic_config(shape)
    block_ms = sorted({base.block_m, 16} | ({32, 64} if shape.m >= 256 else set()))
    block_ns = (32, 64, 128) if not quick else (64, 128)
    block_ks = (64, 128, 256) if not quick else (128,)
    splits = (1, 2, 4) if not quick else (1, 4)
    warps = (4, 8) if not quick else (4,)
    stages = (2, 3, 4) if not quick else (3,)
    unpacks = ("slices", "tile")
    for bm, bn, bk, sk, nw, ns, up in itertools.product(
        block_ms, block_ns, block_ks, splits, warps, stages, unpacks
    ):
        cfg = wj.BlockConfig(
            block_m=bm,
            block_n=bn,
            block_k=bk,
            split_k=sk,
            num_warps=nw,
            num_stages=ns,
            unpack=up,
        )
        if not _configs.config_problems(cfg, shape):
            yield cfg


def tune_gemm(qw, m, top_k, *, interpret, quick, iters, repeats):
    from pallas_kernels import fused_moe as pm
    from pallas_kernels.wna16_gemm import wna16_gemm

    e, _, k = qw.shape
    shape = _configs.GemmShape.of_weights(qw, m=m * top_k)
    key = jax.random.key(m)
    a = jax.random.normal(key, (m, k), jnp.bfloat16)
    tw, ids = benchmark.random_routing(jax.random.fold_in(key, 1), m, e, top_k, 1)
    results = []
    for cfg in candidates(shape, quick):
        routing = pm.align(
            ids[0], num_experts=e, block_m=cfg.block_m, expert_map=None, interpret=interpret
        )

        def run(qw, a, routing, cfg=cfg):
            return wna16_gemm(a, qw, routing, top_k=top_k, config=cfg, interpret=interpret)

        try:
            t, _ = benchmark.time_loop(
                run, [(a, routing)], iters=iters, repeats=repeats, consts=(qw,)
            )
        except Exception as err:  # does not compile or run on this device: skip it
            logger.info("skip %s: %s", cfg, str(err).splitlines()[0][:200])
            continue
        results.append((t, cfg, routing))
        logger.info("%8.1f us  %s", t * 1e6, cfg)
    if not results:
        raise RuntimeError(f"no candidate config ran for {shape}")
    t, best, routing = min(results, key=lambda r: r[0])
    out = wna16_gemm(
        a, qw, routing, top_k=top_k, config=best, out_dtype=jnp.float32, interpret=interpret
    )
    ref = _reference.grouped_matmul(a, qw, routing, top_k=top_k)
    placed = np.asarray(ids[0]).reshape(-1) >= 0
    o, r = np.asarray(out)[placed], np.asarray(ref)[placed]
    err = float(np.linalg.norm(o - r) / np.linalg.norm(r))
    if not err < 1e-2:
        raise RuntimeError(f"best config {best} is wrong: relative error {err}")
    return shape, best, t, err, len(results)


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset", choices=sorted(benchmark.PRESETS), default="deepseek-v3" if on_gpu else "tiny"
    )
    p.add_argument("--m", type=int, nargs="+", default=None, help="token counts")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--no-zp", action="store_true")
    p.add_argument("--full", action="store_true", help="the full candidate grid (slow)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=str, default=None, help="tuned JSON to write (merged)")
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
    entries = []
    print(f"{'gemm':>5} {'M':>6} {'us':>9} {'rel err':>8}  config")
    for m in ms:
        for name, qw in gemms.items():
            shape, best, t, err, n = tune_gemm(
                qw,
                m,
                top_k,
                interpret=interpret,
                quick=not args.full,
                iters=iters,
                repeats=args.repeats,
            )
            print(f"{name:>5} {m:>6} {t * 1e6:>9.1f} {err:>8.1e}  {best}  ({n} ran)", flush=True)
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
                )
            )
    if args.out:
        table = {"device": jax.devices()[0].device_kind, "entries": []}
        if os.path.exists(args.out):
            with open(args.out) as f:
                table = json.load(f)
        keys = {(d["E"], d["N"], d["K"], d["bits"], d["group_size"], d["M"]) for d in entries}
        table["entries"] = [
            d
            for d in table["entries"]
            if (d["E"], d["N"], d["K"], d["bits"], d["group_size"], d["M"]) not in keys
        ] + entries
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {len(entries)} entries to {args.out}")
    return entries


if __name__ == "__main__":
    main()
