"""Dequant-fused grouped matmul over block-sorted token slots in Triton (int4/int8/MXFP4)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.common import block_configs
from pallas_kernels.triton import _launch
from pallas_kernels.triton.config import MIN_SPAN, check_triton_config
from wna16_jax import backend_api
from wna16_jax.backend_api import AlignedRouting, BlockConfig, QuantizedExperts

SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")

# The exponent trick: or-ing v into the mantissa of the 16-bit float 2^p gives 2^p + v
# exactly (an int -> float conversion becomes one logical op).
# dtype name: (bit pattern of 2^p, 2^p, the widest v in bits that stays exact)
_HALF_MAGIC = {"bfloat16": (0x4300, 128, 7), "float16": (0x6400, 1024, 10)}


@triton.jit
def _span_product(
    a_rows,  # [BM, 1] pointers to the activation rows
    qw_rows,  # [BN, 1] pointers to expert e's packed weight rows (uint32 words)
    s_rows,  # [BN] pointers to expert e's scale rows
    z_rows,  # [BN] pointers to expert e's zero-point bytes (unused without zeros)
    z_shift,  # [BN] int32 bit offset of each row's zero point in its byte (int4)
    k0,  # first input feature of the span
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    SPAN: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    LOAD_ONCE: tl.constexpr,
    MAGIC: tl.constexpr,
    OFFSET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    E2M1: tl.constexpr,
):
    """f32 [BM, BN] = a[:, k0:k0+SPAN] @ dequant(w[:, k0:k0+SPAN]).T, the span inside one group.

    The group's scale multiplies the [BM, BN] product; the zero point comes off the product
    as z * rowsum(a) (or off the integers before the dot when no exponent trick applies).
    E2M1 (MXFP4): the codes' values (exact in every activation dtype) meet the activations and
    the group's E8M0 scale 2^(X - 127) multiplies the product.
    """
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_k = k0 + tl.arange(0, SPAN)
    a = tl.load(a_rows + offs_k[None, :])  # [BM, SPAN]
    if LOAD_ONCE:
        # Each word once: [BN, SPAN / PER_WORD] words -> [BN, SPAN / PER_WORD, PER_WORD] values
        # -> [BN, SPAN], value i of word j being feature k0 + PER_WORD * j + i.
        words = tl.load(qw_rows + (k0 // PER_WORD + tl.arange(0, SPAN // PER_WORD))[None, :])
        shifts = tl.arange(0, PER_WORD) * BITS
        v = (words[:, :, None] >> shifts[None, None, :]) & MASK
        v = tl.reshape(v, [words.shape[0], SPAN])
    else:
        # Each word loaded once per value it holds (the repeats hit L1), shifted in place.
        words = tl.load(qw_rows + (offs_k // PER_WORD)[None, :])  # [BN, SPAN]
        v = (words >> ((offs_k % PER_WORD) * BITS)[None, :]) & MASK  # [BN, SPAN] uint32
    g = k0 // GROUP
    if E2M1:
        # The value's f32 bits: 0, 252 << 22 (0.5) and (m + 252) << 22 for the magnitudes
        # m = 2..7 (1 .. 6); the code's bit 3 is the sign. The scale: X in the exponent field.
        mag = v & 7
        bits = tl.where(mag < 2, mag * (252 << 22), (mag + 252) << 22) | ((v & 8) << 28)
        w = bits.to(tl.float32, bitcast=True).to(a.dtype)  # [BN, SPAN]
        x = tl.load(s_rows + g).to(tl.uint32)  # [BN] E8M0 bytes
        s = (x << 23).to(tl.float32, bitcast=True)
        return tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION) * s[None, :]
    s = tl.load(s_rows + g).to(tl.float32)  # [BN]
    if HAS_ZEROS:
        z = (tl.load(z_rows + g).to(tl.int32) >> z_shift) & MASK  # [BN]
    else:
        z = tl.full(s.shape, 1 << (BITS - 1), tl.int32)  # the implicit zero 8 / 128
    if OFFSET > 0:
        # OFFSET + v exactly in the activation dtype; OFFSET and z come off through rowsum(a).
        w = (v | MAGIC).to(tl.uint16).to(a.dtype, bitcast=True)  # [BN, SPAN]
        part = tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
        rowsum = tl.sum(a.to(tl.float32), axis=1)  # [BM]
        part = part - rowsum[:, None] * (z + OFFSET).to(tl.float32)[None, :]
    else:
        # v - z is an integer of at most 9 bits: exact in bf16, fp16 and f32.
        w = (v.to(tl.int32) - z[:, None]).to(a.dtype)  # [BN, SPAN]
        part = tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    return part * s[None, :]


@triton.jit
def _gemm_program(
    ids_ptr,  # [P] int32 sorted slot ids; padding holds NUM_SLOTS
    eids_ptr,  # [NUM_BLOCKS] int32 expert of each block (-1: off-shard or past the end)
    ntpp_ptr,  # [1] int32 num_tokens_post_padded
    a_ptr,  # [R, K] activations (bf16/f16/f32); slot s reads row s // TOP_K
    qw_ptr,  # [E, N, K // PER_WORD] uint32
    s_ptr,  # [E, N, K // GROUP] scales
    z_ptr,  # [E, N // 2, K // GROUP] uint8 (int4, even n low nibble) / [E, N, K // GROUP] (int8)
    rw_ptr,  # [NUM_SLOTS] f32 routed weights (a 1-element dummy without them)
    bias_ptr,  # [E, N] per-expert biases (a 1-element dummy without them)
    out_ptr,  # [NUM_SLOTS, N]; f32 and zeroed when SPLIT_K > 1
    NUM_SLOTS: tl.constexpr,
    TOP_K: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_RW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPAN: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    LOAD_ONCE: tl.constexpr,
    MAGIC: tl.constexpr,
    OFFSET: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    E2M1: tl.constexpr,
):
    """Program (pid, split): rows of block m_block, columns n_block * BN.., k-tiles of split.

    Blocks at or past num_tokens_post_padded exit at once; blocks of expert -1 store zeros
    (split_k == 1); padding slots read activation row 0 and are masked out of every store.
    The epilogue adds expert e's bias to the f32 sums (split 0 alone under split-K), then
    multiplies by the routed weight.
    """
    PER_WORD: tl.constexpr = 32 // BITS
    NUM_N_BLOCKS: tl.constexpr = N // BN
    NUM_GROUPS: tl.constexpr = K // GROUP
    TILES: tl.constexpr = K // BK // SPLIT_K

    # Programs walk GROUP_M row blocks for each column block, so neighbours share weight tiles.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    per_group = GROUP_M * NUM_N_BLOCKS
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(NUM_BLOCKS - first_m, GROUP_M)
    m_block = first_m + (pid % per_group) % rows_in_group
    n_block = (pid % per_group) // rows_in_group

    if m_block * BM < tl.load(ntpp_ptr):
        e = tl.load(eids_ptr + m_block)
        slot = tl.load(ids_ptr + m_block * BM + tl.arange(0, BM))  # [BM]
        valid = slot < NUM_SLOTS  # padding slots are masked out of every store
        offs_n = n_block * BN + tl.arange(0, BN)  # [BN]
        out_ptrs = out_ptr + slot.to(tl.int64)[:, None] * N + offs_n[None, :]
        if e < 0:
            # Off-shard expert: exact zeros (a split-K buffer is zero already).
            if SPLIT_K == 1:
                zero = tl.zeros([BM, BN], out_ptr.dtype.element_ty)
                tl.store(out_ptrs, zero, mask=valid[:, None])
        else:
            row = tl.where(valid, slot // TOP_K, 0).to(tl.int64)
            a_rows = a_ptr + row[:, None] * K  # [BM, 1]
            # 64-bit expert offsets: DeepSeek-V3's w13 qweight alone is 3.76e9 bytes.
            e64 = e.to(tl.int64)
            qw_rows = qw_ptr + e64 * (N * (K // PER_WORD)) + offs_n[:, None] * (K // PER_WORD)
            s_rows = s_ptr + e64 * (N * NUM_GROUPS) + offs_n * NUM_GROUPS  # [BN]
            if BITS == 4:
                z_rows = z_ptr + e64 * ((N // 2) * NUM_GROUPS) + (offs_n // 2) * NUM_GROUPS
                z_shift = (offs_n % 2) * 4
            else:
                z_rows = z_ptr + e64 * (N * NUM_GROUPS) + offs_n * NUM_GROUPS
                z_shift = offs_n * 0
            acc = tl.zeros([BM, BN], tl.float32)
            for t in range(TILES):
                k_tile = (split * TILES + t) * BK
                for sub in tl.static_range(BK // SPAN):
                    acc += _span_product(
                        a_rows,
                        qw_rows,
                        s_rows,
                        z_rows,
                        z_shift,
                        k_tile + sub * SPAN,
                        BITS,
                        GROUP,
                        SPAN,
                        HAS_ZEROS,
                        LOAD_ONCE,
                        MAGIC,
                        OFFSET,
                        DOT_PRECISION,
                        E2M1,
                    )
            if HAS_BIAS:
                b = tl.load(bias_ptr + e64 * N + offs_n).to(tl.float32)  # [BN]
                if SPLIT_K > 1:
                    b = tl.where(split == 0, b, 0.0)
                acc += b[None, :]
            if HAS_RW:
                rw = tl.load(rw_ptr + tl.where(valid, slot, 0), mask=valid, other=0.0)
                acc = acc * rw[:, None]
            if SPLIT_K == 1:
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None])
            else:
                tl.atomic_add(out_ptrs, acc, mask=valid[:, None], sem="relaxed")


@triton.jit
def _wna16_gemm_kernel(
    ids_ptr, eids_ptr, ntpp_ptr, a_ptr, qw_ptr, s_ptr, z_ptr, rw_ptr, bias_ptr,
    out_ptr,  # [NUM_SLOTS, N] fresh output
    NUM_SLOTS: tl.constexpr, TOP_K: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_RW: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr, SPAN: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    LOAD_ONCE: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    DOT_PRECISION: tl.constexpr, E2M1: tl.constexpr,
):  # fmt: skip
    _gemm_program(
        ids_ptr, eids_ptr, ntpp_ptr, a_ptr, qw_ptr, s_ptr, z_ptr, rw_ptr, bias_ptr, out_ptr,
        NUM_SLOTS, TOP_K, N, K, NUM_BLOCKS, BITS, GROUP, HAS_ZEROS, HAS_RW, HAS_BIAS, BM, BN,
        BK, SPAN, SPLIT_K, GROUP_M, LOAD_ONCE, MAGIC, OFFSET, DOT_PRECISION, E2M1,
    )  # fmt: skip


@triton.jit
def _wna16_gemm_into_kernel(
    ids_ptr, eids_ptr, ntpp_ptr, a_ptr, qw_ptr, s_ptr, z_ptr, rw_ptr, bias_ptr,
    init_ptr,  # [NUM_SLOTS, N] the caller's buffer, aliased to out_ptr (not read)
    out_ptr,
    NUM_SLOTS: tl.constexpr, TOP_K: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_RW: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr, SPAN: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    LOAD_ONCE: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
    DOT_PRECISION: tl.constexpr, E2M1: tl.constexpr,
):  # fmt: skip
    _gemm_program(
        ids_ptr, eids_ptr, ntpp_ptr, a_ptr, qw_ptr, s_ptr, z_ptr, rw_ptr, bias_ptr, out_ptr,
        NUM_SLOTS, TOP_K, N, K, NUM_BLOCKS, BITS, GROUP, HAS_ZEROS, HAS_RW, HAS_BIAS, BM, BN,
        BK, SPAN, SPLIT_K, GROUP_M, LOAD_ONCE, MAGIC, OFFSET, DOT_PRECISION, E2M1,
    )  # fmt: skip


def check_gemm_config(config: BlockConfig, qw: QuantizedExperts) -> None:
    """Raises ValueError when `config` cannot run a GEMM over `qw` ([E, N, K])."""
    block_configs.check_config(config, backend_api.GemmShape.of_weights(qw))
    check_triton_config(config)
    span = min(config.block_k, qw.group)
    if span < MIN_SPAN:
        raise ValueError(
            f"group_size={qw.group_size} with block_k={config.block_k} gives dots over "
            f"{span} input features; the Triton kernel's dots contract at least {MIN_SPAN} "
            f"(one group, or one k-tile inside a group)"
        )


def span_of(config: BlockConfig, qw: QuantizedExperts) -> int:
    """Input features per dot: the k-tile when it lies inside one group, else one group."""
    return min(config.block_k, qw.group)


def gemm_launch(
    a,
    qw: QuantizedExperts,
    routing: AlignedRouting,
    routed_weights=None,
    *,
    top_k: int,
    config: BlockConfig,
    out_dtype=None,
    out_init=None,
    bias=None,
) -> _launch.Launch:
    """The kernel launch of `wna16_gemm` (arguments as there; arrays or jax.ShapeDtypeStruct).

    Its single output is [R * top_k, N] of out_dtype (split_k == 1; written into out_init when
    given) or a zeroed f32 split-K buffer (split_k > 1).
    """
    check_gemm_config(config, qw)
    r, k = a.shape
    block_configs.check_gemm_operands(config, routing, k, qw)
    e, n, _ = qw.shape
    dtype = jnp.dtype(a.dtype)
    if dtype.name not in SUPPORTED_DTYPES:
        raise ValueError(f"activation dtype {dtype} is not one of {SUPPORTED_DTYPES}")
    num_slots = r * top_k
    if routed_weights is not None and tuple(routed_weights.shape) != (num_slots,):
        raise ValueError(
            f"routed_weights must be [R * top_k] = [{num_slots}], got {tuple(routed_weights.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"bias must be [E, N] = {[e, n]}, got {tuple(bias.shape)}")
    out_dtype = jnp.dtype(out_dtype or dtype)
    magic, offset, widest = _HALF_MAGIC.get(dtype.name, (0, 0, 0))
    if qw.bits > widest or qw.is_mxfp4:  # no exponent trick: integers (or E2M1 values) dotted
        magic, offset = 0, 0
    num_blocks = routing.expert_ids.shape[0]
    zeros = qw.zeros if qw.has_zeros else jnp.zeros((1,), jnp.uint8)
    if routed_weights is None:
        rw = jnp.zeros((1,), jnp.float32)
    else:
        rw = routed_weights.astype(jnp.float32)
    has_bias = bias is not None
    bias = bias if has_bias else jnp.zeros((1,), jnp.float32)
    split = config.split_k > 1
    out = jax.ShapeDtypeStruct((num_slots, n), jnp.float32 if split else out_dtype)
    inputs = (
        routing.sorted_token_ids,
        routing.expert_ids,
        routing.num_tokens_post_padded.reshape(1),
        a,
        qw.qweight,
        qw.scales,
        zeros,
        rw,
        bias,
    )
    kernel, aliases = _wna16_gemm_kernel, ()
    if out_init is not None:
        if split:
            raise ValueError("out_init needs split_k == 1 (split-K accumulates into zeros)")
        if (tuple(out_init.shape), jnp.dtype(out_init.dtype)) != (out.shape, out.dtype):
            raise ValueError(
                f"out_init must be {out.dtype} {out.shape}, got {out_init.dtype} "
                f"{tuple(out_init.shape)}"
            )
        inputs += (out_init,)
        kernel, aliases = _wna16_gemm_into_kernel, ((len(inputs) - 1, 0),)
    return _launch.Launch(
        kernel=kernel,
        inputs=inputs,
        aliases=aliases,
        outputs=(out,),
        grid=(num_blocks * (n // config.block_n), config.split_k),
        constexprs=dict(
            NUM_SLOTS=num_slots,
            TOP_K=top_k,
            N=n,
            K=k,
            NUM_BLOCKS=num_blocks,
            BITS=qw.bits,
            GROUP=qw.group,
            HAS_ZEROS=qw.has_zeros,
            HAS_RW=routed_weights is not None,
            HAS_BIAS=has_bias,
            BM=config.block_m,
            BN=config.block_n,
            BK=config.block_k,
            SPAN=span_of(config, qw),
            SPLIT_K=config.split_k,
            GROUP_M=config.group_m,
            LOAD_ONCE=config.unpack == "slices",
            MAGIC=magic,
            OFFSET=offset,
            # f32 operands dot in IEEE f32 (TF32 keeps 10 mantissa bits); 16-bit ignore it.
            DOT_PRECISION="ieee" if dtype == jnp.float32 else "tf32",
            E2M1=qw.is_mxfp4,
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        zeroed_outputs=(0,) if split else (),
        name="triton_wna16_gemm_mxfp4" if qw.is_mxfp4 else f"triton_wna16_gemm_int{qw.bits}",
    )


@functools.partial(jax.jit, static_argnames=("top_k", "config", "out_dtype", "interpret"))
def wna16_gemm(
    a,
    qw: QuantizedExperts,
    routing: AlignedRouting,
    routed_weights=None,
    *,
    top_k: int,
    config: BlockConfig,
    out_dtype=None,
    out_init=None,
    interpret: bool = False,
    bias=None,
):
    """Grouped matmul of gathered activation rows with dequantized expert weights (Triton).

    out[s] = (a[s // top_k] @ dequant(qw[e(s)]).T + bias[e(s)]) * routed_weights[s] for each
    slot s of the routing, where e(s) is the expert of the block holding s (zeros for expert
    -1).

    Each dot contracts a span of min(block_k, G) input features inside one group: the group's
    scale multiplies the f32 [bm, bn] product, not each weight. For bf16 with int4 and for fp16
    the values convert by the exponent trick (2^p + v exactly) and (2^p + z) * rowsum(a) comes
    off the product; otherwise the integers v - z convert exactly before the dot. f32
    activations dot in IEEE f32. config.unpack: "slices" loads each packed word once and
    unpacks it in registers (shift by a [32 // bits] vector, reshape); "tile" loads each word
    once per value it holds (the repeats hit L1) and shifts in place.

    Args:
        a: [R, K] bf16/f16/f32 activations; the routing's slots number R * top_k.
        qw: QuantizedExperts [E, N, K] (group size a multiple of 16, or -1), integer codes or
            MXFP4 (E8M0 scale bytes 0 and 255, 2^-127 and NaN, read as 0 and inf).
        routing: AlignedRouting with block_m == config.block_m.
        routed_weights: optional f32 [R * top_k] per-slot multipliers.
        top_k: slots per activation row.
        config: BlockConfig (the rules of block_configs.check_config; split_k > 1 accumulates
            the partial tiles with atomic adds into a zeroed f32 buffer).
        out_dtype: output dtype (default a.dtype; split-K always accumulates in f32).
        out_init: optional [R * top_k, N] out_dtype buffer the kernel writes into (split_k == 1
            only); rows it does not write keep their values (tests pass NaN to see coverage).
        interpret: run in Triton's interpreter on the host (any platform; slow).
        bias: optional [E, N] per-expert biases (bf16/f16/f32), added to the f32 sums before
            the routed weights and the output's rounding.

    Returns:
        [R * top_k, N] of out_dtype. Rows of slots that sit in no block (ids the alignment
        dropped) are not written when split_k == 1 and are zero when split_k > 1: callers mask
        them (fused_moe does, in its reduction).

    Raises:
        ValueError: a config that cannot run the shapes, a span under 16 features, mismatched
            shapes or block_m.
    """
    launch = gemm_launch(
        a,
        qw,
        routing,
        routed_weights,
        top_k=top_k,
        config=config,
        out_dtype=out_dtype,
        out_init=out_init,
        bias=bias,
    )
    (out,) = _launch.run(launch, interpret=interpret)
    return out.astype(out_dtype or a.dtype)
