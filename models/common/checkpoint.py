"""Hugging Face checkpoints on disk, for every family: config.json, safetensors files (one, or
sharded with model.safetensors.index.json) read lazily tensor by tensor, Hub ids, FP8 block
dequantization and sharded safetensors writing.

Reads only JSON and safetensors (never pickle). A family's loader (its checkpoint name table)
checks what it needs from the headers (`Checkpoint.meta`) before reading any data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

logger = logging.getLogger("models")

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INT_DTYPES = ("I8", "U8", "I16", "I32", "U32", "I64")
NP_DTYPES = {
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "U8": np.uint8,
    "I16": np.int16,
    "I32": np.int32,
    "U32": np.uint32,
    "I64": np.int64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
}
# safetensors dtypes its numpy reader has no dtype for: read from the file's bytes.
RAW_DTYPES = ("F8_E4M3",)

# FP8 checkpoints (quant_method "fp8", HF's FineGrainedFP8Config; DeepSeek-V3 / R1): each
# quantized linear holds `weight` float8 [N, K] and `weight_scale_inv` float [ceil(N / bn),
# ceil(K / bk)], with (bn, bk) = weight_block_size; the weight is their product, block by block.
# config.json fmt -> the weights' safetensors dtype.
FP8_FORMATS = {"e4m3": "F8_E4M3"}
FP8_DEFAULT_BLOCK = (128, 128)  # HF's default when weight_block_size is absent
# What quantize=None loads an FP8 checkpoint as: its float weights would take twice the FP8
# checkpoint's memory (1.3 TB of bf16 for DeepSeek-V3), int4 g128 about half of it.
FP8_DEFAULT_QUANTIZE = "int4"
# Every float8_e4m3fn bit pattern as float32 (NaN included): a table lookup converts exactly,
# and faster than ml_dtypes' astype (2.5x measured on a [2048, 7168] expert weight).
E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def read_json(path: str | os.PathLike) -> dict:
    """The JSON object in the file `path`.

    Raises:
        FileNotFoundError: no such file (named).
        ValueError: the file is not valid JSON, or holds no object: the file and the error named.
    """
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a text JSON file: {err}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds a JSON {type(d).__name__}, not an object")
    return d


def fmt_shape(s) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def quant_method(qcfg: Mapping | None) -> str | None:
    """config.json quantization_config's quant_method (None: a float checkpoint)."""
    return None if qcfg is None else qcfg.get("quant_method")


def checkpoint_file(root: str, fname, where: str) -> str:
    """The path of the checkpoint file `fname` under `root`, resolved.

    A downloaded index must not make loading read elsewhere: an entry that is not a relative
    path, or that resolves (`..`, an absolute path, a symlink) outside `root`, is refused. In
    a Hugging Face cache snapshot (.../snapshots/<revision>) the files are symlinks to the
    repository's blobs (../../blobs): those are inside too.

    Raises:
        ValueError: naming `where` (the index entry or the file) and the value.
    """
    if not isinstance(fname, str) or not fname:
        raise ValueError(f"{where} is not a file name")
    real_root = os.path.realpath(root)
    inside = [real_root]
    if os.path.basename(os.path.dirname(real_root)) == "snapshots":
        inside.append(os.path.join(os.path.dirname(os.path.dirname(real_root)), "blobs"))
    full = os.path.realpath(os.path.join(real_root, fname))
    lexical = os.path.normpath(os.path.join(real_root, fname))
    if (
        os.path.isabs(fname)
        or os.path.commonpath([real_root, lexical]) != real_root
        or not any(os.path.commonpath([d, full]) == d for d in inside)
    ):
        raise ValueError(
            f"{where} lies outside the checkpoint directory {root} (its files must be inside "
            f"it; symlinks are followed)"
        )
    return full


# Bit masks of the exponent of each float safetensors dtype: all ones is NaN or inf (float8
# e4m3fn has no inf; its NaN is the pattern with all exponent and mantissa bits set).
_NON_FINITE_BITS = {
    "F16": (np.uint16, 0x7C00, 0x7C00),
    "BF16": (np.uint16, 0x7F80, 0x7F80),
    "F32": (np.uint32, 0x7F800000, 0x7F800000),
    "F64": (np.uint64, 0x7FF0000000000000, 0x7FF0000000000000),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),
}


def non_finite_problem(name: str, arr: np.ndarray, dtype: str) -> str | None:
    """A sentence where the float tensor `arr` (safetensors dtype `dtype`) holds NaN or inf,
    else None. The bits are tested as integers (no float conversion of bfloat16 or float8)."""
    if dtype not in _NON_FINITE_BITS or arr.size == 0:
        return None
    view, mask, value = _NON_FINITE_BITS[dtype]
    bits = np.ascontiguousarray(arr).view(view)
    bad = (bits & view(mask)) == view(value)
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), arr.shape))
    return (
        f"tensor {name!r} holds {count} non-finite value{'s' * (count > 1)} (NaN or inf, first at "
        f"{list(first)}): the checkpoint is damaged (download it again); a NaN weight makes "
        f"every logit NaN and generation emit token 0"
    )


class Checkpoint(Mapping):
    """The tensors of a local HF directory, by name, read lazily one at a time.

    `meta(name)` gives (shape, safetensors dtype string) from the headers without reading data.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX_FILE)
        single = os.path.join(self.path, SINGLE_FILE)
        if os.path.exists(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object (tensor name -> file)")
            first_tensor = {}
            for name, fname in weight_map.items():
                first_tensor.setdefault(fname if isinstance(fname, str) else repr(fname), name)
            files = sorted(first_tensor)
            for fname in files:
                where = f"{index}: weight_map[{first_tensor[fname]!r}]={fname!r}"
                checkpoint_file(self.path, fname, where)
        elif os.path.exists(single):
            files = [SINGLE_FILE]
            weight_map = None
            checkpoint_file(self.path, SINGLE_FILE, single)
        else:
            raise FileNotFoundError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} exists")
        self._handles = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        self._file_of: dict[str, str] = {}
        for fname in files:
            full = os.path.join(self.path, fname)
            if not os.path.exists(full):
                raise FileNotFoundError(f"{full} is missing (listed in {INDEX_FILE})")
            try:
                handle = safe_open(full, framework="numpy")
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(
                    f"{full} cannot be read as safetensors (truncated or corrupt; download it "
                    f"again): {err}"
                ) from None
            self._handles[full] = handle
            for name in handle.keys():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue
                sl = handle.get_slice(name)
                self._meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
                self._file_of[name] = full
        if weight_map is not None:
            lost = sorted(set(weight_map) - set(self._meta))
            if lost:
                raise ValueError(f"{index} lists tensors its files do not hold: {lost[:20]}")
        # prefix -> names of the tensors directly under it ("a.b.qweight" under "a.b").
        self.children: dict[str, list[str]] = {}
        for name in self._meta:
            self.children.setdefault(name.rpartition(".")[0], []).append(name)
        # file -> (offset of its data, {name: (dtype, shape, data_offsets)}), for _read_raw.
        self._headers: dict[str, tuple[int, dict]] = {}
        self.reads = 0
        self.on_read: Callable[[str], None] | None = None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles = {}

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        return self._meta[name]

    def _read_raw(self, file: str, name: str) -> np.ndarray:
        """Reads one tensor straight from the safetensors layout (8-byte header length, JSON
        header, raw little-endian data): for dtypes the installed safetensors cannot give
        numpy (float8; bfloat16 with old versions). Each file's header is parsed once."""
        if file not in self._headers:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            self._headers[file] = (8 + n, header)
        data_start, header = self._headers[file]
        info = header[name]
        start, end = info["data_offsets"]
        with open(file, "rb") as f:
            f.seek(data_start + start)
            buf = f.read(end - start)
        return np.frombuffer(buf, dtype=NP_DTYPES[info["dtype"]]).reshape(info["shape"])

    def __getitem__(self, name: str) -> np.ndarray:
        file = self._file_of[name]
        if self._meta[name][1] in RAW_DTYPES:
            arr = self._read_raw(file, name)
        else:
            try:
                arr = self._handles[file].get_tensor(name)
            except (TypeError, ValueError):  # e.g. no numpy dtype for BF16 in old safetensors
                arr = self._read_raw(file, name)
        problem = non_finite_problem(name, arr, self._meta[name][1])
        if problem is not None:
            raise ValueError(f"{file}: {problem}")
        self.reads += 1
        if self.on_read is not None:
            self.on_read(name)
        return arr

    def __contains__(self, name) -> bool:
        return name in self._meta

    def __iter__(self):
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)


def fp8_block_size(qcfg: Mapping) -> tuple[int, int]:
    """The block (rows, columns) of an FP8 checkpoint's scales, from config.json's
    quantization_config (quant_method "fp8"): `weight_block_size`, HF's default 128 x 128
    when absent; `fmt` must be "e4m3" (the default, and DeepSeek's).

    Raises:
        ValueError: another fmt, or a weight_block_size that is not two positive integers,
            naming config.json and the value.
    """
    fmt = qcfg.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:
        raise ValueError(
            f"{CONFIG_FILE}: quantization_config fmt={fmt!r} is not supported (supported: "
            f"{sorted(FP8_FORMATS)})"
        )
    block = qcfg.get("weight_block_size", list(FP8_DEFAULT_BLOCK))
    if not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{CONFIG_FILE}: quantization_config weight_block_size={block!r} is not two "
            f"positive integers [rows, columns] (DeepSeek-V3: [128, 128]; per-tensor or "
            f"per-channel FP8 scales are not supported)"
        )
    return int(block[0]), int(block[1])


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    """An FP8 checkpoint's linear weight in float32: weight[n, k] * scale_inv[n // bn, k // bk].

    The product of a float8_e4m3fn value (4 significant bits) and a float32 scale is rounded
    once, to float32 (as DeepSeek's fp8_cast_bf16.py computes it before its bf16 cast).

    Args:
        weight: float8_e4m3fn [N, K] (safetensors F8_E4M3).
        scale_inv: float [ceil(N / bn), ceil(K / bk)]: it multiplies, despite its name; the
            last row / column of blocks may be partial.
        block: (bn, bk), config.json's weight_block_size.

    Returns:
        float32 [N, K] (host numpy).

    Raises:
        ValueError: weight is not float8_e4m3fn [N, K], or scale_inv has another shape.
    """
    weight = np.asarray(weight)
    if weight.dtype != ml_dtypes.float8_e4m3fn or weight.ndim != 2:
        raise ValueError(
            f"weight is {weight.dtype} {fmt_shape(weight.shape)}, expected float8_e4m3fn [N, K]"
        )
    n, k = weight.shape
    bn, bk = block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if np.shape(scale_inv) != want:
        raise ValueError(
            f"weight_scale_inv has shape {fmt_shape(np.shape(scale_inv))}, expected "
            f"{fmt_shape(want)} (blocks {fmt_shape(block)} over [N, K] = [{n}, {k}])"
        )
    out = E4M3_TO_F32[weight.view(np.uint8)]  # [N, K] f32, exact
    rows = np.repeat(np.asarray(scale_inv, np.float32), bk, axis=1)[:, :k]  # [ceil(N/bn), K]
    whole = n // bn * bn
    blocks = out[:whole].reshape(n // bn, bn, k)  # a view: out is C-contiguous
    blocks *= rows[: n // bn, None]
    if whole < n:
        out[whole:] *= rows[-1]  # the partial last block row
    return out


# The files loading reads (and generation: the tokenizer's and generation defaults): what a
# Hub download fetches, nothing else (a repository may also hold .bin / .pt copies, docs, code).
HUB_FILES = (
    CONFIG_FILE, INDEX_FILE, "*.safetensors", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "tiktoken.model", "chat_template.jinja",  # Kimi-K2's tokenizer
)  # fmt: skip
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_checkpoint(
    path_or_id: str | os.PathLike, *, revision: str | None = None, cache_dir=None
) -> str:
    """The local directory of a checkpoint: `path_or_id` itself where it is a directory, else
    a Hugging Face Hub repository id ("org/name") fetched by huggingface_hub.snapshot_download
    (only HUB_FILES; files already in the cache are not fetched again; with HF_HUB_OFFLINE=1
    the cache only), at `revision` (a branch, tag or commit; default main) into `cache_dir`
    (default the Hub's cache, HF_HOME). Logs the directory it resolved to.

    Raises:
        FileNotFoundError: neither a directory nor a repository id, or the download (or the
            offline cache) failed: the id and the reason named.
    """
    path = os.fspath(path_or_id)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise FileNotFoundError(f"{path} is a file: pass the checkpoint's directory")
    if not REPO_ID.match(path):
        raise FileNotFoundError(
            f"{path}: no such directory, and not a Hugging Face Hub id ('org/name')"
        )
    import huggingface_hub

    try:
        local = huggingface_hub.snapshot_download(
            path, revision=revision, cache_dir=cache_dir, allow_patterns=list(HUB_FILES)
        )
    except Exception as err:  # network, authentication, unknown repository, offline cache
        raise FileNotFoundError(
            f"{path}: not a local directory, and the Hugging Face Hub download failed "
            f"({type(err).__name__}: {err})"
        ) from err
    logger.info("%s (revision %s) resolved to %s", path, revision or "main", local)
    return local


def write_json(path: str, obj) -> None:
    """`obj` as indented JSON in the file `path`."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _fsync(path: str) -> None:
    """Flushes the file (or directory) `path` to the disk, so a rename after it never
    publishes a name whose data a power loss could still lose (a no-op for directories where
    the platform cannot open them)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_file(path: str, write: Callable[[str], None]) -> None:
    """write(a temporary name beside `path`), then renames it to `path`: a reader sees the old
    file or the whole new one, never a half-written one."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# A save's crash safety. A save writes its new files beside the old ones under names the old
# checkpoint does not use, then makes them the checkpoint with ONE atomic step (the switch):
# the rename of model.safetensors.index.json (sharded) or of model.safetensors, or, for an
# unsharded save over a sharded one, the removal of the old index. config.json is replaced
# after the switch, and the old files are removed last. The switch file carries the new
# config.json's text and the SHA-256 of the config.json it replaces (SAVED_CONFIG_KEYS: in the
# index's "metadata", in model.safetensors' header metadata): a directory whose config.json is
# still the replaced one was killed between the switch and config.json, and `read_config`
# takes the config saved with the weights. Killed at any instant, the directory loads as the
# whole old checkpoint or the whole new one.
SAVED_CONFIG = "config_json"  # the config.json text saved with the weights
REPLACED_CONFIG = "replaces_config_sha256"  # of the config.json the save replaced ("": none)
# The shard names write_safetensors gives: HF's, with a suffix where a file has that name.
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}(-[0-9a-f]{8})?\.safetensors")
# What a save killed mid-file leaves: its temporary files.
_TMP_NAME = re.compile(
    r"(model[\w.-]*\.safetensors|model\.safetensors\.index\.json|config\.json)\.tmp"
)
# Hugging Face's size strings (PreTrainedModel.save_pretrained's max_shard_size): "5GB",
# "500MB", "1.5GiB", "100kB": decimal units, and binary ones with an i.
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value, *, name: str = "max_shard_bytes") -> int | None:
    """A size in bytes: an int, or a Hugging Face size string ("5GB" = 5 * 10**9 bytes,
    "2GiB" = 2 * 2**30, "500MB", "100kB", "123" bytes); None or 0 means no limit (None).

    Raises:
        TypeError: neither an int nor a string (the argument `name` and the value named).
        ValueError: a string that is not a size, or a negative size (named likewise).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, str)):
        raise TypeError(
            f"{name}={value!r} is a {type(value).__name__}: pass a number of bytes or a size "
            f"string such as '5GB' or '500MiB'"
        )
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m is None:
            raise ValueError(
                f"{name}={value!r} is not a size: pass a number of bytes or a size string such "
                f"as '5GB', '500MB' or '2GiB'"
            )
        number, unit, binary = m.groups()
        base = 1024 if binary else 1000
        value = int(float(number) * base ** _SIZE_POWER[unit.lower()])
    if value < 0:
        raise ValueError(f"{name}={value!r} is negative: pass a positive size (or None)")
    return int(value) or None


def _config_sha256(path: str) -> str:
    """The SHA-256 of the file `path` in hex, "" where there is none."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _saved_config(path: str) -> dict[str, str] | None:
    """The SAVED_CONFIG / REPLACED_CONFIG entries of the checkpoint directory `path`'s switch
    file (its index where there is one, else model.safetensors), None where it has none."""
    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    try:
        if os.path.exists(index):
            meta = read_json(index).get("metadata")
        elif os.path.exists(single):
            with safe_open(single, framework="numpy") as f:
                meta = f.metadata()
        else:
            return None
    except Exception:  # an unreadable file: loading it names the problem
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get(SAVED_CONFIG), str):
        return None
    return {SAVED_CONFIG: meta[SAVED_CONFIG], REPLACED_CONFIG: str(meta.get(REPLACED_CONFIG))}


def read_config(path: str | os.PathLike) -> dict:
    """The config.json dict of the checkpoint directory `path` (or of the config.json file
    `path`): the file's, except where a save was killed between switching the weights and
    writing config.json (see SAVED_CONFIG): then the config saved with the weights, with a
    warning. A config.json edited after a save is read as edited.

    Raises:
        FileNotFoundError: no config.json (the file named).
        ValueError: not a JSON object (the file named).
    """
    path = os.fspath(path)
    if os.path.basename(path) == CONFIG_FILE and not os.path.isdir(path):
        directory, file = os.path.dirname(path) or ".", path
    else:
        directory, file = path, os.path.join(path, CONFIG_FILE)
    saved = _saved_config(directory)
    if saved is not None and (
        not os.path.exists(file)
        or (
            _config_sha256(file) == saved[REPLACED_CONFIG]
            and _config_sha256(file) != hashlib.sha256(saved[SAVED_CONFIG].encode()).hexdigest()
        )
    ):
        try:
            hf = json.loads(saved[SAVED_CONFIG])
        except json.JSONDecodeError:
            hf = None
        if isinstance(hf, dict):
            logger.warning(
                "%s: a save into this directory was stopped before it wrote %s; reading the "
                "config saved with its weights (save again to complete the directory)",
                directory,
                CONFIG_FILE,
            )
            return hf
    if not os.path.exists(file) and os.path.isdir(directory):
        raise FileNotFoundError(
            f"{directory} has no {CONFIG_FILE}: not a checkpoint directory (pass the directory "
            f"that holds {CONFIG_FILE} and the *.safetensors files)"
        )
    return read_json(file)


def _switch_metadata(config_text: str, config_file: str) -> dict[str, str]:
    return {SAVED_CONFIG: config_text, REPLACED_CONFIG: _config_sha256(config_file)}


def _earlier_weight_files(path: str) -> set[str]:
    """The weight files of earlier saves into `path`: model.safetensors, the shards of the
    save's naming, those its index lists (inside `path` only) and the temporary files of a
    save that was stopped."""
    names = {
        f
        for f in os.listdir(path)
        if f == SINGLE_FILE or _SHARD_NAME.fullmatch(f) or _TMP_NAME.fullmatch(f)
    }
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            listed = read_json(index).get("weight_map", {}).values()
        except (ValueError, AttributeError):  # a broken index lists nothing it can be trusted on
            listed = ()
        real = os.path.realpath(path)
        for fname in listed:
            if (
                isinstance(fname, str)
                and os.path.dirname(os.path.realpath(os.path.join(real, fname))) == real
            ):
                names.add(os.path.basename(fname))
    return names


def _fresh_name(path: str, name: str) -> str:
    """`name` where no file in `path` has it, else `name` with a random 8-hex-digit suffix:
    a new shard never overwrites a file the old checkpoint may still read."""
    while os.path.exists(os.path.join(path, name)):
        stem = name.removesuffix(".safetensors")[: len("model-00001-of-00001")]
        name = f"{stem}-{os.urandom(4).hex()}.safetensors"
    return name


def _shards(tensors: Mapping[str, np.ndarray], max_shard_bytes: int) -> list[dict]:
    """`tensors` split in order into groups of at most `max_shard_bytes` (a larger tensor
    alone)."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    return shards


def write_checkpoint(
    path: str | os.PathLike, tensors: dict[str, np.ndarray], config: dict, *, max_shard_bytes=None
) -> None:
    """Writes a checkpoint directory crash-safely: `tensors` as one model.safetensors, or, with
    `max_shard_bytes`, files of at most that size with model.safetensors.index.json; `config`
    as config.json. Killed at any instant, the directory loads as the whole old checkpoint or
    the whole new one (see SAVED_CONFIG); afterwards, the index and weight files of an earlier
    save that this one does not hold are removed, so a load reads only the new weights.

    Args:
        path: the directory (created).
        tensors: name -> host array.
        config: the config.json dict.
        max_shard_bytes: None (one file), a number of bytes or a Hugging Face size string
            ("5GB", "500MiB"; `parse_size`).
    """
    path = os.fspath(path)
    max_shard_bytes = parse_size(max_shard_bytes)
    os.makedirs(path, exist_ok=True)
    config_file = os.path.join(path, CONFIG_FILE)
    index_file = os.path.join(path, INDEX_FILE)
    config_text = json.dumps(config, indent=2)
    switch = _switch_metadata(config_text, config_file)
    earlier = _earlier_weight_files(path)
    had_index = os.path.exists(index_file)
    if not max_shard_bytes:
        meta = {"format": "pt", **switch}
        single = os.path.join(path, SINGLE_FILE)
        # Over a sharded checkpoint the index still wins over this file: its removal switches.
        replace_file(single, lambda tmp: save_file(tensors, tmp, meta))
        if had_index:
            os.remove(index_file)
        _fsync(path)
        written = {SINGLE_FILE}
    else:
        shards = _shards(tensors, max_shard_bytes)
        weight_map = {}
        for n, shard in enumerate(shards, start=1):
            fname = _fresh_name(path, f"model-{n:05d}-of-{len(shards):05d}.safetensors")
            replace_file(
                os.path.join(path, fname),
                lambda tmp, shard=shard: save_file(shard, tmp, {"format": "pt"}),
            )
            weight_map.update({name: fname for name in shard})
        total = sum(a.nbytes for a in tensors.values())
        index = {"metadata": {"total_size": total, **switch}, "weight_map": weight_map}
        replace_file(index_file, lambda tmp: write_json(tmp, index))  # the switch
        _fsync(path)
        written = set(weight_map.values())

    def write_config(tmp):
        with open(tmp, "w") as f:
            f.write(config_text)

    replace_file(config_file, write_config)
    _fsync(path)
    for fname in sorted(earlier - written):
        os.remove(os.path.join(path, fname))
