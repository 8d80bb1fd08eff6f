"""DeepSeek-V3 at full size (random int4 experts) sharded over a mesh: tokens/s, memory, bytes.

The whole 671B model on 8 GPUs, experts EP=8 (the default on 8 GPUs):
    python examples/full_deepseek_v3.py --mesh expert=8 --layers 61 --batch-sizes 1 16 64
A dry run of the same script at reduced depth on 2 GPUs:
    python examples/full_deepseek_v3.py --mesh expert=2 --layers 8
On a CPU the default is the tiny preset on the one device (a smoke test); on 8 fake devices:
    python examples/full_deepseek_v3.py --cpu-devices 8 --mesh expert=4

Weights are drawn on the devices, each device only its shard (models.deepseek_v3.init_random
with a mesh), so no device ever holds all experts; the quantized non-expert linears run on
--linear-implementation (default auto: the fastest kernel here, per device on its shard of each
weight). For each batch size it generates --max-new-tokens tokens greedily from random prompts
and reports decode tokens/s, the memory each device holds (peak where the runtime reports it),
and the bytes one decode step must read per device (the routed experts the step touches, at
most min(E, B*k) per layer, split over the expert axis, plus every other weight as it is
sharded) over the measured copy ceiling: the bandwidth bound of the step, beside the measured
step time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arg_types  # noqa: E402  (no JAX import: --cpu-devices must come first)


def _set_cpu_devices(n: int | None) -> None:
    if n:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"


def _weight_bytes(model):
    """(routed expert bytes per expert per layer summed over layers, other weight bytes)."""
    import jax
    from benchmark import array_bytes
    from flax import nnx

    from models.deepseek_v3.modeling import RoutedExperts

    expert_bytes = 0
    expert_ids = set()
    for _, module in nnx.iter_modules(model):
        if isinstance(module, RoutedExperts):
            for leaf in jax.tree.leaves(nnx.state(module)):
                expert_bytes += array_bytes(leaf) // model.cfg.n_routed_experts
                expert_ids.add(id(leaf))
    total = sum(array_bytes(leaf) for leaf in jax.tree.leaves(nnx.state(model)))
    expert_total = sum(
        array_bytes(leaf) for leaf in jax.tree.leaves(nnx.state(model)) if id(leaf) in expert_ids
    )
    return expert_bytes, total - expert_total


def _device_memory():
    import jax

    out = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        out.append(
            dict(
                device=str(d),
                bytes_in_use=stats.get("bytes_in_use"),
                peak_bytes_in_use=stats.get("peak_bytes_in_use"),
            )
        )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--preset",
        choices=("deepseek-v3", "tiny"),
        default=None,
        help="model size (default: deepseek-v3 on GPUs, tiny on a CPU)",
    )
    p.add_argument(
        "--layers", type=arg_types.positive_int, default=None, help="depth (default: the preset's)"
    )
    p.add_argument(
        "--mesh",
        default=None,
        help='mesh axes, e.g. "expert=8,tensor=1" (default: expert=<every device>)',
    )
    p.add_argument(
        "--batch-sizes",
        type=arg_types.positive_int,
        nargs="+",
        default=None,
        help="default: 1 16 64; 1 2 on a CPU",
    )
    p.add_argument(
        "--prompt-len",
        type=arg_types.positive_int,
        default=32,
        help="prompt tokens per row (default 32)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=arg_types.positive_int,
        default=None,
        help="default: 32; 4 on a CPU",
    )
    p.add_argument("--implementation", default=None, help="fused_moe backend (default auto)")
    p.add_argument(
        "--expert-layout",
        choices=("auto", "canonical", "mgpu_int4", "mgpu_int8"),  # wna16_jax.layouts.LAYOUTS
        default="auto",
        help="the routed experts' weight layout, converted per shard after drawing them; auto: "
        "as generate.py (the mgpu layout of the experts' bits, mgpu_int4 or mgpu_int8, with "
        "--implementation mgpu*, else the fastest backend's layout here: mgpu_int4 / mgpu_int8 "
        "on H100/H200)",
    )
    p.add_argument(
        "--linear-implementation",
        choices=("auto", "xla", "mgpu", "pallas", "mgpu_interpret", "pallas_interpret"),
        default="auto",
        help="the quantized non-expert linears, as generate.py's flag: a kernel runs per device "
        "on its shard of each weight (auto: the fastest kernel here, xla on a CPU)",
    )
    p.add_argument(
        "--cpu-devices", type=arg_types.positive_int, default=None, help="N fake CPU devices"
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    _set_cpu_devices(args.cpu_devices)

    import benchmark
    import jax
    import numpy as np
    from flax import nnx

    import models
    from models.deepseek_v3 import DeepseekV3Config, generate, init_random, sharding

    on_gpu = jax.default_backend() == "gpu"
    preset = args.preset or ("deepseek-v3" if on_gpu else "tiny")
    batch_sizes = args.batch_sizes or ([1, 16, 64] if on_gpu else [1, 2])
    max_new_tokens = args.max_new_tokens or (32 if on_gpu else 4)
    if preset == "tiny":
        cfg = DeepseekV3Config.tiny(dtype="bfloat16")
        if args.layers:
            cfg = DeepseekV3Config.tiny(dtype="bfloat16", num_hidden_layers=args.layers)
    else:
        cfg = (
            DeepseekV3Config.full_width(args.layers)
            if args.layers
            else DeepseekV3Config.deepseek_v3(num_nextn_predict_layers=0)
        )
    mesh = sharding.make_mesh(**sharding.parse_mesh(args.mesh or f"expert={jax.device_count()}"))
    n_dev = mesh.devices.size
    print(f"mesh: {sharding.describe(mesh)}; layers {cfg.num_hidden_layers}", flush=True)
    t0 = time.perf_counter()
    model = init_random(cfg, mesh=mesh, on_device=True, implementation=args.implementation)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    print(f"weights drawn on the devices in {time.perf_counter() - t0:.1f} s", flush=True)
    t1 = time.perf_counter()
    models.prepare(  # the kernels chosen and the weights converted to their layouts, once
        model,
        implementation=args.implementation,
        linear_implementation=args.linear_implementation,
        expert_layout=args.expert_layout,
    )
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    # kv_b_proj runs no GEMM (attention reads its dequantized weight): not counted.
    linears = collections.Counter(
        m.kernel(cfg.dtype) or "xla" for m in model.gemm_linears().values()
    )
    linears = ", ".join(f"{n} on {name!r}" for name, n in linears.most_common()) or "none"
    layouts = ", ".join(sorted({m.layout for m in model.routed_experts()})) or "none"
    print(
        f"quantized linears: {linears}; experts in the {layouts} layout "
        f"({time.perf_counter() - t1:.1f} s)",
        flush=True,
    )
    expert_bytes_per_expert, other_bytes = _weight_bytes(model)
    n_copy = (1 << 28) if on_gpu else (1 << 20)  # f32 values: 1 GiB on a GPU
    copy_bps = 2 * n_copy * 4 / benchmark.time_copy(n_copy, iters=10, repeats=3)
    ep = mesh.shape.get("expert", 1)
    rows = []
    rng = np.random.default_rng(0)
    for b in batch_sizes:
        ids = rng.integers(1, cfg.vocab_size, size=(b, args.prompt_len)).astype(np.int32)
        generate(model, ids, max_new_tokens=2)  # compile
        _, stats = generate(model, ids, max_new_tokens=max_new_tokens, eos_id=(), return_stats=True)
        touched = min(cfg.n_routed_experts, b * cfg.num_experts_per_tok)
        # Per device: its share of the touched experts (spread over the expert axis) plus the
        # other weights as sharded (replicated ones count on every device: upper bound).
        step_bytes = expert_bytes_per_expert * touched / ep + other_bytes / n_dev
        replicated_bound = expert_bytes_per_expert * touched / ep + other_bytes
        step_s = stats.decode_s / max(stats.new_tokens, 1)
        row = dict(
            batch=b,
            decode_tokens_per_s=stats.decode_tokens_per_s,
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            step_seconds=step_s,
            step_bytes_per_device_sharded=step_bytes,
            step_bytes_per_device_if_replicated=replicated_bound,
            bandwidth_bound_seconds=(step_bytes / copy_bps, replicated_bound / copy_bps),
            memory=_device_memory(),
        )
        rows.append(row)
        print(
            f"batch {b:>3}: decode {stats.decode_tokens_per_s:9.1f} tok/s, step "
            f"{step_s * 1e3:8.2f} ms; bytes/step/device {step_bytes / 1e9:.2f}-"
            f"{replicated_bound / 1e9:.2f} GB -> bound {step_bytes / copy_bps * 1e3:.2f}-"
            f"{replicated_bound / copy_bps * 1e3:.2f} ms at {copy_bps / 1e12:.2f} TB/s",
            flush=True,
        )
    peaks = [m["peak_bytes_in_use"] for m in rows[-1]["memory"] if m["peak_bytes_in_use"]]
    if peaks:
        print(f"peak memory per device: {max(peaks) / 2**30:.1f} GiB (max over devices)")
    result = dict(
        command=" ".join(sys.argv),
        mesh=sharding.describe(mesh),
        layers=cfg.num_hidden_layers,
        devices=n_dev,
        device_kind=jax.devices()[0].device_kind,
        jax=jax.__version__,
        copy_bytes_per_s=copy_bps,
        expert_layout=layouts,
        linears=linears,
        routed_expert_bytes_per_expert_all_layers=expert_bytes_per_expert,
        other_weight_bytes=other_bytes,
        rows=rows,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
