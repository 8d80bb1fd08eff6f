"""Does the alignment kernel run slower right after a memory-bound kernel than on its own?

In the layer's timelines (sessions 16, 18) the alignment kernels took 14.9 us per call at M=16
and 24-28 us at M=256, against 7.0 and 11.8 us in experiments/align_probe.py, which runs them
alone. This probe times the same kernels (the default AlignConfig, DeepSeek-V3's E=256, top-8)
three ways in one process, from the device trace (kernel_timeline.trace_loop):
- alone: one alignment per loop iteration (align_probe.py's loop);
- after a pass: each call first reads `--pass-mb` MB of f32 (an XLA sum: memory-bound, as a
  GEMM streaming weights) and the alignment's ids depend on that sum, so the alignment starts
  as the pass ends (session 19 call 3 ran an elementwise pass of which only two elements were
  used: XLA computed just those, so its "after a pass" rows were not after a pass);
- the pass alone, for its own time.

Usage (H200): PYTHONPATH=$PWD python3 experiments/align_context_probe.py [--calls 50]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import kernel_timeline  # noqa: E402

from pallas_kernels import align  # noqa: E402


def busy_us(fn, sets, consts, calls):
    """{kernel name: us per call} of fn's loop, from the device trace."""
    trace, n = kernel_timeline.trace_loop(fn, sets, consts=consts, calls=calls, chain=False)
    s = kernel_timeline.summarize(kernel_timeline.device_kernels(trace), n)
    return {r["name"]: r["total_us_per_call"] for r in s["kernels"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--pass-mb", type=int, default=128, help="MB of f32 the pass reads")
    args = p.parse_args(argv)
    key = jax.random.key(0)
    big = jax.random.uniform(key, (args.pass_mb * 2**18,), jnp.float32)
    for t, block_m in ((16, 8), (256, 16)):
        sets = []
        for s in range(4):  # k distinct experts per token, as the router gives
            scores = jax.random.uniform(jax.random.fold_in(key, 16 * t + s), (t, 256))
            sets.append((jax.lax.top_k(scores, 8)[1].astype(jnp.int32),))

        def aligned(ids, block_m=block_m):
            r = align.moe_align_block_size(ids, num_experts=256, block_m=block_m)
            return r.sorted_token_ids

        def after_pass(big, ids):
            total = jnp.sum(big)
            late = (total > 3e38).astype(jnp.int32)  # never true; the ids wait for the pass
            return jnp.sum(aligned(ids + late).astype(jnp.float32))

        def pass_only(big, ids):
            return jnp.sum(big) + ids[0, 0].astype(jnp.float32)

        cases = (("alone", aligned, ()), ("after a pass", after_pass, (big,)),
                 ("pass only", pass_only, (big,)))  # fmt: skip
        for name, fn, consts in cases:
            kernels = busy_us(fn, sets, consts, args.calls)
            align_us = sum(us for k, us in kernels.items() if k.startswith("moe_align"))
            others = ", ".join(f"{k} {us:.1f}" for k, us in kernels.items()
                               if not k.startswith("moe_align") and us >= 0.5)  # fmt: skip
            print(f"T={t:<4} block_m={block_m:<3} {name:<13} align kernels {align_us:6.1f} "
                  f"us/call; others: {others}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
