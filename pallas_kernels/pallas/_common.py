"""In-kernel helpers of the grouped GEMMs, written once: program mapping, operand loads, launch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.pallas import _dequant
from wna16_jax.backend_api import AlignedRouting, BlockConfig


def slice_major(a, *, block_k: int, bits: int):
    """[R, K] activations -> the column order the "slices" unpack mode reads (XLA, outside).

    Inside each k-tile of block_k columns, column k0 + per_word * j + i moves to
    k0 + W * i + j (W = block_k // per_word), so that the activations meeting value slice i of
    the tile's words are one contiguous run of W columns.
    """
    r, k = a.shape
    per_word = 32 // bits
    w = block_k // per_word
    return a.reshape(r, k // block_k, w, per_word).swapaxes(2, 3).reshape(r, k)


def slice_major_columns(c, *, block_k: int, bits: int):
    """Where natural column indices `c` sit after slice_major (int32 arrays, traceable)."""
    per_word = 32 // bits
    w = block_k // per_word
    within = c % block_k
    return c - within + (within % per_word) * w + within // per_word


def _word_range(bits, block_k, words):
    """Word indices j of a k-tile: all block_k // per_word, or the run (start, count)."""
    start, count = (0, block_k // (32 // bits)) if words is None else words
    return start + jnp.arange(count, dtype=jnp.int32)


def slice_words(qw_ref, e, n_idx, k0, *, bits, block_k, words=None):
    """The "slices" k-tile's packed weights: uint32 [bn, W], W = block_k // per_word.

    words: (start, count) loads only words start .. start + count of the tile (e.g. one group
    of a tile that holds several).
    """
    j = _word_range(bits, block_k, words)
    return plgpu.load(qw_ref.at[e, n_idx[:, None], (k0 // (32 // bits) + j)[None, :]])


def slice_activations(a_ref, row, k0, *, bits, block_k, words=None):
    """The "slices" k-tile's activations: [(a_i [bm, W], k_i [W]) for each value slice i].

    a_ref holds the activations in slice_major order, so a_i is a contiguous load; k_i are the
    natural feature indices of slice i (k0 + per_word * j + i). words: as in slice_words (the
    activations meeting those words).
    """
    per_word = 32 // bits
    w = block_k // per_word
    j = _word_range(bits, block_k, words)
    return [
        (plgpu.load(a_ref.at[row[:, None], (k0 + w * i + j)[None, :]]), k0 + per_word * j + i)
        for i in range(per_word)
    ]


def operand_pairs(a_ref, qw_ref, e, row, n_idx, k0, *, bits, block_k, unpack):
    """The k-tile as (a [bm, W], v [bn, W] uint32 values, k [W] feature indices) pairs.

    a is loaded in a_ref's dtype (16/32-bit floats, or int8 for W8A8); v holds the unsigned
    stored values in [0, 2**bits).

    unpack="slices" (a_ref in slice_major order): the [bn, bk // per_word] word tile is loaded
    once and value slice i of the words meets activation columns k0 + per_word * j + i:
    per_word pairs, W = bk // per_word.
    unpack="tile" or "join" (a_ref in natural order): each word is loaded once per value it
    holds (the repeats hit L1) and shifted in place: one pair with W = bk, so the tensor cores
    see one dot of K = bk.
    """
    per_word = 32 // bits
    if unpack in ("tile", "join"):  # natural feature order ("join" outside its exact path)
        kk = k0 + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
        words = plgpu.load(qw_ref.at[e, n_idx[:, None], (kk // per_word)[None, :]])  # [bn, bk]
        shift = ((kk % per_word) * bits).astype(jnp.uint32)
        v = (words >> shift[None, :]) & jnp.uint32((1 << bits) - 1)
        a = plgpu.load(a_ref.at[row[:, None], kk[None, :]])  # [bm, bk]
        return [(a, v, kk)]
    words = slice_words(qw_ref, e, n_idx, k0, bits=bits, block_k=block_k)
    slices = slice_activations(a_ref, row, k0, bits=bits, block_k=block_k)
    return [(a, _dequant.value_slice(words, i, bits=bits), kk) for i, (a, kk) in enumerate(slices)]


def silu(x):
    """x * sigmoid(x) in x's dtype (f32 in the kernels)."""
    return x / (1.0 + jnp.exp(-x))


def gated(activation):
    """The fused epilogue's (gate, up) -> f32 of an activation: "silu" (silu(gate) * up) or a
    ClampedSwiGLU (gpt-oss's: gate clamped above at limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate))."""
    if activation == "silu":
        return lambda gate, up: silu(gate) * up
    alpha, limit = activation.alpha, activation.limit

    def clamped_swiglu(gate, up):
        g = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1.0) * (g / (1.0 + jnp.exp(-alpha * g)))

    return clamped_swiglu


def grouped_gemm_program(
    ids_ref,  # [max_padded] int32 sorted slot ids
    eids_ref,  # [num_blocks] int32 expert of each block
    ntpp_ref,  # [1] int32 num_tokens_post_padded
    rw_ref,  # [num_slots] f32 routed weights, or None
    out_ref,  # [num_slots + 1, N]; row num_slots is a spare row for padding
    *,
    num_slots: int,
    top_k: int,
    n: int,
    k: int,
    config: BlockConfig,
    tile_product: Callable,
    acc_dtype=jnp.float32,
    epilogue: Callable | None = None,
    gate_offset: int | None = None,
    out_columns: Callable | None = None,
    bias_ref=None,
    activation="silu",
):
    """One program of a grouped GEMM over block-sorted token slots.

    Program (pid, split) owns rows m_block * bm .. + bm of the sorted slots and columns
    n_block * bn .. + bn, and k-tiles split * tiles .. + tiles (tiles = K / bk / split_k).
    Blocks past num_tokens_post_padded exit at once; blocks of expert -1 store zeros (split_k
    == 1; a split-K buffer starts at zero); padding slots write the spare row num_slots.

    Args:
        tile_product: (e, row [bm], n_idxs, k0) -> one acc_dtype [bm, bn] per [bn] array in
            the tuple n_idxs: one k-tile's contribution for activation rows `row`
            (slot // top_k) of expert e and weight rows n_idx (the activations loaded once).
        acc_dtype: the k-sum's dtype (f32, or int32 for integer dots).
        epilogue: (acc, e, row, n_idx) -> f32 [bm, bn], applied to the k-sum before the routed
            weight; default: the k-sum itself.
        gate_offset: the fused activation (split_k == 1 only): the program sums two products,
            gate over weight rows n_idx and up over rows n_idx + gate_offset, and stores
            silu(gate) * up in f32 arithmetic (`n` counts output columns: gate_offset of them).
        out_columns: n_idx -> the output columns to store to (default n_idx), e.g. the
            slice_major order the next GEMM reads.
        bias_ref: None, or [E, N] per-expert biases added to the f32 sums (gate's and up's)
            before the activation and the routed weight (by split 0 alone under split-K).
        activation: the fused activation of gate_offset: "silu" or a ClampedSwiGLU (`gated`).
    """
    bm, bn, bk, split_k = config.block_m, config.block_n, config.block_k, config.split_k
    num_n_blocks = n // bn
    pid = pl.program_id(0)
    split = pl.program_id(1)
    m_block = pid // num_n_blocks
    n_block = pid % num_n_blocks
    ntpp = ntpp_ref[0]

    @pl.when(m_block * bm < ntpp)
    def _():
        e = eids_ref[m_block]
        slot = plgpu.load(ids_ref.at[pl.ds(m_block * bm, bm)])  # [bm]
        valid = slot < num_slots
        out_row = jnp.where(valid, slot, num_slots)  # padding -> the spare row
        n_idx = n_block * bn + jnp.arange(bn, dtype=jnp.int32)  # [bn]
        cols = n_idx if out_columns is None else out_columns(n_idx)
        out_at = out_ref.at[out_row[:, None], cols[None, :]]

        if split_k == 1:
            # Blocks of off-shard experts contribute exact zeros (split-K buffers start at 0).
            @pl.when(e < 0)
            def _():
                plgpu.store(out_at, jnp.zeros((bm, bn), out_ref.dtype))

        @pl.when(e >= 0)
        def _():
            row = jnp.where(valid, slot // top_k, 0)  # [bm] activation rows
            tiles = k // bk // split_k
            first = split * tiles

            if gate_offset is None:

                def body(t, acc):
                    (part,) = tile_product(e, row, (n_idx,), (first + t) * bk)
                    return acc + part

                acc = jax.lax.fori_loop(0, tiles, body, jnp.zeros((bm, bn), acc_dtype))
                if epilogue is not None:
                    acc = epilogue(acc, e, row, n_idx)
                if bias_ref is not None:
                    b = plgpu.load(bias_ref.at[e, n_idx]).astype(jnp.float32)  # [bn]
                    acc = acc + (b if split_k == 1 else jnp.where(split == 0, b, 0.0))[None, :]
            else:

                def gated_body(t, accs):
                    parts = tile_product(e, row, (n_idx, n_idx + gate_offset), (first + t) * bk)
                    return accs[0] + parts[0], accs[1] + parts[1]

                zero = jnp.zeros((bm, bn), acc_dtype)
                gate, up = jax.lax.fori_loop(0, tiles, gated_body, (zero, zero))
                if epilogue is not None:
                    gate = epilogue(gate, e, row, n_idx)
                    up = epilogue(up, e, row, n_idx + gate_offset)
                gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
                if bias_ref is not None:
                    gate = gate + plgpu.load(bias_ref.at[e, n_idx]).astype(jnp.float32)[None, :]
                    b_up = plgpu.load(bias_ref.at[e, n_idx + gate_offset]).astype(jnp.float32)
                    up = up + b_up[None, :]
                acc = gated(activation)(gate, up)
            if rw_ref is not None:
                rw = plgpu.load(rw_ref.at[jnp.where(valid, slot, 0)])  # [bm]
                acc = acc * rw[:, None]
            if split_k == 1:
                plgpu.store(out_at, acc.astype(out_ref.dtype))
            else:
                plgpu.atomic_add(out_at, (), acc)


def grouped_gemm_call(
    kernel: Callable,
    operands: Sequence,
    *,
    routing: AlignedRouting,
    num_slots: int,
    n: int,
    out_dtype,
    config: BlockConfig,
    interpret: bool,
    name: str,
):
    """Launches a grouped GEMM kernel over (num_blocks * N / block_n, split_k) programs.

    Args:
        kernel: (ids_ref, eids_ref, ntpp_ref, *operand_refs, out_ref) -> None; an operand given
            as None arrives as a None ref.
        operands: the kernel's arrays after the routing, None for absent optional ones.
        routing: AlignedRouting (its block_m is config.block_m).
        num_slots: rows of the output (the routing's slot count).
        n: output columns.
        out_dtype: the kernel's store dtype when split_k == 1.
        config: BlockConfig of the launch (grid, split-K, warps, stages).
        interpret: run under the Pallas interpreter.
        name: the kernel's name.

    Returns:
        [num_slots, N] in out_dtype (split_k == 1) or f32 (split_k > 1, accumulated with atomic
        adds into a zeroed buffer).
    """
    present = [x is not None for x in operands]
    inputs = [routing.sorted_token_ids, routing.expert_ids]
    inputs += [routing.num_tokens_post_padded.reshape(1)]
    inputs += [x for x in operands if x is not None]

    def with_optionals(*refs):
        fixed, rest = refs[:3], list(refs[3:])
        args = [rest.pop(0) if p else None for p in present]
        kernel(*fixed, *args, *rest)

    out_rows = num_slots + 1  # the last row takes padding slots' stores
    num_blocks = routing.expert_ids.shape[0]
    grid = (num_blocks * (n // config.block_n), config.split_k)
    if config.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((out_rows, n), out_dtype)
        aliases = {}
        body = with_optionals
    else:
        inputs.append(jnp.zeros((out_rows, n), jnp.float32))
        out_shape = jax.ShapeDtypeStruct((out_rows, n), jnp.float32)
        aliases = {len(inputs) - 1: 0}

        def body(*refs):
            *ins, _zero_in, out = refs
            with_optionals(*ins, out)

    out = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=interpret,
        name=name,
    )(*inputs)
    return out[:num_slots]
