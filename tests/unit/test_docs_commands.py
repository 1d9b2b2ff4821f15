"""The manual's commands name what exists, and the configuration reference matches the code.

Every fenced shell block in README.md and docs/*.md is checked: a ``helixserve`` subcommand and
its flags against the CLI's argparse parser, ``python bench/X.py --flag`` against the script's
source, ``make TARGET`` against the Makefile, ``pip install -e '.[extra]'`` against pyproject's
extras, and every repository path (``deploy/...``, ``bench/...``) against the tree. YAML blocks'
keys, and inline ``section.key`` spans, must be keys of the deployment config; inline repository
paths must exist. docs/configuration-reference.md must equal what docs/gen_config_reference.py
writes now.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from helixserve.cli import build_parser
from helixserve.config import DeploymentConfig

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SHELL_LANGS = {"bash", "sh", "shell", "console"}
REPO_DIRS = ("deploy/", "bench/", "docs/", "tests/", "helixserve/", ".ci/")
OUTPUT_FLAGS = {"--out", "--plot", "--log"}  # their values are files a command writes
GENERATED = ("bench/results",)  # written by make bench, git-ignored
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CONFIG_SPAN = re.compile(r"`((?:model|cache|scheduler|ctx\[\]|gen\[\]|router|security|limits|launch|shutdown"
                         r"|transceiver)\.[a-z_.\[\]]+)`")
FILE_NAME = re.compile(r"\.(safetensors|json|ya?ml|py|md|jinja|model|so|log|txt|proto)$")
PATH_SPAN = re.compile(r"`((?:deploy|bench|docs|tests|helixserve|\.ci)/[\w./\-]+)`")


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs/gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _load_generator()


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(text)]


def shell_commands(body: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments dropped, split on
    ``&&`` / ``||`` / ``;`` / ``|``, leading ``VAR=value`` and ``sudo [-E]`` removed."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        current: list[str] = []
        for tok in tokens + [";"]:
            if tok in {"&&", "||", ";", "|"}:
                while current and (re.match(r"^[A-Za-z_]\w*=", current[0]) or current[0] in {"sudo", "-E"}):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(tok.strip("()"))
    return commands


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("-") and t not in {"-", "--"}]


def _check_flags_in_source(path: Path, flags: list[str], what: str) -> list[str]:
    source = path.read_text()
    if "base_parser" in source:  # bench/_common.py's shared options (--quick, --out)
        source += (ROOT / "bench/_common.py").read_text()
    return [f"{what}: {flag} is not an option of {path.relative_to(ROOT)}"
            for flag in flags if f'"{flag}"' not in source and f"'{flag}'" not in source]


def _check_helixserve(args: list[str]) -> list[str]:
    parser = build_parser()
    if not args or args[0].startswith("-"):
        bad = [f for f in _flags(args) if f not in _options(parser) | {"-h", "--help"}]
        return [f"helixserve: no option {f}" for f in bad]
    commands = _subparsers(parser)
    if args[0] not in commands:
        return [f"helixserve: no subcommand {args[0]!r} (have {sorted(commands)})"]
    known = _options(commands[args[0]]) | _options(parser)
    return [f"helixserve {args[0]}: no option {f}" for f in _flags(args[1:]) if f not in known]


def _check_python(args: list[str]) -> list[str]:
    if args[:2] == ["-m", "helixserve.launch.slurm"]:
        return _check_flags_in_source(ROOT / "helixserve/launch/slurm.py", _flags(args[2:]), "slurm launcher")
    if args and args[0].endswith(".py") and args[0].startswith(REPO_DIRS):
        script = ROOT / args[0]
        if not script.is_file():
            return [f"no script {args[0]}"]
        return _check_flags_in_source(script, _flags(args[1:]), args[0])
    return []


def _check_make(args: list[str]) -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, re.M))
    return [f"make: no target {t!r}" for t in args if "=" not in t and not t.startswith("-") and t not in targets]


def _check_extras(tokens: list[str]) -> list[str]:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    problems = []
    for tok in tokens:
        match = re.fullmatch(r"(?:\.|helixserve)\[([\w,-]+)\]", tok)
        if match:
            problems += [f"pip: no extra {e!r}" for e in match.group(1).split(",") if e not in extras]
    return problems


def _check_paths(tokens: list[str]) -> list[str]:
    problems = []
    for prev, tok in zip(["", *tokens], tokens):
        path = tok.split("::", 1)[0]
        if (prev in OUTPUT_FLAGS or not path.startswith(REPO_DIRS) or path.startswith(GENERATED)
                or re.search(r"[<>*$]", path)):
            continue
        if not (ROOT / path).exists():
            problems.append(f"no file {path}")
    return problems


def check_command(tokens: list[str]) -> list[str]:
    """What in one simple command names something that does not exist."""
    problems = _check_paths(tokens) + _check_extras(tokens)
    head, args = tokens[0], tokens[1:]
    if head == "helixserve" or head.endswith("/helixserve"):
        problems += _check_helixserve(args)
    elif re.fullmatch(r"(.*/)?python3?", head) or head == "bash":
        problems += _check_python(args)
    elif head == "make":
        problems += _check_make(args)
    elif head == "sbatch":
        script = next((i for i, t in enumerate(args) if t.endswith(".sbatch")), None)
        if script is not None:
            problems += _check_flags_in_source(ROOT / "helixserve/launch/slurm.py", _flags(args[script + 1:]),
                                               "slurm launcher")
    return problems


def check_config_keys(data: object, model: type[BaseModel] = DeploymentConfig, prefix: str = "") -> list[str]:
    """Keys of a YAML mapping that are not fields of ``model`` (recursively)."""
    if not isinstance(data, dict):
        return []
    problems = []
    for key, value in data.items():
        if key not in model.model_fields:
            problems.append(f"no config key {prefix}{key}")
            continue
        nested = GENERATOR._nested_model(model.model_fields[key].annotation)
        if nested is None:
            continue
        for item in (value if isinstance(value, list) else [value]):
            problems += check_config_keys(item, nested, f"{prefix}{key}.")
    return problems


def check_config_span(span: str) -> list[str]:
    """``ctx[].warm_up`` style: every part a field of the model before it."""
    model: type[BaseModel] | None = DeploymentConfig
    for part in span.replace("[]", "").split("."):
        if model is None or part not in model.model_fields:
            return [f"no config key {span}"]
        model = GENERATOR._nested_model(model.model_fields[part].annotation)
    return []


def check_text(text: str) -> list[str]:
    """Every problem in one Markdown document."""
    problems = []
    for lang, body in fenced_blocks(text):
        if lang in SHELL_LANGS:
            for tokens in shell_commands(body):
                problems += [f"`{' '.join(tokens)}`: {p}" for p in check_command(tokens)]
        elif lang in {"yaml", "yml"}:
            problems += check_config_keys(yaml.safe_load(body))
    prose = FENCE.sub("", text)
    for span in CONFIG_SPAN.findall(prose):
        if not FILE_NAME.search(span):  # model.safetensors is a file, not a key
            problems += check_config_span(span)
    problems += [f"no file {p}" for p in PATH_SPAN.findall(prose)
                 if not p.startswith(GENERATED) and not (ROOT / p.rstrip(".")).exists()]
    return problems


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_in_the_docs_names_what_exists(doc: Path) -> None:
    assert check_text(doc.read_text()) == []


def test_the_docs_have_command_blocks_to_check() -> None:
    blocks = [b for doc in DOC_FILES for lang, b in fenced_blocks(doc.read_text()) if lang in SHELL_LANGS]
    commands = [c for b in blocks for c in shell_commands(b)]
    assert len(blocks) >= 10 and sum(c[0] == "helixserve" for c in commands) >= 10


BAD = """
```bash
helixserve launch --no-such-flag -c deploy/configs/local.yaml
helixserve serve-everything -c deploy/configs/local.yaml
helixserve launch -c deploy/configs/missing.yaml
python bench/engine.py --no-such-bench-flag
python bench/no_such_bench.py --quick
make no-such-target
pip install -e '.[cu12,no-such-extra]'
sbatch deploy/slurm/helixserve.sbatch --no-such-launcher-flag
```

```yaml
cache: {tokens_per_block: 16, no_such_key: 1}
gen: [{dp: 1, no_such_gen_key: 2}]
```

Prose naming `router.no_such_key` and `deploy/configs/missing-too.yaml`.
"""


def test_the_checker_names_each_bad_command_flag_file_and_key() -> None:
    problems = "\n".join(check_text(BAD))
    for expected in ("no option --no-such-flag", "no subcommand 'serve-everything'",
                     "no file deploy/configs/missing.yaml", "--no-such-bench-flag is not an option",
                     "no script bench/no_such_bench.py", "no target 'no-such-target'",
                     "no extra 'no-such-extra'", "--no-such-launcher-flag is not an option",
                     "no config key cache.no_such_key", "no config key gen.no_such_gen_key",
                     "no config key router.no_such_key", "no file deploy/configs/missing-too.yaml"):
        assert expected in problems, (expected, problems)
    assert len(check_text(BAD)) == 13  # the missing script: as a file and as a script


def test_the_checker_passes_commands_that_exist() -> None:
    good = """```bash
VAR=1 sudo -E helixserve launch -c deploy/configs/local.yaml --no-restart && make test
python bench/engine.py --quick --out bench/results/new.json   # an output path need not exist
```
"""
    assert check_text(good) == []


def test_the_configuration_reference_is_generated_from_the_current_models() -> None:
    committed = GENERATOR.PAGE.read_text()
    assert committed == GENERATOR.render(), (
        f"docs/configuration-reference.md is stale: run {GENERATOR.REGENERATE} and commit it")


def test_the_configuration_reference_lists_every_key_with_its_bounds() -> None:
    page = GENERATOR.render()
    assert "| `cache.tokens_per_block` | `int` | `16` | >= 1; <= 4096 |" in page
    assert "| `launch.restart.max_restarts` | `int` | `5` | >= 0 |" in page  # the enclosing default's value
    assert "| `transceiver.kv_transfer_timeout_ms` | `float` | `10000.0` |" in page
    assert "`gen[].world_restart.backoff_s`" in page and "`transceiver.control_tls.ca_file`" in page
