"""Layering of the configuration, as the design draws it: ``config.py``
resolves env vars, derived values and defaults once and imports nothing above it; only the
config modules read the environment; SLURM / torchrun variables are parsed in one module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "helixserve"

# what helixserve/config.py may import from the package: torch-free leaf config only
CONFIG_MODULES = ("config.py", "config_env.py", "config_lifecycle.py", "config_http.py", "config_speculative.py",
                  "config_transceiver.py", "config_workers.py")
CONFIG_MAY_IMPORT = {f"helixserve.{name.removesuffix('.py')}" for name in CONFIG_MODULES}
# the modules that read os.environ (the config modules) ...
ENV_READERS = {"helixserve/config.py", "helixserve/config_env.py"}
# ... and the short allow-list of others, each with its reason
ENV_ALLOWED = {
    # TRITON_INTERPRET is Triton's own switch (set by triton's users, read by triton itself);
    # the kernels ask whether triton will interpret, not a helixserve setting
    "helixserve/kernels/triton_common.py": "TRITON_INTERPRET",
}


def helixserve_imports(path: Path) -> set[str]:
    """Every ``helixserve...`` module ``path`` imports, at any depth (function-local imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "helixserve")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "helixserve":
            found.add(node.module)
    return found


def reads_environ(path: Path) -> bool:
    """Whether ``path`` touches ``os.environ`` / ``os.getenv`` / ``os.putenv`` (or imports them)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv", "putenv", "unsetenv", "environb"} \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in {"environ", "getenv", "putenv", "environb"} for a in node.names):
            return True
    return False


def test_config_imports_only_leaf_config() -> None:
    for name in CONFIG_MODULES:
        imported = helixserve_imports(PKG / name)
        assert imported <= CONFIG_MAY_IMPORT, f"helixserve/{name} imports {sorted(imported - CONFIG_MAY_IMPORT)}"


def test_config_imports_no_launcher_server_or_model_at_runtime() -> None:
    """The import graph as Python runs it: loading the config (and resolving the launcher
    variables) pulls in nothing but the config modules: no package (transceiver, launcher,
    server, engine, model), nor torch."""
    code = ("import sys, helixserve.config as c; c.dist_env({}); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('helixserve.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert eval(out.stdout.strip()) == sorted(CONFIG_MAY_IMPORT)


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in PKG.rglob("*.py")))
def test_only_config_reads_the_environment(path: str) -> None:
    if path in ENV_READERS or path in ENV_ALLOWED:
        return
    assert not reads_environ(ROOT / path), (
        f"{path} reads os.environ: resolve the variable in helixserve/config.py (or config_env.py) "
        "and pass the value down")


def test_allow_list_is_still_needed() -> None:
    """An allow-listed module that stopped reading the environment leaves the list."""
    stale = [p for p in ENV_ALLOWED if not reads_environ(ROOT / p)]
    assert not stale, f"drop {stale} from ENV_ALLOWED"


def test_launcher_variables_are_parsed_in_one_module() -> None:
    """``SLURM_PROCID`` / ``RANK`` / ``MASTER_ADDR`` ... appear as string literals (the variable
    being read) in config_env.py only."""
    names = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_PROCID",
             "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_SUBMIT_DIR", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    where = {}
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Constant) and node.value in names:
                where.setdefault(node.value, set()).add(p.relative_to(ROOT).as_posix())
    elsewhere = {k: sorted(v - {"helixserve/config_env.py"}) for k, v in where.items() if v - {"helixserve/config_env.py"}}
    assert not elsewhere, f"launcher variables parsed outside helixserve/config_env.py: {elsewhere}"


def test_config_resolves_the_launch_timeouts() -> None:
    """The launchers' waits default from the config (no second literal in the launchers)."""
    from helixserve.cli import build_parser
    from helixserve.config import DeploymentConfig
    from helixserve.launch.slurm import parse_args

    deploy = DeploymentConfig(model={"path": "/m"})
    assert deploy.launch.ready_timeout_s == 180.0 and deploy.launch.slurm.ready_timeout_s == 600.0
    assert deploy.launch.stop_grace_s == 15.0 and deploy.launch.slurm.stop_grace_s == 20.0
    args = parse_args([])
    assert args.ready_timeout is None and args.grace is None  # None: launch.slurm's values
    assert build_parser().parse_args(["launch"]).ready_timeout is None  # None: launch.ready_timeout_s
    custom = DeploymentConfig.model_validate({"model": {"path": "/m"}, "launch": {"ready_timeout_s": 5,
                                                                                  "slurm": {"stop_grace_s": 1}}})
    assert custom.launch.ready_timeout_s == 5.0 and custom.launch.slurm.stop_grace_s == 1.0
    with pytest.raises(ValueError, match="ready_timeout_s"):
        DeploymentConfig.model_validate({"model": {"path": "/m"}, "launch": {"ready_timeout_s": 0}})
