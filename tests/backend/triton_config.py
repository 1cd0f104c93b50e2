"""The repository's config.pbtxt files, read as tests need them, and Triton's `model_config`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
PARAMETER = re.compile(r'parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}')


def config_parameters(model: str, repository: Path = MODEL_REPOSITORY) -> dict[str, str]:
    """The `parameters` of `<repository>/<model>/config.pbtxt` (the template's by default)."""
    return dict(PARAMETER.findall((repository / model / "config.pbtxt").read_text()))


@dataclass(frozen=True)
class ConfigTensor:
    data_type: str
    dims: tuple[int, ...]
    optional: bool


def config_tensor_entries(model: str, section: str) -> dict[str, ConfigTensor]:
    """Name -> entry of the `input` or `output` tensors of `model`'s config.pbtxt."""
    text = (MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    body = text.split(f"\n{section} [", 1)[1].split("\n]", 1)[0]
    entries = re.findall(
        r'name: "(\w+)", data_type: (TYPE_\w+), dims: \[([^\]]*)\](, optional: true)?', body
    )
    return {
        name: ConfigTensor(data_type, tuple(int(d) for d in dims.split(",")), bool(optional))
        for name, data_type, dims, optional in entries
    }


def config_tensors(model: str, section: str) -> dict[str, str]:
    """Name -> data_type of the `input` or `output` tensors of `model`'s config.pbtxt."""
    return {name: entry.data_type for name, entry in config_tensor_entries(model, section).items()}


def model_config_json(model: str, parameters: dict[str, str], decoupled: bool | None) -> str:
    """`args["model_config"]` as Triton passes it (only the fields the models read)."""
    config: dict[str, Any] = {
        "name": model,
        "backend": "python",
        "max_batch_size": 0,
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
    }
    if decoupled is not None:
        config["model_transaction_policy"] = {"decoupled": decoupled}
    return json.dumps(config)
