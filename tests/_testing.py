"""Shared test helpers: fla-style closeness check and by-path loading of reference modules."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch


def _err_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (ref - out).square().mean().sqrt().item()
    base = ref.square().mean().sqrt().item()
    return err / (base + 1e-8)


def assert_close(
    name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float, *, atol: float | None = None,
    err_atol: float = 1e-6,
) -> None:
    """fla-style check: same shape, no NaN, same +-inf pattern, then on finite entries
    relative RMS error < ratio (skipped when max-abs diff <= err_atol) and, if given, max-abs <= atol."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ref, out = ref.detach().double().cpu(), out.detach().double().cpu()
    assert not torch.isnan(ref).any(), f"{name}: NaN in reference"
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    ref_inf, out_inf = torch.isinf(ref), torch.isinf(out)
    assert torch.equal(ref_inf, out_inf), f"{name}: inf pattern differs ({int(ref_inf.sum())} vs {int(out_inf.sum())})"
    assert torch.equal(ref[ref_inf], out[out_inf]), f"{name}: inf signs differ"
    finite = ~ref_inf
    ref, out = ref[finite], out[finite]
    if ref.numel() == 0:
        return
    max_abs = (ref - out).abs().max().item()
    rel = _err_ratio(ref, out)
    msg = f"{name}: max-abs {max_abs:.3e}, rel-rms {rel:.3e} (ratio {ratio}, atol {atol})"
    if atol is not None:
        assert max_abs <= atol, msg
    if max_abs <= err_atol:
        return
    assert rel < ratio, msg


def site_package_file(package: str, relpath: str) -> Path:
    """Path of a file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


def load_module_by_path(package: str, relpath: str) -> ModuleType:
    """Import one file of a package on its own (fla's package import needs triton)."""
    path = site_package_file(package, relpath)
    name = f"_ref_{package}_{relpath.replace(os.sep, '_').removesuffix('.py')}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_functions_from_source(package: str, relpath: str, names: list[str], namespace: dict) -> dict:
    """Exec only the named top-level functions of a file whose imports cannot load (e.g. triton)."""
    tree = ast.parse(site_package_file(package, relpath).read_text())
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {node.name for node in defs}
    if missing:
        pytest.skip(f"{relpath} lacks {sorted(missing)}")
    scope = dict(namespace)
    exec(compile(ast.Module(body=defs, type_ignores=[]), relpath, "exec"), scope)
    return {name: scope[name] for name in names}


INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# a kernel test that runs only in the child pytest of run_under_triton_interpreter
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess")


# the test files whose tests run in the interpreter child: one child runs them all, for the first
# of them to ask (one child start-up, not one per file); a file not listed gets a child of its own
INTERPRETER_FILES = ("tests/unit/test_gemm_batch_invariant.py", "tests/unit/test_gpu_kernels_interpret.py",
                     "tests/unit/test_gpu_fusions_interpret.py", "tests/unit/test_kernels_mxfp4.py", "tests/unit/test_mxfp4_decode_ptx.py")
_CHILD_RUNS: dict[tuple[str, ...], tuple[int, str]] = {}  # files -> (exit status, output)


def run_under_triton_interpreter(test_file: str) -> None:
    """Run ``test_file``'s tests in a child pytest with ``TRITON_INTERPRET=1`` (Triton decides at
    import whether kernels are interpreted); Triton from ``HELIXSERVE_TRITON_INTERP`` (a ``pip
    --target`` folder that ``make test`` fills) or the environment; skipped when neither has it,
    and in the child itself (already the interpreter run). Fails when a test of ``test_file``
    failed or errored there, or none of them ran."""
    if INTERPRETING:
        pytest.skip("already the interpreter run")
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    extra = os.environ.get("HELIXSERVE_TRITON_INTERP")
    if extra and (Path(extra) / "triton").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(extra).resolve()), env.get("PYTHONPATH")) if p)
    elif importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (make test installs it for this test under .venv/triton-interp)")
    root = Path(__file__).resolve().parents[1]
    mine = Path(test_file).resolve().relative_to(root).as_posix()
    files = INTERPRETER_FILES if mine in INTERPRETER_FILES else (mine,)
    if files not in _CHILD_RUNS:
        # -rA: a line per test (PASSED / FAILED / ERROR, SKIPPED per reason) naming its file;
        # the files' GPU tests run in the parent, on the device; the child interprets the kernels
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "not gpu",
               "--continue-on-collection-errors", *files]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300 * len(files), cwd=root)
        _CHILD_RUNS[files] = (proc.returncode, proc.stdout + proc.stderr)
    status, output = _CHILD_RUNS[files]
    outcomes = [line for line in output.splitlines() if mine in line and line.startswith(
        ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"))]
    failed = [line for line in outcomes if line.startswith(("FAILED", "ERROR"))]
    assert status in (0, 1) and outcomes and not failed, "\n".join(failed) + "\n" + output[-6000:]


@contextlib.contextmanager
def triton_interpreter_patches():
    """Two patches of Triton's interpreter for this Triton / numpy pairing, undone on exit: a loaded
    scalar used as a loop bound or in a branch is a 1-element array that numpy 2 refuses to
    ``int()``; autotuned kernels run their first config (no GPU to time candidates on)."""
    import numpy as np
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    patch_lang_tensor, autotune_run = interpreter._patch_lang_tensor, autotuner.Autotuner.run

    def patched_lang_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    def first_config_run(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return autotune_run(self, *args, **kwargs)

    interpreter._patch_lang_tensor = patched_lang_tensor
    autotuner.Autotuner.run = first_config_run
    try:
        yield
    finally:
        interpreter._patch_lang_tensor, autotuner.Autotuner.run = patch_lang_tensor, autotune_run
