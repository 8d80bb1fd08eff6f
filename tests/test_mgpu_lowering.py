"""The Mosaic GPU kernels of the 'mgpu' layer's two GEMMs at its shipped (heuristic) configs,
lowered for CUDA on any machine (lowering needs no GPU: it is Mosaic GPU's MLIR) and compared,
without locations, with the hashes recorded in tests/fixtures/mgpu_kernels.json for this jax
version.
A change that alters a kernel fails here: a refactor must leave every hash as it is; after an
intended kernel change, record the new hashes with

    python tests/test_mgpu_lowering.py --update

(the file keeps one table per jax version; other versions skip).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

import wna16_jax as wj

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "mgpu_kernels.json"


class Layer(NamedTuple):
    """A layer's experts and tokens. scale_dtype "e8m0": MXFP4 (E2M1 codes, group 32, held by
    the mgpu_int4 layout). gpt_oss: gpt-oss's expert math, bfloat16 biases of both GEMMs and
    the clamped SwiGLU (wj.ClampedSwiGLU())."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int
    bits: int
    group: int
    zero_points: bool
    scale_dtype: str
    tokens: int
    w8a8: bool
    gpt_oss: bool = False


CASES = {
    "deepseek-v3-g128-zp-m1": Layer(256, 8, 7168, 2048, 4, 128, True, "bfloat16", 1, False),
    "deepseek-v3-g128-zp-m16": Layer(256, 8, 7168, 2048, 4, 128, True, "bfloat16", 16, False),
    "deepseek-v3-g128-zp-m256": Layer(256, 8, 7168, 2048, 4, 128, True, "bfloat16", 256, False),
    "deepseek-v3-g128-zp-m4096": Layer(256, 8, 7168, 2048, 4, 128, True, "bfloat16", 4096, False),
    "deepseek-v3-tp8-g128-sym-m1": Layer(256, 8, 7168, 256, 4, 128, False, "bfloat16", 1, False),
    "kimi-k2-48-experts-g32-sym-m160": Layer(
        48, 8, 7168, 2048, 4, 32, False, "bfloat16", 160, False
    ),
    "kimi-k2-48-experts-g32-sym-m4096": Layer(
        48, 8, 7168, 2048, 4, 32, False, "bfloat16", 4096, False
    ),
    "deepseek-v3-g64-zp-f32-m16": Layer(256, 8, 7168, 2048, 4, 64, True, "float32", 16, False),
    "deepseek-v3-g128-zp-f16-m4096": Layer(
        256, 8, 7168, 2048, 4, 128, True, "float16", 4096, False
    ),
    "deepseek-v3-int8-g32-zp-f16-m1": Layer(256, 8, 7168, 2048, 8, 32, True, "float16", 1, False),
    "qwen3-moe-g128-sym-fp16-m64": Layer(128, 8, 2048, 768, 4, 128, False, "float16", 64, False),
    "w8a16-per-channel-m4096": Layer(256, 8, 7168, 2048, 8, -1, False, "bfloat16", 4096, False),
    "w8a8-per-channel-m256": Layer(256, 8, 7168, 2048, 8, -1, False, "bfloat16", 256, True),
    "gpt-oss-120b-mxfp4-m1": Layer(128, 4, 2880, 2880, 4, 32, False, "e8m0", 1, False),
    "gpt-oss-120b-mxfp4-m4096": Layer(128, 4, 2880, 2880, 4, 32, False, "e8m0", 4096, False),
    "deepseek-v3-mxfp4-m16": Layer(256, 8, 7168, 2048, 4, 32, False, "e8m0", 16, False),
    # gpt-oss-120b's and -20b's experts (H = I = 2880: 45 tiles of 64) with their biases and
    # activation: at decode GEMM1's 8-row blocks fuse both into its epilogue; 16-row blocks of
    # 128 features and 128-row blocks of two consumers do not tile a half of 2880 (the
    # activation follows GEMM1's f32 output)
    "gpt-oss-120b-mxfp4-oai-m1": Layer(128, 4, 2880, 2880, 4, 32, False, "e8m0", 1, False, True),
    "gpt-oss-120b-mxfp4-oai-m4096": Layer(
        128, 4, 2880, 2880, 4, 32, False, "e8m0", 4096, False, True
    ),
    "gpt-oss-20b-mxfp4-oai-m1": Layer(32, 4, 2880, 2880, 4, 32, False, "e8m0", 1, False, True),
    "gpt-oss-20b-mxfp4-oai-m256": Layer(32, 4, 2880, 2880, 4, 32, False, "e8m0", 256, False, True),
}


def _unescaped(text: str) -> bytes:
    """An MLIR string attribute's bytes (its escapes: \\XX hex, \\\\, \\", \\n, \\t)."""
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] != "\\":
            out.append(ord(text[i]))
            i += 1
        elif text[i + 1] in '\\"nt':
            out.append({"n": 10, "t": 9}.get(text[i + 1], ord(text[i + 1])))
            i += 2
        else:
            out.append(int(text[i + 1 : i + 3], 16))
            i += 3
    return bytes(out)


def kernel_texts(lowered_text: str) -> list[str]:
    """The Mosaic GPU modules embedded (as MLIR bytecode) in a lowered program, as MLIR text
    without locations (which name source lines) or the dump file's name."""
    from jax._src.interpreters import mlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir

    texts = []
    for match in re.finditer(r'module = "((?:[^"\\]|\\.)*)"', lowered_text):
        with mlir.make_ir_context() as ctx:
            ctx.allow_unregistered_dialects = True
            mosaic_gpu_dialect.register_dialect(ctx)  # its types (e.g. of barriers)
            module = ir.Module.parse(_unescaped(match.group(1)))
            text = module.operation.get_asm(enable_debug_info=False)
            # the dump file's name counts the kernels the process has lowered
            texts.append(re.sub(r'dump_basename = "[^"]*"', 'dump_basename = ""', text))
    return texts


def lowered_kernels(case) -> list[str]:
    """The case's two GEMMs as the 'mgpu' layer runs them (its config for the case's slots,
    `layer_config`; as many blocks as the alignment uses at most; GEMM1 gated into the
    activation where it tiles; gpt-oss's with their biases), lowered for CUDA on shapes
    alone."""
    from pallas_kernels.mgpu import config as mgpu_config
    from pallas_kernels.mgpu.fused_moe import block_gemm
    from wna16_jax._activations import Int8Rows

    e, k, h, i, bits, group, zp, scale_dtype, t, w8a8, gpt_oss = case

    def experts(n, kk):
        if scale_dtype == "e8m0":
            qw = wj.random_quantized_experts(jax.random.key(0), (e, n, kk), scheme="mxfp4")
            return wj.layouts.to_kernel_layout(qw, "mgpu_int4")
        qw = wj.random_quantized_experts(
            jax.random.key(0), (e, n, kk), bits=bits, group_size=group, has_zeros=zp,
            dtype=jnp.dtype(scale_dtype),
        )  # fmt: skip
        return wj.layouts.to_kernel_layout(qw, f"mgpu_int{bits}")

    w13, w2 = jax.eval_shape(lambda: experts(2 * i, h)), jax.eval_shape(lambda: experts(h, i))
    slots = t * k
    cfg = mgpu_config.layer_config(None, slots, e, w13, w2, int8_rows=w8a8)
    ids = jax.ShapeDtypeStruct((t, k), jnp.int32)
    routing = jax.eval_shape(
        lambda ids: wj.moe_align_block_size(
            ids, num_experts=e, block_m=cfg.block_m, implementation="xla"
        ),
        ids,
    )
    blocks = min(routing.expert_ids.shape[0], slots)
    p = blocks * cfg.block_m
    block_experts = jax.ShapeDtypeStruct((blocks,), jnp.int32)
    in_use = mgpu_config.gemm_rows_in_use(cfg, block_experts)

    def rows(kk):
        if w8a8:
            return Int8Rows(
                jax.ShapeDtypeStruct((p, kk), jnp.int8), jax.ShapeDtypeStruct((p,), jnp.float32)
            )
        return jax.ShapeDtypeStruct((p, kk), jnp.bfloat16)

    gemm = block_gemm(cfg, interpret=False)
    act_dtype = jnp.float32 if w8a8 else jnp.bfloat16
    b13, b2 = (jax.ShapeDtypeStruct((e, n), jnp.bfloat16) if gpt_oss else None for n in (2 * i, h))
    act = wj.ClampedSwiGLU() if gpt_oss else "silu"
    texts = []
    for run, bias in (
        (lambda x, w, be, ru, b: gemm(x, w, be, ru, act_dtype, act, b), b13),
        (lambda x, w, be, ru, b: gemm(x, w, be, ru, bias=b), b2),
    ):
        w, x = (w13, rows(h)) if not texts else (w2, rows(i))
        traced = jax.jit(run).trace(x, w, block_experts, in_use, bias)
        lowered = traced.lower(lowering_platforms=("cuda",))
        texts += kernel_texts(lowered.as_text(debug_info=False))
    return texts


def kernel_hashes(case) -> list[str]:
    return [hashlib.sha256(text.encode()).hexdigest()[:16] for text in lowered_kernels(case)]


def _recorded() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_unchanged(name):
    recorded = _recorded().get(jax.__version__)
    if recorded is None:
        pytest.skip(f"no kernel hashes recorded for jax {jax.__version__} ({FIXTURE.name})")
    hashes = kernel_hashes(CASES[name])
    assert hashes, "the lowered layer holds no Mosaic GPU kernel"
    assert hashes == recorded[name], (
        f"{name}: the Mosaic GPU kernels changed; if intended, record them: "
        f"python tests/test_mgpu_lowering.py --update"
    )


def main(argv=None) -> None:
    """--update: records this jax version's hashes of every case."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--update"]:
        raise SystemExit(__doc__)
    table = _recorded()
    table[jax.__version__] = {name: kernel_hashes(case) for name, case in sorted(CASES.items())}
    FIXTURE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(CASES)} layers' kernels for jax {jax.__version__} in {FIXTURE}")


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    main()
