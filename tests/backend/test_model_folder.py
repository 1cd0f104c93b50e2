"""A path that is no servable model folder is refused before any server starts."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from transformers import BartConfig, PretrainedConfig, Qwen2Config, T5Config

from backend import launcher
from backend.model_folder import check_model_folder
from tests.backend.test_fast_decode import _SIZES, _save


def _without_tokenizer(model_dir: Path, out: Path) -> Path:
    """A Qwen2 folder without its tokenizer files: transformers 5 then builds a tokenizer of
    one token instead of raising."""
    path = _save(Qwen2Config(**_SIZES), model_dir, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)
    return path


def _with_config(model_dir: Path, out: Path, config: PretrainedConfig) -> Path:
    """A folder of `config` and the model's tokenizer: the check reads no weights."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    config.save_pretrained(out)
    return out


def test_a_model_folder_passes(model_dir: Path) -> None:
    check_model_folder(model_dir)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp, model_dir: tmp / "missing", "is not a folder"),
        (lambda tmp, model_dir: shutil.copy(model_dir / "config.json", tmp), "is not a folder"),
        (lambda tmp, model_dir: tmp, "has no config.json"),
        (lambda tmp, model_dir: _without_tokenizer(model_dir, tmp / "m"), "has no tokenizer"),
        (
            lambda tmp, model_dir: _with_config(model_dir, tmp / "t5", T5Config(num_layers=1)),
            "'t5' model, which has no causal-LM class",
        ),
        (  # transformers has BartForCausalLM: the decoder alone
            lambda tmp, model_dir: _with_config(model_dir, tmp / "bart", BartConfig()),
            "'bart' model, an encoder-decoder",
        ),
    ],
)
def test_what_is_no_model_folder_stops_the_launcher_before_tritonserver(
    make, message: str, model_dir: Path, tmp_path: Path
) -> None:
    path = Path(make(tmp_path, model_dir))
    with pytest.raises(ValueError, match=message):
        check_model_folder(path)
    run_dir = tmp_path / "run"
    args = launcher.parse_args(["--model-path", str(path), "--run-dir", str(run_dir)])
    with pytest.raises(SystemExit, match=re.escape(f"cannot serve {path}: ")):
        launcher.build_server(args)
    assert not (run_dir / "tritonserver.log").exists()
