"""Generate text with DeepSeek-V3 on WNA16 experts: a tiny random int4 model by default.

python examples/generate.py                         # tiny random int4 model on CPU
python examples/generate.py --model /path/to/hf_dir --max-new-tokens 64
python examples/generate.py --full-width-layers 4   # V3 width, 4 layers, random int4
"""

from __future__ import annotations

import argparse
import logging
import time

import jax

from models.deepseek_v3 import (
    DeepseekV3Config,
    QuantSpec,
    generate,
    init_random,
    load_pretrained,
    load_tokenizer,
)


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
        metavar="DIR",
        help="local HF directory (config.json + safetensors); default: a tiny random int4 model",
    )
    src.add_argument(
        "--full-width-layers",
        type=int,
        metavar="N",
        help="random model at full DeepSeek-V3 width with N layers (int4 experts "
        "generated on device)",
    )
    p.add_argument(
        "--implementation",
        default=None,
        help="fused_moe backend (xla, pallas, pallas_interpret, ...); default auto",
    )
    p.add_argument(
        "--quantize",
        choices=("int4", "int8"),
        default=None,
        help="quantize float weights: on load with --model, or the random model's "
        "weights (default int4)",
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="activation dtype (default float32 for the tiny model, else bfloat16)",
    )
    return p.parse_args(argv)


def build_model(args):
    """(model, tokenizer, description) for the arguments."""
    if args.model:
        dtype = args.dtype or "bfloat16"
        model = load_pretrained(
            args.model, dtype=dtype, implementation=args.implementation, quantize=args.quantize
        )
        return model, load_tokenizer(args.model, cfg=model.cfg), args.model
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
    model = init_random(cfg, seed=args.seed, implementation=args.implementation)
    return model, load_tokenizer(None, cfg=cfg), what


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    backend_log = _BackendLog()
    moe_logger = logging.getLogger("wna16_jax")
    moe_logger.addHandler(backend_log)
    moe_logger.setLevel(logging.INFO)
    moe_logger.propagate = False  # printed below instead

    t0 = time.perf_counter()
    model, tokenizer, what = build_model(args)
    print(
        f"model: {what} ({time.perf_counter() - t0:.1f} s to build); "
        f"JAX platform {jax.default_backend()}"
    )
    prompt_ids = tokenizer.encode(args.prompt)
    prompts = [prompt_ids] * args.batch_size
    tokens, stats = generate(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        pad_id=tokenizer.pad_id,
        return_stats=True,
    )
    backend = (
        backend_log.lines[-1]
        if backend_log.lines
        else (f"requested {args.implementation!r}" if args.implementation else "auto")
    )
    print(f"fused_moe backend: {backend}")
    for b, row in enumerate(tokens.tolist()):
        new = row[len(prompt_ids) :]
        print(f"[{b}] tokens: {new}")
        print(f"[{b}] text:   {args.prompt!r} -> {tokenizer.decode(new)!r}")
    print(f"speed: {stats}")
    print(f"decode: {stats.decode_tokens_per_s:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
