"""Imports flow downward, at the top of each module: no function-level import of a helixserve
module unless it is on the allow-list below with its reason (a heavy optional dependency behind
it, the CLI's start-up time, or a cycle not broken yet: named with how to break it), and no
cycle between helixserve's packages in the import graph that Python runs at import time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "helixserve"

_TRITON = "triton (optional, GPU): the Triton kernel module imports it; imported on the Triton path only"
# (module path, imported module) -> why the import stays inside a function
FUNCTION_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {
    # the CLI: each subcommand imports its own stack (start-up time of `helixserve --help`, router without torch)
    **{("helixserve/cli.py", m): "CLI start-up: a subcommand imports its own stack" for m in (
        "helixserve.models.presets", "helixserve.engine.llm", "helixserve.engine.request", "helixserve.launch.offline",
        "helixserve.planning.report", "helixserve.config", "helixserve.ctx_server.app", "helixserve.serving.http",
        "helixserve.gen_server.app", "helixserve.router.app", "helixserve.launch.local", "helixserve.ctx_server.world",
        "helixserve.training.checkpoint")},
    # torch-free callers that make or read a checkpoint only on request
    ("helixserve/launch/local.py", "helixserve.models.presets"):
        "torch: `helixserve launch` imports torch only when it has to make the tiny checkpoint",
    ("helixserve/planning/report.py", "helixserve.models.presets"):
        "torch: `helixserve plan` is torch-free unless --preset asks for a preset's config",
    # optional dependencies
    ("helixserve/models/presets.py", "helixserve.models.tokenizer_hf"): "tokenizers: only the hf layout writes it",
    ("helixserve/models/presets.py", "helixserve.models.tokenizer_tiktoken"): "tiktoken: only the kimi layout writes it",
    ("helixserve/models/tokenizer_loader.py", "helixserve.models.tokenizer_tiktoken"):
        "tiktoken: only a checkpoint without tokenizer.json reads it",
    ("helixserve/transceiver/backends.py", "helixserve.transceiver.ucxx_backend"):
        "ucxx (optional extra): the backend picked by TransceiverBackendKind is imported when chosen",
    ("helixserve/transceiver/backends.py", "helixserve.transceiver.fake"):
        "the backend picked by TransceiverBackendKind is imported when chosen (the fake only in tests)",
    ("helixserve/kernels/attn_res/mix.py", "helixserve.kernels.attn_res"): _TRITON,
    ("helixserve/kernels/mla/combine.py", "helixserve.kernels.mla"): _TRITON,
    ("helixserve/kernels/moe/gpu.py", "helixserve.kernels.moe"): _TRITON,
    ("helixserve/kernels/moe/route.py", "helixserve.kernels.moe"): _TRITON,
    ("helixserve/kernels/moe/experts.py", "helixserve.kernels.moe"): _TRITON,
    ("helixserve/kernels/norm/rms.py", "helixserve.kernels.norm"): _TRITON,
    ("helixserve/kernels/kda/gate.py", "helixserve.kernels.kda"): _TRITON,
}


def _module_of(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rsplit(".", 1)[0]
    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{parent}.{node.module}" if node.module else parent


def _names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = _resolve(node, module, is_package)
    return [base]


def function_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, module)`` of every helixserve import inside a function body of ``path``."""
    module, is_package = _module_of(path, root), path.name == "__init__.py"
    if is_package:
        module = module.removesuffix(".__init__")
    found: list[tuple[int, str]] = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [(node.lineno, n) for n in _names(node, module, is_package)
                          if n.split(".")[0] == "helixserve"]
    return sorted(set(found))


def module_level_imports(path: Path, root: Path = ROOT) -> list[str]:
    """The helixserve modules ``path`` imports when it is imported: module-level statements
    (inside ``if`` / ``try`` too), not ``if TYPE_CHECKING:`` blocks, not function bodies."""
    module, is_package = _module_of(path, root), path.name == "__init__.py"
    if is_package:
        module = module.removesuffix(".__init__")
    out: list[str] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body + node.orelse + node.finalbody)
                for handler in node.handlers:
                    walk(handler.body)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, module, is_package)
                out.append(base)
                out.extend(f"{base}.{a.name}" for a in node.names if base == "helixserve")
            elif isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)

    walk(ast.parse(path.read_text(), str(path)).body)
    return [m for m in out if m.split(".")[0] == "helixserve" and m != "helixserve"]


def package_of(module: str) -> str:
    """``helixserve.engine.core`` -> ``engine``; a top-level module is its own node
    (``helixserve.config`` -> ``config``)."""
    return module.split(".")[1]


def package_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """``{package: {package it imports: one module path that does}}`` from module-level imports."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted((root / "helixserve").rglob("*.py")):
        source = package_of(_module_of(path, root))
        for name in module_level_imports(path, root):
            target = package_of(name)
            if target != source:
                graph.setdefault(source, {}).setdefault(target, path.relative_to(root).as_posix())
    return graph


def package_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every cycle's packages (strongly connected components of more than one), sorted."""
    order: list[str] = []
    seen: set[str] = set()
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})

    def visit(node: str) -> None:  # post-order on the graph
        seen.add(node)
        for target in sorted(graph.get(node, {})):
            if target not in seen:
                visit(target)
        order.append(node)

    for node in nodes:
        if node not in seen:
            visit(node)
    reverse: dict[str, set[str]] = {}
    for source, targets in graph.items():
        for target in targets:
            reverse.setdefault(target, set()).add(source)
    assigned: set[str] = set()
    cycles = []
    for node in reversed(order):  # Kosaraju: components on the reversed graph
        if node in assigned:
            continue
        component, stack = [], [node]
        assigned.add(node)
        while stack:
            current = stack.pop()
            component.append(current)
            for source in reverse.get(current, ()):
                if source not in assigned:
                    assigned.add(source)
                    stack.append(source)
        if len(component) > 1:
            cycles.append(sorted(component))
    return sorted(cycles)


SITES = sorted({(p.relative_to(ROOT).as_posix(), m) for p in PKG.rglob("*.py") for _, m in function_imports(p)})


@pytest.mark.parametrize("site", SITES, ids=lambda s: f"{s[0]}:{s[1]}")
def test_a_function_level_import_has_its_reason(site):
    assert site in FUNCTION_IMPORTS_ALLOWED, (
        f"{site[0]} imports {site[1]} inside a function: import it at the top (move the shared piece "
        "down if that makes a cycle), or add it to FUNCTION_IMPORTS_ALLOWED with its reason")


def test_the_allow_list_is_still_needed():
    stale = sorted(set(FUNCTION_IMPORTS_ALLOWED) - set(SITES))
    assert not stale, f"drop {stale} from FUNCTION_IMPORTS_ALLOWED"


def test_no_cycle_between_helixserve_packages():
    graph = package_graph()
    assert {"engine", "transceiver", "kernels", "serving", "gen_server", "launch"} <= set(graph), sorted(graph)
    cycles = package_cycles(graph)
    edges = {f"{a} -> {b} ({graph[a][b]})" for cycle in cycles for a in cycle for b in cycle if b in graph.get(a, {})}
    assert not cycles, f"package cycles {cycles}: {sorted(edges)}"


def test_config_is_a_leaf_of_the_package_graph():
    graph = package_graph()
    config_nodes = {n for n in set(graph) | {t for v in graph.values() for t in v} if n.startswith("config")}
    assert config_nodes == {"config", "config_env", "config_http", "config_lifecycle", "config_speculative",
                            "config_transceiver", "config_workers"}, config_nodes
    for node in config_nodes:
        assert set(graph.get(node, {})) <= config_nodes, (node, graph.get(node))


def test_the_checks_can_fail(tmp_path):
    """A function-level import is found (relative ones resolved), and a cycle of packages through
    module-level imports is found while TYPE_CHECKING imports are not edges."""
    pkg = tmp_path / "helixserve"
    for sub in ("a", "b", "c"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from helixserve.b import y\ndef f():\n    from ..c import z\n    import helixserve.b.y\n")
    (pkg / "b" / "y.py").write_text("try:\n    from helixserve.a.x import f\nexcept ImportError:\n    pass\n")
    (pkg / "c" / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from helixserve.a import x\n")
    assert function_imports(pkg / "a" / "x.py", tmp_path) == [(3, "helixserve.c"), (4, "helixserve.b.y")]
    graph = package_graph(tmp_path)
    assert graph == {"a": {"b": "helixserve/a/x.py"}, "b": {"a": "helixserve/b/y.py"}}
    assert package_cycles(graph) == [["a", "b"]]


@pytest.mark.parametrize("leaf", ["clock", "dtypes", "cache_layout", "host_copy"])
def test_leaf_modules_import_no_helixserve_package(leaf):
    """The clock protocol, the dtype table, the cache layout and the host copy sit under everything."""
    assert leaf in {package_of(_module_of(p, ROOT)) for p in PKG.glob("*.py")}
    assert not package_graph().get(leaf), package_graph()[leaf]


# file cycles (module imports anywhere, TYPE_CHECKING too) still to break, each with its reason
KNOWN_FILE_CYCLES: dict[tuple[str, ...], str] = {}


def module_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """``{module: {helixserve module it imports anywhere (functions, TYPE_CHECKING too): path}}``."""
    paths = {_module_of(p, root).removesuffix(".__init__"): p for p in (root / "helixserve").rglob("*.py")}
    graph: dict[str, dict[str, str]] = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, module, is_package)
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            for name in names:
                if name in paths and name != module:
                    graph.setdefault(module, {})[name] = path.relative_to(root).as_posix()
    return graph


def test_the_file_cycles_are_only_the_known_ones():
    cycles = {tuple(c) for c in package_cycles(module_graph())}
    assert cycles <= set(KNOWN_FILE_CYCLES), f"new file cycles: {sorted(cycles - set(KNOWN_FILE_CYCLES))}"
    assert set(KNOWN_FILE_CYCLES) <= cycles, f"drop {sorted(set(KNOWN_FILE_CYCLES) - cycles)} from KNOWN_FILE_CYCLES"
