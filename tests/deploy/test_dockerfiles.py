"""docker/*.Dockerfile: hadolint finds nothing, and what the images copy and install is there.

CI has no Docker engine, so the images are never built here; these checks catch what a build
would: lint findings, COPY sources that do not exist or that the build context leaves out, and
pins that drifted from pyproject.toml.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.tools import DOCKER_DIR, REPO_ROOT, run, tool

DOCKERFILES = sorted(DOCKER_DIR.glob("*.Dockerfile"))
HADOLINT_CONFIG = DOCKER_DIR / "hadolint.yaml"


def hadolint(path: Path) -> tuple[int, list[dict]]:
    result = run(
        [tool("hadolint"), "--config", str(HADOLINT_CONFIG), "--format", "json", str(path)]
    )
    assert result.stdout.strip(), result.stderr
    return result.returncode, json.loads(result.stdout)


def test_both_images_are_there() -> None:
    assert [p.name for p in DOCKERFILES] == ["adapter.Dockerfile", "triton.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    returncode, findings = hadolint(dockerfile)
    assert findings == []
    assert returncode == 0


def test_hadolint_runs_with_the_projects_rules(tmp_path: Path) -> None:
    """The linter is live and the config bites: an unpinned image, an unpinned apt install and a
    registry outside the trusted ones are all reported, and fail."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install -y curl\nFROM quay.io/x/y:1.0\n")
    returncode, findings = hadolint(bad)
    assert returncode != 0
    assert {"DL3007", "DL3008", "DL3026"} <= {f["code"] for f in findings}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_ignored_rule_says_why(dockerfile: Path) -> None:
    """An inline `# hadolint ignore=...` must follow a comment line giving the reason."""
    lines = dockerfile.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+ignore=", line):
            previous = lines[number - 1].strip() if number else ""
            assert previous.startswith("#") and "hadolint" not in previous, (
                f"{dockerfile.name}:{number + 1}: say why {line.strip()!r} is needed"
            )


# --- the build context -----------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.split()))
    return out


def copy_sources(dockerfile: Path) -> list[str]:
    """Sources of every COPY from the build context (not `--from=` another stage)."""
    sources = []
    for instruction, args in _instructions(dockerfile):
        if instruction == "COPY" and not any(a.startswith("--from=") for a in args):
            paths = [a for a in args if not a.startswith("--")]
            sources.extend(paths[:-1])
    return sources


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match syntax plus `**`) as a regular expression."""
    pattern = pattern.strip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def excluded(path: str, ignore_file: Path) -> bool:
    """Whether the build context leaves `path` out: the last pattern that matches the path or one
    of its parent folders decides, `!` patterns including (Docker's rule)."""
    patterns = []
    for line in ignore_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            patterns.append((negated, _pattern(line.removeprefix("!"))))
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for negated, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            result = not negated
    return result


def test_the_ignore_rules_behave_as_docker_reads_them(tmp_path: Path) -> None:
    ignore = tmp_path / "x.dockerignore"
    ignore.write_text("*\n!backend/\n!docker/a.sh\n**/__pycache__\n")
    assert excluded(".venv/bin/python", ignore)
    assert excluded("docker/b.sh", ignore)
    assert not excluded("docker/a.sh", ignore)
    assert not excluded("backend/engine.py", ignore)
    assert excluded("backend/__pycache__/engine.cpython-311.pyc", ignore)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_files_exist_and_are_in_the_build_context(dockerfile: Path) -> None:
    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile; the context is the repo root.
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore_file.is_file()
    sources = copy_sources(dockerfile)
    assert sources
    for source in sources:
        path = REPO_ROOT / source
        assert path.exists(), f"{dockerfile.name} copies {source}, which does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        included = [f for f in files if not excluded(str(f.relative_to(REPO_ROOT)), ignore_file)]
        assert included, f"{ignore_file.name} leaves {source} out of the build context"
        if path.is_dir():
            tracked = [f for f in files if "__pycache__" not in f.parts]
            assert included == tracked, f"{ignore_file.name} leaves files of {source} out"
    # Nothing else: the context holds only what the image copies (no .venv/, no .cache/).
    copied = {REPO_ROOT / s for s in sources}
    for top in REPO_ROOT.iterdir():
        if top.name == ".git" or any(top == c or top in c.parents for c in copied):
            continue
        assert excluded(top.name, ignore_file), f"{ignore_file.name} sends {top.name} along"
    for other in (p for p in DOCKER_DIR.iterdir() if p not in copied):
        assert excluded(str(other.relative_to(REPO_ROOT)), ignore_file), other


def test_the_entrypoint_script_is_the_triton_images_command() -> None:
    """CMD runs docker/triton-entrypoint.sh (tested in tests/integration/test_launcher.py) from
    PATH; the base image's ENTRYPOINT (NVIDIA's script, which execs the command) stays."""
    instructions = _instructions(DOCKER_DIR / "triton.Dockerfile")
    copies = [args for name, args in instructions if name == "COPY"]
    assert ["docker/triton-entrypoint.sh", "/usr/local/bin/triton-entrypoint"] in copies
    assert ("CMD", ['["triton-entrypoint"]']) in instructions
    assert not [args for name, args in instructions if name == "ENTRYPOINT"]


# --- the pins --------------------------------------------------------------------------------


def _requirements(path: Path) -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def _pyproject_dependencies() -> dict[str, Requirement]:
    """pyproject.toml's dependencies, extras' included, as installed (the Makefile reinstalls the
    project whenever pyproject.toml changes): name -> the first requirement naming it."""
    found: dict[str, Requirement] = {}
    for line in importlib.metadata.requires("triton-logprobs") or []:
        requirement = Requirement(line)
        found.setdefault(requirement.name, requirement)
    return found


def test_triton_image_pins_are_exact_and_within_pyproject() -> None:
    """The Triton image installs exact versions, each one pyproject.toml allows, so it runs what
    the tests run (the dev machines' CPU torch pin is the same release as the image's CUDA
    torch)."""
    project = _pyproject_dependencies()
    for requirement in _requirements(DOCKER_DIR / "requirements-triton.txt"):
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{requirement} is not pinned"
        assert requirement.name in project, f"{requirement.name} is not a project dependency"
        allowed = project[requirement.name].specifier
        assert allowed.contains(spec.version), f"{requirement} is outside {allowed}"


def test_the_adapter_image_installs_no_engine_dependency() -> None:
    """It installs `.[adapter]`: the project's own dependencies and the `adapter` extra."""
    assert "'.[adapter]'" in (DOCKER_DIR / "adapter.Dockerfile").read_text()
    names = set()
    for line in importlib.metadata.requires("triton-logprobs") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or marker.evaluate({"extra": "adapter"}):
            names.add(requirement.name)
    assert names.isdisjoint({"torch", "transformers", "tokenizers", "triton", "nvidia-pytriton"})
    assert {"fastapi", "uvicorn", "tritonclient", "numpy"} <= names


def _closure(names: set[str]) -> set[str]:
    """The installed distributions `names` pull in, themselves included (no extras)."""
    found: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def test_the_triton_images_import_check_needs_only_what_it_installs() -> None:
    """The build's own check (`import backend.launcher, kernels`) run here with everything the
    image lacks made unimportable: the project's folders it does not copy (the adapter), and the
    project's dependencies that requirements-triton.txt does not pull in. A launcher importing
    the adapter's settings broke the image once (an audit)."""
    dockerfile = (DOCKER_DIR / "triton.Dockerfile").read_text()
    [check] = re.findall(r"python3 -c '(import numpy, torch[^']*)'", dockerfile)
    copied = {source.strip("/") for source in copy_sources(DOCKER_DIR / "triton.Dockerfile")}
    packages = {p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file()}
    installed = _closure({r.name for r in _requirements(DOCKER_DIR / "requirements-triton.txt")})
    missing = {canonicalize_name(name) for name in _pyproject_dependencies()} - installed
    modules = {
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if {canonicalize_name(d) for d in distributions} <= missing
    }
    assert "adapter" in packages - copied and "fastapi" in modules  # the check can fail
    blocked = sorted((packages - copied) | modules)
    code = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n{check}"
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
