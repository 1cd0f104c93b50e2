"""Write the model repository that Triton serves: `model_repository/` with its parameters set.

The repository in git is a template with documented defaults; serving another model or other
limits only changes `parameters` values (`model_path`, `max_num_seqs`, ...), written here into a
copy so the source tree stays untouched.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from backend.config import LLMConfig
from backend.context_length import served_context_length

TEMPLATE = Path(__file__).resolve().parent.parent / "model_repository"
_PARAMETER = re.compile(r'(parameters \{ key: "(\w+)" value: \{ string_value: ")([^"]*)(" \} \})')


def set_parameters(config_text: str, values: dict[str, str]) -> str:
    """Replace the value of each existing `parameters` entry named in `values`."""

    def replace(match: re.Match[str]) -> str:
        key = match.group(2)
        value = values.get(key, match.group(3))
        return f"{match.group(1)}{value}{match.group(4)}"

    return _PARAMETER.sub(replace, config_text)


def known_parameters(model: str = "llm", template: Path = TEMPLATE) -> set[str]:
    text = (template / model / "config.pbtxt").read_text()
    return {match.group(2) for match in _PARAMETER.finditer(text)}


def context_length(model_path: Path, requested: int) -> int:
    """The context `llm` will serve the model with (`backend.context_length`, which refuses
    what the engine cannot serve), so that clients read the limit the engine holds;
    `requested` where the folder has no config.json yet."""
    if not (Path(model_path) / "config.json").exists():
        return requested
    from transformers import AutoConfig  # the engine's dependency: only where a model is served

    return served_context_length(AutoConfig.from_pretrained(model_path), requested)


def write_repository(
    dest: Path,
    model_path: Path,
    parameters: dict[str, str] | None = None,
    template: Path = TEMPLATE,
) -> Path:
    """Copy `template` to `dest` (replaced), pointing every model at `model_path`."""
    values = {**(parameters or {}), "model_path": str(Path(model_path).resolve())}
    unknown = set(values) - known_parameters("llm", template) - {"model_path"}
    if unknown:
        raise ValueError(f"unknown llm parameters: {sorted(unknown)}")
    for key, value in values.items():
        if re.search(r'["\\\n]', value):  # config.pbtxt writes values unescaped
            raise ValueError(f"llm parameter {key}: quotes, backslashes and newlines are refused")
    config = LLMConfig.from_parameters(values, str(dest / "llm"))  # each value's type and range
    values["max_model_len"] = str(context_length(model_path, config.max_model_len))
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(template, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for config_file in dest.glob("*/config.pbtxt"):
        config_file.write_text(set_parameters(config_file.read_text(), values))
    return dest
