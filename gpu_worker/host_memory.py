"""How much host memory this process can still take: what sizes the default CPU KV pool.

Linux's MemAvailable (free memory plus what the kernel can reclaim without swapping) is the
machine's answer; inside a container a cgroup limit can be far lower, and then what is left
under it counts: the limit less the group's usage, where the group's inactive page cache is
counted as free, since the kernel drops it before it refuses memory.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# A cgroup limit this large is no limit (v1 writes "unlimited" as about 2**63 rounded to pages).
UNLIMITED = 1 << 60


def available_bytes(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process can allocate without the kernel swapping or refusing: MemAvailable,
    at most what its memory cgroup (v2 or v1) leaves; None where MemAvailable cannot be read
    (not Linux)."""
    try:
        meminfo = _fields((proc / "meminfo").read_text(), scale=1024)
    except OSError:
        return None
    available = meminfo.get("MemAvailable")
    if available is None:
        return None
    left = _cgroup_left(proc, cgroup_root)
    return available if left is None else max(0, min(available, left))


def _cgroup_left(proc: Path, root: Path) -> int | None:
    """What the memory cgroup's limit leaves, or None without a limit (or a cgroup to read)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            names = ("memory.max", "memory.current", "inactive_file")
            base = root
        elif "memory" in controllers.split(","):
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            base = root / "memory"
        else:
            continue
        # A container sees its own group at the root of its cgroup namespace.
        for group in (base / path.lstrip("/"), base):
            left = _left_in(group, *names)
            if left is not None:
                return left
    return None


def _left_in(group: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        raw = (group / limit_file).read_text().strip()
        usage = int((group / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if raw == "max" or not raw.isdigit() or int(raw) >= UNLIMITED:
        return None
    try:
        inactive = _fields((group / "memory.stat").read_text()).get(inactive_key, 0)
    except OSError:
        inactive = 0
    return int(raw) - usage + inactive


def _fields(text: str, scale: int = 1) -> dict[str, int]:
    """`name value` or `name: value kB` lines as {name: value x scale}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * scale
    return out
