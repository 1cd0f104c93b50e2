"""What RAM a CPU KV cache may still take: the machine's available memory, or less where the
process's container (its memory cgroup) has a limit, which `psutil` does not read and which the
kernel enforces with the OOM killer instead of an error."""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")

_NO_LIMIT = 2**60
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is none."""


def available_bytes(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The smaller of the available RAM and the room left under a container's memory limit."""
    available = int(psutil.virtual_memory().available)
    room = cgroup_room(cgroup_root)
    return available if room is None else min(available, room)


def cgroup_room(cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Limit less usage of the memory cgroup mounted at `cgroup_root` (a container's own, as
    Docker and Kubernetes mount it), not counting inactive file cache, which the kernel reclaims
    before it kills: `docker stats` counts usage the same way. None where there is no limit."""
    for limit_file, usage_file, cache_key in (
        ("memory.max", "memory.current", "inactive_file"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            limit_text = (cgroup_root / limit_file).read_text().strip()
            usage = int((cgroup_root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        reclaimable = _stat((cgroup_root / usage_file).parent / "memory.stat", cache_key)
        return max(0, int(limit_text) - usage + reclaimable)
    return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
