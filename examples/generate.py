"""Generate text with DeepSeek-V3 on WNA16 experts: a tiny random int4 model by default.

python examples/generate.py                         # tiny random int4 model on CPU
python examples/generate.py --model /path/to/hf_dir --max-new-tokens 64
python examples/generate.py --full-width-layers 4   # V3 width, 4 layers, random int4

Sharded (expert parallel over "expert", tensor parallel over "tensor", batch over "data"):
python examples/generate.py --mesh expert=2 --cpu-devices 8            # 8 fake CPU devices
python examples/generate.py --mesh expert=2,tensor=2 --cpu-devices 8
python examples/generate.py --mesh expert=8 --full-width-layers 61     # 8 GPUs, DeepSeek-V3 size
--cpu-devices N sets XLA_FLAGS=--xla_force_host_platform_device_count=N and JAX_PLATFORMS=cpu
at the top of main(), before JAX starts its backend (importing jax is fine; a JAX that already
runs, e.g. inside another program, cannot change its device count: main() then says so).

Several hosts: run the same command on every host with --coordinator HOST0:PORT
--num-processes N --process-id I (I = 0..N-1); the mesh then spans all hosts' devices.
"""

from __future__ import annotations

import argparse
import collections
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import wna16_jax as wj
from models.deepseek_v3 import (
    DeepseekV3Config,
    QuantSpec,
    generate,
    init_random,
    load_pretrained,
    load_tokenizer,
    resolve_checkpoint,
    sharding,
)
from models.deepseek_v3.modeling import QuantizedLinear, RoutedExperts, dequantize_model


class _BackendLog(logging.Handler):
    """Keeps wna16_jax's "fused_moe uses ..." line so main() can print the chosen backend."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "fused_moe uses" in msg:
            self.lines.append(msg.split("fused_moe uses ", 1)[-1])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        metavar="DIR_OR_ID",
        help="local HF directory (config.json + safetensors) or a Hugging Face Hub id "
        "(org/name: only the safetensors, config and tokenizer files are fetched, into the "
        "Hub's cache; HF_HUB_OFFLINE=1 uses the cache only); default: a tiny random int4 model",
    )
    src.add_argument(
        "--full-width-layers",
        type=int,
        metavar="N",
        help="random model at full DeepSeek-V3 width with N layers (int4 experts "
        "generated on device)",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="with a Hub id --model: the branch, tag or commit (default main)",
    )
    p.add_argument(
        "--implementation",
        default=None,
        help="fused_moe backend (xla, pallas, pallas_interpret, mgpu, mgpu_interpret, ...); "
        "default auto. mgpu* convert the experts to the mgpu_int4 layout (see --expert-layout)",
    )
    p.add_argument(
        "--expert-layout",
        choices=("auto", *wj.layouts.LAYOUTS),
        default="auto",
        help="the routed experts' weight layout (wna16_jax.layouts), converted once after "
        "building or loading: mgpu_int4 for the Mosaic GPU backend (H100/H200; int4, bf16). "
        "auto (default): mgpu_int4 with --implementation mgpu*, canonical "
        "with another --implementation, else the layout of the fastest backend that runs the "
        "experts here (wna16_jax.preferred_layout: mgpu_int4 on H100/H200 for int4 "
        "bf16 experts, canonical elsewhere)",
    )
    p.add_argument(
        "--linear-implementation",
        choices=("auto", "xla", "mgpu", "pallas", "mgpu_interpret", "pallas_interpret"),
        default="auto",
        help="quantized non-expert linears (attention, dense MLP, shared experts): a "
        "kernel's dequant-fused GEMM with one expert, its weights converted once to the "
        "layout it reads (mgpu: the Mosaic GPU GEMM, H100/H200; pallas: any NVIDIA GPU), or "
        "xla (dequantize + dot in every step). auto (default): the fastest kernel here, xla "
        "on CPU and with --mesh (kernels need an unsharded model)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="time the first executions of prefill and decode (default: run each once "
        "untimed first, so module loading and communicator setup are not timed)",
    )
    p.add_argument(
        "--float-weights",
        action="store_true",
        help="dequantize every quantized weight once after building or loading and run the "
        "float model on XLA (dots in --dtype): the baseline a JAX user would run without "
        "quantized kernels. Needs the float weights' memory (bf16: 4x int4's; at full width "
        "each MoE layer holds 22.5 GB of bf16 experts) and an unsharded model",
    )
    p.add_argument(
        "--quantize",
        choices=("int4", "int8"),
        default=None,
        help="quantize float weights: on load with --model (an FP8 checkpoint, e.g. "
        "deepseek-ai/DeepSeek-V3, is dequantized and quantized again: default int4), or the "
        "random model's weights (default int4)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=[1],
        help="prompts per batch; several values generate once per value with the same model "
        "(built once)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="start each row's prompt with its own random token (seeded by --seed), so that "
        "rows route to different experts as a server's batch would; by default every row is "
        "the same prompt and, decoded greedily, every row sends its tokens to the same experts",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="activation dtype (default float32 for the tiny model, else bfloat16)",
    )
    dist = p.add_argument_group("sharding and several hosts")
    dist.add_argument(
        "--mesh",
        default=None,
        metavar="AXES",
        help='mesh axes, e.g. "expert=2" or "expert=2,tensor=2" (axes: data, expert, tensor); '
        "default: one device",
    )
    dist.add_argument(
        "--moe-mode",
        choices=sharding.MOE_MODES,
        default="replicated",
        help="sharded MoE tokens: replicated (psum), all_to_all, or auto by token count",
    )
    dist.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="N",
        help="run on N fake CPU devices (sets XLA_FLAGS before JAX starts)",
    )
    dist.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (several hosts)")
    dist.add_argument("--num-processes", type=int, default=None, help="number of hosts")
    dist.add_argument("--process-id", type=int, default=None, help="this host's index")
    return p.parse_args(argv)


def build_model(args, mesh=None):
    """(model, tokenizer, description) for the arguments, placed on `mesh` when given."""
    if args.model:
        dtype = args.dtype or "bfloat16"
        local = resolve_checkpoint(args.model, revision=args.revision)
        if local != args.model:
            print(f"checkpoint: {args.model} (revision {args.revision or 'main'}) at {local}")
        model = load_pretrained(
            local,
            dtype=dtype,
            implementation=args.implementation,
            quantize=args.quantize,
            mesh=mesh,
            moe_mode=args.moe_mode,
        )
        return model, load_tokenizer(local, cfg=model.cfg), args.model
    bits = 8 if args.quantize == "int8" else 4
    if args.full_width_layers:
        cfg = DeepseekV3Config.full_width(
            args.full_width_layers,
            dtype=args.dtype or "bfloat16",
            quant=QuantSpec(bits=bits, group_size=128),
        )
        what = f"random DeepSeek-V3 width, {args.full_width_layers} layers, int{bits}"
    else:
        cfg = DeepseekV3Config.tiny(
            dtype=args.dtype or "float32", quant=QuantSpec(bits=bits, group_size=32)
        )
        what = f"tiny random model, int{bits}"
    model = init_random(
        cfg, seed=args.seed, implementation=args.implementation, mesh=mesh, moe_mode=args.moe_mode
    )
    return model, load_tokenizer(None, cfg=cfg), what


def chosen_backend(model, tokens: int) -> str:
    """The fused_moe backend of the routed experts for `tokens` tokens, as each device sees
    them (its own shard of the experts)."""
    experts = [m for _, m in nnx.iter_modules(model) if isinstance(m, RoutedExperts)]
    if not experts:
        return "none (float experts)"
    m = experts[0]
    local = lambda a: jax.ShapeDtypeStruct(a.addressable_shards[0].data.shape, a.dtype)  # noqa: E731
    w13, w2 = jax.tree.map(local, m.w13.get()), jax.tree.map(local, m.w2.get())
    k = model.cfg.num_experts_per_tok
    name = wj.select_implementation(
        jax.ShapeDtypeStruct((tokens, model.cfg.hidden_size), model.cfg.dtype),
        w13,
        w2,
        jax.ShapeDtypeStruct((tokens, k), jnp.float32),
        jax.ShapeDtypeStruct((tokens, k), jnp.int32),
        implementation=m.implementation,
    )
    return repr(name)


def linear_backends(model) -> str:
    """How many quantized non-expert linears each backend runs, e.g. "40 on 'mgpu', 8 on
    'xla'" (a layer no kernel takes stays on the float dot, 'xla')."""
    counts = collections.Counter(
        m.kernel(model.cfg.dtype) or "xla"
        for _, m in nnx.iter_modules(model)
        if isinstance(m, QuantizedLinear)
    )
    if not counts:
        return "none (float linears)"
    return ", ".join(f"{n} on {name!r}" for name, n in counts.most_common())


def main(argv=None) -> int:
    args = parse_args(argv)
    # Both must happen before JAX starts its backend (the first device query).
    if args.cpu_devices:
        sharding.use_cpu_devices(args.cpu_devices)
    sharding.maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    mesh = sharding.make_mesh(**sharding.parse_mesh(args.mesh)) if args.mesh else None
    if mesh is not None and args.linear_implementation not in ("auto", "xla"):
        raise SystemExit(
            f"--linear-implementation {args.linear_implementation} cannot run under --mesh (a "
            f"Pallas call is not partitioned by GSPMD); use xla"
        )
    linears = "xla" if mesh is not None else args.linear_implementation
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    backend_log = _BackendLog()
    moe_logger = logging.getLogger("wna16_jax")
    moe_logger.addHandler(backend_log)
    moe_logger.setLevel(logging.INFO)
    moe_logger.propagate = False  # printed below instead

    print(f"mesh: {sharding.describe(mesh)}")
    t0 = time.perf_counter()
    model, tokenizer, what = build_model(args, mesh)
    if args.float_weights:
        if mesh is not None:
            raise SystemExit("--float-weights needs an unsharded model (no --mesh)")
        t1 = time.perf_counter()
        model = dequantize_model(model)  # the quantized model is dropped: one copy kept
        print(f"weights dequantized to {model.cfg.dtype} ({time.perf_counter() - t1:.1f} s)")
    model.set_linear_implementation(linears)
    print(f"quantized linears: {linear_backends(model)}")
    layout = model.resolve_expert_layout(args.expert_layout, args.implementation)
    if layout != "canonical":
        t1 = time.perf_counter()
        model.set_expert_layout(layout)
        print(f"experts converted to the {layout} layout ({time.perf_counter() - t1:.1f} s)")
    print(
        f"model: {what} ({time.perf_counter() - t0:.1f} s to build); "
        f"JAX platform {jax.default_backend()}, {jax.device_count()} device(s)"
    )
    prompt_ids = tokenizer.encode(args.prompt)
    for batch_size in args.batch_size:
        if len(args.batch_size) > 1:
            print(f"=== batch size {batch_size}")
        prompts = [prompt_ids] * batch_size
        if args.distinct_prompts:
            prompts = [[tok, *prompt_ids] for tok in first_tokens(model, tokenizer, batch_size,
                                                                  args.seed)]  # fmt: skip
        tokens, stats = generate(
            model,
            prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            pad_id=tokenizer.pad_id,
            return_stats=True,
            warmup=not args.no_warmup,
        )
        # The log line names the candidates; it is emitted once per process, so a later run in
        # the same process asks the selection again.
        backend = backend_log.lines[-1] if backend_log.lines else chosen_backend(model, batch_size)
        backend_log.lines.clear()
        print(f"fused_moe backend: {backend}")
        for b, row in enumerate(tokens.tolist()):
            new = row[len(prompts[b]) :]
            print(f"[{b}] tokens: {new}")
            print(f"[{b}] text:   {args.prompt!r} -> {tokenizer.decode(new)!r}")
        print(f"speed: {stats}")
        print(f"decode: {stats.decode_tokens_per_s:.1f} tokens/s")
    return 0


def first_tokens(model, tokenizer, n: int, seed: int) -> list[int]:
    """n random token ids (no padding id) to start n distinct prompts."""
    rng = np.random.default_rng(seed)
    pad = tokenizer.pad_id
    candidates = [t for t in range(model.cfg.vocab_size) if t != pad]
    ids = rng.choice(candidates, n, replace=n > len(candidates))
    return [int(t) for t in ids]


if __name__ == "__main__":
    raise SystemExit(main())
