"""docs/configuration.md lists every `llm` config parameter with config.pbtxt's value, and every
adapter setting with its default: a parameter added, removed or changed fails here until the
docs follow."""

from __future__ import annotations

import re

import pytest

from adapter.settings import AdapterSettings
from backend.default_model import REPO_ROOT
from tests.backend.triton_config import config_parameters

DOCS = (REPO_ROOT / "docs" / "configuration.md").read_text()


def table_rows(heading: str) -> list[list[str]]:
    """The cells of each body row of the first table after `heading`."""
    section = DOCS.split(heading, 1)[1]
    lines = [line for line in section.split("\n\n", 2)[1].splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_every_llm_parameter_is_documented_with_its_config_value() -> None:
    documented = {row[0].strip("`"): row[1] for row in table_rows("## Model configuration")}
    parameters = config_parameters("llm")
    assert set(documented) == set(parameters)
    for name, value in parameters.items():
        assert documented[name] == f"`{value}`", name


def _documented_default(value: object) -> str | None:
    """How the table writes a default; None for no default (the cell says what happens)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@pytest.mark.parametrize("name", sorted(AdapterSettings.model_fields))
def test_every_adapter_setting_is_documented_with_its_default(name: str) -> None:
    flag = "--" + name.replace("_", "-")
    rows = [row for row in table_rows("## Adapter settings") if f"`{flag}`" in row[0]]
    assert len(rows) == 1, f"{flag}: {len(rows)} rows"
    (_, default_cell, meaning) = rows[0]
    assert meaning
    default = _documented_default(AdapterSettings.model_fields[name].default)
    if default is not None:
        pattern = rf"(^|[`\s,]){re.escape(default)}($|[`\s,(])"
        assert re.search(pattern, default_cell), (flag, default_cell, default)
