"""How fast a Pallas Mosaic GPU pipeline streams bytes with an empty body (no conversion, no
wgmma): the ceiling the mgpu GEMM's decode structure can reach (one program per output tile,
`plgpu.emit_pipeline` copying one box per k-step, `stages` boxes in flight per program).

Usage (H200): PYTHONPATH=$PWD python3 experiments/stream_probe.py
Prints, per (box bytes, stages, programs): microseconds per pass over the same total bytes and
the share of the measured copy bandwidth (read + write, as benchmark.py's copy ceiling).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import benchmark  # noqa: E402


def stream(data, *, stages: int, interpret: bool = False):
    """Reads data [programs, steps, rows, width] int8 with one program per [steps, rows, width]
    strip, one box of rows x width bytes per step (width: a TMA row's bytes); returns a
    [programs, used, width] int8 array whose rows per program are the strip's last box's
    first `used` rows (128 bytes of them, so the copies are used)."""
    programs, steps, rows, width = data.shape
    used = max(1, 128 // width)

    def kernel(d_gmem, o_gmem, o_smem):
        pid = jax.lax.axis_index("p")

        def step(_, box):
            o_smem[...] = box[0:used, :]

        plgpu.emit_pipeline(
            step,
            grid=(steps,),
            in_specs=[plgpu.BlockSpec((None, None, rows, width), lambda s: (pid, s, 0, 0))],
            max_concurrent_steps=min(stages, steps),
        )(d_gmem)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pid])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((programs, used, width), jnp.int8),
        scratch_types=[plgpu.SMEM((used, width), jnp.int8)],
        grid=(programs,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mbytes", type=float, default=117.4, help="bytes streamed per pass (MB); "
                   "117.4 = GEMM1's int4 weights at M=1 (8 experts)")  # fmt: skip
    p.add_argument("--box-kb", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--programs", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--row-bytes", type=int, nargs="+", default=[128],
                   help="bytes per TMA row of a box (at most 256); the mgpu GEMM's int4 weight "
                   "tiles copy rows of 32 bytes")  # fmt: skip
    p.add_argument("--interpret", action="store_true", help="check on the CPU (tiny sizes)")
    args = p.parse_args(argv)
    if args.interpret:
        data = jnp.arange(4 * 3 * 8 * 128, dtype=jnp.int32).astype(jnp.int8).reshape(4, 3, 8, 128)
        out = stream(data, stages=2, interpret=True)
        assert (out[:, 0] == data[:, -1, 0]).all(), "the last box's first row per program"
        print("interpret: ok")
        return 0
    copy_bps = 2 * (1 << 28) * 4 / benchmark.time_copy(1 << 28, iters=20, repeats=5)
    print(f"copy {copy_bps / 1e12:.2f} TB/s", flush=True)
    combos = itertools.product(args.box_kb, args.stages, args.programs, args.row_bytes)
    for box_kb, stages, programs, width in combos:
        rows = box_kb * 1024 // width
        steps = max(1, round(args.mbytes * 1e6 / (programs * box_kb * 1024)))
        if rows > 256 or stages * box_kb > 200:
            continue
        data = jax.random.randint(
            jax.random.key(programs), (programs, steps, rows, width), -128, 127, jnp.int8
        )
        fn = jax.jit(lambda d, stages=stages: stream(d, stages=stages))
        try:
            seconds, _ = benchmark.time_loop(fn, [(data,)], iters=50, repeats=5, host=False)
        except Exception as e:  # noqa: BLE001 (a config the hardware refuses: report, go on)
            print(f"box {box_kb:>2} KB rows of {width:>3} B stages {stages} "
                  f"programs {programs:>5}: {type(e).__name__}: {str(e)[:120]}")  # fmt: skip
            continue
        nbytes = data.size
        print(
            f"box {box_kb:>2} KB rows of {width:>3} B stages {stages} programs {programs:>5} "
            f"steps {steps:>4}: "
            f"{seconds * 1e6:8.1f} us {nbytes / seconds / copy_bps:6.1%} of copy",
            flush=True,
        )
        del data
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
