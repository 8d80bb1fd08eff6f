"""A Triton kernel launch described once: run by jax_triton, compiled for a target, or interpreted.

Each kernel wrapper builds a `Launch`; `run` calls it through `jax_triton.triton_call` (NVIDIA
GPU), or with interpret=True through Triton's own interpreter on the host (any platform, inside
`jax.pure_callback`, so also under jit); `compile_for` compiles it for a given GPU target without
a GPU (the tests check sm_90 compiles on CPU). `triton` and `jax_triton` are imported lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# jax_triton assumes every array argument is 16-byte aligned (XLA buffers are).
POINTER_ALIGNMENT = 16

# dtype name -> Triton's signature type name.
_TRITON_TYPE_NAMES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
}


@dataclasses.dataclass(frozen=True, eq=False)
class Launch:
    """One launch of a `triton.jit` kernel over JAX arrays.

    The kernel's parameters are the pointers of `inputs`, then those of `outputs` (jax_triton's
    order), then the constexprs, named as in `constexprs`; it takes no runtime scalars.

    Attributes:
        kernel: the `triton.jit` function.
        inputs: arrays (or jax.ShapeDtypeStruct for `compile_for`), in parameter order.
        outputs: jax.ShapeDtypeStruct of each output, in parameter order.
        grid: programs per grid axis (up to 3).
        constexprs: name -> value of every constexpr parameter.
        num_warps, num_stages: Triton compile options.
        zeroed_outputs: indices into `outputs` zeroed before the kernel runs (atomic targets).
        aliases: (input index, output index) pairs: the output is the input's buffer (the
            kernel still takes both pointers).
        name: the custom call's name (shows in profiles).
    """

    kernel: Any
    inputs: tuple
    outputs: tuple
    grid: tuple[int, ...]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    zeroed_outputs: tuple[int, ...] = ()
    aliases: tuple[tuple[int, int], ...] = ()
    name: str = ""

    def check_signature(self) -> None:
        """Raises ValueError when the kernel's parameters do not match arrays + constexprs."""
        names = list(self.kernel.arg_names)
        num_arrays = len(self.inputs) + len(self.outputs)
        want = names[num_arrays:]
        if len(names) < num_arrays or sorted(want) != sorted(self.constexprs):
            raise ValueError(
                f"{self.kernel.__name__} takes {names}; the launch passes {num_arrays} arrays "
                f"and the constexprs {sorted(self.constexprs)}"
            )


def triton_type_name(dtype) -> str:
    """The Triton signature name of a pointer to `dtype` elements, e.g. '*bf16'."""
    name = jnp.dtype(dtype).name
    if name not in _TRITON_TYPE_NAMES:
        raise ValueError(f"no Triton type for dtype {name}")
    return "*" + _TRITON_TYPE_NAMES[name]


def run(launch: Launch, *, interpret: bool = False) -> tuple:
    """The launch's outputs: through jax_triton (GPU) or Triton's interpreter (host)."""
    launch.check_signature()
    if interpret:
        host = functools.partial(_interpret_host, dataclasses.replace(launch, inputs=()))
        return tuple(jax.pure_callback(host, launch.outputs, *launch.inputs))
    import jax_triton  # optional: imported on first use

    outs = jax_triton.triton_call(
        *launch.inputs,
        kernel=launch.kernel,
        out_shape=list(launch.outputs),
        grid=launch.grid,
        name=launch.name,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        zeroed_outputs=launch.zeroed_outputs,
        input_output_aliases=dict(launch.aliases),
        **launch.constexprs,
    )
    return tuple(outs)


def compile_for(launch: Launch, target):
    """Compiles the launch's kernel for `target` (a triton GPUTarget) as jax_triton would.

    Same signature, constexprs, 16-byte pointer alignment and options as `run`; needs no GPU.
    Returns triton's CompiledKernel (asm: ttir, ttgir, llir, ptx, cubin; metadata.shared).
    """
    import triton
    from triton.compiler import ASTSource

    launch.check_signature()
    arrays = [*launch.inputs, *launch.outputs]
    names = launch.kernel.arg_names
    signature = {name: triton_type_name(a.dtype) for name, a in zip(names, arrays, strict=False)}
    signature.update({name: "constexpr" for name in launch.constexprs})
    attrs = {(i,): [["tt.divisibility", POINTER_ALIGNMENT]] for i in range(len(arrays))}
    source = ASTSource(
        fn=launch.kernel, signature=signature, constexprs=dict(launch.constexprs), attrs=attrs
    )
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return triton.compile(source, target=target, options=options)


# ---- Triton's interpreter on host arrays ----------------------------------------------------
#
# Triton's interpreter (triton.runtime.interpreter) runs a kernel program by program in numpy.
# It expects torch tensors; _HostTensor gives it the few tensor methods it calls over a numpy
# array. Two adjustments make it run these kernels without TRITON_INTERPRET=1 (which would turn
# every kernel into an interpreted one for good): nested @triton.jit calls (helpers, tl.sum,
# tl.cumsum) are interpreted while a kernel runs, and bfloat16 values (stored as raw uint16 by
# the interpreter) are widened to f32 bits for dots and for conversions from and to integers,
# and rounded to nearest even from f32 (the interpreter truncates; compiled kernels round).

_INTERPRET_LOCK = threading.Lock()

# Poison of fresh (not zeroed) outputs: an element the kernel should write but does not shows.
_INT_POISON = -123456789


class _HostStorage:
    def __init__(self, array: np.ndarray):
        self.array = array

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other) -> None:
        if other.array is not self.array:
            self.array[...] = other.array


class _HostTensor:
    """The part of torch.Tensor's surface that Triton's interpreter uses, over a numpy array."""

    def __init__(self, array: np.ndarray, dtype):
        self.array = np.ascontiguousarray(array)
        self.dtype = dtype  # a triton.language dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostStorage:
        return _HostStorage(self.array)

    def new_empty(self, *args, **kwargs) -> _HostTensor:
        return _HostTensor(np.empty(0, self.array.dtype), self.dtype)

    def set_(self, storage: _HostStorage, *args) -> _HostTensor:
        self.array = storage.array
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other) -> None:
        _HostStorage(self.array).copy_(_HostStorage(other.array))


def _tl_dtype(dtype):
    import triton.language as tl

    return getattr(tl, jnp.dtype(dtype).name)


def _poisoned(shape, dtype) -> np.ndarray:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.full(shape, np.nan, dtype)
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return np.full(shape, _INT_POISON, dtype)
    return np.full(shape, np.iinfo(dtype).max, dtype)


@contextlib.contextmanager
def _interpreter_patches(kernel):
    """Interpreted nested @triton.jit calls and f32-widened bf16 dots, while one kernel runs."""
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    builder = interpreter.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl
    jit_call = JITFunction.__call__

    def interpreted_call(self, *args, **kwargs):
        # Helpers, and triton.language's own jit functions (tl.sum, tl.cumsum, ...).
        return _interpreted(self.fn)(*args, **kwargs)

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        wide = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(wide, tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def patched_cast(self, src, dst_type):
        ends = (src.dtype.scalar, dst_type.scalar)
        if ends == (tl.float32, tl.bfloat16):  # round to nearest even, as compiled kernels do
            rounded = src.data.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        if tl.bfloat16 in ends and tl.float32 not in ends and ends[0] != ends[1]:
            # bf16 <-> an integer type through f32 (the interpreter would convert bf16's raw
            # uint16 storage as values).
            return cast_impl(self, cast_impl(self, src, tl.float32), dst_type)
        return cast_impl(self, src, dst_type)

    with _INTERPRET_LOCK:
        try:
            JITFunction.__call__ = interpreted_call
            builder.create_dot, builder.cast_impl = patched_dot, patched_cast
            yield _interpreted(kernel.fn)
        finally:
            builder.create_dot, builder.cast_impl = create_dot, cast_impl
            JITFunction.__call__ = jit_call


@functools.cache
def _interpreted(fn):
    from triton.runtime import interpreter

    return interpreter.InterpretedFunction(fn)


def interpret_numpy(launch: Launch, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Runs the launch in Triton's interpreter on host arrays; returns the outputs.

    Outputs start as their aliased input, zeroed (zeroed_outputs), or else poisoned (NaN, or
    -123456789 / the max for integers), so elements the kernel leaves unwritten are visible.
    """
    ins = [_HostTensor(np.array(a, copy=True), _tl_dtype(a.dtype)) for a in inputs]
    aliased = {o: i for i, o in launch.aliases}
    outs = []
    for i, spec in enumerate(launch.outputs):
        if i in aliased:
            fresh = np.array(inputs[aliased[i]], spec.dtype, copy=True)
        elif i in launch.zeroed_outputs:
            fresh = np.zeros(spec.shape, spec.dtype)
        else:
            fresh = _poisoned(spec.shape, spec.dtype)
        outs.append(_HostTensor(fresh, _tl_dtype(spec.dtype)))
    with _interpreter_patches(launch.kernel) as kernel:
        kernel[tuple(launch.grid)](*ins, *outs, **launch.constexprs)
    return [o.array for o in outs]


def _interpret_host(launch: Launch, *arrays) -> tuple[np.ndarray, ...]:
    return tuple(interpret_numpy(launch, [np.asarray(a) for a in arrays]))
