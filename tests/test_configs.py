"""Tests of kernel configs: the GEMM's validity rules and heuristic, MgpuConfig, the resolver
(caller, tuned table, heuristic) under each backend's rules, and the tuned tables (their lookup
and the shipped files, which hold no copy of a heuristic's choice)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import types
from importlib import resources

import jax
import pytest

import wna16_jax as wj
from pallas_kernels.common import block_configs
from pallas_kernels.mgpu import MgpuConfig
from pallas_kernels.mgpu import config as mgpu_config
from pallas_kernels.mgpu import grouped_matmul as mgpu_gemm
from pallas_kernels.pallas import fused_moe as pallas_moe
from pallas_kernels.pallas import w8a8_gemm
from pallas_kernels.triton import config as triton_config
from wna16_jax import BlockConfig, _configs
from wna16_jax._configs import ConfigRules, GemmShape

# Every backend's ConfigRules, by a name for the tests.
ALL_RULES = {
    "pallas": pallas_moe.RULES,
    "w8a8": w8a8_gemm.RULES,
    "triton": triton_config.RULES,
    "mgpu layer": mgpu_config.LAYER_RULES,
    "mgpu gemm": mgpu_gemm.GEMM_RULES,
}


def _shape(m=16, n=4096, k=7168, e=256, bits=4, group_size=128) -> GemmShape:
    group = k if group_size == -1 else group_size
    return GemmShape(m=m, n=n, k=k, num_experts=e, bits=bits, group=group, group_size=group_size)


# ---- BlockConfig ----------------------------------------------------------------------------


def test_block_config_is_hashable_and_frozen():
    a, b = BlockConfig(block_k=64), BlockConfig(block_k=64)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_k = 128


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_m=0), "BlockConfig.block_m=0 must be a positive int"),
        (dict(split_k=-2), "BlockConfig.split_k=-2 must be a positive int"),
        (dict(num_warps=4.0), "BlockConfig.num_warps=4.0 must be a positive int"),
        (dict(block_n=48), "BlockConfig.block_n=48 must be a power of two"),
        (dict(block_k=96), "BlockConfig.block_k=96 must be a power of two"),
        (
            dict(unpack="rows"),
            "BlockConfig.unpack='rows' is not one of ('slices', 'tile', 'join')",
        ),
    ],
)
def test_block_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BlockConfig(**kwargs)


# ---- check_config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, shape, substrings",
    [
        (
            BlockConfig(block_k=64, unpack="tile"),
            _shape(k=7168, group_size=-1),  # G = K = 7168: fine, 64 divides it
            [],
        ),
        (
            BlockConfig(block_k=256),
            _shape(k=7168, group_size=128),  # two groups per tile: fine
            [],
        ),
        (
            BlockConfig(block_k=32, unpack="tile"),
            _shape(k=7168, group_size=128),  # a quarter group per tile: fine
            [],
        ),
        (
            BlockConfig(block_k=64),
            _shape(k=7168, group_size=128, bits=4),  # "slices": 64 // 8 = 8 < 16 per dot
            ["block_k=64 is below 128 for int4 with unpack='slices'"],
        ),
        (
            BlockConfig(block_k=128),
            _shape(k=2880, group_size=96),  # 2880 = 30 * 96; 128 vs 96 straddles groups
            ["block_k=128 is incompatible with group_size=96", "K=2880 is not a multiple"],
        ),
        (
            BlockConfig(block_k=64),
            _shape(k=2880, group_size=96),
            ["block_k=64 is incompatible with group_size=96"],
        ),
        (
            BlockConfig(block_k=1024),
            _shape(k=7168 + 512, group_size=512),
            ["K=7680 is not a multiple of block_k=1024"],
        ),
        (
            BlockConfig(block_k=128, split_k=3),
            _shape(k=7168, group_size=128),  # 56 k-tiles
            ["split_k=3 does not divide the 56 k-tiles", "K=7168, block_k=128"],
        ),
        (
            BlockConfig(block_k=128, split_k=8),
            _shape(k=7168, group_size=128),
            [],
        ),
        (
            BlockConfig(block_k=4),
            _shape(k=64, group_size=32, bits=4),
            ["block_k=4 is smaller than one packed word (8)"],
        ),
    ],
)
def test_check_config(config, shape, substrings):
    problems = block_configs.config_problems(config, shape)
    if not substrings:
        assert problems == []
        block_configs.check_config(config, shape)
        return
    with pytest.raises(ValueError) as err:
        block_configs.check_config(config, shape)
    msg = str(err.value)
    assert f"N={shape.n}, K={shape.k}" in msg
    for s in substrings:
        assert s in msg, msg


# ---- heuristic ------------------------------------------------------------------------------

# DeepSeek-V3: w13 (N=2I=4096, K=H=7168), w2 (N=H=7168, K=I=2048), TP=8 w13 (N=512, K=7168),
# TP=8 w2 (N=7168, K=256), and small shapes of the tests.
NK = [(4096, 7168), (7168, 2048), (512, 7168), (7168, 256), (64, 64), (96, 32), (24, 40)]


HEURISTIC_GRID = [
    (n, k, bits, group_size, e)
    for n, k in NK
    for bits in (4, 8)
    for group_size in (128, -1, 32, 64)
    for e in (1, 8, 256)
    if group_size == -1 or k % group_size == 0
]


# No config fits N=24 (block_n >= 16 must divide N) or K=40 (block_k >= 16 must divide K).
UNFIT_NK = {(24, 40)}


@pytest.mark.parametrize("n, k, bits, group_size, e", HEURISTIC_GRID)
def test_heuristic_config_is_valid(n, k, bits, group_size, e):
    if (n, k) in UNFIT_NK:
        with pytest.raises(ValueError, match="no block config fits"):
            block_configs.heuristic_config(
                _shape(m=8, n=n, k=k, e=e, bits=bits, group_size=group_size)
            )
        return
    for m in (1, 8, 64, 512, 4096 * 8, 65536 * 8):
        shape = _shape(m=m, n=n, k=k, e=e, bits=bits, group_size=group_size)
        for allow_fma in (True, False):
            cfg = block_configs.heuristic_config(shape, allow_fma=allow_fma)
            assert isinstance(cfg, BlockConfig)
            assert block_configs.config_problems(cfg, shape) == [], (m, cfg)
            if cfg.dot == "fma":  # decode: at most a quarter of a row per expert
                assert allow_fma and 4 * m <= e and cfg.block_m == 1, (m, cfg)
            else:
                assert cfg.block_m in (16, 32, 64)


@pytest.mark.parametrize(
    "n, k, split_k",
    [(4096, 7168, 8), (7168, 2048, 4), (512, 7168, 8), (7168, 256, 1)],
    ids=["w13", "w2", "w13-tp8", "w2-tp8"],
)
def test_heuristic_decode_is_fma_with_split_k(n, k, split_k):
    """DeepSeek-V3 at one token (8 slots over 256 experts): the CUDA-core family that won on
    the H200, split-K into chunks of at least 4 k-tiles; 128 slots take 16-row tensor-core
    tiles again, and allow_fma=False (tensor-core-only kernels) never gives "fma"."""
    decode = _shape(m=8, n=n, k=k, e=256, bits=4, group_size=128)
    cfg = block_configs.heuristic_config(decode)
    assert (cfg.dot, cfg.block_m, cfg.block_n, cfg.split_k) == ("fma", 1, 128, split_k)
    assert (k // cfg.block_k) // cfg.split_k >= 4 or cfg.split_k == 1
    mma = block_configs.heuristic_config(decode, allow_fma=False)
    assert mma.dot == "mma" and mma.block_m == 16 and mma.split_k == 1
    batch = block_configs.heuristic_config(_shape(m=128, n=n, k=k, e=256, bits=4, group_size=128))
    assert batch.dot == "mma" and batch.block_m == 16


@pytest.mark.parametrize("k, group_size", [(24, 12), (40, 20)])
def test_heuristic_refuses_when_no_config_fits(k, group_size):
    """int4 groups that end inside a packed word leave no power-of-two block_k: say so."""
    shape = _shape(m=4, n=64, k=k, e=4, bits=4, group_size=group_size)
    with pytest.raises(ValueError, match=f"incompatible with group_size={group_size}"):
        block_configs.heuristic_config(shape)


# ---- tuned tables ---------------------------------------------------------------------------

DEVICE = "NVIDIA H200 (test)"
PROBLEM = dict(E=256, N=4096, K=7168, bits=4, group_size=128)


def _entry(m, problem=PROBLEM, **config):
    return {"problem": problem, "M": m, "config": config}


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    """Writes tuned tables for DEVICE into a temporary package root and points the loader at
    it: tuned(pallas=[entries], mgpu=[entries])."""

    def write(**tables):
        folder = tmp_path / _configs.TUNED_DIR
        folder.mkdir(parents=True, exist_ok=True)
        data = {"device": DEVICE, "tables": {t: {"entries": e} for t, e in tables.items()}}
        (folder / _configs.device_file_name(DEVICE)).write_text(json.dumps(data))
        _configs.tuned_entries.cache_clear()

    monkeypatch.setattr(_configs, "resources", types.SimpleNamespace(files=lambda pkg: tmp_path))
    _configs.tuned_entries.cache_clear()
    yield write
    _configs.tuned_entries.cache_clear()


TABLE = [
    _entry(1, block_m=16, block_n=32, block_k=128, split_k=4),
    _entry(16, block_m=16, block_n=64, block_k=128),
    _entry(256, block_m=32, block_n=128, block_k=64, unpack="tile"),
    _entry(4096, block_m=64, block_n=128, block_k=256, num_stages=4),
]


def test_device_file_name():
    assert _configs.device_file_name("NVIDIA H200") == "nvidia_h200.json"
    assert _configs.device_file_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3.json"


def test_tuned_table_missing_is_empty(tuned):
    assert _configs.tuned_entries("no such device", "pallas", BlockConfig) == ()
    tuned(pallas=TABLE)
    assert _configs.tuned_entries(DEVICE, "mgpu", MgpuConfig) == ()  # the file has no such table


def test_tuned_table_parses(tuned):
    tuned(pallas=TABLE, mgpu=[_entry(8, dict(E=8), block_m=8, block_halvings=1)])
    table = _configs.tuned_entries(DEVICE, "pallas", BlockConfig)
    assert len(table) == len(TABLE)
    assert table[3] == (
        PROBLEM,
        4096,
        BlockConfig(block_m=64, block_n=128, block_k=256, num_stages=4),
    )
    assert _configs.tuned_entries(DEVICE, "mgpu", MgpuConfig) == (
        (dict(E=8), 8, MgpuConfig(block_m=8, block_halvings=1)),
    )


def _lookup(m, within=None, problem=PROBLEM):
    return _configs.lookup_tuned("pallas", BlockConfig, problem, m, DEVICE, within=within)


@pytest.mark.parametrize(
    "m, want_m",
    [
        (1, 1),
        (2, 1),
        (8, 1),  # |8-1| = 7 < |8-16| = 8
        (9, 16),
        (16, 16),
        (136, 16),  # tie between 16 and 256: the smaller M
        (137, 256),
        (2000, 256),
        (3000, 4096),
        (10**6, 4096),
    ],
)
def test_lookup_picks_nearest_m(tuned, m, want_m):
    tuned(pallas=TABLE)
    want = BlockConfig(**next(e["config"] for e in TABLE if e["M"] == want_m))
    assert _lookup(m) == want


@pytest.mark.parametrize(
    "m, want_m", [(1, 1), (2, 1), (3, None), (8, 16), (32, 16), (33, None), (4096, 4096)]
)
def test_lookup_within_a_factor(tuned, m, want_m):
    """within=2: the nearest entry whose M is at most twice or half m, else None."""
    tuned(pallas=TABLE)
    want = next((BlockConfig(**e["config"]) for e in TABLE if e["M"] == want_m), None)
    assert _lookup(m, within=2) == want


@pytest.mark.parametrize(
    "change", [dict(e=128), dict(n=2048), dict(k=2048), dict(bits=8), dict(group_size=-1)]
)
def test_lookup_needs_exact_problem(tuned, change):
    tuned(pallas=TABLE)
    assert _lookup(16, problem=_shape(m=16, **change).table_problem()) is None


def test_lookup_reads_only_its_table(tuned):
    """The same problem keys in another table are not an entry of this one."""
    tuned(mgpu=[_entry(16, block_m=8)])
    assert _lookup(16) is None
    assert _configs.lookup_tuned("mgpu", MgpuConfig, PROBLEM, 16, DEVICE) == MgpuConfig(8)


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(_configs, "device_kind", lambda: DEVICE)


def test_resolve_order(tuned, on_device):
    """The caller's config, else the table's entry within TUNED_M_RATIO of its M, else the
    heuristic's."""
    tuned(pallas=TABLE)
    rules = pallas_moe.RULES
    caller = BlockConfig(block_m=32, block_k=64, unpack="tile")
    assert _configs.resolve(rules, _shape(m=16), caller) == (caller, "caller")
    assert _configs.resolve(rules, _shape(m=16), None) == (
        BlockConfig(block_m=16, block_n=64, block_k=128),
        f"tuned:{DEVICE}",
    )
    for other in (_shape(m=16, n=2048), _shape(m=64)):  # another problem; M far from 16, 256
        assert _configs.resolve(rules, other, None) == (rules.heuristic(other), "heuristic")


def test_resolve_with_a_toy_kernels_rules(tuned, on_device):
    """The resolver knows no kernel: a kernel's own config class, table, heuristic, check and
    converters are all it reads."""

    @dataclasses.dataclass(frozen=True)
    class ToyConfig:
        tile: int

    rules = ConfigRules(
        config_type=ToyConfig,
        heuristic=lambda n: ToyConfig(n // 2),
        table="toy",
        table_key=lambda n: (dict(n=n), n),
        check=lambda cfg, n: None if n % cfg.tile == 0 else _raise(f"tile={cfg.tile}"),
        converters={int: ToyConfig},
    )
    tuned(toy=[{"problem": dict(n=12), "M": 12, "config": dict(tile=3)}])
    assert _configs.resolve(rules, 12) == (ToyConfig(3), f"tuned:{DEVICE}")
    assert _configs.resolve(rules, 10) == (ToyConfig(5), "heuristic")
    assert _configs.resolve(rules, 12, 4) == (ToyConfig(4), "caller")  # converted from int
    with pytest.raises(ValueError, match="tile=5"):
        _configs.resolve(rules, 12, ToyConfig(5))
    with pytest.raises(ValueError, match=r"config must be a ToyConfig or int or None, got 'x'"):
        _configs.resolve(rules, 12, "x")


def _raise(message):
    raise ValueError(message)


def test_mgpu_gemm_reads_its_table(tuned, on_device):
    """The Mosaic GPU GEMM's config (the quantized linear's): the caller's, else its table's
    entry for exactly this GEMM at the nearest M within a factor of 2, else the heuristic
    (`linear_config`); a BlockConfig converts."""
    rules, linear_config = mgpu_gemm.GEMM_RULES, mgpu_gemm.linear_config
    shape = GemmShape(m=1, n=2112, k=7168, num_experts=1, bits=4, group=128, group_size=128)
    fields = dict(block_m=16, block_k=128, stages=5, block_n=64)
    tuned(mgpu_gemm=[_entry(1, shape.table_problem(), **fields)])
    assert _configs.resolve(rules, shape) == (MgpuConfig(**fields), f"tuned:{DEVICE}")
    assert _configs.resolve(rules, dataclasses.replace(shape, m=2))[0] == MgpuConfig(**fields)
    # Rows more than TUNED_M_RATIO from the entry's take the heuristic's blocks.
    far = dataclasses.replace(shape, m=3)
    assert _configs.resolve(rules, far) == (linear_config(far), "heuristic")
    for other in (dataclasses.replace(shape, n=4096), dataclasses.replace(shape, num_experts=8)):
        assert _configs.resolve(rules, other) == (linear_config(other), "heuristic")
    caller = MgpuConfig(block_m=8)
    assert _configs.resolve(rules, shape, caller) == (caller, "caller")
    block = BlockConfig(block_m=32, block_k=64, num_stages=3)
    assert _configs.resolve(rules, shape, block) == (MgpuConfig(32, 64, 3), "caller")
    with pytest.raises(ValueError, match="config must be a MgpuConfig or BlockConfig or None"):
        _configs.resolve(rules, shape, "fast")


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_m=16, block_n=64, block_k=128, split_k=3),  # 56 k-tiles
        dict(block_m=16, block_n=64, block_k=2048),  # 7168 % 2048 != 0
    ],
)
def test_resolve_never_returns_an_invalid_entry(tuned, on_device, bad):
    tuned(pallas=TABLE + [_entry(64, **bad)])
    shape = _shape(m=64)
    assert block_configs.config_problems(BlockConfig(**bad), shape)  # the entry really is invalid
    cfg, source = _configs.resolve(pallas_moe.RULES, shape, None)
    assert block_configs.config_problems(cfg, shape) == []
    assert (cfg, source) == (pallas_moe.RULES.heuristic(shape), "heuristic")


def test_tensor_core_rules_pass_over_fma_entries(tuned, on_device):
    """The Triton GEMM's rules (tensor-core dots only) read no table: a tuned CUDA-core ("fma")
    entry of the Pallas GEMM's table is not theirs, and their heuristic gives a tensor-core
    config; block_config_rules(allow_fma=False) with a table passes over an "fma" entry and
    takes a tensor-core one."""
    shape = _shape(m=8)  # decode: the heuristic's answer with CUDA-core products is "fma"
    fma = dict(block_m=1, block_n=128, block_k=128, split_k=8, dot="fma")
    mma = dict(block_m=16, block_n=128, block_k=128)
    tuned(pallas=[_entry(8, **fma)])
    assert _configs.resolve(pallas_moe.RULES, shape) == (BlockConfig(**fma), f"tuned:{DEVICE}")
    cfg, source = _configs.resolve(triton_config.RULES, shape)
    assert source == "heuristic" and cfg.dot == "mma" and cfg.block_m == 16
    assert cfg == block_configs.heuristic_config(shape, allow_fma=False)
    tensor_core = block_configs.block_config_rules(table="pallas", allow_fma=False)
    assert _configs.resolve(tensor_core, shape) == (cfg, "heuristic")
    tuned(pallas=[_entry(8, **mma)])
    assert _configs.resolve(tensor_core, shape) == (BlockConfig(**mma), f"tuned:{DEVICE}")
    assert _configs.resolve(triton_config.RULES, shape) == (cfg, "heuristic")


def test_resolve_rejects_invalid_caller_config():
    with pytest.raises(ValueError, match="split_k=5 does not divide the 56 k-tiles"):
        _configs.resolve(pallas_moe.RULES, _shape(), BlockConfig(block_k=128, split_k=5))
    with pytest.raises(ValueError, match="cannot run the Triton GEMM: dot='fma'"):
        _configs.resolve(triton_config.RULES, _shape(m=8), BlockConfig(block_m=16, dot="fma"))


# ---- the mgpu table: W8A8 entries apart from W8A16 -------------------------------------------


def _int8_layer(e=4, h=128, i=64):
    """Symmetric int8 per-channel w13 [E, 2I, H] and w2 [E, H, I] (the weights W8A8 runs)."""
    scheme = dict(bits=8, group_size=-1, has_zeros=False)
    key = jax.random.key(0)
    w13 = wj.random_quantized_experts(jax.random.fold_in(key, 1), (e, 2 * i, h), **scheme)
    w2 = wj.random_quantized_experts(jax.random.fold_in(key, 2), (e, h, i), **scheme)
    return w13, w2


def _layer_problem(w13, w2, int8_rows=False):
    return mgpu_config.LayerShape.of_layer(4, 4, w13, w2, int8_rows=int8_rows).table_problem()


def test_mgpu_w8a8_problem_differs_from_w8a16():
    """int8 rows (W8A8) add activations="int8" to the layer's key; 16-bit activations keep the
    keys the table files have always held; a tuned entry's problem gives the layer back."""
    w13, w2 = _int8_layer()
    w8a16 = _layer_problem(w13, w2)
    w8a8 = _layer_problem(w13, w2, int8_rows=True)
    assert w8a16 == dict(E=4, H=128, I=64, bits=8, group=64)
    assert w8a8 == w8a16 | dict(activations="int8") and w8a8 != w8a16
    for rows in (False, True):
        layer = mgpu_config.LayerShape.of_layer(8, 4, w13, w2, int8_rows=rows)
        assert mgpu_config.LayerShape.of_entry(layer.table_problem(), 8) == layer


def test_mgpu_layer_config_reads_w8a8_entries(tuned, on_device, caplog, monkeypatch):
    """layer_config(int8_rows=True) takes the W8A8 entry of its problem (source "tuned:<kind>"),
    16-bit activations the entry without the activations key (as the shipped entries are
    written); neither reads the other's, falling back to default_config."""
    w13, w2 = _int8_layer()
    w8a16 = _layer_problem(w13, w2)
    w8a8 = _layer_problem(w13, w2, int8_rows=True)
    old_style = _entry(8, dict(E=4, H=128, I=64, bits=8, group=64), block_m=8, stages=5)
    new_entry = _entry(8, w8a8, block_m=16, block_n=128, stages=4)
    w8a16_cfg, w8a8_cfg = MgpuConfig(8, stages=5), MgpuConfig(16, block_n=128, stages=4)
    monkeypatch.setattr(_configs, "_logged", set())
    caplog.set_level(logging.INFO, logger="wna16_jax")
    heuristic = {
        rows: mgpu_config.default_config(8, 4, 64, 64, 8, int8_rows=rows, per_channel=True)
        for rows in (False, True)
    }
    assert {w8a16_cfg, w8a8_cfg}.isdisjoint(heuristic.values())  # a hit is told apart

    def config(int8_rows):
        return mgpu_config.layer_config(None, 8, 4, w13, w2, int8_rows=int8_rows)

    tuned(mgpu=[old_style, new_entry])
    assert _configs.lookup_tuned("mgpu", MgpuConfig, w8a16, 8, DEVICE) == w8a16_cfg
    assert config(False) == w8a16_cfg
    assert config(True) == w8a8_cfg
    logged = [r.getMessage() for r in caplog.records]
    assert any("'activations': 'int8'" in m and f"[tuned:{DEVICE}]" in m for m in logged)
    tuned(mgpu=[old_style])  # W8A16 only: W8A8 takes the heuristic
    assert _configs.lookup_tuned("mgpu", MgpuConfig, w8a8, 8, DEVICE) is None
    assert config(True) == heuristic[True]
    assert any("'activations': 'int8'" in m and "[heuristic]" in m for m in
               [r.getMessage() for r in caplog.records])  # fmt: skip
    tuned(mgpu=[new_entry])  # W8A8 only: W8A16 takes the heuristic
    assert config(False) == heuristic[False]


# ---- the shipped tables ---------------------------------------------------------------------


def _shipped():
    folder = resources.files("wna16_jax").joinpath(_configs.TUNED_DIR)
    files = sorted(f for f in folder.iterdir() if f.name.endswith(".json"))
    assert files, "no tuned table is shipped"
    return [(f.name, json.loads(f.read_text())) for f in files]


def _rules_of_table(table: str) -> ConfigRules:
    found = [r for r in ALL_RULES.values() if r.table == table]
    assert len(found) == 1, f"table {table!r} is read by {len(found)} kernels' rules"
    return found[0]


def _shipped_entries():
    """(file name, table, entry, its kernel's rules) of every shipped entry."""
    return [
        (name, table, entry, _rules_of_table(table))
        for name, data in _shipped()
        for table, body in data["tables"].items()
        for entry in body["entries"]
    ]


def test_shipped_tables_are_valid():
    """Each file is named after its device; each table is a kernel's (its rules name it) and
    has entries; each entry names its problem, M and a config of its kernel's class, which
    the kernel may run (its rules' `usable`); no problem has two entries at one M."""
    for name, data in _shipped():
        assert name == _configs.device_file_name(data["device"])
        for table, body in data["tables"].items():
            assert body["about"] and body["entries"], (name, table)
    seen = set()
    for name, table, entry, rules in _shipped_entries():
        key = (name, table, tuple(sorted(entry["problem"].items())), entry["M"])
        assert key not in seen, key
        seen.add(key)
        cfg = rules.config_type(**entry["config"])
        problem = rules.entry_problem(entry["problem"], entry["M"])
        assert rules.usable is None or rules.usable(cfg, problem), (name, entry)


def test_shipped_entries_are_not_the_heuristics_choice():
    """An entry exists only where a measurement beat the heuristic: none equals what the
    kernel's heuristic returns for its problem at its M (such an entry only copies the
    rules, and goes stale when they change)."""
    entries = _shipped_entries()
    assert entries
    copies = [
        (name, table, entry["problem"], entry["M"])
        for name, table, entry, rules in entries
        if rules.config_type(**entry["config"])
        == rules.heuristic(rules.entry_problem(entry["problem"], entry["M"]))
    ]
    assert not copies, f"{len(copies)} entries equal the heuristic's choice: {copies}"


def test_the_honesty_check_sees_a_copy():
    """The check above catches an entry equal to the heuristic (it cannot pass vacuously)."""
    rules = pallas_moe.RULES
    shape = _shape(m=8)
    entry = _entry(8, shape.table_problem(), **dataclasses.asdict(rules.heuristic(shape)))
    assert rules.config_type(**entry["config"]) == rules.heuristic(
        rules.entry_problem(entry["problem"], entry["M"])
    )


def test_examples_tune_writes_what_the_lookup_reads(tmp_path, monkeypatch):
    """examples/tune.py's table writer (merge_table) produces the format tuned_entries reads,
    and a second write replaces an entry of the same problem and M."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "tune.py"
    spec = importlib.util.spec_from_file_location("tune_for_test", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    out = tmp_path / _configs.TUNED_DIR / _configs.device_file_name(DEVICE)
    out.parent.mkdir(parents=True)
    first = _entry(16, block_m=16, block_n=64, block_k=128) | {"microseconds": 5.0}
    second = _entry(16, block_m=32, block_n=64, block_k=128) | {"microseconds": 4.0}
    layer = _entry(8, dict(E=8, H=256, I=128, bits=4, group=64), block_m=8, block_halvings=1)
    tune.merge_table(str(out), DEVICE, "pallas", [first], about="test")
    tune.merge_table(str(out), DEVICE, "mgpu", [layer], about="test")
    tune.merge_table(str(out), DEVICE, "pallas", [second], about="test")
    monkeypatch.setattr(_configs, "resources", types.SimpleNamespace(files=lambda pkg: tmp_path))
    _configs.tuned_entries.cache_clear()
    try:
        assert _lookup(16) == BlockConfig(block_m=32, block_n=64, block_k=128)
        assert len(_configs.tuned_entries(DEVICE, "pallas", BlockConfig)) == 1
        assert _configs.lookup_tuned("mgpu", MgpuConfig, layer["problem"], 1, DEVICE) == (
            MgpuConfig(block_m=8, block_halvings=1)
        )
    finally:
        _configs.tuned_entries.cache_clear()


def test_mgpu_config_is_public_from_its_backend_and_wna16_jax():
    """MgpuConfig lives in the Mosaic GPU backend's folder; wna16_jax.MgpuConfig is the same
    class (the registry's 'mgpu' config_type), found without wna16_jax importing the kernels."""
    assert wj.MgpuConfig is MgpuConfig is mgpu_config.MgpuConfig
    assert "MgpuConfig" in wj.__all__
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchConfig'"):
        wj.NoSuchConfig  # noqa: B018
