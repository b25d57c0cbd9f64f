"""What the benchmark ran on: CPU, disk, versions, source state, free memory."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from benchkit.common import GB, REPO, Case, GiB, _size


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        return match.group(1).strip() if match else platform.processor() or "unknown"
    except OSError:
        return platform.processor() or "unknown"


def _disk_of(path: Path) -> str:
    """Device, file system and size of the file system holding ``path``."""
    best = ("?", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if str(path).startswith(mount) and len(mount) >= len(best[2]):
                    best = (device, fstype, mount)
    except OSError:
        pass
    device, fstype, mount = best
    total = shutil.disk_usage(path).total
    rotational = Path(f"/sys/block/{Path(device).name}/queue/rotational")
    kind = ""
    if rotational.exists():
        kind = ", rotational" if rotational.read_text().strip() == "1" else ", non-rotational"
    return f"{device} ({fstype} on {mount}, {total / GB:.0f} GB{kind})"


def _source_state() -> str:
    """The commit the benchmark ran against, and whether jaxckpt/ had local changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "jaxckpt"],
            capture_output=True,
            text=True,
            cwd=REPO,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}" + (" + uncommitted changes in jaxckpt/" if dirty else "")


def machine_info(root: Path) -> dict[str, Any]:
    import psutil

    versions = {}
    for name in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy", "jaxckpt"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / GiB,
        "disk": _disk_of(root),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "versions": versions,
        "jaxckpt_source": _source_state(),
        "load_at_start": os.getloadavg(),
    }


def fits_in_memory(case: Case) -> str | None:
    """Why the case cannot run now, or None: state + restored copy + transient buffers."""
    import psutil

    need = 3 * case.nbytes + GiB
    available = psutil.virtual_memory().available
    if need > available:
        return f"needs ~{_size(need)} of memory, {_size(available)} available"
    return None


# ---- object stores ---------------------------------------------------------------------------
