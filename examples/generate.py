"""Generate text with an MoE model on WNA16 experts: a tiny random int4 model by default.

python examples/generate.py                         # tiny random int4 model on CPU
python examples/generate.py --model /path/to/hf_dir --max-new-tokens 64
python examples/generate.py --model /path/to/hf_dir --chat --prompt "Why is the sky blue?"
python examples/generate.py --full-width-layers 4   # V3 width, 4 layers, random int4
python examples/generate.py --preset qwen3-30b-a3b  # a released size, random GPTQ-like int4
python examples/generate.py --preset kimi-k2 --layers 4

--model reads any family's checkpoint (DeepSeek-V3 / V2, Kimi-K2, Qwen2-MoE, Qwen3-MoE: by
config.json's model_type); --preset draws a random model of a released size (PRESETS).
python examples/generate.py --activation-quant int8_per_token  # random W8A8 experts

Sharded (expert parallel over "expert", tensor parallel over "tensor", batch over "data"):
python examples/generate.py --mesh expert=2 --cpu-devices 8            # 8 fake CPU devices
python examples/generate.py --mesh expert=2,tensor=2 --cpu-devices 8
python examples/generate.py --mesh data=2,tensor=2 --cpu-devices 8 --linear-implementation \
    pallas_interpret                                                   # kernels per shard
python examples/generate.py --mesh expert=8 --full-width-layers 61     # 8 GPUs, DeepSeek-V3 size
--cpu-devices N sets XLA_FLAGS=--xla_force_host_platform_device_count=N and JAX_PLATFORMS=cpu
at the top of main(), before JAX starts its backend (importing jax is fine; a JAX that already
runs, e.g. inside another program, cannot change its device count: main() then says so).

With --model, the checkpoint's generation_config.json supplies the sampling defaults
(eos_token_id, do_sample, temperature, top_p, max_new_tokens); flags given override them.

Several hosts: run the same command on every host with --coordinator HOST0:PORT
--num-processes N --process-id I (I = 0..N-1); the mesh then spans all hosts' devices.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
import wna16_jax as wj
from models import load_pretrained, registry
from models.common import sharding
from models.common.causal_lm import dequantize_model
from models.common.checkpoint import read_config, resolve_checkpoint
from models.common.config import QuantSpec
from models.common.generate import generate, load_generation_config
from models.common.modules import Embed, FloatExperts, RoutedExperts
from models.common.tokenizer import load_chat_template, load_tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arg_types  # noqa: E402
import benchmark  # noqa: E402  (the copy ceiling, arrays' bytes)
import cli  # noqa: E402

# Tokens per row where neither --max-new-tokens nor the checkpoint's generation_config.json
# says (the other sampling settings default to generate()'s: greedy, no nucleus).
DEFAULT_MAX_NEW_TOKENS = 16

# --preset: a random model of a released size, int4 as its release is (GPTQ-like for Qwen:
# group 128 symmetric, float16 scales; Kimi-K2's group 32 symmetric routed experts): every
# family's presets, from the registry.
PRESETS = {name: make for name, (_, make) in registry.presets().items()}
# --family: whose tiny (or --full-width-layers) random model; the registry's first by default.
FAMILIES = registry.FAMILY_PACKAGES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.setup_parser(p)
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
        type=arg_types.positive_int,
        metavar="N",
        help="random model at full DeepSeek-V3 width with N layers (int4 experts "
        "generated on device)",
    )
    src.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="random model of a released size, quantized as its int4 release (Qwen: GPTQ-like "
        "int4 group 128 symmetric, float16 scales); --layers keeps fewer layers",
    )
    p.add_argument(
        "--no-memory-check",
        action="store_true",
        help="build a --preset even where its weights exceed the memory here",
    )
    p.add_argument(
        "--family",
        choices=FAMILIES,
        default=FAMILIES[0],
        help=f"the family of the tiny random model and of --full-width-layers (default "
        f"{FAMILIES[0]})",
    )
    p.add_argument(
        "--layers",
        type=arg_types.positive_int,
        default=None,
        metavar="N",
        help="with --preset: N layers instead of the released count",
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
        "default auto. mgpu* convert the experts to the mgpu_int4 / mgpu_int8 layout (see "
        "--expert-layout)",
    )
    p.add_argument(
        "--expert-layout",
        choices=("auto", *wj.layouts.LAYOUTS),
        default="auto",
        help="the routed experts' weight layout (wna16_jax.layouts), converted once after "
        "building or loading: mgpu_int4 / mgpu_int8 for the Mosaic GPU backend (H100/H200; "
        "int4 or int8 with bf16 activations, or W8A8). auto (default): the mgpu layout of the "
        "experts' bits with --implementation mgpu*, canonical with another --implementation, "
        "else the layout of the fastest backend that runs the experts here, for their "
        "activations (wna16_jax.preferred_layout: mgpu_int4 / mgpu_int8 on H100/H200 for "
        "bf16 int4 / int8 experts and for W8A8 ones of any dtype, canonical elsewhere)",
    )
    p.add_argument(
        "--linear-implementation",
        choices=("auto", "xla", "mgpu", "pallas", "mgpu_interpret", "pallas_interpret"),
        default="auto",
        help="quantized non-expert linears (attention, dense MLP, shared experts): a "
        "kernel's dequant-fused GEMM with one expert, its weights converted once to the "
        "layout it reads (mgpu: the Mosaic GPU GEMM, H100/H200; pallas: any NVIDIA GPU), or "
        "xla (dequantize + dot in every step). auto (default): the fastest kernel here, xla "
        "on CPU. With --mesh a kernel runs per device on its shard of each weight (a linear "
        "whose shard it cannot run stays on xla)",
    )
    p.add_argument(
        "--no-fuse-linears",
        action="store_true",
        help="run every quantized linear as its own GEMM. By default a kernel "
        "(--linear-implementation other than xla, without --mesh) runs the linears that read "
        "one input as one GEMM: gate_proj and up_proj (silu(gate) * up in its epilogue), and "
        "q_a_proj and kv_a_proj_with_mqa",
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
        "--activation-quant",
        choices=("int8_per_token",),
        default=None,
        help="random models (tiny or --full-width-layers): int8 per-channel symmetric weights "
        "(what W8A8 kernels take; --quantize int4 is refused) and routed experts that quantize "
        "their activations to int8 per token (W8A8); the non-expert linears keep 16-bit "
        "activations. A checkpoint (--model) says its own in its quantization_config",
    )
    p.add_argument(
        "--quantize-lm-head",
        choices=("int4", "int8"),
        default=None,
        help="quantize the float lm_head (the vocabulary projection, 1.85 GB of bf16 at "
        "DeepSeek-V3's width: the largest weight a decode step reads) to int4 or int8 (groups "
        "of 128, zero points) after loading, for its bytes per step; default: as the "
        "checkpoint ships it",
    )
    p.add_argument(
        "--batch-size",
        "--batch-sizes",
        dest="batch_size",
        type=arg_types.positive_int,
        nargs="+",
        default=[1],
        help="prompts per batch; several values generate once per value with the same model "
        "(built once)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=arg_types.positive_int,
        default=None,
        help="tokens generated per row (default: the checkpoint's generation_config.json, "
        f"else {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument(
        "--prompt",
        default="The capital of France is",
        help='the text every row starts from (default: "The capital of France is")',
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="with --model: render --prompt as one user message through the chat template "
        "of the checkpoint's tokenizer_config.json (chat_template; needs jinja2), with the "
        "assistant's turn opened, before encoding it",
    )
    p.add_argument(
        "--distinct-prompts",
        action="store_true",
        help="start each row's prompt with its own random token (seeded by --seed), so that "
        "rows route to different experts as a server's batch would; by default every row is "
        "the same prompt and, decoded greedily, every row sends its tokens to the same experts",
    )
    p.add_argument(
        "--temperature",
        type=arg_types.non_negative_float,
        default=None,
        help="sampling temperature, 0 for greedy (default: the checkpoint's "
        "generation_config.json: its temperature with do_sample true, 0 with do_sample false; "
        "else 0)",
    )
    p.add_argument(
        "--top-p",
        type=arg_types.probability_mass,
        default=None,
        help="nucleus sampling mass, 1 for none (default: generation_config.json, else 1)",
    )
    p.add_argument(
        "--eos-id",
        type=arg_types.non_negative_int,
        nargs="+",
        default=None,
        metavar="ID",
        help="ids that end a row (default: generation_config.json's eos_token_id, else "
        "config.json's)",
    )
    p.add_argument(
        "--seed",
        type=arg_types.non_negative_int,
        default=0,
        help="seed of the random model, --distinct-prompts and sampling (default 0)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every row computed as it would be alone: its tokens and logits bitwise the "
        "same for any batch size and position, and on every run (models.prepare(..., "
        "batch_invariant=True); each row samples with its own key from --seed). Slower: "
        "fixed 16-row blocks, attention in key chunks, no kernel that refuses it (mgpu). "
        "One device (no --mesh), no --mtp",
    )
    p.add_argument(
        "--mtp",
        type=int,
        choices=(1, 2, 3),
        metavar="K",
        default=None,
        help="speculative decoding with DeepSeek-V3's MTP layer, K = 1..3 chained drafts per "
        "step (loaded from --model's layer num_hidden_layers, or drawn at random); prints the "
        "acceptance rate, tokens per step and ms per token. One device (no --mesh)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (default: a bar on stderr for loading, drawing random weights "
        "and converting layouts, where a step takes more than a few seconds)",
    )
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
        type=arg_types.positive_int,
        default=None,
        metavar="N",
        help="run on N fake CPU devices (sets XLA_FLAGS before JAX starts)",
    )
    dist.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (several hosts)")
    dist.add_argument(
        "--num-processes", type=arg_types.positive_int, default=None, help="number of hosts"
    )
    dist.add_argument(
        "--process-id", type=arg_types.non_negative_int, default=None, help="this host's index"
    )
    args = p.parse_args(argv)
    if None not in (args.process_id, args.num_processes) and args.process_id >= args.num_processes:
        p.error(f"--process-id {args.process_id}: not in [0, --num-processes {args.num_processes})")
    if args.activation_quant is not None:
        why = activation_quant_conflict(args)
        if why:
            p.error(f"--activation-quant {args.activation_quant}: {why}")
    why = flag_conflict(args)
    if why:
        p.error(why)
    return args


# Backends that run only on an NVIDIA GPU, and what runs the same kernels elsewhere.
GPU_BACKENDS = {"pallas": "pallas_interpret", "mgpu": "mgpu_interpret", "triton": "xla"}


def flag_conflict(args) -> str | None:
    """Why the flags cannot run together, found before JAX starts or a model is built, or None:
    --layers without --preset, an unknown --implementation, --mtp with --mesh,
    --batch-invariant with either, a Mosaic GPU backend on float32 activations."""
    if args.layers and not args.preset:
        return f"--layers {args.layers} sets a --preset's layer count: add --preset NAME"
    if args.implementation is not None:
        known = wj.registered_backends()
        names = args.implementation.split(",")
        unknown = [n for n in names if n not in known]
        if unknown:
            return f"--implementation {args.implementation}: {unknown} not among {list(known)}"
    if args.mtp and args.mesh:
        return "--mtp decodes on one device: drop --mesh (or --mtp)"
    if args.batch_invariant and (args.mesh or args.mtp):
        flag = "--mesh" if args.mesh else "--mtp"
        return f"--batch-invariant runs on one device without speculative decoding: drop {flag}"
    mgpu = [f"{f} {v}" for f, v in (("--implementation", args.implementation),
                                    ("--linear-implementation", args.linear_implementation))
            if v and v.startswith("mgpu")]  # fmt: skip
    dtype = args.dtype or ("float32" if not (args.model or args.preset or
                                             args.full_width_layers) else "bfloat16")  # fmt: skip
    if mgpu and dtype == "float32":
        return (
            f"{mgpu[0]}: the Mosaic GPU kernels take bfloat16 or float16 activations, "
            f"and this model runs float32: add --dtype bfloat16"
        )
    return None


def gpu_flag_conflict(args, platform: str) -> str | None:
    """Why a GPU-only backend flag cannot run on `platform` (JAX's), or None: checked before
    the model is built (and its weights converted to a layout the platform cannot run)."""
    if platform == "gpu":
        return None
    for flag, value in (("--implementation", args.implementation),
                        ("--linear-implementation", args.linear_implementation)):  # fmt: skip
        for name in (value or "").split(","):
            if name in GPU_BACKENDS:
                return (
                    f"{flag} {name} runs on an NVIDIA GPU and JAX runs on {platform}: use "
                    f"{GPU_BACKENDS[name]} (the same kernels, interpreted) or xla"
                )
    return None


def activation_quant_conflict(args) -> str | None:
    """Why --activation-quant cannot run with the other flags, or None."""
    if args.model:
        return (
            "a checkpoint's quantization_config says how its experts' activations are "
            "quantized (compressed-tensors input_activations); the flag is for random models"
        )
    if args.quantize == "int4":
        return (
            "W8A8 needs int8 per-channel symmetric experts (bits=8, group_size=-1, no zero "
            "points); --quantize int4 gives int4 experts"
        )
    if args.float_weights:
        return "--float-weights runs float experts, with 16-bit activations"
    return None


def checkpoint_dir(args) -> str | None:
    """The local directory of --model (a Hub id fetched, and where it lies printed); None for
    a random model."""
    if not args.model:
        return None
    local = resolve_checkpoint(args.model, revision=args.revision)
    if local != args.model:
        print(f"checkpoint: {args.model} (revision {args.revision or 'main'}) at {local}")
    return local


def sampling_settings(args, checkpoint: str | None) -> dict:
    """generate()'s sampling keywords: each flag given, else the value of the checkpoint's
    generation_config.json (printed, with the keys of the file left unused), else the
    built-in default (DEFAULT_MAX_NEW_TOKENS; generate()'s own for the others, left out).

    Raises:
        SystemExit: a malformed generation_config.json (named).
    """
    given = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        eos_id=None if args.eos_id is None else tuple(args.eos_id),
    )
    settings = {k: v for k, v in given.items() if v is not None}
    try:
        defaults = load_generation_config(checkpoint) if checkpoint else None
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if defaults is not None:
        settings = defaults.merged(**given)
        taken = [f"{k}={v}" for k, v in defaults.values().items() if given[k] is None]
        print(f"from {defaults.path}: {', '.join(taken) or 'nothing (flags given)'}")
        if defaults.unused:
            print(f"not used from {defaults.path}: {', '.join(defaults.unused)}")
    settings.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    return settings


def check_mtp_flag(args, checkpoint: str | None) -> None:
    """Refuses --mtp before the model is built where --model's config.json has no MTP layer
    (no num_nextn_predict_layers, as in a Qwen-MoE checkpoint, or 0).

    Raises:
        SystemExit: the checkpoint and what to do named.
    """
    if not args.mtp or checkpoint is None:
        return
    hf = read_config(checkpoint)
    layers = hf.get("num_nextn_predict_layers") or 0
    if not isinstance(layers, int) or layers < 1:
        raise SystemExit(
            f"--mtp: {args.model} has no MTP layer (config.json num_nextn_predict_layers="
            f"{hf.get('num_nextn_predict_layers')!r}, model_type={hf.get('model_type')!r}); "
            f"drop --mtp"
        )


def prompt_text(args, checkpoint: str | None) -> tuple[str, bool | None]:
    """(the text to encode, encode's add_bos): --prompt, encoded as the checkpoint's own
    tokenizer encodes it (None: a bos token where it adds one), or with --chat the prompt
    rendered by the checkpoint's chat template (which writes the bos token: False).

    Raises:
        SystemExit: --chat without --model, or without a chat template (the file named).
    """
    if not args.chat:
        return args.prompt, None
    if checkpoint is None:
        raise SystemExit("--chat needs --model: a random model has no chat template")
    try:
        template = load_chat_template(checkpoint)
        text = template.render([{"role": "user", "content": args.prompt}])
    except (FileNotFoundError, ValueError, ImportError) as err:
        raise SystemExit(f"--chat: {err}") from None
    print(f"chat template of {template.path}: {text!r}")
    return text, False


def build_model(args, mesh=None, checkpoint: str | None = None):
    """(model, tokenizer, description) for the arguments, placed on `mesh` when given;
    `checkpoint`: the local directory of --model (`checkpoint_dir`)."""
    progress = not args.no_progress
    placement = dict(mesh=mesh, moe_mode=args.moe_mode, progress=progress)
    if args.preset:
        return build_preset(args, placement)
    if args.model:
        local = checkpoint or checkpoint_dir(args)
        model = load_pretrained(  # each tensor placed on the mesh as it is read
            local,
            dtype=args.dtype or "bfloat16",
            implementation=args.implementation,
            quantize=args.quantize,
            mtp=bool(args.mtp),
            **placement,
        )
        what = args.model
        aq = next((m.activation_quant for m in model.routed_experts()), None)
        if aq is not None:  # one scheme in every layer (load_pretrained refuses others)
            what += f" (routed experts W8A8: {aq.scheme} activations)"
        return model, load_tokenizer(local, cfg=model.cfg), what
    family = registry.families()[args.family]
    bits = 8 if args.quantize == "int8" else 4
    if args.activation_quant:  # W8A8: the weights its kernels take
        quant, weights = QuantSpec(bits=8, group_size=-1, has_zp=False), "int8 per channel"
    elif args.full_width_layers:
        quant, weights = QuantSpec(bits=bits, group_size=128), f"int{bits}"
    else:
        quant, weights = QuantSpec(bits=bits, group_size=32), f"int{bits}"
    overrides = dict(quant=quant)
    if args.mtp:
        overrides["num_nextn_predict_layers"] = 1
    if args.full_width_layers:
        if family.full_width is None:
            raise SystemExit(f"--full-width-layers: {args.family} has none; use --preset")
        cfg = family.full_width(args.full_width_layers, dtype=args.dtype or "bfloat16", **overrides)
        what = f"random full-width model, {args.full_width_layers} layers, {weights}"
    else:
        cfg = family.config_class.tiny(dtype=args.dtype or "float32", **overrides)
        what = f"tiny random model, {weights}"
    if args.mtp:
        what += ", with its MTP layer"
    if args.activation_quant:
        what += f", routed experts W8A8 ({args.activation_quant} activations)"
    what += f" ({family.model_class.__name__})"
    model = family.init_random(cfg, seed=args.seed, implementation=args.implementation, **placement)
    model.set_activation_quant(args.activation_quant)
    return model, load_tokenizer(None, cfg=cfg), what


def build_preset(args, placement: dict):
    """(model, tokenizer, description) of --preset: random weights of a released size
    (--layers: fewer layers), in --dtype (default bfloat16), placed as `placement` says."""
    overrides = {"dtype": args.dtype or "bfloat16"}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    cfg = PRESETS[args.preset](**overrides)
    check_preset_memory(args, cfg, placement.get("mesh"))
    model = registry.family_of_model(cfg).init_random(
        cfg, seed=args.seed, implementation=args.implementation, **placement
    )
    what = f"random {args.preset}, {cfg.num_hidden_layers} layers, {cfg.quant}"
    return model, load_tokenizer(None, cfg=cfg), what


def available_memory(mesh) -> tuple[int, str]:
    """(bytes, where): the memory the weights may take here: the devices' own (GPU; each
    device's limit times the mesh's devices), else the host's available RAM."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    stats = devices[0].memory_stats() if devices[0].platform == "gpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]) * len(devices), f"{len(devices)} GPU(s)"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "this host (MemAvailable)"
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(pages), "this host"


def check_preset_memory(args, cfg, mesh) -> None:
    """Prints the preset's weight bytes (from an abstract model: nothing allocated) against the
    memory here, and refuses to build what cannot fit unless --no-memory-check.

    Raises:
        SystemExit: over the memory, with how many layers would fit.
    """
    model_class = registry.family_of_model(cfg).model_class
    need = model_class.param_bytes(cfg)
    have, where = available_memory(mesh)
    print(
        f"--preset {args.preset}: {cfg.num_hidden_layers} layers, about "
        f"{cli.figure(need / 1e9)} GB of weights; {where} has {cli.figure(have / 1e9)} GB "
        f"free (drawing them takes more for a while)"
    )
    if need <= have or args.no_memory_check:
        return
    layers = cfg.num_hidden_layers
    one = model_class.param_bytes(dataclasses.replace(cfg, num_hidden_layers=1))
    per_layer = (need - one) / (layers - 1) if layers > 1 else need  # the layers' mean
    fit = min(max(int((have - one + per_layer) // per_layer), 0), layers - 1)
    hint = f"pass --layers {fit} (about as many fit)" if fit else "it does not fit with 1 layer"
    raise SystemExit(
        f"--preset {args.preset}: its weights take about {cli.figure(need / 1e9)} GB, over the "
        f"{cli.figure(have / 1e9)} GB {where} has free: {hint}, or --no-memory-check to build "
        f"it anyway"
    )


def prepare_model(model, args, linears: str, *, progress: bool):
    """The built model as the flags ask it to run: --float-weights (a float copy), then
    `models.prepare` (the lm_head quantized with --quantize-lm-head, the quantized linears on
    `linears`, the experts in their layout, --expert-layout), each step printed."""
    if args.float_weights:
        if model.sharding is not None:
            raise SystemExit("--float-weights needs an unsharded model (no --mesh)")
        t1 = time.perf_counter()
        model = dequantize_model(model)  # the quantized model is dropped: one copy kept
        print(f"weights dequantized to {model.cfg.dtype} ({time.perf_counter() - t1:.1f} s)")
    if args.quantize_lm_head and model.sharding is not None:
        raise SystemExit("--quantize-lm-head needs an unsharded model (no --mesh)")
    t1 = time.perf_counter()
    models.prepare(
        model,
        implementation=args.implementation,
        linear_implementation=linears,
        expert_layout=args.expert_layout,
        quantize_lm_head=args.quantize_lm_head,
        fuse_linears=not args.no_fuse_linears,
        batch_invariant=args.batch_invariant,
        progress=progress,
    )
    if args.batch_invariant:
        print("batch-invariant: every row computed as it would be alone")
    if args.quantize_lm_head:
        print(f"lm_head quantized to {args.quantize_lm_head}")
    counts, reasons = linear_backends(model)
    print(f"quantized linears: {counts}")
    for reason in reasons:
        print(f"  {reason}")
    layouts = sorted({m.layout for m in model.routed_experts()})
    if layouts and layouts != ["canonical"]:
        print(f"experts in the {', '.join(layouts)} layout ({time.perf_counter() - t1:.1f} s)")
    return model


def unavailable(select, chosen: str) -> list[str]:
    """The library's reason for each other backend (interpreters aside: never chosen
    automatically) that cannot run a call, as `select(implementation=name)` raises it."""
    reasons = []
    for name in wj.registered_backends():
        if name == chosen or name.endswith("_interpret"):
            continue
        try:
            select(implementation=name)
        except NotImplementedError as err:
            reasons.append(str(err))
    return reasons


def chosen_backend(model, tokens: int) -> tuple[str, list[str]]:
    """The fused_moe backend of the routed experts for `tokens` tokens, as each device sees
    them (its own shard of the experts), by wj.select_implementation; with the automatic
    choice also why each other backend cannot run them (`unavailable`)."""
    experts = model.routed_experts()
    if not experts:
        return "none (float experts)", []
    m = experts[0]
    local = lambda a: jax.ShapeDtypeStruct(a.addressable_shards[0].data.shape, a.dtype)  # noqa: E731
    w13, w2 = jax.tree.map(local, m.w13.get()), jax.tree.map(local, m.w2.get())
    k = model.cfg.num_experts_per_tok
    select = functools.partial(
        wj.select_implementation,
        jax.ShapeDtypeStruct((tokens, model.cfg.hidden_size), model.cfg.dtype),
        w13,
        w2,
        jax.ShapeDtypeStruct((tokens, k), jnp.float32),
        jax.ShapeDtypeStruct((tokens, k), jnp.int32),
        activation_quant=m.activation_quant,
    )
    name = select(implementation=m.implementation)
    return repr(name), unavailable(select, name) if m.implementation is None else []


def linear_backends(model) -> tuple[str, list[str]]:
    """How many quantized non-expert linears each backend runs as a GEMM, e.g. "40 on 'mgpu',
    8 on 'xla'" (a layer no kernel takes stays on the float dot, 'xla'; a fused pair counts
    once, and the fused ones are named: "; fused: 4 gate_up_proj, 3 qkv_a_proj"), by
    wj.linear.select_implementation on the weight each device holds (its shard on a mesh);
    the linears attention reads only as a dequantized weight are named apart, as they run no
    GEMM ("; dequantized for attention: 4 kv_b_proj"); why linears are left on 'xla': with a
    named backend, each distinct reason (`QuantizedLinear.kernel_reason`, e.g. a shard the
    kernel does not tile), with the automatic choice, why each other backend cannot run the
    first of them (`unavailable`)."""
    linears = list(model.gemm_linears().values())
    dequantized = collections.Counter(p.rsplit(".", 1)[1] for p in model.dequantized_linears())
    if not linears and not dequantized:
        return "none (float linears)", []
    kernels = [m.kernel(model.cfg.dtype) or "xla" for m in linears]
    counts = collections.Counter(kernels)
    text = ", ".join(f"{n} on {name!r}" for name, n in counts.most_common()) or "none as GEMMs"
    fused = collections.Counter(path.rsplit(".", 1)[1] for path in model.fused_linears())
    if fused:
        text += "; fused: " + ", ".join(f"{n} {name}" for name, n in sorted(fused.items()))
    if dequantized:
        text += "; dequantized for attention: " + ", ".join(
            f"{n} {name}" for name, n in sorted(dequantized.items())
        )
    left = [m for m, k in zip(linears, kernels, strict=True) if k == "xla"]
    if not left or left[0].implementation == "xla":
        return text, []
    if left[0].implementation is not None:  # a named backend: each distinct reason, counted
        whys = collections.Counter(m.kernel_reason(model.cfg.dtype) for m in left)
        return text, [f"{n} not on {left[0].implementation!r}: {why}"
                      for why, n in whys.items() if why is not None]  # fmt: skip
    select = functools.partial(
        wj.linear.select_implementation, left[0].shard_shapes(), dtype=model.cfg.dtype
    )
    return text, unavailable(select, "xla")


def new_tokens(row: list[int], prompt_len: int, eos_ids) -> tuple[list[int], bool]:
    """(the row's generated tokens up to and including its first eos id, whether it stopped
    there): generate() fills a finished row's remaining columns with an eos id."""
    new = row[prompt_len:]
    for i, tok in enumerate(new):
        if tok in eos_ids:
            return new[: i + 1], True
    return new, False


def main(argv=None) -> int:
    args = parse_args(argv)
    # Both must happen before JAX starts its backend (the first device query).
    if args.cpu_devices:
        sharding.use_cpu_devices(args.cpu_devices)
    sharding.maybe_initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    mesh = sharding.make_mesh(**sharding.parse_mesh(args.mesh)) if args.mesh else None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    progress = not args.no_progress
    why = gpu_flag_conflict(args, jax.default_backend())
    if why:
        raise SystemExit(why)

    print(f"mesh: {sharding.describe(mesh)}")
    t0 = time.perf_counter()
    checkpoint = checkpoint_dir(args)
    # The small files first: a bad one stops the run before the weights load.
    settings = sampling_settings(args, checkpoint)
    check_mtp_flag(args, checkpoint)
    text, add_bos = prompt_text(args, checkpoint)
    model, tokenizer, what = build_model(args, mesh, checkpoint)
    model = prepare_model(model, args, args.linear_implementation, progress=progress)
    print(
        f"model: {what} ({time.perf_counter() - t0:.1f} s to build); "
        f"JAX platform {jax.default_backend()}, {jax.device_count()} device(s)"
    )
    settings.setdefault("eos_id", tuple(model.cfg.eos_token_id))
    print("generation: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    prompt_ids = tokenizer.encode(text, add_bos=add_bos)
    shown_reasons = None
    # One device: the copy ceiling for the roofline line (a mesh's bytes per device vary).
    copy_bps = None if mesh else benchmark.measure_copy(jax.default_backend() == "gpu", 3)
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
            **settings,
            # --batch-invariant: one seed a row, so a row samples as it would alone
            seed=[args.seed] * batch_size if args.batch_invariant else args.seed,
            pad_id=tokenizer.pad_id,
            return_stats=True,
            warmup=not args.no_warmup,
            speculative="mtp" if args.mtp else None,
            num_draft_tokens=args.mtp or 1,
        )
        backend, reasons = chosen_backend(model, batch_size)
        print(f"fused_moe backend: {backend}")
        if reasons != shown_reasons:  # the same reasons are not repeated for every batch size
            for reason in reasons:
                print(f"  {reason}")
            shown_reasons = reasons
        for b, row in enumerate(tokens.tolist()):
            new, stopped = new_tokens(row, len(prompts[b]), settings["eos_id"])
            end = f" (stopped at eos id {new[-1]})" if stopped else ""
            print(f"[{b}] tokens: {new}{end}")
            print(f"[{b}] text:   {args.prompt!r} -> {tokenizer.decode(new)!r}")
        print(f"speed: {stats}")  # with --mtp: acceptance rate and tokens per step too
        if copy_bps and stats.step_s:
            print(roofline(model, stats, copy_bps))
        print(f"decode: {stats.decode_tokens_per_s:.1f} tokens/s")
    return 0


def step_bytes(model) -> float:
    """Weight bytes a decode step reads at least: every array of the model but the embedding
    table (a row per token) and the routed experts, of which num_experts_per_tok per MoE layer
    (one token's; rows that route apart read more)."""

    def nbytes(module) -> int:
        return sum(benchmark.array_bytes(a) for a in jax.tree.leaves(nnx.state(module)))

    modules = [m for _, m in nnx.iter_modules(model)]
    embed = sum(nbytes(m) for m in modules if isinstance(m, Embed))
    experts = sum(nbytes(m) for m in modules if isinstance(m, RoutedExperts | FloatExperts))
    share = model.cfg.num_experts_per_tok / model.cfg.n_routed_experts
    return nbytes(model) - embed - (1 - share) * experts


def roofline(model, stats, copy_bps: float) -> str:
    """A decode step's weight bytes (`step_bytes`) and its time against the copy ceiling."""
    nbytes = step_bytes(model)
    floor_s = nbytes / copy_bps
    return (
        f"step reads >= {cli.figure(nbytes / 1e9)} GB of weights = "
        f"{cli.figure(floor_s * 1e3)} ms at the copy ceiling measured now "
        f"({cli.figure(copy_bps / 1e12)} TB/s): the step runs at "
        f"{cli.figure(100 * floor_s / stats.step_s, 2)}% of it"
        + (" (batch > 1: rows that route apart read more experts)" if stats.batch > 1 else "")
    )


def first_tokens(model, tokenizer, n: int, seed: int) -> list[int]:
    """n random token ids (no padding id) to start n distinct prompts."""
    rng = np.random.default_rng(seed)
    pad = tokenizer.pad_id
    candidates = [t for t in range(model.cfg.vocab_size) if t != pad]
    ids = rng.choice(candidates, n, replace=n > len(candidates))
    return [int(t) for t in ids]


if __name__ == "__main__":
    cli.run(main)
