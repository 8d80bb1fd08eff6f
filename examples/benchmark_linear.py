"""Times the quantized linear (wna16_jax.linear: one int4 weight [N, K]) per backend at
DeepSeek-V3's non-expert linear shapes against the copy ceiling of the same run, beside the
bf16 dense dot a JAX user would otherwise run.

Each row is one shape at one row count M on one implementation, timed as a model step runs its
layers (benchmark.py's `make_model_step` and `time_step`: calls written out in one jit, each fed by
the last, steps queued back to back, the marginal time per call; --trace traces the same compiled
step). Each call reads its own copy of the weight, enough copies that they do not fit in L2 together
(the weights a decode step reads are read once). Implementations: a backend name ("mgpu", "pallas",
"xla", their "_interpret" twins; weights converted once to the layout it reads, untimed) or "bf16"
(the weight dequantized to a bf16 [N, K] array once, then a plain dot: twice to four times the
bytes). "%copy" is the bytes a call reads (weight, scales, zero points, rows) over its time, against
the measured copy ceiling (HBM read + write).

--splits times the Mosaic GPU GEMM at given K splits (MgpuConfig.splits on the config it runs
today). --trace also times each row from a device trace (`jax.profiler`): the step's kernels
per call from the first start to the last end, the GEMM's own time plus the two small kernels
that chain one call to the next; steadier than the wall-clock figure for kernels of 5-60 us.

On a GPU the default shapes are DeepSeek-V3's (int4 g128 with zero points); on a CPU tiny ones
in the interpreters (a smoke test).

Examples (GPU):
    python examples/benchmark_linear.py --implementations mgpu pallas xla bf16 --m 1 8 64
    python examples/benchmark_linear.py --shapes kv_a o_proj --m 1 --json out/linear.json
    python examples/benchmark_linear.py --implementations mgpu --m 1 --splits 1 2 4 8 --trace
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder's profile.py

import profile as profile_example  # noqa: E402

import arg_types  # noqa: E402
import cli  # noqa: E402
from benchmark import array_bytes, make_model_step, measure_ceilings, time_step  # noqa: E402

import wna16_jax as wj  # noqa: E402

# name: (N, K, activation) of DeepSeek-V3's non-expert linears (y = x @ W.T, W [N, K]) as the
# model runs them on a kernel: q_a_proj and kv_a_proj_with_mqa as one GEMM (qkv_a), gate_proj
# and up_proj as one [gate; up] GEMM with silu(gate) * up in its epilogue (activation "silu").
SHAPES = {
    "q_a": (1536, 7168, None),
    "q_b": (24576, 1536, None),  # 128 heads x (128 nope + 64 rope)
    "kv_a": (576, 7168, None),  # kv_lora_rank 512 + rope 64
    "qkv_a": (2112, 7168, None),  # q_a and kv_a fused
    "o_proj": (7168, 16384, None),
    "mlp_gate_up": (36864, 7168, "silu"),  # the dense layers' gate and up projections, fused
    "mlp_down": (7168, 18432, None),
    "shared_gate_up": (4096, 7168, "silu"),  # the shared expert's gate and up, fused
    "shared_down": (7168, 2048, None),
    "lm_head": (129280, 7168, None),  # the vocabulary projection, quantized (--quantize-lm-head)
}
TINY_SHAPES = {
    "tiny_a": (128, 256, None),
    "tiny_b": (64, 128, None),
    "tiny_gated": (128, 128, "silu"),
}

# Bytes of the weight copies a timed step reads: several times the H200's 50 MB L2.
STEP_WEIGHT_BYTES = 256 << 20
MAX_COPIES = 64


def weight_bytes(w) -> int:
    """Bytes of a weight's arrays in memory (an int4 array holds two values per byte)."""
    return sum(array_bytes(a) for a in jax.tree.leaves(w))


def linear_fn(implementation: str, activation: str | None = None, config=None):
    """(x, w) -> x + 1e-30 x the sum of each row of the linear's output (the whole output
    read, so no implementation computes less than all of it; the result feeds the next call).
    activation "silu": w's rows are [gate; up] and the output silu(gate) * up. config: the
    kernel's (None: the backend's tuned table or heuristic)."""

    def fn(x, w):
        if implementation == "bf16":
            y = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
            if activation is not None:  # "silu", as the kernels' epilogue computes it
                gate, up = jnp.split(y, 2, axis=-1)
                y = jax.nn.silu(gate) * up
        else:
            y = wj.linear.quantized_matmul(
                x, w, activation=activation, implementation=implementation, config=config
            )
        return x + (jnp.sum(y.astype(jnp.float32), axis=1, keepdims=True) * 1e-30).astype(x.dtype)

    return fn


def weights_for(implementation: str, w: wj.QuantizedExperts, dtype):
    """w as `implementation` reads it: bf16 [N, K] for "bf16", else in its layout."""
    if implementation == "bf16":
        return wj.dequantize_experts(w, dtype=jnp.bfloat16)[0]
    layout = wj.linear.preferred_layout(w, dtype=dtype, implementation=implementation)
    return wj.layouts.to_kernel_layout(w, layout)


def random_weights(
    key, n, k, *, group_size, has_zeros, step_bytes, bits=4, dtype=jnp.bfloat16
):  # fmt: skip
    """Random [1, N, K] weights of `bits`, as many copies (2..MAX_COPIES) as make `step_bytes`."""

    def one(c):
        return wj.random_quantized_experts(
            jax.random.fold_in(key, c), (1, n, k), bits=bits, group_size=group_size,
            has_zeros=has_zeros, dtype=dtype,
        )  # fmt: skip

    first = one(0)
    copies = max(2, min(MAX_COPIES, math.ceil(step_bytes / weight_bytes(first))))
    return [first] + [one(c) for c in range(1, copies)]


def random_rows(key, m, k, copies, dtype=jnp.bfloat16):
    """One [m, K] input per weight copy."""
    return [jax.random.normal(jax.random.fold_in(key, 1000 + c), (m, k), dtype)
            for c in range(copies)]  # fmt: skip


def traced_us(run, calls) -> float:
    """us per call of a built model step (`make_model_step`), from a device trace: the span of
    the step's kernels over its calls."""
    trace, _ = profile_example.trace_run(run)
    return profile_example.summarize(profile_example.device_kernels(trace), calls)["span_us"]


def configs_to_time(impl, w, m, splits):
    """(splits, config) pairs of a row each: (None, None) (the config it runs today), or for
    the Mosaic GPU GEMM with `splits` given, that config with each of them."""
    if not splits or not impl.startswith("mgpu"):
        return [(None, None)]
    today = wj.gemm_config(w, m, implementation=impl)
    return [(s, dataclasses.replace(today, splits=s)) for s in splits]


def print_header(trace: bool) -> None:
    """The column names of `bench_shape`'s rows: us per call, MB read per call (weights and
    activations), that rate as a % of the copy ceiling, and with --trace the traced us."""
    traced = f" {'traced us':>9}" if trace else ""
    print(
        f"{'shape':>15} {'N':>6} {'K':>6} {'M':>5} {'implementation':>16} {'us':>9} "
        f"{'MB read':>8} {'%copy':>6}{traced}",
        flush=True,
    )


def bench_shape(name, n, k, activation, ms, implementations, args, copy_bps):
    """The rows of one shape: each implementation at each M (and each of args.splits)."""
    dtype = jnp.bfloat16
    key = jax.random.key(args.seed)
    ws = random_weights(
        key, n, k, group_size=args.group_size, has_zeros=not args.no_zp,
        step_bytes=args.step_bytes, dtype=dtype,
    )  # fmt: skip
    copies = len(ws)
    rows = []
    print_header(args.trace)
    for impl in implementations:
        try:
            held = [weights_for(impl, w, dtype) for w in ws]
        except (ValueError, NotImplementedError) as err:
            print(f"{name} {impl}: cannot run ({err})", file=sys.stderr)
            continue
        step_bytes = weight_bytes(held[0])
        for m in ms:
            for splits, config in configs_to_time(impl, held[0], m, args.splits):
                sets = list(zip(random_rows(key, m, k, copies, dtype), held, strict=True))
                fn = linear_fn(impl, activation, config)
                label = "" if splits is None else f" splits={splits}"
                try:
                    run, calls = make_model_step(fn, sets)
                    seconds = time_step(run, calls, repeats=args.repeats)
                    trace_us = traced_us(run, calls) if args.trace else None
                except (ValueError, NotImplementedError) as err:
                    print(f"{name} {impl} M={m}{label}: cannot run ({err})", file=sys.stderr)
                    continue
                read = step_bytes + m * k * 2 + m * (n // 2 if activation else n) * 2
                rows.append(dict(
                    shape=name, N=n, K=k, M=m, implementation=impl, splits=splits, seconds=seconds,
                    bytes=read, copy_fraction=read / seconds / copy_bps, weight_copies=copies,
                    trace_us=trace_us,
                ))  # fmt: skip
                traced = "" if trace_us is None else f" {trace_us:9.1f}"
                print(
                    f"{name:>15} {n:>6} {k:>6} {m:>5} {impl + label:>16} "
                    f"{seconds * 1e6:9.1f} {read / 1e6:8.2f} "
                    f"{100 * rows[-1]['copy_fraction']:6.1f}{traced}",
                    flush=True,
                )
    return rows


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.setup_parser(p)
    table = SHAPES if on_gpu else TINY_SHAPES
    p.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES | TINY_SHAPES), default=sorted(table),
        help="linears to time (default: DeepSeek-V3's on a GPU, tiny ones on a CPU)",
    )  # fmt: skip
    p.add_argument(
        "--implementation", "--implementations", dest="implementations", nargs="+",
        default=["mgpu", "pallas", "xla", "bf16"] if on_gpu else ["mgpu_interpret", "xla", "bf16"],
        help="backends with a grouped GEMM, or bf16 (a dense bf16 weight and a plain dot)",
    )  # fmt: skip
    p.add_argument(
        "--m", type=arg_types.positive_int, nargs="+", default=[1, 8, 64], help="rows (tokens)"
    )
    p.add_argument(
        "--group-size",
        type=arg_types.group_size,
        default=128,
        help="quantization group (default 128; -1 = per channel)",
    )
    p.add_argument("--no-zp", action="store_true", help="symmetric weights (no zero points)")
    p.add_argument(
        "--repeats",
        type=arg_types.positive_int,
        default=5 if on_gpu else 1,
        help="timed runs per row, median taken (default 5; 1 on CPU)",
    )
    p.add_argument(
        "--step-bytes", type=arg_types.non_negative_int, default=STEP_WEIGHT_BYTES if on_gpu else 0,
        help="weight bytes per timed step: copies of each weight (2..64) to make them",
    )  # fmt: skip
    p.add_argument(
        "--splits",
        type=arg_types.positive_int,
        nargs="+",
        default=None,
        help="mgpu implementations: a row per K split count (MgpuConfig.splits on the config "
        "the linear runs today; each must divide its k-steps); default: the linear's own rule",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also time each row from a device trace (the step's kernels per call, first start "
        "to last end): steadier than wall-clock time for 5-60 us kernels",
    )
    p.add_argument(
        "--seed",
        type=arg_types.non_negative_int,
        default=0,
        help="seed of the random weights and inputs (default 0)",
    )
    p.add_argument("--json", type=str, default=None, help="write the results here")
    args = p.parse_args(argv)
    for m in args.m:
        if m < 1:
            p.error(f"--m {m}: rows must be positive")
    copy_bps, mm_flops = measure_ceilings(on_gpu, args.repeats)
    print(
        f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; copy ceiling "
        f"{copy_bps / 1e12:.2f} TB/s; bf16 matmul {cli.figure(mm_flops / 1e12)} TFLOP/s",
        flush=True,
    )
    rows = []
    for name in args.shapes:
        n, k, activation = (SHAPES | TINY_SHAPES)[name]
        rows += bench_shape(name, n, k, activation, args.m, args.implementations, args, copy_bps)
    result = dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, copy_bytes_per_s=copy_bps,
        matmul_flops_per_s=mm_flops, rows=rows,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    cli.run(main)
