"""What one DeepSeek-V3 decode step spends, kernel by kernel, from a device trace.

The model is built as examples/generate.py builds it (the same flags after ours), then
`generate` runs under `jax.profiler.trace` twice: with 2 new tokens (the prefill and a decode
loop of one step) and with 2 + --steps. The difference of the two traces' launches, divided by
--steps, is the kernels one loop iteration launches; the longer trace holds 1 + --steps such
iterations back to back, the same kernel names in the same order each time (copies aside,
`COPY_EVENTS`), and a step's
kernels are their mean (`loop_step`): names within one compiled program, so each row is one
kernel of the loop. Where the iterations differ (on the H200 some kernels come a fractional
number of times per step) the longer trace's last --steps iterations are cut at an anchor
instead, a long kernel launched once per step (`anchored_iterations`: the lm_head's GEMM in a
decode step), and a step is their mean. Where neither is found the rows fall back to the
difference of the two traces per kernel name (`per_step`), which can pair different kernels:
XLA numbers the fusions of each compiled program on its own (the two calls' decode loops have
different trip counts, so two programs).

    python examples/profile_decode.py --steps 8 --full-width-layers 8 --batch-size 1

Printed: the untraced ms per step of the longer call (GenerateStats.step_s, as generate.py
prints it: the decode call's own work spread over its steps) beside the sum of the step's
kernels; the weight bytes a step reads at least (every non-expert weight, and
num_experts_per_tok routed experts per MoE layer: the batch-1 bytes; a batch reads more experts
the more its rows route apart) against the copy ceiling measured in the same run; then the
kernels, longest first: launches per step, us per step, their share, the kernel name. On a CPU
(the tiny default, kernels in the interpreters) the XLA CPU runtime's op events stand in for
the kernels: a check of this script, not a profile.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import profile as profile_example  # noqa: E402

import arg_types  # noqa: E402
import benchmark  # noqa: E402
import generate as generate_example  # noqa: E402

from models.common.generate import generate  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(this script's flags, examples/generate.py's flags for the model)."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every other flag is examples/generate.py's (the model, its layouts and "
        "implementations, --batch-size (one value), --prompt, --dtype, ...): see "
        "`python examples/generate.py --help`.",
    )
    p.add_argument(
        "--steps", type=arg_types.positive_int, default=4, help="decode steps traced (default 4)"
    )
    p.add_argument(
        "--top", type=arg_types.positive_int, default=25, help="kernels listed (default 25)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    p.add_argument(
        "--order",
        action="store_true",
        help="also list one loop iteration's kernels in launch order, each with its mean us "
        "over the traced iterations (each GEMM of the step on its own line; needs the loop "
        "iteration to be found)",
    )
    ours, rest = p.parse_known_args(argv)
    if ours.steps < 1:
        p.error(f"--steps must be >= 1, got {ours.steps}")
    model_args = generate_example.parse_args(rest)
    if len(model_args.batch_size) != 1:
        p.error(f"one --batch-size per profile, got {model_args.batch_size}")
    if model_args.mesh or model_args.float_weights:
        p.error("--mesh and --float-weights are not profiled here (one device, quantized)")
    return ours, model_args


def traced_kernels(run) -> list[dict]:
    """The device kernels (profile.device_kernels) of one call of `run`, traced."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        (path,) = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            return profile_example.device_kernels(json.load(f))


def totals(kernels: list[dict]) -> dict[str, list[float]]:
    """Per kernel name: [launches, us] over `kernels`."""
    out: dict[str, list[float]] = {}
    for k in kernels:
        n, t = out.get(k["name"], (0, 0.0))
        out[k["name"]] = [n + 1, t + k["dur"]]
    return out


def per_step(base: list[dict], more: list[dict], steps: int) -> list[dict]:
    """Per kernel name: launches and us of one decode step, from the kernels of a generate call
    and of one with `steps` more decode steps; longest first."""
    before, after = totals(base), totals(more)
    rows = []
    for name, (n, t) in after.items():
        n0, t0 = before.get(name, (0, 0.0))
        if n > n0:
            rows.append(dict(name=name, launches=(n - n0) / steps, us=(t - t0) / steps))
    return sorted(rows, key=lambda r: -r["us"])


def loop_start(names: list[str], period: int, iterations: int) -> int | None:
    """The index at which `names` holds `iterations` repetitions of one sequence of `period`
    names back to back (the last such run if several: the decode loop comes after the
    prefill), or None."""
    span = period * iterations
    for start in range(len(names) - span, -1, -1):
        if all(names[i] == names[i + period] for i in range(start, start + span - period)):
            return start
    return None


# Copies between kernels (CUDA memcpy / memset events): their count varies from one loop
# iteration to the next on the H200 (2.4 per step in one trace), so a loop's kernels repeat
# only without them.
COPY_EVENTS = ("memcpy", "memset")


def without_copies(kernels: list[dict]) -> list[dict]:
    return [k for k in kernels if not k["name"].lower().startswith(COPY_EVENTS)]


def loop_iterations(base: list[dict], more: list[dict], steps: int) -> list[list[dict]] | None:
    """The 1 + steps iterations of the decode loop in the kernels of the longer call (`more`;
    `base`: the call with a one-step loop, whose launch count sets the iteration's length), each
    its kernels in launch order, copies (COPY_EVENTS) left out; None where the launches do not
    split into equal iterations that repeat."""
    base, more = without_copies(base), without_copies(more)
    extra = len(more) - len(base)
    if extra <= 0 or extra % steps:
        return None
    period, iterations = extra // steps, steps + 1
    start = loop_start([k["name"] for k in more], period, iterations)
    if start is None:
        return None
    return [more[start + i * period : start + (i + 1) * period] for i in range(iterations)]


# Kernels within this fraction of an anchor candidate's duration count as its launches (the
# prefill's launch of the same GEMM takes longer; other kernels of its name far less).
ANCHOR_SHARE = 0.9
# The longest kernels tried as anchors, longest first.
ANCHOR_CANDIDATES = 16


def anchored_iterations(base: list[dict], more: list[dict], steps: int) -> list[list[dict]] | None:
    """The decode loop's last `steps` iterations in the longer call's kernels (`more`), cut at
    an anchor: the longest kernel (of the ANCHOR_CANDIDATES longest) whose launches of its name
    and at least ANCHOR_SHARE of its duration number exactly `steps` more in `more` than in
    `base` (one per decode step; a step's largest GEMM, the lm_head, at batch 1). Each
    iteration runs from after one launch of the anchor to the next, copies (COPY_EVENTS) left
    out; the iterations may differ. None where no kernel is such an anchor."""
    base, more = without_copies(base), without_copies(more)

    def launches(kernels, anchor):
        least = ANCHOR_SHARE * anchor["dur"]
        return [
            i for i, k in enumerate(kernels) if k["name"] == anchor["name"] and k["dur"] >= least
        ]

    for anchor in sorted(more, key=lambda k: -k["dur"])[:ANCHOR_CANDIDATES]:
        at = launches(more, anchor)
        if len(at) - len(launches(base, anchor)) == steps and len(at) > steps:
            at = at[-(steps + 1) :]
            return [more[a + 1 : b + 1] for a, b in zip(at, at[1:], strict=False)]
    return None


def per_name(iterations: list[list[dict]]) -> list[dict]:
    """Per kernel name: launches and us of one loop iteration, the mean of `iterations`;
    longest first."""
    loop = totals([k for it in iterations for k in it])
    n = len(iterations)
    rows = [dict(name=name, launches=c / n, us=t / n) for name, (c, t) in loop.items()]
    return sorted(rows, key=lambda r: -r["us"])


def loop_step(base: list[dict], more: list[dict], steps: int) -> list[dict] | None:
    """`per_name` of the decode loop's iterations (`loop_iterations`); None where there is no
    loop iteration."""
    iterations = loop_iterations(base, more, steps)
    return None if iterations is None else per_name(iterations)


def launch_order(iterations: list[list[dict]]) -> list[dict]:
    """One loop iteration's kernels in launch order: each position's name and its mean us over
    the iterations where they launch the same names in the same order, else the kernels of the
    iteration of the median launch count as they are."""
    names = {tuple(k["name"] for k in it) for it in iterations}
    if len(names) > 1:
        one = sorted(iterations, key=len)[len(iterations) // 2]
        return [dict(name=k["name"], us=k["dur"]) for k in one]
    return [
        dict(name=kernels[0]["name"], us=sum(k["dur"] for k in kernels) / len(kernels))
        for kernels in zip(*iterations, strict=True)
    ]


def main(argv=None) -> int:
    ours, args = parse_args(argv)
    model, tokenizer, what = generate_example.build_model(args)
    progress = not args.no_progress
    model = generate_example.prepare_model(
        model, args, args.linear_implementation, progress=progress
    )
    on_gpu = jax.default_backend() == "gpu"
    print(f"model: {what}")
    prompts = [tokenizer.encode(args.prompt)] * args.batch_size[0]

    def stats_of(new_tokens):  # runs generate
        _, stats = generate(
            model,
            prompts,
            max_new_tokens=new_tokens,
            pad_id=tokenizer.pad_id,
            seed=args.seed,
            return_stats=True,
        )
        return stats

    base, more = 2, 2 + ours.steps
    for n in (base, more):  # compile and load both programs before timing
        stats_of(n)
    step_s = min(stats_of(more).step_s for _ in range(3))
    base_kernels = traced_kernels(lambda: stats_of(base))
    more_kernels = traced_kernels(lambda: stats_of(more))
    iterations = loop_iterations(base_kernels, more_kernels, ours.steps)
    method = "one loop iteration, mean of the traced ones, copies left out"
    if iterations is None:
        iterations = anchored_iterations(base_kernels, more_kernels, ours.steps)
        method = "one loop iteration, mean of the last ones cut at a long kernel, copies left out"
    if iterations is not None:
        rows = per_name(iterations)
    else:
        rows = per_step(base_kernels, more_kernels, ours.steps)
        method = "the two traces' difference per kernel name (no loop iteration found)"
    step_us = sum(r["us"] for r in rows)
    launches = sum(r["launches"] for r in rows)
    copy_bps, _ = benchmark.measure_ceilings(on_gpu, repeats=3)
    nbytes = generate_example.step_bytes(model)
    floor_us = nbytes / copy_bps * 1e6
    print(f"batch {args.batch_size[0]}, {ours.steps} decode steps traced")
    print(f"  kernels per step:  {step_us:.1f} us in {launches:.0f} launches ({method})")
    print(f"  step, untraced:    {step_s * 1e6:.1f} us")
    print(f"  weights per step:  {nbytes / 1e9:.3f} GB")
    print(f"  copy ceiling:      {copy_bps / 1e12:.2f} TB/s (measured now)")
    print(f"  read-time floor:   {floor_us:.1f} us (the weights at the copy ceiling)")
    # 100%: the kernels take no longer than reading the weights once at the copy ceiling.
    print(f"  floor / kernels:   {100 * floor_us / step_us:.0f}%")
    print(f"{'launches':>8} {'us/step':>9} {'share':>6}  kernel")
    for r in rows[: ours.top]:
        print(f"{r['launches']:8.1f} {r['us']:9.1f} {100 * r['us'] / step_us:5.1f}%  {r['name']}")
    rest = rows[ours.top :]
    if rest:
        rest_us = sum(r["us"] for r in rest)
        print(f"{'':8} {rest_us:9.1f} {100 * rest_us / step_us:5.1f}%  ({len(rest)} others)")
    order = launch_order(iterations) if iterations is not None else None
    if ours.order:
        if order is None:
            print("launch order: no loop iteration found in the trace")
        else:
            print(f"one loop iteration in launch order ({len(order)} kernels):")
            for i, r in enumerate(order):
                print(f"{i:5d} {r['us']:9.1f}  {r['name']}")
    if ours.json:
        with open(ours.json, "w") as f:
            record = dict(
                model=what,
                batch_size=args.batch_size[0],
                steps=ours.steps,
                kernel_us_per_step=step_us,
                method=method,
                step_us=step_s * 1e6,
                weight_bytes_per_step=nbytes,
                copy_bytes_per_s=copy_bps,
                device=str(jax.devices()[0].device_kind),
                jax=jax.__version__,
                kernels=rows,
                launch_order=order,
            )
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
