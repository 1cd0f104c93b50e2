"""Write the model repository that Triton serves: `model_repository/` with its parameters set.

The repository in git is a template with documented defaults; serving another model or other
limits only changes `parameters` values (`model_path`, `max_num_seqs`, ...), written here into a
copy so the source tree stays untouched.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

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


def context_length(model_path: Path) -> int:
    """`max_position_embeddings` from the model's config.json (0 when absent)."""
    config_path = Path(model_path) / "config.json"
    if not config_path.exists():
        return 0
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or 0)


def write_repository(
    dest: Path,
    model_path: Path,
    parameters: dict[str, str] | None = None,
    template: Path = TEMPLATE,
) -> Path:
    """Copy `template` to `dest` (replaced), pointing every model at `model_path`."""
    values = {**(parameters or {}), "model_path": str(Path(model_path).resolve())}
    if values.get("max_model_len", "0") == "0" and (context := context_length(model_path)):
        values["max_model_len"] = str(context)  # so clients (the adapter) can read the limit
    unknown = set(values) - known_parameters("llm", template) - {"model_path"}
    if unknown:
        raise ValueError(f"unknown llm parameters: {sorted(unknown)}")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(template, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for config in dest.glob("*/config.pbtxt"):
        config.write_text(set_parameters(config.read_text(), values))
    return dest
