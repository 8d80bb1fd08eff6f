"""Times the 'mgpu' backend (pallas_kernels/mosaic_gpu/fused_moe.py, the Mosaic GPU int4 GEMM)
against the 'pallas' backend on the benchmark's workload, in one run on one GPU.

For each M it times `fused_moe(..., implementation="pallas")` (the package's configs),
`implementation="mgpu"` (its default config for M), the same with the opt-in block choice at run
time (`config=ByRouting()`; the row names the block_m picked for each input set) and the mgpu
layer at its default config through the kernels' entry, on the same
weights, converted once to the mgpu_int4 layout for mgpu (not timed); with --search also
every candidate (block_m, block_k, stages, consumer warpgroups, K splits); then GEMM1 and
GEMM2 alone at the best config. Same timing method as benchmark.py (jitted loop over 4 rotated
input sets, median of repeats). A candidate that fails to compile is reported with its error
and skipped. --chain adds the layers back to back (pallas, the mgpu layer and the block
choice by routing); --straight N adds the model-step figures (N calls written out in one jit,
the GEMMs alone also traced); --gemms-only times the GEMMs alone and no layer; --lower-only
runs nothing and checks on any machine that each config's GEMMs lower for sm_90.

    python examples/mgpu_probe.py --m 1 16 256 4096 --json out/mgpu.json
    python examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 1 16 --no-zp
    python examples/mgpu_probe.py --m 1 16 --chain --chain-unroll 8
    python examples/mgpu_probe.py --lower-only --m 1 --configs default:down_stages=6
    python examples/mgpu_probe.py --preset deepseek-v3-tp8 --m 4 --gemms-only 1 --straight 16 \
        --configs default:splits=1 default:splits=2
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from dataclasses import astuple

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import benchmark  # noqa: E402
import kernel_timeline  # noqa: E402

import wna16_jax as wj  # noqa: E402
from pallas_kernels.mosaic_gpu import config as mgpu_config
from pallas_kernels.mosaic_gpu import fused_moe as mgpu_fused_moe  # noqa: E402
from pallas_kernels.mosaic_gpu.config import MgpuConfig  # noqa: E402


def candidates(rows: float, group: int) -> list[MgpuConfig]:
    """Configs to try for `rows` rows per used expert: block_m around it; no warp
    specialization or a producer with 1-2 consumer warpgroups; K splits for few rows; k-steps
    of one group (block_k 128 where it divides the group: 64 lost to 128 at every M in session
    4) or of two (256: fewer, larger copies per step); 4 stages (2 and 6-8 changed nothing in
    sessions 4-6) except where 4 would not fit in shared memory, and 2 with k-steps of two
    groups for up to 4 rows (8-row blocks: the default's GEMM1 since session 24)."""
    bk = mgpu_config.one_group_block_k(group)
    # (block_k, stages, consumers, splits) per block_m; splits None: auto_splits
    if rows <= 1:
        bms = [8]
        variants = [(bk, 4, 0, None), (bk, 4, 0, 8), (2 * group, 4, 0, None), (bk, 8, 2, 1),
                    (4 * group, 4, 0, None), (4 * group, 2, 0, None),
                    (2 * group, 2, 0, None)]  # fmt: skip
    elif rows <= 4:
        bms, variants = [8, 16], [(bk, 4, 0, None), (bk, 4, 0, 2), (2 * group, 4, 0, None),
                                  (2 * group, 2, 0, None)]  # fmt: skip
    elif rows <= 64:
        bms, variants = [16, 32, 64], [(bk, 4, 0, None), (bk, 4, 2, None), (2 * group, 3, 2, None)]
    else:
        bms, variants = [64, 128], [(bk, 4, 2, None), (bk, 4, 1, None), (2 * group, 3, 2, None),
                                    (2 * group, 2, 2, None), (2 * group, 3, 1, None),
                                    (4 * group, 2, 2, None)]  # fmt: skip
    configs = (
        MgpuConfig(bm, k, min(st, 3) if bm * k > 64 * 128 and c == 2 else st, c, s)
        for bm in bms
        for k, st, c, s in variants
    )
    return list(dict.fromkeys(configs))


@dataclasses.dataclass(frozen=True)
class DefaultWith:
    """A --configs entry "default:field=value,...": the default config of each M with these
    fields replaced."""

    changes: tuple[tuple[str, object], ...]

    def at(self, default: MgpuConfig) -> MgpuConfig:
        return dataclasses.replace(default, **dict(self.changes))


def parse_default_with(text: str) -> DefaultWith:
    """ "default:down_stages=2,narrow_blocks=0" -> DefaultWith: ints, '-' for None, 0/1 for
    the bool fields."""
    fields = {f.name: f for f in dataclasses.fields(MgpuConfig)}
    changes = []
    for item in filter(None, text.partition(":")[2].split(",")):
        name, _, value = item.partition("=")
        if name not in fields:
            raise argparse.ArgumentTypeError(f"bad config {text!r}: no MgpuConfig field {name!r}")
        parsed = None if value == "-" else int(value)
        if fields[name].type in (bool, "bool"):
            parsed = bool(parsed)
        changes.append((name, parsed))
    return DefaultWith(tuple(changes))


def parse_config(text: str) -> MgpuConfig | DefaultWith:
    """ "8,256,4,0,-,128,0" -> MgpuConfig(8, 256, 4, 0, None, 128, False): fields in order,
    '-' for None; "default:name=value,..." -> DefaultWith."""
    if text == "default" or text.startswith("default:"):
        return parse_default_with(text)
    try:
        fields = [None if v == "-" else int(v) for v in text.split(",")]
        if len(fields) > 6:  # fuse_activation
            fields[6] = bool(fields[6])
        if len(fields) > 12 and fields[12] is None:  # narrow_blocks
            fields[12] = 0
        if len(fields) > 13:  # bf16_down_rows
            fields[13] = bool(fields[13])
        if len(fields) > 14:  # direct_token
            fields[14] = bool(fields[14])
        if len(fields) > 15:  # bf16_weights
            fields[15] = bool(fields[15])
        return MgpuConfig(*fields)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"bad config {text!r}: {err}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(benchmark.PRESETS), default="deepseek-v3")
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--no-zp", action="store_true", help="symmetric weights (no zero points)")
    p.add_argument(
        "--zp8",
        action="store_true",
        help="--no-zp's symmetric weights stored with zero points of 8: the zero-point path on "
        "the same data (the same quantized values and scales as --no-zp and the default)",
    )
    p.add_argument(
        "--routing",
        choices=("uniform", "identical"),
        default="uniform",
        help="uniform: each token picks k distinct experts at random (the benchmark's); "
        "identical: every token of a set picks the first token's experts, as a batch of one "
        "prompt decoded greedily does (all M*k rows on k experts)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--search",
        action="store_true",
        help="also time candidate configs (block_m, block_k, stages, consumers, splits) besides "
        "the default",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        type=parse_config,
        default=[],
        metavar="BM,BK,STAGES,CONSUMERS,SPLITS,BLOCK_N,FUSE_ACTIVATION,DOWN_BLOCK_N,DOWN_STAGES,"
        "DOWN_BLOCK_K,TILES,DOWN_TILES,NARROW_BLOCKS,BF16_DOWN_ROWS,DIRECT_TOKEN,BF16_WEIGHTS "
        "| default:FIELD=VALUE,...",
        help="also time these configs (MgpuConfig's fields in order, '-' for None; trailing "
        "fields may be left out), e.g. 64,128,4,2,-,128: two consumer warpgroups of 128 "
        "features each; 8,256,4,0,-,64,0: GEMM1 without the fused activation; "
        "64,256,3,2,-,64,1,128,2: GEMM2 at 128 features per consumer and 2 stages; "
        "64,256,3,2,-,64,1,128,2,-,-,-,2: and blocks narrowed to half or a quarter of their "
        "rows where they use no more; 64,256,3,2,-,64,1,128,2,-,-,-,2,1: and GEMM2's rows "
        "rounded to bf16; 8,256,3,0,-,64,1,-,-,-,-,-,1,0,1: one token's GEMM1 on the token's "
        "row itself and the router's ids as block experts; 128,128,3,2,-,64,1,128,2,-,-,-,3,0,0,1: "
        "128-row blocks on weights rounded to bf16; default:down_stages=4: each M's default "
        "config with these fields replaced (MgpuConfig's field names)",
    )
    p.add_argument(
        "--chain",
        action="store_true",
        help="also time the pallas layer, the mgpu layer at its default config and the mgpu "
        "backend with its block choice by routing (ByRouting) chained: each call's input the "
        "previous call's output, 4 input sets in turn (layers back to back; no sum of each "
        "output and no loop counter per call: benchmark.make_loop)",
    )
    p.add_argument(
        "--straight",
        type=int,
        default=0,
        metavar="N",
        help="also time the mgpu backend (fused_moe at its defaults) and the mgpu layer at its "
        "default config with N calls written out in one jit, no loop, one input set per call, "
        "each call's input the previous call's output (a model step's layers as the model runs "
        "them), steps queued back to back: the marginal time of a queued step per call "
        "(benchmark.time_straight; N >= 2); the GEMMs timed alone likewise, N calls on N "
        "routings, each made to wait for the last through its block experts (one small "
        "kernel per call), and on a GPU also traced (the span per call and its kernels)",
    )
    p.add_argument(
        "--chain-unroll",
        type=int,
        default=1,
        metavar="N",
        help="with --chain, also time the mgpu layer and the choice by routing chained with N "
        "passes over the input sets per loop iteration (4 N calls): the loop's wait on the "
        "host for its condition, once per iteration, spread over more calls",
    )
    p.add_argument(
        "--all-gemms",
        action="store_true",
        help="time GEMM1 and GEMM2 alone at the default and every --configs / --search config "
        "(default: at the fastest only)",
    )
    p.add_argument(
        "--gemms-only",
        nargs="*",
        type=int,
        choices=(1, 2),
        metavar="GEMM",
        help="time no layer: only the GEMMs alone (these: 1, 2; none named: both) at the "
        "default and every --configs / --search config, e.g. a K-split sweep of GEMM1 "
        "(--gemms-only 1)",
    )
    p.add_argument(
        "--lower-only",
        action="store_true",
        help="run nothing: lower both GEMMs of each M's default and --configs / --search config "
        "for sm_90 at the preset's shapes (no GPU needed) and say which lower and which fail, "
        "e.g. to check a device script's configs before a call",
    )
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--iters", type=int, help="calls per timed loop (default: 100, 20 for M > 256)")
    p.add_argument(
        "--warmup-s", type=float, default=0.0,
        help="run each timed loop this many seconds before timing it: the GPU's clock settles "
        "where sustained decoding puts it (power-capped from M=16 on the H200); default 0: "
        "short bursts, as sessions 4-19 timed",
    )  # fmt: skip
    p.add_argument(
        "--interpret",
        action="store_true",
        help="run the kernels in the Mosaic GPU interpreter (a CPU check of this script; the "
        "times mean nothing)",
    )
    args = p.parse_args(argv)
    if args.chain_unroll < 1:
        p.error(f"--chain-unroll must be at least 1, got {args.chain_unroll}")
    if args.straight == 1 or args.straight < 0:
        p.error(f"--straight must be 0 (off) or at least 2, got {args.straight}")
    logging.basicConfig(level=logging.WARNING)
    if args.lower_only:
        return 0 if _lower_only(args) else 1
    if jax.default_backend() != "gpu" and not args.interpret:
        raise SystemExit("mgpu_probe.py times compiled Mosaic GPU kernels: it needs an sm_90 GPU "
                         "(or --interpret)")  # fmt: skip
    interpret = args.interpret
    mgpu = "mgpu_interpret" if interpret else "mgpu"

    e, top_k, h, i, g = benchmark.PRESETS[args.preset]
    if args.zp8 and args.no_zp:
        p.error("--zp8 stores symmetric weights with zero points: leave out --no-zp")
    has_zp = not args.no_zp
    key = jax.random.key(0)
    w13, w2 = benchmark.probe_experts(key, args.preset, has_zp=has_zp and not args.zp8)
    if args.zp8:  # zero points of 8 (two nibbles a byte): w = (q - 8) * s, as without them
        w13, w2 = (dataclasses.replace(w, zeros=_zeros_of_8(w)) for w in (w13, w2))
    to_mgpu = functools.partial(wj.layouts.to_kernel_layout, layout="mgpu_int4")
    w13p, w2p = jax.block_until_ready((to_mgpu(w13), to_mgpu(w2)))
    copy_bps, mm_flops = benchmark.measure_ceilings(not interpret, args.repeats)
    print(f"{args.preset} zp={'8' if args.zp8 else has_zp}: copy {copy_bps / 1e12:.2f} TB/s, "
          f"matmul {mm_flops / 1e12:.1f} TFLOP/s", flush=True)  # fmt: skip
    rows = []
    for m in args.m:
        xs, tws, idss = benchmark.probe_inputs(key, args.preset, m)
        if args.routing == "identical":
            idss = jnp.broadcast_to(idss[:, :1], idss.shape)
        sets = [(xs[s], tws[s], idss[s]) for s in range(4)]
        touched = benchmark.experts_touched(idss)
        bytes1, bytes2 = (benchmark.weight_bytes(w, 1) * touched for w in (w13, w2))
        flops1, flops2 = 2.0 * m * top_k * 2 * i * h, 2.0 * m * top_k * h * i
        iters = args.iters or benchmark.default_iters(m)
        timing = dict(iters=iters, repeats=args.repeats, host=False, warmup_s=args.warmup_s)

        keys = dict(preset=args.preset, zp="8" if args.zp8 else has_zp, M=m, routing=args.routing)
        record = functools.partial(_record, rows, keys, copy_bps, mm_flops)
        layer = dict(weight_bytes=bytes1 + bytes2, flops=flops1 + flops2)
        configs = mgpu_fused_moe.routed_configs(m, top_k, e, h if g == -1 else g, i)
        chosen = configs[0]  # the default: the backend's config for m tokens
        searched, given = _asked_configs(args, m, chosen)
        straight_sets = None
        if args.straight:  # one set per call, never repeated (benchmark.make_straight)
            n = args.straight
            sxs, stws, sidss = benchmark.probe_inputs(jax.random.fold_in(key, 5), args.preset, m, n)
            straight_sets = [(sxs[s], stws[s], sidss[s]) for s in range(n)]
            straight_work = (bytes1 + bytes2) / touched * benchmark.experts_touched(sidss)
        gemms = functools.partial(
            _time_gemms, record, xs[0], idss[0], w13p, w2p, key=key, interpret=interpret,
            work=(bytes1, flops1, bytes2, flops2), timing=timing, straight_sets=straight_sets,
            repeats=args.repeats, warmup_s=args.warmup_s, which=args.gemms_only or (1, 2),
        )  # fmt: skip
        if args.gemms_only is not None:
            for cfg in dict.fromkeys([chosen, *searched, *given]):
                gemms(cfg)
            continue

        pallas = lambda a, b, x, tw, ids: wj.fused_moe(  # noqa: E731
            x, a, b, tw, ids, implementation="xla" if interpret else "pallas"
        )
        t, _ = benchmark.time_loop(pallas, sets, consts=(w13, w2), **timing)
        record("pallas layer", "package", t, **layer)
        backend = lambda a, b, x, tw, ids, mgpu=mgpu: wj.fused_moe(  # noqa: E731
            x, a, b, tw, ids, implementation=mgpu
        )
        t, _ = benchmark.time_loop(backend, sets, consts=(w13p, w2p), **timing)
        record("mgpu backend", f"{chosen.block_m} rows", t, **layer)
        # The opt-in block choice at run time (an XLA conditional where there is a choice)
        by_routing = lambda a, b, x, tw, ids, mgpu=mgpu: wj.fused_moe(  # noqa: E731
            x, a, b, tw, ids, implementation=mgpu, config=mgpu_fused_moe.ByRouting()
        )
        t, _ = benchmark.time_loop(by_routing, sets, consts=(w13p, w2p), **timing)
        picked = [configs[int(mgpu_fused_moe.pick_config(s[2], e, configs))] for s in sets]
        blocks = "/".join(str(c.block_m) for c in picked) + " rows"
        record("backend by routing", blocks, t, **layer)
        # The default config through the kernels' entry, as the search's rows run.
        fn = functools.partial(_layer, config=chosen, interpret=interpret)
        t, _ = benchmark.time_loop(fn, sets, consts=(w13p, w2p), **timing)
        record("mgpu layer", astuple(chosen), t, **layer)
        best = (t, chosen)
        if args.chain:
            t, _ = benchmark.time_loop(pallas, sets, consts=(w13, w2), chain=True, **timing)
            record("pallas chained", "package", t, **layer)
            t, _ = benchmark.time_loop(fn, sets, consts=(w13p, w2p), chain=True, **timing)
            record("mgpu chained", astuple(chosen), t, **layer)
            # the opt-in choice back to back: where there is a choice, an XLA conditional (a
            # wait on the host) per layer
            t, _ = benchmark.time_loop(by_routing, sets, consts=(w13p, w2p), chain=True, **timing)
            record("by routing chained", blocks, t, **layer)
            if args.chain_unroll > 1:
                x = args.chain_unroll
                for what, f, config in (
                    ("mgpu", fn, astuple(chosen)),
                    ("by routing", by_routing, blocks),
                ):
                    t, _ = benchmark.time_loop(
                        f, sets, consts=(w13p, w2p), chain=True, unroll=x, **timing
                    )
                    record(f"{what} chained x{x}", config, t, **layer)
        if straight_sets:
            swork = dict(weight_bytes=straight_work, flops=layer["flops"])
            for what, f, config in (
                ("backend", backend, f"{chosen.block_m} rows"),
                ("mgpu", fn, astuple(chosen)),
            ):
                t = benchmark.time_straight(
                    f, straight_sets, consts=(w13p, w2p), repeats=args.repeats,
                    warmup_s=args.warmup_s,
                )  # fmt: skip
                record(f"{what} straight x{len(straight_sets)}", config, t, **swork)
        for cfg in dict.fromkeys(searched + given):
            fn = functools.partial(_layer, config=cfg, interpret=interpret)
            t0 = time.perf_counter()
            try:
                t, _ = benchmark.time_loop(fn, sets, consts=(w13p, w2p), **timing)
            except Exception as err:  # report, go on
                msg = str(err).strip().splitlines()
                print(f"M={m:<5} mgpu layer     {astuple(cfg)!s:<22} FAILED "
                      f"({time.perf_counter() - t0:.0f} s): {msg[:1]} ... {msg[-3:]}",
                      flush=True)  # fmt: skip
                rows.append(dict(M=m, what="mgpu layer", config=astuple(cfg), error="\n".join(msg)))
                continue
            record("mgpu layer", astuple(cfg), t, **layer)
            if t < best[0]:
                best = (t, cfg)
        # The two GEMMs alone as the layer runs them, at the best config (--all-gemms: at each).
        timed = [chosen, *dict.fromkeys(searched + given)] if args.all_gemms else [best[1]]
        for cfg in timed:
            gemms(cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                           date=time.strftime("%Y-%m-%d"), copy_bps=copy_bps,
                           matmul_flops=mm_flops, warmup_s=args.warmup_s, rows=rows), f,
                      indent=1)  # fmt: skip
    return 0


def _zeros_of_8(w: wj.QuantizedExperts):
    """uint8 [E, N/2, K/G] zero points, all 8 (int4 pairs: 0x88)."""
    e, n, k = w.shape
    return jnp.full((e, n // 2, k // w.group), 0x88, jnp.uint8)


def _gemm_inputs(cfg, x, ids, num_experts: int, i: int, key, interpret):
    """(GEMM1's rows, GEMM2's rows, block experts, rows in use) as the layer gives them at cfg
    for x routed by ids (GEMM2's rows random activations)."""
    block_experts, x_rows, _, in_use = mgpu_fused_moe.aligned_blocks(
        x, ids, num_experts=num_experts, block_m=cfg.block_m, expert_map=None,
        interpret=interpret,
    )  # fmt: skip
    act_rows = jax.random.normal(key, (x_rows.shape[0], i), jnp.bfloat16)
    return x_rows, act_rows, block_experts, cfg.gemm_rows_in_use(in_use)


def _time_gemms(
    record, x, ids, w13p, w2p, cfg, *, key, interpret, work, timing, straight_sets, repeats,
    warmup_s, which=(1, 2),
):  # fmt: skip
    """Times GEMM1 and GEMM2 alone as the layer runs them at cfg (GEMM1 with the activation,
    fused where the config fuses it; GEMM2's rows in the layer's dtype for a bf16 output; the
    rows in use with narrow blocks), on x's rows (GEMM2 on random activations), in a loop; with
    straight_sets (one (x, weights, ids) per call) also one call per set written out in one jit,
    each call after the last (`_after_last_gemm`): the marginal queued step
    (benchmark.time_straight) and, on a GPU, the traced span per call with its kernels
    (kernel_timeline). A straight figure's bytes are those of the loop's set
    (the same M; the routings differ). which: the GEMMs to time (1, 2)."""
    e, i = w13p.num_experts, w2p.shape[2]
    bytes1, flops1, bytes2, flops2 = work
    x_rows, act_rows, block_experts, in_use = _gemm_inputs(cfg, x, ids, e, i, key, interpret)
    straight = [
        _gemm_inputs(cfg, sx, sids, e, i, jax.random.fold_in(key, n), interpret)
        for n, (sx, _, sids) in enumerate(straight_sets or [])
    ]
    gemm = mgpu_fused_moe.block_gemm(cfg, interpret)
    down_rows = mgpu_fused_moe.down_rows_dtype(cfg, jnp.bfloat16, None)
    for number, w, act, out, weight_bytes, flops in (
        (1, w13p, jnp.bfloat16, None, bytes1, flops1),
        (2, w2p, None, down_rows, bytes2, flops2),
    ):
        if number not in which:
            continue
        what, rows = f"mgpu GEMM{number}", number - 1

        def fn(w, a, ex, used, act=act, out=out):
            return gemm(a, w, ex, used, activation_dtype=act, out_dtype=out)

        a = (x_rows, act_rows)[rows]
        t, _ = benchmark.time_loop(fn, [(a, block_experts, in_use)], consts=(w,), **timing)
        record(what, astuple(cfg), t, weight_bytes=weight_bytes, flops=flops)
        if not straight:
            continue
        sets = [(s[rows], s[2], s[3]) for s in straight]
        work = dict(weight_bytes=weight_bytes, flops=flops)
        t = benchmark.time_straight(
            fn, sets, consts=(w,), link=_after_last_gemm, repeats=repeats, warmup_s=warmup_s
        )
        record(f"{what} straight x{len(sets)}", astuple(cfg), t, **work)
        if interpret:  # no device trace on the CPU
            continue
        trace, calls = kernel_timeline.trace_loop(
            fn, sets, consts=(w,), calls=len(sets), chain=True, straight=True,
            link=_after_last_gemm,
        )  # fmt: skip
        s = kernel_timeline.summarize(kernel_timeline.device_kernels(trace), calls)
        record(f"{what} traced x{calls}", astuple(cfg), s["span_us"] * 1e-6, **work)
        for r in s["kernels"][:4]:
            print(f"      {r['per_call']:5.2f} / call {r['total_us_per_call']:7.1f} us (idle "
                  f"before {r['idle_before_us_per_call']:4.1f})  {r['name'][:70]}")  # fmt: skip


def _after_last_gemm(args, out):
    """A GEMM's straight-run link (benchmark.make_straight): its block experts made to depend on
    the previous GEMM's output (one small kernel per call; nothing changes unless the output
    holds a NaN), so the calls run one after another, as a model's layers do."""
    a, block_experts, in_use = args
    first = out.reshape(-1)[0]
    return a, block_experts + (first != first).astype(block_experts.dtype), in_use


def _record(rows, keys, copy_bps, mm_flops, what, config, seconds, *, weight_bytes, flops):
    """One timed row; weight_bytes and flops are those of what was timed (the layer's, or one
    GEMM's), against the run's copy and matmul ceilings."""
    rows.append(dict(keys, what=what, config=config, seconds=seconds, weight_bytes=weight_bytes,
                     flops=flops))  # fmt: skip
    pct = weight_bytes / seconds / copy_bps * 100
    tflops = flops / seconds / 1e12
    print(f"M={keys['M']:<5} {what:<14} {config!s:<22} {seconds * 1e6:10.1f} us "
          f"({pct:5.1f}% of copy, {tflops:6.1f} TFLOP/s = {flops / seconds / mm_flops:5.1%} "
          f"of matmul)", flush=True)  # fmt: skip


def _asked_configs(args, m: int, default: MgpuConfig):
    """(--search's candidates, the --configs) at M=m, "default:..." entries resolved against
    m's default config."""
    e, top_k, h, _, g = benchmark.PRESETS[args.preset]
    rows_per_expert = m if args.routing == "identical" else m * top_k / e
    searched = candidates(rows_per_expert, h if g == -1 else g) if args.search else []
    given = [c.at(default) if isinstance(c, DefaultWith) else c for c in args.configs]
    return searched, given


def _lower_only(args) -> bool:
    """--lower-only: both GEMMs of each config as the layer runs them (mgpu_config.gemm_plan)
    at the preset's DeepSeek-V3-sized shapes, lowered for the "cuda" platform from shapes alone
    (no weights made, no GPU): what lowers, and each failure's first line. True if all lower.
    The lowering checks the shared memory the kernel takes; ptxas (registers) and the run
    are checked only on a GPU."""
    e, top_k, h, i, g = benchmark.PRESETS[args.preset]
    group = h if g == -1 else g

    def experts(n, k):
        scales = jax.ShapeDtypeStruct((e, k // group, n), jnp.bfloat16)
        return wj.QuantizedExperts(
            jax.ShapeDtypeStruct((e, n // 64, k // 64, 64, 64), jnp.int4), scales,
            None if args.no_zp else scales, bits=4, group_size=g, layout="mgpu_int4",
        )  # fmt: skip

    w13, w2 = experts(2 * i, h), experts(h, i)
    all_lower = True
    for m in args.m:
        chosen = mgpu_fused_moe.routed_configs(m, top_k, e, group, i)[0]
        searched, given = _asked_configs(args, m, chosen)
        for cfg in dict.fromkeys([chosen, *searched, *given]):
            for what, verdict in _lowered_gemms(cfg, m, top_k, e, w13, w2):
                all_lower &= not verdict.startswith("FAILED")
                print(f"M={m:<5} {what} {astuple(cfg)!s:<22} {verdict}", flush=True)
    return all_lower


def _lowered_gemms(cfg, m, top_k, e, w13, w2):
    """(GEMM name, verdict) of each GEMM the layer runs at cfg for m tokens, lowered for sm_90:
    "lowers (...)" with its options, or "FAILED: <first line>" (from the plan or the GEMM)."""
    from pallas_kernels.mosaic_gpu.wna16_gemm import mgpu_wna16_gemm

    h = w13.shape[2]
    try:
        blocks = jax.eval_shape(
            functools.partial(
                mgpu_fused_moe.aligned_blocks, num_experts=e, block_m=cfg.block_m,
                expert_map=None, interpret=False,
            ),
            jax.ShapeDtypeStruct((m, h), jnp.bfloat16), jax.ShapeDtypeStruct((m, top_k), jnp.int32),
        )[0].shape[0]  # fmt: skip
    except Exception as err:  # report, go on
        yield "layer", f"FAILED: {str(err).strip().splitlines()[0][:160]}"
        return
    for what, w, act in (("GEMM1", w13, jnp.bfloat16), ("GEMM2", w2, None)):
        try:
            _, _, _, options = mgpu_config.gemm_plan(cfg, w, blocks, act)
            rows = jax.ShapeDtypeStruct((blocks * cfg.block_m, w.shape[2]), jnp.bfloat16)
            experts = jax.ShapeDtypeStruct((blocks,), jnp.int32)
            in_use = experts if cfg.narrow_steps() else None
            gemm = functools.partial(mgpu_wna16_gemm, **options)
            jax.jit(gemm).trace(rows, w, experts, in_use).lower(lowering_platforms=("cuda",))
        except Exception as err:  # report, go on
            yield what, f"FAILED: {str(err).strip().splitlines()[0][:160]}"
            continue
        yield (
            what,
            (
                f"lowers (tiles {options['tiles_per_program']}, block_n {options['block_n']}, "
                f"stages {options['max_concurrent_steps']}, splits {options['splits']})"
            ),
        )


def _layer(w13p, w2p, x, tw, ids, *, config, interpret):
    return mgpu_fused_moe.fused_moe(x, w13p, w2p, tw, ids, config=config, interpret=interpret)


if __name__ == "__main__":
    raise SystemExit(main())
