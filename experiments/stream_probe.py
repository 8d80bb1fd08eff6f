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


def stream(data, *extra, shared=None, stages: int, interpret: bool = False):
    """Reads data [programs, steps, rows, width] int8 with one program per [steps, rows, width]
    strip, one box of rows x width bytes per step (width: a TMA row's bytes); returns a
    [programs, used, width] int8 array whose rows per program are the strip's last box's
    first `used` rows (128 bytes of them, so the copies are used). extra: more arrays
    [programs, steps, rows_i, width_i] copied a box per step alongside (as the GEMM's second
    weight half, its scales and zero points); shared: [steps, rows, width] copied a box per step
    by every program (as the GEMM's rows' tile, read from L2)."""
    programs, steps, rows, width = data.shape
    used = max(1, 128 // width)

    def kernel(*refs):
        *in_refs, o_gmem, o_smem = refs
        pid = jax.lax.axis_index("p")

        def step(_, box, *_others):
            o_smem[...] = box[0:used, :]

        specs = [
            plgpu.BlockSpec((None, None, *a.shape[2:]), lambda s: (pid, s, 0, 0))
            for a in (data, *extra)
        ]
        if shared is not None:
            specs.append(plgpu.BlockSpec((None, *shared.shape[1:]), lambda s: (s, 0, 0)))
        plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=specs, max_concurrent_steps=min(stages, steps)
        )(*in_refs)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pid])
        plgpu.wait_smem_to_gmem(0)

    operands = (data, *extra) + ((shared,) if shared is not None else ())
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((programs, used, width), jnp.int8),
        scratch_types=[plgpu.SMEM((used, width), jnp.int8)],
        grid=(programs,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*operands)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mbytes", type=float, default=117.4, help="bytes streamed per pass (MB); "
                   "117.4 = GEMM1's int4 weights at M=1 (8 experts)")  # fmt: skip
    p.add_argument("--box-kb", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--programs", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--row-bytes", type=int, nargs="+", default=[128],
                   help="bytes per TMA row of a box (at most 256); the mgpu GEMM copies its "
                   "int4 weight tiles in rows of 128 bytes (32 before session 21)")  # fmt: skip
    p.add_argument("--halves", type=int, nargs="+", default=[1],
                   help="copies a step's box is split into (GEMM1 at M=1: its gate and up "
                   "halves, 2 x 8 KB)")  # fmt: skip
    p.add_argument("--small-copies", type=int, nargs="+", default=[0],
                   help="more copies per step of 2 x 128 bytes each (the GEMM's scales and zero "
                   "points of a k-step of two groups, per half)")  # fmt: skip
    p.add_argument("--shared-kb", type=int, nargs="+", default=[0],
                   help="a box per step of this many KB that every program reads (the GEMM's "
                   "rows' tile, from L2; 4 = 8 bf16 rows of 256)")  # fmt: skip
    p.add_argument("--interpret", action="store_true", help="check on the CPU (tiny sizes)")
    args = p.parse_args(argv)
    if args.interpret:
        data = jnp.arange(4 * 3 * 8 * 128, dtype=jnp.int32).astype(jnp.int8).reshape(4, 3, 8, 128)
        out = stream(data, stages=2, interpret=True)
        assert (out[:, 0] == data[:, -1, 0]).all(), "the last box's first row per program"
        small = jnp.ones((4, 3, 2, 128), jnp.int8)
        out = stream(data, small, shared=jnp.ones((3, 16, 256), jnp.int8), stages=2,
                     interpret=True)  # fmt: skip
        assert (out[:, 0] == data[:, -1, 0]).all(), "with more copies per step"
        print("interpret: ok")
        return 0
    copy_bps = 2 * (1 << 28) * 4 / benchmark.time_copy(1 << 28, iters=20, repeats=5)
    print(f"copy {copy_bps / 1e12:.2f} TB/s", flush=True)
    combos = itertools.product(
        args.box_kb, args.stages, args.programs, args.row_bytes, args.halves,
        args.small_copies, args.shared_kb,
    )  # fmt: skip
    for box_kb, stages, programs, width, halves, smalls, shared_kb in combos:
        rows = box_kb * 1024 // width // halves
        steps = max(1, round(args.mbytes * 1e6 / (programs * box_kb * 1024)))
        if rows > 256 or stages * (box_kb + shared_kb) > 200:
            continue
        keys = jax.random.split(jax.random.key(programs), halves + smalls + 1)
        data = [
            jax.random.randint(keys[i], (programs, steps, rows, width), -128, 127, jnp.int8)
            for i in range(halves)
        ]
        data += [
            jax.random.randint(keys[halves + i], (programs, steps, 2, 128), -128, 127, jnp.int8)
            for i in range(smalls)
        ]
        operands = list(data)
        if shared_kb:  # an argument like the rest, never a constant captured by the jit
            operands.append(
                jax.random.randint(keys[-1], (steps, shared_kb * 4, 256), -128, 127, jnp.int8)
            )

        def fn(*d, stages=stages, n=halves + smalls):  # the first n: data
            return stream(*d[:n], shared=d[n] if len(d) > n else None, stages=stages)

        name = (
            f"box {box_kb:>2} KB rows of {width:>3} B stages {stages} programs {programs:>5} "
            f"halves {halves} small {smalls} shared {shared_kb:>2} KB"
        )
        try:
            seconds, _ = benchmark.time_loop(
                jax.jit(fn), [tuple(operands)], iters=50, repeats=5, host=False
            )
        except Exception as e:  # noqa: BLE001 (a config the hardware refuses: report, go on)
            print(f"{name}: {type(e).__name__}: {str(e)[:120]}")
            continue
        nbytes = sum(d.size for d in data[:halves])  # the weights' bytes only
        print(
            f"{name} steps {steps:>4}: "
            f"{seconds * 1e6:8.1f} us {nbytes / seconds / copy_bps:6.1%} of copy",
            flush=True,
        )
        del data, operands
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
