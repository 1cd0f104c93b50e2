"""The prepared GPU check (bench/gpu_check.py) dry-run on CPU, so it cannot rot between loans.

It runs under the venv's numpy < 2 and under numpy 2 (the GPU image's), from a wheel installed
once under .cache; Triton's client and server packages are hidden from it, as the image has none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import STAGES, run_stage

REPO = Path(__file__).resolve().parents[2]
NUMPY2 = REPO / ".cache" / f"numpy2-py{sys.version_info.major}{sys.version_info.minor}"
ABSENT_ON_IMAGE = ("tritonclient", "pytriton", "tritonserver")


def _numpy2() -> Path:
    """A numpy 2 wheel's files, installed once (`pip --target`), to put first on PYTHONPATH."""
    if not (NUMPY2 / "numpy").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(NUMPY2), "numpy>=2,<3"],
            check=True,
            timeout=600,
        )
    return NUMPY2


def _hide(packages: tuple[str, ...], folder: Path) -> Path:
    """Packages of these names that fail to import, to shadow the installed ones."""
    for name in packages:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name}: not on the image')")
    return folder


@pytest.mark.parametrize("numpy_major", [1, 2])
def test_the_cpu_dry_run_passes_every_stage(numpy_major: int, tmp_path: Path) -> None:
    path = [_hide(ABSENT_ON_IMAGE, tmp_path / "hidden")]
    if numpy_major == 2:
        path.append(_numpy2())
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, REPO]))}
    command = [sys.executable, "-m", "bench.gpu_check", "--out", str(out), "--device", "cpu"]
    done = subprocess.run(
        [*command, "--quick"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert list(results) == [stage.name for stage in STAGES]
    # One summary line per stage, and every stage's log.
    assert [line.split(" [")[0] for line in done.stdout.splitlines()] == list(results)
    assert all((out / f"{name}.log").stat().st_size > 0 for name in results)
    for result in results.values():
        assert result["status"] == "ok"
        assert int(result["versions"]["numpy"].split(".")[0]) == numpy_major

    assert results["kernel_tests"]["passed"] > 0 and "failed" not in results["kernel_tests"]
    rows = results["kernel_bench"]["rows"]
    assert [(r["dtype"], r["n_rows"], r["n_vocab"]) for r in rows] == [
        (dtype, b, 32000) for dtype in ("bf16", "fp32") for b in (1, 8)
    ]
    assert all(r["ours_s"] > 0 and r["naive_s"] > 0 for r in rows)
    for dtype in ("bfloat16", "float32"):
        assert results["engine"][dtype]["greedy"]["mismatches"] == 0
        assert results["engine"][dtype]["concurrent"]["token_mismatches"] == 0
    logprobs = results["engine"]["float32"]["logprobs"]
    assert max(logprobs[f"worst_{k}"] for k in ("sampled", "top_k", "explicit")) <= 1e-4
    for concurrency in (1, 16, 64):
        load = results["throughput"][f"C={concurrency}"]
        assert load["errors"] == 0 and load["output_tokens"] == load["expected_tokens"] > 0
        assert load["decode_step_ms"] > 0


def test_a_stage_past_its_limit_is_killed_and_reported(tmp_path: Path) -> None:
    hang = [sys.executable, "-c", "import threading; threading.Event().wait()"]  # never returns
    result = run_stage("hang", hang, limit_s=3, out=tmp_path)
    assert (result["status"], result["summary"]) == ("timeout", "killed after 3 s")
    assert result["seconds"] >= 3


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
