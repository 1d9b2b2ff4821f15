"""Layers as the design draws them: the engine raises its own errors (no import of the
OpenAI protocol, nor of a server, anywhere under ``helixserve/engine``), the servers map them to
HTTP, and the pieces the torch-free router uses import without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helixserve.engine import errors as engine_errors
from helixserve.serving.engine_errors import to_openai_error

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = sorted((ROOT / "helixserve" / "engine").rglob("*.py"))
# what engine/ may not import: the OpenAI protocol and everything above the engine
FORBIDDEN = ("helixserve.protocol", "helixserve.serving", "helixserve.ctx_server", "helixserve.gen_server",
             "helixserve.router")


def imported_modules(path: Path, root: Path = ROOT) -> list[str]:
    """Every module ``path`` imports (``from x import y`` counts as ``x`` and ``x.y``), lazy
    imports inside functions too; relative imports resolved against the package."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_the_engine_package_is_found():
    rels = {p.relative_to(ROOT).as_posix() for p in ENGINE_MODULES}
    assert {"helixserve/engine/async_engine.py", "helixserve/engine/engine_thread.py",
            "helixserve/engine/errors.py"} <= rels


@pytest.mark.parametrize("path", ENGINE_MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_engine_module_imports_nothing_above_the_engine(path):
    bad = [name for name in imported_modules(path)
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_import_parser_sees_protocol_imports(tmp_path):
    """The check above can fail: it catches each spelling of a protocol import."""
    src = tmp_path / "helixserve" / "engine" / "bad.py"
    src.parent.mkdir(parents=True)
    src.write_text("import helixserve.protocol.errors\n"
                   "def f():\n    from helixserve.protocol import QueueFullError\n"
                   "from helixserve import protocol\nfrom ..protocol import errors\n")
    found = [n for n in imported_modules(src, tmp_path) if n.startswith("helixserve.protocol")]
    assert sorted(found) == sorted(["helixserve.protocol.errors", "helixserve.protocol",
                                    "helixserve.protocol.QueueFullError", "helixserve.protocol",
                                    "helixserve.protocol", "helixserve.protocol.errors"])


@pytest.mark.parametrize("module", ["helixserve.parallel.mapping", "helixserve.parallel",
                                    "helixserve.serving.http", "helixserve.serving.auth",
                                    "helixserve.engine.errors", "helixserve.launch.restarts"])
def test_imports_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"importing {module} imports torch:\n{result.stderr[-2000:]}"



def package_modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / "helixserve" / pkg).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imports_from(path: Path, prefixes: tuple[str, ...], root: Path = ROOT) -> list[str]:
    return [n for n in imported_modules(path, root) if any(n == f or n.startswith(f + ".") for f in prefixes)]


# the cache layout: one leaf that models, kvcache and transceiver import
LAYOUT_LEAF = ROOT / "helixserve" / "cache_layout.py"
LAYOUT_NAMES = ("ModelCaches", "CacheSpec", "CacheGeometry", "cache_spec_for", "head_slice")


@pytest.mark.parametrize("path", package_modules("models"), ids=rel)
def test_models_import_nothing_from_kvcache_or_transceiver(path):
    bad = imports_from(path, ("helixserve.kvcache", "helixserve.transceiver"))
    assert not bad, f"{rel(path)} imports {bad}"


@pytest.mark.parametrize("path", package_modules("kvcache", "transceiver"), ids=rel)
def test_kvcache_and_transceiver_import_no_model_module(path):
    bad = imports_from(path, ("helixserve.models",))
    assert not bad, f"{rel(path)} imports {bad} (the cache layout is helixserve.cache_layout)"


def test_the_layout_leaf_imports_only_torch_and_the_standard_library():
    tops = {n.split(".")[0] for n in imported_modules(LAYOUT_LEAF)}
    assert tops <= set(sys.stdlib_module_names) | {"torch", "__future__"}, tops
    code = ("import sys, helixserve.cache_layout; "
            "print(sorted(m for m in sys.modules if m.startswith('helixserve.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['helixserve.cache_layout']"


def test_the_cache_layout_is_defined_once_and_imported_from_the_leaf():
    """No second definition and no re-export: every import of a layout name names the leaf."""
    defined: dict[str, list[str]] = {}
    wrong: list[str] = []
    for path in sorted((ROOT / "helixserve").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py")) \
            + sorted((ROOT / "bench").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in LAYOUT_NAMES \
                    and rel(path).startswith("helixserve/"):
                defined.setdefault(node.name, []).append(rel(path))
            elif isinstance(node, ast.ImportFrom) and node.module != "helixserve.cache_layout" \
                    and any(a.name in LAYOUT_NAMES for a in node.names) and node.module != "__future__":
                wrong.append(f"{rel(path)}: from {node.module} import ...")
    assert defined == {n: ["helixserve/cache_layout.py"] for n in LAYOUT_NAMES}, defined
    assert not wrong, wrong



# launch code sits in one package at the top: it may import servers, engine and config; below it,
# only these import it, each with its reason
LAUNCH_IMPORTERS_ALLOWED = {
    # a world worker (gen or ctx) restarts its world under the same bounded-restart policy as
    # `helixserve launch`
    "helixserve/serving/world_supervisor.py": "helixserve.launch.restarts",
}
OLD_LAUNCH_MODULES = ("helixserve/serving/launch.py", "helixserve/serving/restarts.py", "helixserve/launch_slurm.py",
                      "helixserve/parallel/launch.py")


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "helixserve").rglob("*.py"))
                                  if "helixserve/launch/" not in rel(p) and rel(p) != "helixserve/cli.py"], ids=rel)
def test_nothing_below_the_launch_package_imports_it(path):
    found = sorted(set(imports_from(path, ("helixserve.launch",))))
    allowed = LAUNCH_IMPORTERS_ALLOWED.get(rel(path))
    bad = [n for n in found if allowed is None or not (n == allowed or n.startswith(allowed + "."))]
    assert not bad, f"{rel(path)} imports {bad}: launch code is the top layer"


def test_the_launch_allow_list_is_still_needed():
    stale = [p for p, mod in LAUNCH_IMPORTERS_ALLOWED.items()
             if not any(n == mod or n.startswith(mod + ".") for n in imported_modules(ROOT / p))]
    assert not stale, f"drop {stale} from LAUNCH_IMPORTERS_ALLOWED"


def test_launch_code_is_in_one_package():
    assert not [m for m in OLD_LAUNCH_MODULES if (ROOT / m).exists()]
    assert {p.name for p in (ROOT / "helixserve" / "launch").glob("*.py")} == {
        "__init__.py", "local.py", "offline.py", "probe.py", "processes.py", "restarts.py", "slurm.py"}
    out = subprocess.run([sys.executable, "-m", "helixserve.launch.slurm", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "python -m helixserve.launch.slurm" in out.stdout, out.stderr[-2000:]


# engine error -> (status, code) the client sees: exactly the answers of the servers before the
# engine had its own errors
MAPPED = [
    (engine_errors.RequestRejectedError("prompt token 9 out of range"), 400, None),
    (engine_errors.DuplicateRequestIdError("request id 'a' is already running here", request_id="a"),
     400, "duplicate_request_id"),
    (engine_errors.EngineQueueFullError(5, 4), 429, "queue_full"),
    (engine_errors.RequestAbortedError("request a was aborted", request_id="a"), 499, "request_cancelled"),
    (engine_errors.RequestFailedError("request a failed in the engine (error)"), 500, "internal_error"),
    (engine_errors.StepFailedError("engine step failed: RuntimeError: boom"), 500, "engine_error"),
    (engine_errors.EngineUnavailableError("the server is shutting down"), 503, "service_unavailable"),
    (engine_errors.EngineUnavailableError("rank 1 died", code="gen_world_failed"), 503, "gen_world_failed"),
    (engine_errors.KVTransferError("ctx refused"), 503, "kv_transfer_failed"),
    (engine_errors.KVTransferTimeoutError("timed out after 5 s"), 504, "kv_transfer_timeout"),
]


@pytest.mark.parametrize(("err", "status", "code"), MAPPED, ids=lambda v: type(v).__name__
                         if isinstance(v, Exception) else None)
def test_engine_errors_map_to_the_openai_errors_clients_saw(err, status, code):
    out = to_openai_error(err)
    assert (out.status_code, out.code, out.message) == (status, code, err.message)
    assert out.body()["error"]["code"] == code
    if status == 429:
        assert out.headers == {"Retry-After": "1"}


def test_every_engine_error_class_has_a_mapping():
    base = engine_errors.EngineError
    classes = [c for c in vars(engine_errors).values()
               if isinstance(c, type) and issubclass(c, base) and c is not base]
    mapped = {type(err) for err, _, _ in MAPPED}
    assert set(classes) == mapped, f"unmapped in this test: {set(classes) - mapped}"


def test_a_refusal_is_still_a_value_error():
    assert isinstance(engine_errors.RequestRejectedError("x"), ValueError)
    assert isinstance(engine_errors.DuplicateRequestIdError("x", request_id="a"), ValueError)


def test_the_engine_starts_no_process():
    """Starting processes is the launchers' (and a gen worker's local world's): nothing under
    ``helixserve/engine`` imports multiprocessing or subprocess, nor calls ``os.fork``."""
    spawners = ("multiprocessing", "subprocess", "concurrent.futures.process")
    bad = {rel(p): found for p in ENGINE_MODULES
           if (found := sorted({n for n in imported_modules(p) if n.split(".")[0] in spawners
                                or any(n == s or n.startswith(s + ".") for s in spawners)}))}
    forks = [rel(p) for p in ENGINE_MODULES if "os.fork" in p.read_text()]
    assert not bad and not forks, (bad, forks)


# the transceiver's two sides: what a ctx worker runs and what a gen rank runs
TRANSCEIVER = ROOT / "helixserve" / "transceiver"
SIDES = {"ctx": "helixserve.transceiver.ctx", "gen": "helixserve.transceiver.gen"}


def side_imports(path: Path, root: Path = ROOT) -> dict[str, list[str]]:
    """``{side: modules of that side path imports}`` (function-level imports too)."""
    return {side: found for side, prefix in SIDES.items() if (found := imports_from(path, (prefix,), root))}


def test_both_sides_of_the_transceiver_are_found():
    assert {p.name for p in (TRANSCEIVER / "ctx").glob("*.py")} >= {"sender.py", "hold.py", "control_server.py"}
    assert {p.name for p in (TRANSCEIVER / "gen").glob("*.py")} >= {
        "receiver.py", "inbound.py", "control_client.py", "transport.py", "granted_pull.py", "asked_pull.py",
        "tagged_stream.py"}


@pytest.mark.parametrize("side,other", [("ctx", "gen"), ("gen", "ctx")])
def test_a_transceiver_side_never_imports_the_other(side, other):
    bad = {rel(p): found for p in sorted((TRANSCEIVER / side).rglob("*.py"))
           if (found := side_imports(p).get(other))}
    assert not bad, f"transceiver.{side} imports transceiver.{other}: {bad}"


def test_the_shared_transceiver_modules_import_neither_side():
    shared = [p for p in sorted(TRANSCEIVER.rglob("*.py"))
              if p.parent.name not in SIDES]
    bad = {rel(p): found for p in shared if (found := side_imports(p))}
    assert not bad, f"shared transceiver modules import a side (move them into it): {bad}"


@pytest.mark.parametrize("packages,other", [(("ctx_server",), "gen"), (("gen_server", "engine"), "ctx")])
def test_each_server_uses_only_its_own_side(packages, other):
    bad = {rel(p): found for p in package_modules(*packages) if (found := side_imports(p).get(other))}
    assert not bad, f"{packages} import transceiver.{other}: {bad}"


def test_the_side_check_sees_absolute_relative_and_function_level_imports(tmp_path):
    ctx = tmp_path / "helixserve" / "transceiver" / "ctx"
    ctx.mkdir(parents=True)
    (ctx / "a.py").write_text("from helixserve.transceiver.gen.receiver import KVReceiver\n")
    (ctx / "b.py").write_text("from ..gen import inbound\n")
    (ctx / "c.py").write_text("def f():\n    import helixserve.transceiver.gen.pull\n")
    (ctx / "d.py").write_text("from helixserve.transceiver import layout\nfrom . import hold\n")
    found = {p.name: side_imports(p, tmp_path) for p in sorted(ctx.glob("*.py"))}
    assert found == {"a.py": {"gen": ["helixserve.transceiver.gen.receiver",
                                      "helixserve.transceiver.gen.receiver.KVReceiver"]},
                     "b.py": {"gen": ["helixserve.transceiver.gen", "helixserve.transceiver.gen.inbound"]},
                     "c.py": {"gen": ["helixserve.transceiver.gen.pull"]},
                     "d.py": {"ctx": ["helixserve.transceiver.ctx", "helixserve.transceiver.ctx.hold"]}}
