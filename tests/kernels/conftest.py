"""Fixtures for the kernel tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Fresh but reproducible random inputs in every test."""
    torch.manual_seed(0)
