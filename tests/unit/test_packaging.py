"""What pyproject and the Makefile install: torch as a range holding the CPU pin make puts in
first and the GPU runs' build; the UCX transport only as one extra per CUDA major (so a CUDA 13
install never gets the CUDA 12 wheel, which ships the same `ucxx` module); `gpu` for either CUDA
major; `make serve` without the test extras, `make test` with them."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, names)}


def test_torch_is_a_range_holding_the_cpu_pin_and_the_gpu_build() -> None:
    torch = requirements(PROJECT["dependencies"])["torch"]
    assert not [s for s in torch.specifier if s.operator in ("==", "===")], torch  # not one build
    for version in ("2.13.0", "2.13.0+cpu", "2.11.0+cu130", "2.12.1+cu128"):
        assert torch.specifier.contains(version), version
    assert not torch.specifier.contains("2.10.0") and not torch.specifier.contains("2.14.0")


def test_ucx_transport_is_one_extra_per_cuda_major_and_nowhere_else() -> None:
    extras = PROJECT["optional-dependencies"]
    assert not [n for n in requirements(PROJECT["dependencies"]) if n.startswith("ucxx")]
    for major in ("cu12", "cu13"):
        assert set(requirements(extras[major])) == {f"ucxx-{major}"}, major
    assert requirements(extras["cu12"])["ucxx-cu12"].specifier == requirements(extras["cu13"])["ucxx-cu13"].specifier
    for name, deps in extras.items():
        if name not in ("cu12", "cu13"):
            assert not [n for n in requirements(deps) if n.startswith("ucxx")], name
    assert {"triton", "fla-core"} <= set(requirements(extras["gpu"]))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(("target", "extras"), [("serve", "'.[cu12]'"), ("test", "'.[cu12,test]'")])
def test_make_installs_torch_first_then_the_extras_of_its_target(tmp_path: Path, target: str,
                                                                 extras: str) -> None:
    venv = tmp_path / "venv"  # absent: make -n prints every step of a fresh machine
    steps = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.splitlines()
    installs = [s.split("/pip install", 1)[1] for s in steps if "/pip install" in s and "--upgrade pip" not in s]
    assert installs[0] == " -q torch==2.13.0", installs
    package = [s for s in installs if " -e " in s]
    assert package[-1].endswith(f"-e {extras}"), package
    if target == "serve":
        assert not [s for s in installs if "test" in s or "triton" in s], installs
