"""A/B in one run: the mgpu layer with the rows it never reads left unwritten, each option
alone and both (session 11's call 7 measured both on, against other calls, as slower):
mgpu_wna16_gemm(zero_empty=False) for blocks of expert -1, gather_rows(fill=False) for padding
rows. The options are switched by patching the layer's helpers (an experiment, not an API);
the base config runs first and last to show the drift within the run.

    PYTHONPATH=$PWD python3 experiments/empty_rows_probe.py --m 16 256 4096
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import jax
import numpy as np

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)

import benchmark  # noqa: E402

import wna16_jax as wj  # noqa: E402
from pallas_kernels import gather_rows, mgpu_fused_moe  # noqa: E402


@contextlib.contextmanager
def unwritten(zero_empty: bool, fill: bool):
    """The layer's GEMMs with zero_empty and its rows gathered with fill, for the duration
    (jax's caches cleared on entry, so the layer is traced again)."""
    options, gather = mgpu_fused_moe.gemm_options, gather_rows.gather_rows

    def patched_options(*args, **kwargs):
        return dict(options(*args, **kwargs), zero_empty=zero_empty)

    jax.clear_caches()
    mgpu_fused_moe.gemm_options = patched_options
    gather_rows.gather_rows = functools.partial(gather, fill=fill)
    try:
        yield
    finally:
        mgpu_fused_moe.gemm_options, gather_rows.gather_rows = options, gather


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(benchmark.PRESETS), default="deepseek-v3")
    p.add_argument("--m", type=int, nargs="+", default=[16, 256, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--interpret", action="store_true", help="a CPU check (times mean nothing)")
    args = p.parse_args(argv)
    e, top_k, _, _, g = benchmark.PRESETS[args.preset]
    key = jax.random.key(0)
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    w13, w2 = map(to_mgpu, benchmark.probe_experts(key, args.preset, has_zp=True))
    variants = [(True, True), (False, True), (True, False), (False, False), (True, True)]
    for m in args.m:
        xs, tws, idss = benchmark.probe_inputs(key, args.preset, m)
        sets = [(xs[s], tws[s], idss[s]) for s in range(4)]
        cfg = mgpu_fused_moe.default_config(m * top_k, e, g)
        layer = lambda a, b, x, tw, ids, cfg=cfg: mgpu_fused_moe.fused_moe(  # noqa: E731
            x, a, b, tw, ids, config=cfg, interpret=args.interpret
        )
        outs = []
        for zero_empty, fill in variants:
            with unwritten(zero_empty, fill):
                t, _ = benchmark.time_loop(
                    layer, sets, consts=(w13, w2), iters=4 if args.interpret else
                    benchmark.default_iters(m), repeats=args.repeats, host=False,
                )  # fmt: skip
                outs.append(np.asarray(layer(w13, w2, *sets[0]), np.float32))
            print(f"M={m:<5} zero_empty={zero_empty!s:<5} fill={fill!s:<5} {t * 1e6:10.1f} us",
                  flush=True)  # fmt: skip
        for out in outs[1:]:  # the rows read are the same products
            np.testing.assert_array_equal(out, outs[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
