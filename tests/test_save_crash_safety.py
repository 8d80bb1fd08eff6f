"""Saves killed at every file boundary and mid-file load as the whole old or the whole new one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from test_deepseek_v3_common import logits_of, random_ids, tiny_model

from models.common import checkpoint
from models.common.checkpoint import Checkpoint, parse_size, read_config
from models.deepseek_v3 import load_pretrained, save_pretrained

KILL_SHARD_BYTES = 600_000  # the tiny model's 2-4 MB of weights take 3-7 such files

# The save, run in a child process that imports the checkpoint module alone (no JAX: it starts
# in a fraction of a second): it writes the checkpoint of directory SRC into DST with
# write_checkpoint, as save_pretrained does, counting the file steps (a file written under its
# temporary name, a rename, a removal) and killing itself with SIGKILL before step KILL_AT; with
# MID_FILE, step KILL_AT (a write) is made and its file cut to half its bytes first. It prints
# its steps when it is not killed: w for a write, - for a rename or removal.
CHILD = r"""
import importlib.util, os, signal, sys

module, src, dst, kill_at, mid_file, shard_bytes = sys.argv[1:]
kill_at, mid_file, shard_bytes = int(kill_at), mid_file == "1", int(shard_bytes) or None
spec = importlib.util.spec_from_file_location("checkpoint", module)
ck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ck)
steps = []

def step(write=None, path=None):
    if len(steps) == kill_at:
        if mid_file and write is not None:
            write()
            os.truncate(path, os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    steps.append("w" if write is not None else "-")

def counted(fn, path_arg=None):
    def wrapped(*args):
        if path_arg is None:
            step()
        else:
            step(lambda: fn(*args), args[path_arg])
        return fn(*args)
    return wrapped

ck.save_file = counted(ck.save_file, 1)
ck.write_json = counted(ck.write_json, 0)
os.replace, os.remove = counted(os.replace), counted(os.remove)
source = ck.Checkpoint(src)
tensors = {name: source[name] for name in source}
ck.write_checkpoint(dst, tensors, ck.read_config(src), max_shard_bytes=shard_bytes)
print(''.join(steps))
"""


def _save_child(src, dst, *, kill_at: int = -1, mid_file: bool = False, shard_bytes=None):
    """Runs CHILD; returns its steps (kill_at -1: "w" a write, "-" a rename or a removal) or
    checks that it was killed."""
    run = subprocess.run(
        [sys.executable, "-c", CHILD, checkpoint.__file__, str(src), str(dst), str(kill_at),
         str(int(mid_file)), str(shard_bytes or 0)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if kill_at < 0:
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stderr)
    return None


def _contents(path):
    """(config dict, {name: (dtype, shape, bytes)}) of the checkpoint at `path`, as loading
    reads it."""
    ck = Checkpoint(path)
    try:
        tensors = {n: (ck[n].dtype.str, ck[n].shape, ck[n].tobytes()) for n in ck}
    finally:
        ck.close()
    return read_config(path), tensors


def _save(model, path, fmt, sharded):
    save_pretrained(model, path, format=fmt, max_shard_bytes=KILL_SHARD_BYTES if sharded else None)


# (old format or None for an empty directory, old sharded, new format, new sharded, new seed):
# each format the project writes, sharded over sharded (the same shard names: an interrupted
# save must never mix them), and every change between one file and shards.
CASES = {
    "bf16-sharded>gptq-sharded": ("bf16", True, "gptq", True, 1),
    "gptq-sharded>gptq-sharded": ("gptq", True, "gptq", True, 1),
    "awq-sharded>awq-sharded": ("awq", True, "awq", True, 1),
    "ct-sharded>ct-sharded": ("compressed-tensors", True, "compressed-tensors", True, 1),
    "bf16>bf16": ("bf16", False, "bf16", False, 1),
    "bf16>gptq": ("bf16", False, "gptq", False, 0),
    "gptq-sharded>awq": ("gptq", True, "awq", False, 1),
    "awq>ct-sharded": ("awq", False, "compressed-tensors", True, 1),
    "empty>gptq-sharded": (None, False, "gptq", True, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_killed_save_loads_as_old_or_new(case, tmp_path):
    old_fmt, old_sharded, new_fmt, new_sharded, seed = CASES[case]
    quant = {} if new_fmt != "bf16" else dict(dtype="bfloat16", quant=None)
    pristine, new_src = tmp_path / "old", tmp_path / "new"
    pristine.mkdir()
    if old_fmt is not None:
        old_quant = {} if old_fmt != "bf16" else dict(dtype="bfloat16", quant=None)
        _save(tiny_model(seed=0, **old_quant), pristine, old_fmt, old_sharded)
        (pristine / "tokenizer_config.json").write_text("{}")  # a file a save leaves alone
    _save(tiny_model(seed=seed, **quant), new_src, new_fmt, new_sharded)
    old = _contents(pristine) if old_fmt is not None else None
    new = _contents(new_src)
    assert old != new
    dst = tmp_path / "dst"
    shard_bytes = KILL_SHARD_BYTES if new_sharded else None
    shutil.copytree(pristine, dst)
    steps = _save_child(new_src, dst, shard_bytes=shard_bytes)
    assert _contents(dst) == new
    kills = [(k, mid) for k, kind in enumerate(steps) for mid in (False, True)[: 1 + (kind == "w")]]
    seen = []
    for kill_at, mid_file in kills:
        shutil.rmtree(dst)
        shutil.copytree(pristine, dst)
        _save_child(new_src, dst, kill_at=kill_at, mid_file=mid_file, shard_bytes=shard_bytes)
        if (
            old is None
            and not os.path.exists(dst / "config.json")
            and not any(f.endswith(".json") for f in os.listdir(dst))
        ):
            seen.append("old")  # nothing loadable, as before the save
            continue
        got = _contents(dst)
        assert got in (old, new), f"killed at step {kill_at} (mid-file {mid_file}): a mix"
        seen.append("old" if got == old else "new")
        if old_fmt is not None:
            assert (dst / "tokenizer_config.json").exists()
    # Early kills leave the old checkpoint, late ones the new: one switch, never back.
    assert seen[0] == "old" and seen[-1] == "new"
    assert seen == sorted(seen, key=["old", "new"].index)


def test_killed_bf16_to_gptq_save_in_place_loads(tmp_path):
    """The model loaded from a bf16 directory saved as GPTQ into it, killed at each step: the
    directory loads (load_pretrained) with the old model's logits or the new one's."""
    bf16 = tiny_model(dtype="bfloat16", quant=None)
    gptq = tiny_model()
    pristine, new_src, dst = tmp_path / "old", tmp_path / "new", tmp_path / "dst"
    _save(bf16, pristine, "bf16", False)
    _save(gptq, new_src, "gptq", False)
    ids = random_ids(np.random.default_rng(0), (1, 6), gptq.cfg)
    mask = np.ones(ids.shape, bool)

    def logits(path):
        model = load_pretrained(path, dtype=jnp.float32, progress=False)
        return np.asarray(logits_of(model, ids, mask))

    want = {"old": logits(pristine), "new": logits(new_src)}
    shutil.copytree(pristine, dst)
    steps = _save_child(new_src, dst)
    for kill_at in range(len(steps)):
        shutil.rmtree(dst)
        shutil.copytree(pristine, dst)
        _save_child(new_src, dst, kill_at=kill_at)
        got = logits(dst)
        assert any(np.array_equal(got, w) for w in want.values()), f"killed at step {kill_at}"


@pytest.mark.parametrize(
    "value, want",
    [(None, None), (0, None), (1234, 1234), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
     ("2GiB", 2 * 2**30), ("1.5kB", 1500), ("100", 100), ("10 MiB", 10 * 2**20)],
)  # fmt: skip
def test_max_shard_bytes_takes_hugging_face_sizes(value, want):
    assert parse_size(value) == want


@pytest.mark.parametrize(
    "value, error, match",
    [("1 parsec", ValueError, "max_shard_bytes='1 parsec' is not a size"),
     (-5, ValueError, "max_shard_bytes=-5 is negative"),
     (1.5e9, TypeError, "max_shard_bytes=1500000000.0 is a float"),
     (True, TypeError, "max_shard_bytes=True is a bool")],
)  # fmt: skip
def test_max_shard_bytes_refuses_what_is_not_a_size(value, error, match):
    with pytest.raises(error, match=match):
        parse_size(value)


def test_save_pretrained_takes_a_size_string(tmp_path):
    save_pretrained(tiny_model(), tmp_path, format="awq", max_shard_bytes="40kB")
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors.index.json" in files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1


def test_edited_config_after_a_save_is_read_as_edited(tmp_path):
    """read_config prefers the config saved with the weights only where config.json is still
    the one the save replaced: a config.json edited after a complete save wins."""
    _save(tiny_model(), tmp_path, "awq", False)
    _save(tiny_model(seed=1), tmp_path, "awq", False)  # config.json replaced by an equal one
    hf = read_config(tmp_path)
    hf["rms_norm_eps"] = 1e-3
    checkpoint.write_json(str(tmp_path / "config.json"), hf)
    assert read_config(tmp_path)["rms_norm_eps"] == 1e-3
