"""The CPU KV cache's memory check reads a container's memory limit (cgroup v2 and v1)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from backend.host_memory import available_bytes, cgroup_room

GIB = 2**30


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    "files",
    [
        {
            "memory.max": f"{2 * GIB}\n",
            "memory.current": f"{GIB}\n",
            "memory.stat": f"anon 1\ninactive_file {GIB // 4}\nactive_file 7\n",
        },
        {
            "memory/memory.limit_in_bytes": f"{2 * GIB}\n",
            "memory/memory.usage_in_bytes": f"{GIB}\n",
            "memory/memory.stat": f"inactive_file 5\ntotal_inactive_file {GIB // 4}\n",
        },
    ],
    ids=["v2", "v1 (its hierarchy's total_inactive_file)"],
)
def test_room_is_limit_less_usage_plus_inactive_file_cache(
    tmp_path: Path, files: dict[str, str]
) -> None:
    assert cgroup_room(write(tmp_path, files)) == GIB + GIB // 4


@pytest.mark.parametrize(
    "files",
    [
        {"memory.max": "max\n", "memory.current": "123\n"},
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "1",
        },
        {},
    ],
    ids=["v2 max", "v1 page-rounded max", "no cgroup files"],
)
def test_no_limit_is_no_room_figure(tmp_path: Path, files: dict[str, str]) -> None:
    assert cgroup_room(write(tmp_path, files)) is None


def test_usage_over_the_limit_leaves_no_room(tmp_path: Path) -> None:
    root = write(tmp_path, {"memory.max": "100\n", "memory.current": "250\n"})
    assert cgroup_room(root) == 0


def test_available_is_the_smaller_of_ram_and_the_containers_room(tmp_path: Path) -> None:
    ram = psutil.virtual_memory().available
    small = write(tmp_path / "small", {"memory.max": f"{GIB}\n", "memory.current": "0\n"})
    assert available_bytes(small) == min(ram, GIB)
    huge = write(tmp_path / "huge", {"memory.max": f"{1000 * ram}\n", "memory.current": "0\n"})
    assert abs(available_bytes(huge) - ram) < GIB  # RAM's figure, read again a moment later
