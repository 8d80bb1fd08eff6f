"""Would one kernel for both GEMMs stream decode's weights faster than two? The empty pipeline
(experiments/stream_probe.py: copies only, no math) in two phases shaped like the layer's GEMMs
at M=1, timed three ways:

- two: two kernels, phase 1 (GEMM1's shape) then phase 2 (GEMM2's), as the layer runs now;
- one: one kernel of both phases' programs (phase 1's first): a phase-1 program signals its
  block's semaphore once its output row is written; a phase-2 program waits until all of its
  block's phase-1 programs have signalled, reads one of their rows, then streams its own bytes;
- prefetch: as `one`, but a phase-2 program starts its pipeline first and waits in its first
  k-step, so its first `stages` copies are in flight while it waits.

Each phase-2 program writes the phase-1 row it read next to its own last box's first row, so
the run checks that the wait orders the reads after the writes (fresh random data per check).

Usage (H200): PYTHONPATH=$PWD python3 experiments/chain_probe.py
    [--blocks 8] [--programs 256 896] [--mbytes 117.4 58.7] [--box-kb 16 8] [--stages 3]
Check on the CPU (interpreter, tiny sizes): python3 experiments/chain_probe.py --interpret
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import benchmark  # noqa: E402

MODES = ("two", "one", "prefetch")
WIDTH = 128  # bytes per TMA row and per output row


def _params(interpret: bool):
    return dict(
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def two_phase(d1, d2, *, blocks: int, stages: int, mode: str, interpret: bool = False):
    """(o1 [P1, 1, WIDTH], o2 [P2, 2, WIDTH]) int8 for d1 [P1, steps, rows, WIDTH] and d2
    [P2, steps, rows, WIDTH] (each phase's programs in `blocks` equal runs, block-major):
    o1[p] is the first row of phase-1 program p's last box; o2[q] is phase-1 program
    b * P1/B + q % (P1/B)'s row (b: q's block) and the first row of q's own last box."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not among {MODES}")
    p1, p2 = d1.shape[0], d2.shape[0]
    if p1 % blocks or p2 % blocks or p2 // blocks < p1 // blocks:
        raise ValueError(f"{p1} and {p2} programs in {blocks} blocks, phase 2's no fewer")
    per1, per2 = p1 // blocks, p2 // blocks
    o1_type = jax.ShapeDtypeStruct((p1, 1, WIDTH), jnp.int8)
    o2_type = jax.ShapeDtypeStruct((p2, 2, WIDTH), jnp.int8)

    def spec(d, program):
        return plgpu.BlockSpec((None, None, *d.shape[2:]), lambda s: (program, s, 0, 0))

    def phase1(p, d1_gmem, o1_gmem, o_smem, sem):
        def step(_, box):
            o_smem.at[pl.ds(0, 1)][...] = box[0:1, :]

        plgpu.emit_pipeline(
            step, grid=(d1.shape[1],), in_specs=[spec(d1, p)], max_concurrent_steps=stages
        )(d1_gmem)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, 1)], o1_gmem.at[p])
        plgpu.wait_smem_to_gmem(0)  # the row written, not only read
        if sem is not None:
            pl.semaphore_signal(sem.at[p // per1])

    def phase2(q, d2_gmem, o1_gmem, o2_gmem, o_smem, in_smem, barrier, sem):
        b = q // per2
        source = b * per1 + q % per1

        def read_row():
            if sem is not None:
                pl.semaphore_wait(sem.at[b], per1, decrement=False)
            plgpu.copy_gmem_to_smem(o1_gmem.at[source], in_smem, barrier)
            plgpu.barrier_wait(barrier)

        if mode != "prefetch":
            read_row()

        def step(idx, box):
            if mode == "prefetch":
                pl.when(idx[0] == 0)(read_row)
            o_smem.at[pl.ds(1, 1)][...] = box[0:1, :]

        plgpu.emit_pipeline(
            step, grid=(d2.shape[1],), in_specs=[spec(d2, q)], max_concurrent_steps=stages
        )(d2_gmem)
        o_smem.at[pl.ds(0, 1)][...] = in_smem[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o2_gmem.at[q])
        plgpu.wait_smem_to_gmem(0)

    smem2 = [
        plgpu.SMEM((2, WIDTH), jnp.int8),
        plgpu.SMEM((1, WIDTH), jnp.int8),
        plgpu.Barrier(num_arrivals=1),
    ]
    if mode == "two":

        def kernel1(d1_gmem, o1_gmem, o_smem):
            phase1(lax.axis_index("p"), d1_gmem, o1_gmem, o_smem, None)

        def kernel2(d2_gmem, o1_gmem, o2_gmem, o_smem, in_smem, barrier):
            phase2(lax.axis_index("p"), d2_gmem, o1_gmem, o2_gmem, o_smem, in_smem, barrier, None)

        o1 = plgpu.kernel(
            kernel1, out_type=o1_type, scratch_types=[plgpu.SMEM((2, WIDTH), jnp.int8)],
            grid=(p1,), grid_names=("p",), **_params(interpret),
        )(d1)  # fmt: skip
        o2 = plgpu.kernel(
            kernel2, out_type=o2_type, scratch_types=smem2, grid=(p2,), grid_names=("p",),
            **_params(interpret),
        )(d2, o1)  # fmt: skip
        return o1, o2

    def kernel(d1_gmem, d2_gmem, o1_gmem, o2_gmem, o_smem, in_smem, barrier):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR((blocks,)))
        pid = lax.axis_index("p")
        pl.when(pid < p1)(lambda: phase1(pid, d1_gmem, o1_gmem, o_smem, sem))

        @pl.when(pid >= p1)
        def _():
            phase2(pid - p1, d2_gmem, o1_gmem, o2_gmem, o_smem, in_smem, barrier, sem)

    return plgpu.kernel(
        kernel, out_type=(o1_type, o2_type), scratch_types=smem2, grid=(p1 + p2,),
        grid_names=("p",), **_params(interpret),
    )(d1, d2)  # fmt: skip


def expected(d1, d2, blocks: int):
    """two_phase's outputs computed by numpy."""
    d1, d2 = np.asarray(d1), np.asarray(d2)
    p1, p2 = d1.shape[0], d2.shape[0]
    per1, per2 = p1 // blocks, p2 // blocks
    o1 = d1[:, -1, 0:1, :]
    q = np.arange(p2)
    source = q // per2 * per1 + q % per1
    o2 = np.stack([o1[source, 0], d2[:, -1, 0]], axis=1)
    return o1, o2


def check(d1, d2, *, blocks, stages, mode, interpret=False) -> str:
    o1, o2 = two_phase(d1, d2, blocks=blocks, stages=stages, mode=mode, interpret=interpret)
    e1, e2 = expected(d1, d2, blocks)
    bad1 = int((np.asarray(o1) != e1).any(axis=(1, 2)).sum())
    bad2 = int((np.asarray(o2)[:, 0] != e2[:, 0]).any(axis=1).sum())
    bad_own = int((np.asarray(o2)[:, 1] != e2[:, 1]).any(axis=1).sum())
    if bad1 or bad2 or bad_own:
        return f"WRONG: {bad1} phase-1 rows, {bad2} rows read back, {bad_own} phase-2 rows"
    return "ok"


def random_data(key, programs: int, steps: int, rows: int):
    return jax.random.randint(key, (programs, steps, rows, WIDTH), -128, 127, jnp.int8)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=8, help="blocks (experts at M=1)")
    p.add_argument("--programs", type=int, nargs=2, default=[256, 896],
                   help="programs of phase 1, 2 (GEMM1, GEMM2 at M=1: 8x32, 8x112)")  # fmt: skip
    p.add_argument("--mbytes", type=float, nargs=2, default=[117.4, 58.7],
                   help="MB streamed by phase 1 and 2 (the GEMMs' weights at M=1)")  # fmt: skip
    p.add_argument("--box-kb", type=int, nargs=2, default=[16, 8], help="KB per k-step")
    p.add_argument("--stages", type=int, nargs="+", default=[3])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--interpret", action="store_true",
                   help="check on the CPU (tiny sizes; the interpreter runs 'two' only: it has no "
                   "global semaphores), and lower every mode for sm_90")  # fmt: skip
    args = p.parse_args(argv)
    if args.interpret:
        keys = jax.random.split(jax.random.key(0), 2)
        d1, d2 = random_data(keys[0], 4, 3, 8), random_data(keys[1], 6, 2, 8)
        result = check(d1, d2, blocks=2, stages=2, mode="two", interpret=True)
        print(f"interpret two: {result}")
        for mode in MODES:
            fn = jax.jit(lambda a, b, mode=mode: two_phase(a, b, blocks=2, stages=2, mode=mode))
            fn.trace(d1, d2).lower(lowering_platforms=("cuda",))
            print(f"lowers for sm_90: {mode}")
        return 0 if result == "ok" else 1
    copy_bps = 2 * (1 << 28) * 4 / benchmark.time_copy(1 << 28, iters=20, repeats=5)
    print(f"copy {copy_bps / 1e12:.2f} TB/s", flush=True)
    shapes = []
    for programs, mbytes, box_kb in zip(args.programs, args.mbytes, args.box_kb, strict=True):
        steps = max(1, round(mbytes * 1e6 / (programs * box_kb * 1024)))
        shapes.append((programs, steps, box_kb * 1024 // WIDTH))
    keys = jax.random.split(jax.random.key(1), 4)
    data = [random_data(keys[i], *shapes[i]) for i in range(2)]
    fresh = [random_data(keys[2 + i], *shapes[i]) for i in range(2)]
    nbytes = sum(d.size for d in data)
    print(f"phase 1: {shapes[0]}, phase 2: {shapes[1]} (programs, steps, rows of {WIDTH} B)")
    for stages in args.stages:
        for mode in args.modes:
            name = f"{mode:>8} stages {stages}"
            try:
                result = check(*fresh, blocks=args.blocks, stages=stages, mode=mode)
                fn = jax.jit(
                    lambda a, b, stages=stages, mode=mode: two_phase(
                        a, b, blocks=args.blocks, stages=stages, mode=mode
                    )[1]
                )
                seconds, _ = benchmark.time_loop(fn, [tuple(data)], iters=50, repeats=5, host=False)
            except Exception as e:  # noqa: BLE001 (report, go on)
                print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(
                f"{name}: {seconds * 1e6:8.1f} us {nbytes / seconds / copy_bps:6.1%} of copy "
                f"({result})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
