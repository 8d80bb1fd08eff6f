"""The alignment kernel's GPU time per AlignConfig at the layer's sizes (DeepSeek-V3: E=256,
top-8): T=16 with block_m=8 (M=16's default blocks), T=64 with 8, T=256 with 16. Each config is
traced in a jitted loop (kernel_timeline.trace_loop) and its kernels' busy time per call read
from the device trace, so the loop's own kernels and launch gaps are left out.

Usage (H200): PYTHONPATH=$PWD python3 experiments/align_probe.py [--calls 50]
    [--sizes 16:8 64:8 16384:64] [--default-only]
Prints per (T, block_m): each config's kernel time per call (us), the default first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import kernel_timeline  # noqa: E402

from pallas_kernels import align  # noqa: E402


def candidates(num_slots: int):
    """The default config and its neighbours, one field changed at a time."""
    base = align.default_config(num_slots)
    changes = [
        dict(num_warps=2), dict(num_warps=8), dict(blocks_per_program=32),
        dict(blocks_per_program=128), dict(blocks_per_program=256), dict(chunk_slots=32),
        dict(chunk_slots=128), dict(unroll=1), dict(unroll=8),
        dict(fused=not base.fused, chunk_slots=128),
    ]  # fmt: skip
    return [base] + [dataclasses.replace(base, **c) for c in changes]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument(
        "--sizes", nargs="+", default=["16:8", "64:8", "256:16"], metavar="T:BLOCK_M",
        help="tokens and block size per run (default: 16:8 64:8 256:16)",
    )  # fmt: skip
    p.add_argument("--default-only", action="store_true", help="time only the default config")
    args = p.parse_args(argv)
    try:
        sizes = [tuple(int(v) for v in s.split(":")) for s in args.sizes]
        if any(len(s) != 2 or min(s) < 1 for s in sizes):
            raise ValueError
    except ValueError:
        p.error(f"--sizes takes T:BLOCK_M pairs of positive integers, got {args.sizes}")
    key = jax.random.key(0)
    for t, block_m in sizes:
        sets = []
        for s in range(4):  # k distinct experts per token, as the router gives
            scores = jax.random.uniform(jax.random.fold_in(key, 16 * t + s), (t, 256))
            sets.append((jax.lax.top_k(scores, 8)[1].astype(jnp.int32),))
        for cfg in candidates(t * 8)[: 1 if args.default_only else None]:

            def fn(ids, cfg=cfg, block_m=block_m):
                r = align.moe_align_block_size(ids, num_experts=256, block_m=block_m, config=cfg)
                return r.sorted_token_ids

            try:
                trace, calls = kernel_timeline.trace_loop(
                    fn, sets, consts=(), calls=args.calls, chain=False
                )
                s = kernel_timeline.summarize(kernel_timeline.device_kernels(trace), calls)
                align_us = sum(r["total_us_per_call"] for r in s["kernels"]
                               if r["name"].startswith("moe_align"))  # fmt: skip
                print(f"T={t:<4} block_m={block_m:<3} align kernels {align_us:6.1f} us/call  "
                      f"{cfg}", flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                print(f"T={t:<4} block_m={block_m:<3} FAILED {cfg}: {str(e)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
