"""Whether the weight copies' 32-byte TMA rows hold the mgpu GEMM back: GEMM1 and GEMM2 of
DeepSeek-V3 TP=1 timed alone, as the layer runs them at each M's default config, copying the
int4 tiles in TMA rows of 64 nibbles (32 bytes: 256 rows per 8 KB box), 128 or 256 nibbles
(mgpu_wna16_gemm's weight_row_nibbles: 64 or 128 bytes). Each variant's output is checked bit
for bit against the first variant's on the rows in use (the same products in the same order; a
narrowed block leaves its other rows unwritten). Session 21's call 2 compared every row, so its
M=256 "DIFFERENT" (16-row blocks narrowed to 8) says nothing either way.
Session 21's calls 1-2 also timed the tiles as uint32 words in rows of 8 to 256 words (commit
bd1d642 has that path, `words:ROW` variants, and layouts.tile_words; removed after).

Usage (H200): PYTHONPATH=$PWD python3 experiments/weight_rows_probe.py --m 1 16 256
    --lower-only: lower every variant for sm_90 from shapes alone (no GPU; a CPU check).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import benchmark  # noqa: E402

import wna16_jax as wj  # noqa: E402
from pallas_kernels import mgpu_fused_moe  # noqa: E402
from pallas_kernels.mgpu_wna16_gemm import mgpu_wna16_gemm  # noqa: E402

PRESET = "deepseek-v3"


def gemm_cases(cfg, w13p, w2p, blocks: int):
    """(name, w, options, activation dtype) of the layer's two GEMMs at cfg over `blocks`."""
    for what, w, act in (("GEMM1", w13p, jnp.bfloat16), ("GEMM2", w2p, None)):
        _, _, _, options = mgpu_fused_moe.gemm_plan(cfg, w, blocks, act)
        if act is None:
            options["out_dtype"] = mgpu_fused_moe.down_rows_dtype(cfg, jnp.bfloat16, None)
        yield what, w, options


def variant_call(variant: str, options: dict):
    """call(w, rows, block_experts, in_use) of the GEMM at options for a --variants entry
    "nibbles:ROW" (the int4 tiles in TMA rows of ROW nibbles)."""
    kind, row = variant.split(":")
    if kind != "nibbles":
        raise ValueError(f"bad variant {variant!r}: nibbles:ROW")
    fn = functools.partial(mgpu_wna16_gemm, **{**options, "weight_row_nibbles": int(row)})
    return lambda w, r, ex, used: fn(r, w, ex, used)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument(
        "--variants",
        nargs="+",
        default=["nibbles:64", "nibbles:128", "nibbles:256"],
        help="nibbles:ROW (the int4 tiles in TMA rows of ROW nibbles); the first is the "
        "bit-for-bit check's reference",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lower-only", action="store_true")
    args = p.parse_args(argv)
    e, top_k, h, i, g = benchmark.PRESETS[PRESET]
    if args.lower_only:
        return lower_only(args)
    key = jax.random.key(0)
    w13, w2 = benchmark.probe_experts(key, PRESET, has_zp=True)
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    w13p, w2p = jax.block_until_ready((to_mgpu(w13), to_mgpu(w2)))
    copy_bps, _ = benchmark.measure_ceilings(True, args.repeats)
    print(f"copy {copy_bps / 1e12:.2f} TB/s", flush=True)
    for m in args.m:
        xs, _, idss = benchmark.probe_inputs(key, PRESET, m)
        touched = len(np.unique(np.asarray(idss[0])))
        cfg = mgpu_fused_moe.routed_configs(m, top_k, e, g)[0]
        block_experts, x_rows, _, in_use = mgpu_fused_moe.aligned_blocks(
            xs[0], idss[0], num_experts=e, block_m=cfg.block_m, expert_map=None, interpret=False
        )
        in_use = cfg.gemm_rows_in_use(in_use)
        act_rows = jax.random.normal(key, (x_rows.shape[0], i), jnp.bfloat16)
        for what, w, options in gemm_cases(cfg, w13p, w2p, block_experts.shape[0]):
            rows = x_rows if what == "GEMM1" else act_rows
            nbytes = benchmark.weight_bytes(w13 if what == "GEMM1" else w2, 1) * touched
            # the rows in use: a block's first in_use rows (all of them without narrowing)
            used_rows = np.ones(rows.shape[0], bool)
            if in_use is not None:
                used_rows = np.arange(rows.shape[0]) % cfg.block_m < np.repeat(
                    np.asarray(in_use), cfg.block_m
                )
            reference = None
            for variant in args.variants:
                call = variant_call(variant, options)
                out = np.asarray(jax.jit(call)(w, rows, block_experts, in_use))[used_rows]
                if reference is None:
                    reference, same = out, ""
                else:
                    same = "bit-identical" if np.array_equal(out, reference) else "DIFFERENT"
                t, _ = benchmark.time_loop(
                    call,
                    [(rows, block_experts, in_use)],
                    consts=(w,),
                    iters=benchmark.default_iters(m),
                    repeats=args.repeats,
                    host=False,
                )
                print(
                    f"M={m:<4} {what} {variant:<12} {t * 1e6:8.1f} us "
                    f"{nbytes / t / copy_bps:6.1%} of copy {same}",
                    flush=True,
                )
    return 0


def lower_only(args) -> int:
    """Lowers each GEMM variant for sm_90 from shapes (no weights, no GPU)."""
    e, top_k, h, i, g = benchmark.PRESETS[PRESET]

    def experts(n, k):
        scales = jax.ShapeDtypeStruct((e, k // g, n), jnp.bfloat16)
        q = jax.ShapeDtypeStruct((e, n // 64, k // 64, 64, 64), jnp.int4)
        return wj.QuantizedExperts(q, scales, scales, bits=4, group_size=g, layout="mgpu_int4")

    w13, w2 = experts(2 * i, h), experts(h, i)
    failed = 0
    for m in args.m:
        cfg = mgpu_fused_moe.routed_configs(m, top_k, e, g)[0]
        blocks = min(m * top_k, -(-m * top_k // cfg.block_m) + e)
        for what, w, options in gemm_cases(cfg, w13, w2, blocks):
            rows = jax.ShapeDtypeStruct((blocks * cfg.block_m, w.shape[2]), jnp.bfloat16)
            experts_ = jax.ShapeDtypeStruct((blocks,), jnp.int32)
            in_use = experts_ if cfg.narrow_steps() else None
            for variant in args.variants:
                try:
                    jax.jit(variant_call(variant, options)).trace(w, rows, experts_, in_use).lower(
                        lowering_platforms=("cuda",)
                    )
                    verdict = "lowers"
                except Exception as err:  # report, go on
                    failed += 1
                    verdict = f"FAILED: {str(err).strip().splitlines()[0][:160]}"
                print(f"M={m:<4} {what} {variant}: {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
