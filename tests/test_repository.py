"""Checks of the repository itself: the import layers and that tracked files describe the code,
not the runs that measured it."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("wna16_jax", "pallas_kernels", "models", "examples")
# The one library module the kernels import: the backend API.
BACKEND_API = "wna16_jax.backend_api"


def _tracked_files() -> list[pathlib.Path]:
    """The files git tracks (every file under the root when git is not available)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True
        ).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
        ]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> dict[str, pathlib.Path]:
    """Module name -> file of every Python module of the packages and examples."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _imports(path: pathlib.Path, name: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules that module `name` (at `path`) imports, anywhere in its body.

    `from a.b import c` names the module a.b.c when that is a module, else a.b (the package
    that defines c); relative imports are resolved against `name`'s package.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                targets.append(sub if sub in modules else base)
        else:
            continue
        for target in targets:
            # `import a.b.c` imports a.b.c; keep the longest project module it names.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    modules = _project_modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


def _layer_problem(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported` (None when it may)."""
    top, imported_top = importer.split(".")[0], imported.split(".")[0]
    if top == "wna16_jax":
        if imported_top != "wna16_jax":
            return "wna16_jax imports only itself (backends are registered by module name)"
        if imported == "wna16_jax":
            return "a wna16_jax module imports the package's public surface"
        return None
    if top == "pallas_kernels":
        if imported_top == "wna16_jax":
            if imported != BACKEND_API:
                return f"kernels import the library through {BACKEND_API} only"
            return None
        if imported_top != "pallas_kernels":
            return "kernels import only wna16_jax's shared modules and pallas_kernels"
        own, other = importer.split(".")[:2], imported.split(".")[:2]
        if len(other) < 2 or other == own or other[1] == "common":
            return None
        return f"a backend imports another backend ({'.'.join(other)})"
    if top in ("models", "examples"):
        if imported_top in ("wna16_jax", "models") and _is_public(imported):
            return None
        if imported_top == "examples" and top == "examples":
            return None
        return f"{top} import only the public API of wna16_jax and models"
    return None


def test_imports_follow_the_layers(import_graph):
    problems = [
        f"{importer} -> {imported}: {why}"
        for importer, imported_set in sorted(import_graph.items())
        for imported in sorted(imported_set)
        if (why := _layer_problem(importer, imported))
    ]
    assert not problems, "\n".join(problems)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles(import_graph):
    # A package's __init__ importing its own submodules is the normal re-export, not a circle.
    graph = {
        name: {m for m in deps if not (name in m.split(".")[:-1] or m.startswith(name + "."))}
        for name, deps in import_graph.items()
    }
    cycle = _find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# Kernel backends and their layouts, by the prefix of their names: models ask the registry
# (wj.backend_layout, wj.preferred_layout) instead of naming them in code.
KERNEL_NAME = re.compile(r"^(mgpu|pallas|triton)")


def _kernel_names_in_code(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string constant in `source`'s code (docstrings aside) that names a
    kernel backend or layout (KERNEL_NAME)."""
    return [(line, text) for line, text in _string_constants(source) if KERNEL_NAME.match(text)]


def _string_constants(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string constant in `source`'s code, docstrings aside."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_models_name_no_kernel_backend():
    """Model code picks no backend or layout by name: the registry knows each backend's
    layouts (only docstrings may name them, as examples)."""
    hits = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in sorted((ROOT / "models").rglob("*.py"))
        for line, text in _kernel_names_in_code(path.read_text())
    ]
    assert not hits, "\n".join(hits)


def test_kernel_name_rule_catches_a_branch_on_a_backend():
    code = 'def f(impl):\n    """Runs on "mgpu"."""\n    return impl.startswith("mgpu")\n'
    assert _kernel_names_in_code(code) == [(3, "mgpu")]


def test_layer_rules_catch_forbidden_imports():
    """The rules above reject what they must (so the layer test cannot pass vacuously)."""
    assert _layer_problem("pallas_kernels.pallas.fused_moe", "wna16_jax._reference")
    assert _layer_problem("pallas_kernels.pallas.wna16_gemm", "wna16_jax._types")
    assert _layer_problem("pallas_kernels.common.align", "wna16_jax")
    assert _layer_problem("pallas_kernels.mgpu.layout", BACKEND_API) is None
    assert _layer_problem("pallas_kernels.pallas.fused_moe", "pallas_kernels.mgpu.config")
    assert _layer_problem("wna16_jax._api", "pallas_kernels.pallas.backend")
    assert _layer_problem("models.deepseek_v3.modeling", "wna16_jax._types")
    assert _layer_problem("examples.benchmark", "pallas_kernels.pallas.wna16_gemm")
    assert _layer_problem("pallas_kernels.mgpu.fused_moe", "pallas_kernels.common.align") is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _family_packages() -> tuple[str, ...]:
    """models.registry.FAMILY_PACKAGES, read from its source (no model package imported)."""
    tree = ast.parse((ROOT / "models" / "registry.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["FAMILY_PACKAGES"]:
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("models/registry.py defines no FAMILY_PACKAGES")


def _family_problem(importer: str, imported: str, families: tuple[str, ...]) -> str | None:
    """Why `importer` may not import the family module `imported`: outside a family's folder
    only the registry reaches a family (the one line that adds it); an example named after a
    family (examples/full_deepseek_v3.py) may import that family."""
    parts = imported.split(".")
    if parts[0] != "models" or len(parts) < 2 or parts[1] not in families:
        return None
    family = parts[1]
    if importer == "models.registry" or importer.split(".")[:2] == ["models", family]:
        return None
    if importer.startswith("examples.") and family in importer:
        return None
    return f"code outside models/{family}/ names the family (ask models.registry)"


def test_only_the_registry_names_a_family(import_graph):
    families = _family_packages()
    problems = [
        f"{importer} -> {imported}: {why}"
        for importer, imported_set in sorted(import_graph.items())
        for imported in sorted(imported_set)
        if (why := _family_problem(importer, imported, families))
    ]
    assert not problems, "\n".join(problems)


def test_family_rule_catches_a_family_named_elsewhere():
    families = ("deepseek_v3", "qwen_moe")
    assert _family_problem("models.common.loader", "models.qwen_moe.params", families)
    assert _family_problem("examples.generate", "models.deepseek_v3", families)
    assert _family_problem("models.qwen_moe.params", "models.deepseek_v3.config", families)
    assert _family_problem("models.registry", "models.qwen_moe", families) is None
    assert _family_problem("models.qwen_moe.sharding", "models.qwen_moe.modeling", families) is None
    assert _family_problem("examples.full_deepseek_v3", "models.deepseek_v3", families) is None


# ---- the backend seam ------------------------------------------------------------------------
#
# A backend lives in pallas_kernels/<its name>/ (pallas_kernels/common holds what several share),
# registers its stages from <its name>/backend.py, and the library runs the one pipeline: no
# kernel file defines fused_moe.

KERNEL_SHARED = "common"


def _backend_folders() -> list[str]:
    return sorted(
        p.name
        for p in (ROOT / "pallas_kernels").iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name != KERNEL_SHARED
    )


def _fused_moe_definitions(source: str) -> list[int]:
    """The lines where `source` defines a function named fused_moe (at any depth)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "fused_moe"
    ]


def test_no_backend_defines_fused_moe():
    """Backends give stages; the library's pipeline is the one MoE layer."""
    hits = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "pallas_kernels").rglob("*.py"))
        for line in _fused_moe_definitions(path.read_text())
    ]
    assert not hits, "a kernel file defines fused_moe:\n" + "\n".join(hits)


def test_fused_moe_rule_catches_a_definition():
    code = "import jax\n\n@jax.jit\ndef fused_moe(x):\n    return x\n"
    assert _fused_moe_definitions(code) == [4]
    assert _fused_moe_definitions("def stages():\n    return fused_moe\n") == []


def _folder_problems(folders, modules, registered) -> list[str]:
    """Why the backend folders and the registry disagree (empty when each folder is named after
    the backend it registers).

    Args:
        folders: the backend folders of pallas_kernels.
        modules: the registry's built-in backend modules (BUILTIN_BACKEND_MODULES).
        registered: {module: names of the Backends it registers}.
    """
    problems = []
    for module in modules:
        parts = module.split(".")
        if len(parts) != 3 or parts[0] != "pallas_kernels" or parts[2] != "backend":
            problems.append(f"{module} is not pallas_kernels.<backend>.backend")
            continue
        if parts[1] not in folders:
            problems.append(f"{module}: no folder pallas_kernels/{parts[1]}")
        for name in registered.get(module, ()):
            if name not in (parts[1], f"{parts[1]}_interpret"):
                problems.append(f"{module} registers {name!r}, not the folder's name {parts[1]!r}")
    listed = {m.split(".")[1] for m in modules if m.count(".") == 2}
    problems += [f"pallas_kernels/{f} registers no backend" for f in folders if f not in listed]
    return problems


def test_backend_folders_are_named_after_their_backends():
    from wna16_jax import _dispatch

    _dispatch.registered_backends()
    registered = {
        module: [b.name for b in importlib.import_module(module).BACKENDS]
        for module in _dispatch.BUILTIN_BACKEND_MODULES
    }
    problems = _folder_problems(_backend_folders(), _dispatch.BUILTIN_BACKEND_MODULES, registered)
    assert not problems, "\n".join(problems)


def test_folder_rule_catches_a_misnamed_folder():
    """The layout before the folders were renamed: 'triton' lived in jax_triton/."""
    module = "pallas_kernels.jax_triton.backend"
    assert _folder_problems(["jax_triton"], [module], {module: ["triton"]}) == [
        f"{module} registers 'triton', not the folder's name 'jax_triton'"
    ]
    assert _folder_problems(["pallas", "spare"], ["pallas_kernels.pallas.backend"], {}) == [
        "pallas_kernels/spare registers no backend"
    ]
    assert not _folder_problems(
        ["mgpu"], ["pallas_kernels.mgpu.backend"], {"pallas_kernels.mgpu.backend": ["mgpu"]}
    )


def _backend_private_names() -> set[str]:
    """The module constants (UPPER_CASE) of the backend folders that wna16_jax does not
    publish (e.g. MGPU_TILE; wj.layouts.LAYOUTS is public)."""
    import wna16_jax as wj

    public = set(wj.__all__) | set(wj.layouts.__all__)
    names = set()
    for folder in _backend_folders():
        for path in (ROOT / "pallas_kernels" / folder).glob("*.py"):
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                names |= {
                    t.id
                    for t in targets
                    if isinstance(t, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]+", t.id)
                }
    return names - public


def _private_names_in_code(source: str, private: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each name or attribute in `source` that is one of `private`."""
    return [
        (node.lineno, name)
        for node in ast.walk(ast.parse(source))
        if (name := getattr(node, "id", None) or getattr(node, "attr", None)) in private
        and isinstance(node, (ast.Name, ast.Attribute))
    ]


def test_models_read_no_backend_private_name():
    """Model code reads no backend's constants (its tile, layouts, limits): it asks the
    registry (e.g. wj.layouts.shard_granularity(layout))."""
    private = _backend_private_names()
    assert "MGPU_TILE" in private  # the rule sees the backends' constants
    hits = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted((ROOT / "models").rglob("*.py"))
        for line, name in _private_names_in_code(path.read_text(), private)
    ]
    assert not hits, "\n".join(hits)


def test_private_name_rule_catches_a_tile_read():
    code = "import wna16_jax as wj\ntile = wj.layouts.MGPU_TILE\nLAYOUTS = 1\n"
    assert _private_names_in_code(code, {"MGPU_TILE"}) == [(2, "MGPU_TILE")]


def _reference_names_in_code(source: str) -> list[int]:
    """The lines of string constants "xla" in `source`'s code (docstrings aside): a branch on
    the reference backend by its name."""
    return [line for line, text in _string_constants(source) if text == "xla"]


def test_models_branch_on_no_reference_name():
    """Model code names the reference backend through the library (wj.REFERENCE_BACKEND), never
    as the string "xla"."""
    hits = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "models").rglob("*.py"))
        for line in _reference_names_in_code(path.read_text())
    ]
    assert not hits, "\n".join(hits)


def test_reference_rule_catches_a_branch():
    code = 'def f(impl):\n    """Runs on "xla"."""\n    return None if impl == "xla" else impl\n'
    assert _reference_names_in_code(code) == [3]


# Words that name run records rather than the code: work sessions and their numbered calls,
# issue numbers, the GPU-lending machinery. Written in pieces so that this file passes itself.
_RUN_RECORD_PATTERNS = [
    r"\b" + "sess" + r"ions? \d",
    r"\b" + "sess" + r"ion\d",
    r"\b" + "ca" + r"lls? \d",
    r"\bs\d+_" + "ca" + "ll",
    r"\b" + "pend" + r"ing_s\d",
    r"\b" + "iss" + r"ues? #?\d",
    r"\b" + "device" + " time",
    r"\bnot " + "le" + r"nt\b",
    r"\b" + "le" + r"nds? (a |one |the )?(GPU|machine)",
]
RUN_RECORD = re.compile("|".join(_RUN_RECORD_PATTERNS), re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".json", ".sh", ".toml", ".txt", ".cfg", ".yaml", ".yml", ""}


def test_tracked_files_name_no_run_records():
    hits = []
    for path in _tracked_files():
        if path.suffix not in TEXT_SUFFIXES or path.name == "LICENSE":
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if match := RUN_RECORD.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {match.group(0)!r}")
    assert not hits, f"{len(hits)} run-record words:\n" + "\n".join(hits[:50])


@pytest.mark.parametrize(
    "text",
    [
        "measured in " + "sess" + "ion 21",
        "(" + "ca" + "ll 4)",
        "s24_" + "ca" + "ll3.sh",
        "see " + "iss" + "ue #9",
        "30 minutes of " + "device" + " time",
    ],
)
def test_run_record_pattern_catches(text):
    assert RUN_RECORD.search(text)


@pytest.mark.parametrize("text", ["device_kind", "a kernel call per layer", "recall 4 rows"])
def test_run_record_pattern_spares_code_words(text):
    assert not RUN_RECORD.search(text)
