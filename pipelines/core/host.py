"""What this host has for a build: the memory budget, free disk space, and what a full disk looks like.

The budget is `HIVE_AOT_MEMORY_BUDGET` (`12G`, `12GiB`, `800M`, bytes), else the memory this host has
available (MemAvailable, capped by the memory cgroup's own limit). Disk full during a build (ENOSPC, a
quota, or EFBIG from a process's file size limit) is one error (`DiskFull`, a ResourceError): one line
naming the step, the file system and its free space.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from . import settings
from .errors import DiskFull
from .units import KIB, MIB, human_bytes, parse_size

BUDGET_ENV = settings.MEMORY_BUDGET.name


def host_available_memory() -> int:
    """MemAvailable (what can be allocated without swapping, reclaimable cache included), capped by the memory
    cgroup's own limit where one is set."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * KIB
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            available = 0
    cgroup = _cgroup_available()
    return min(available, cgroup) if cgroup is not None else available


CGROUP_ROOT = Path("/sys/fs/cgroup")
# (directory under the mount, limit file, usage file, memory.stat key of reclaimable page cache)
_CGROUP_FILES = {"v2": ("", "memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def _own_memory_cgroups() -> list[tuple[str, Path]]:
    """(version, directory) of this process's memory cgroup and of each of its ancestors, nearest first: a limit
    set on a parent (a container's) binds too. Where /proc/self/cgroup cannot be read, the mount's root."""
    found: list[tuple[str, Path]] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if version is None:
            continue
        base = CGROUP_ROOT / _CGROUP_FILES[version][0]
        d = base / path.strip().lstrip("/")
        while True:
            found.append((version, d))
            if d == base or base not in d.parents:
                break
            d = d.parent
    return found or [("v2", CGROUP_ROOT), ("v1", CGROUP_ROOT / "memory")]


def _cgroup_available() -> int | None:
    """The least of limit - usage + inactive file cache over this process's memory cgroup and its ancestors (v2 or
    v1); None where none of them has a limit."""
    best: int | None = None
    for version, d in _own_memory_cgroups():
        _, limit_file, usage_file, stat_key = _CGROUP_FILES[version]
        try:
            raw = (d / limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:  # no limit (v1 writes a huge number)
                continue
            limit, usage = int(raw), int((d / usage_file).read_text().strip())
            stat = (d / "memory.stat").read_text()
            inactive = next((int(v) for k, v in (ln.split() for ln in stat.splitlines() if ln.strip()) if k == stat_key), 0)
        except (OSError, ValueError):
            continue
        available = max(limit - usage + inactive, 0)
        best = available if best is None else min(best, available)
    return best


def memory_budget() -> tuple[int, str]:
    """(bytes, where they come from): `HIVE_AOT_MEMORY_BUDGET`, else what this host has available."""
    raw = settings.MEMORY_BUDGET.get()
    if raw is not None and raw.strip():
        return parse_size(raw, BUDGET_ENV), BUDGET_ENV
    return host_available_memory(), "memory available on this host"


def _existing(path: Path) -> Path:
    """The path, or its nearest existing ancestor (a store root not created yet lives on its parent's file system)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def device_of(path: Path) -> int:
    try:
        return _existing(path).stat().st_dev
    except OSError:
        return -1


def free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return 0


def filesystem_of(path: Path) -> tuple[str, str]:
    """(mount point, file system type) of the file system holding `path`."""
    p = _existing(path)
    while not os.path.ismount(p) and p.parent != p:
        p = p.parent
    fstype = "unknown"
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1].replace("\\040", " ") == str(p):
                fstype = parts[2]  # the last mount on a point is the visible one
    except OSError:
        pass
    return str(p), fstype


# --- Disk full ---------------------------------------------------------------------------------------------

DISK_FULL_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                    # A process's RLIMIT_FSIZE: the write fails with EFBIG (SIGXFSZ ignored). For the build it is
                    # the same as a full disk: no room for the file.
                    errno.EFBIG: "file size limit exceeded (EFBIG: this process's RLIMIT_FSIZE, or the file system's)"}


# Free space below this after a failed write means the write failed for lack of it (for writers that do not
# say why: numpy's tofile raises "N requested and M written" without an errno, llama.cpp "iostream error").
DISK_FULL_SLACK = 16 * MIB


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS


def out_of_space(where: Path) -> int | None:
    """Why a write under `where` that failed without an errno stopped: EFBIG when a file there reached this
    process's RLIMIT_FSIZE, ENOSPC when the file system is (nearly) full, else EFBIG while a file size limit
    is in force (the writer may have removed its partial file already); None when nothing explains it."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limited = soft != resource.RLIM_INFINITY
    try:
        if limited and Path(where).is_dir():
            for dirpath, _dirs, files in os.walk(where):
                if any(os.path.getsize(os.path.join(dirpath, f)) >= soft for f in files):
                    return errno.EFBIG
    except OSError:
        pass
    if free_bytes(Path(where)) < DISK_FULL_SLACK:
        return errno.ENOSPC
    return errno.EFBIG if limited else None


def disk_full_cause(e: BaseException, where: Path | None) -> int | None:
    """The errno that makes `e` a full disk (ENOSPC, EDQUOT, EFBIG), also for a short write without one."""
    if is_disk_full(e):
        return e.errno  # type: ignore[union-attr]
    if isinstance(e, OSError) and e.errno is None and where is not None:
        return out_of_space(where)
    return None


def disk_full_error(errno_code: int | None, path: Path | str, *, subject: str, step: str | None = None,
                    outcome: str = "partial files removed, nothing was published") -> DiskFull:
    """One line: what filled up, during which step, on which file system, and how much is free there now."""
    mount, fstype = filesystem_of(Path(path))
    reason = DISK_FULL_ERRNOS.get(errno_code or errno.ENOSPC, os.strerror(errno_code or errno.ENOSPC))
    during = f" during step '{step}'" if step else ""
    return DiskFull(f"{subject}: disk full{during} ({reason}) writing under {path} ({fstype} file system at {mount}, "
                    f"{human_bytes(free_bytes(Path(path)))} free); {outcome}", path=str(path), errno_code=errno_code)
