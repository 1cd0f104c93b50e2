"""The prepared GPU check (bench/gpu_check.py) dry-run on CPU, so it cannot rot between loans.

It runs with the pinned packages, and with the GPU image's numpy 2, transformers, tokenizers and
huggingface_hub, installed once under .cache and put first on PYTHONPATH (the model is then built
with them too). Triton's client and server packages are hidden from it: the image has none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backend.default_model import TEST_SPEC
from bench.gpu_check import STAGES, run_stage

REPO = Path(__file__).resolve().parents[2]
# The versions on the GPU image (the device tool's KINDS.md) that differ from the pins; its torch
# 2.11 and triton 3.6 are too large to fetch here.
IMAGE_PACKAGES = (
    "numpy>=2,<3",
    "transformers==5.17.0",
    "tokenizers==0.23.2",
    "huggingface_hub==1.33.0",
)
IMAGE_SITE = REPO / ".cache" / f"gpu-image-py{sys.version_info.major}{sys.version_info.minor}"
ABSENT_ON_IMAGE = ("tritonclient", "pytriton", "tritonserver")


def _image_site() -> Path:
    """The image's packages, installed once with `pip --target` (their own needs are the venv's)."""
    stamp = IMAGE_SITE / "installed.txt"
    if not stamp.exists() or stamp.read_text() != "\n".join(IMAGE_PACKAGES):
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade"]
        subprocess.run([*command, "--target", str(IMAGE_SITE), *IMAGE_PACKAGES], check=True)
        stamp.write_text("\n".join(IMAGE_PACKAGES))
    return IMAGE_SITE


def _hide(packages: tuple[str, ...], folder: Path) -> Path:
    """Packages of these names that fail to import, to shadow the installed ones."""
    for name in packages:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name}: not on the image')")
    return folder


@pytest.mark.parametrize("packages", ["pinned", "image"])
def test_the_cpu_dry_run_passes_every_stage(packages: str, tmp_path: Path) -> None:
    path = [_hide(ABSENT_ON_IMAGE, tmp_path / "hidden")]
    command = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick"]
    if packages == "image":
        path.append(_image_site())
        command += ["--models-dir", str(tmp_path / "models")]  # built with the image's packages
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, REPO]))}
    done = subprocess.run(
        [*command, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert list(results) == [stage.name for stage in STAGES]
    # One summary line per stage, and every stage's log.
    assert [line.split(" [")[0] for line in done.stdout.splitlines()] == list(results)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["results.json", *(f"{name}.log" for name in results)]
    )  # what comes back from the device tool: at most 8 files
    expected = {"numpy": "1."}
    if packages == "image":
        expected = {"numpy": "2.", "transformers": "5.17.0"}
    for result in results.values():
        assert result["status"] == "ok"
        versions = result["versions"]
        assert all(versions[name].startswith(v) for name, v in expected.items()), versions

    assert results["kernel_tests"]["passed"] > 0 and "failed" not in results["kernel_tests"]
    rows = results["kernel_bench"]["rows"]
    assert [(r["dtype"], r["n_rows"], r["n_vocab"]) for r in rows] == [
        (dtype, b, 32000) for dtype in ("bf16", "fp32") for b in (1, 8)
    ]
    assert all(r["ours_s"] > 0 and r["naive_s"] > 0 for r in rows)
    assert Path(results["model"]["path"]).name == TEST_SPEC.name
    for dtype in ("bfloat16", "float32"):
        assert results["engine"][dtype]["greedy"]["mismatches"] == 0
        assert results["engine"][dtype]["concurrent"]["divergences"] == 0
    assert results["engine"]["float32"]["concurrent"]["near_tie_divergences"] == 0
    assert results["engine"]["float32"]["greedy"]["near_tie_mismatches"] == 0
    logprobs = results["engine"]["float32"]["logprobs"]
    assert max(logprobs[f"worst_{k}"] for k in ("sampled", "top_k", "explicit")) <= 1e-4
    for name in ("C=1", "C=16", "C=64", "C=16 + 1024 ids"):
        load = results["throughput"][name]
        assert load["errors"] == 0 and load["output_tokens"] == load["expected_tokens"] > 0
        assert load["decode_step_ms"] > 0
    with_ids, without = (results["throughput"][name] for name in ("C=16 + 1024 ids", "C=16"))
    assert results["throughput"]["explicit_ids_tpot_ratio"] == (
        with_ids["tpot_p50"] / without["tpot_p50"]
    )


def test_a_stage_past_its_limit_is_killed_and_reported(tmp_path: Path) -> None:
    hang = [sys.executable, "-c", "import threading; threading.Event().wait()"]  # never returns
    result = run_stage("hang", hang, limit_s=3, out=tmp_path)
    assert (result["status"], result["summary"]) == ("timeout", "killed after 3 s")
    assert result["seconds"] >= 3


def test_a_stage_that_outlives_its_kill_does_not_hold_up_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stuck in the GPU driver ignores SIGKILL for a while: a kill that does nothing
    stands in for it; the stage is reported after EXIT_WAIT_S, and the next stage can run."""
    from bench import gpu_check

    groups: list[int] = []
    kill = os.killpg
    monkeypatch.setattr(gpu_check.os, "killpg", lambda group, _signal: groups.append(group))
    monkeypatch.setattr(gpu_check, "EXIT_WAIT_S", 1.0)
    hang = [sys.executable, "-c", "import threading; threading.Event().wait()"]
    try:
        result = run_stage("stuck", hang, limit_s=2, out=tmp_path)
    finally:
        for group in groups:
            kill(group, signal.SIGKILL)
    assert (result["status"], result["summary"]) == (
        "timeout",
        f"killed after 2 s; still running 1 s later (pid {groups[0]})",
    )


def test_a_failing_stage_is_reported_with_its_exit_status(tmp_path: Path) -> None:
    fail = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    result = run_stage("fail", fail, limit_s=60, out=tmp_path)
    assert (result["status"], result["summary"]) == ("failed", "exit 3: see fail.log")
    assert (tmp_path / "fail.log").read_text() == "boom\n"


def test_a_stage_that_reports_a_failed_check_fails(tmp_path: Path) -> None:
    code = (
        "import json, sys; "
        "open(sys.argv[2], 'w').write(json.dumps({'ok': False, 'summary': 'greedy FAILED'}))"
    )
    result = run_stage("check", [sys.executable, "-c", code], limit_s=60, out=tmp_path)
    assert (result["status"], result["summary"]) == ("failed", "greedy FAILED")
