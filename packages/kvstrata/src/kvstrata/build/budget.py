"""Memory budgets: `"40GiB"`, a byte count, or a fraction of the free device memory; and the free
memory of the device and of the host, measured when asked (never cached: nothing global).

Units: binary `KiB MiB GiB TiB` (and `K M G T` as their short forms), decimal `KB MB GB TB`,
`B` for bytes. A fraction is a float in (0, 1] or a string `"0.9"` / `"90%"`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from kvstrata.build.errors import DeviceUnavailable, InvalidCapacity

#: Bytes per unit suffix (case-insensitive).
UNITS: dict[str, int] = {
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")


def parse_size(text: str) -> int:
    """Bytes of a size string: `"40GiB"`, `"512 MiB"`, `"1.5TB"`, `"1073741824"`. Refuses a
    fraction (use `resolve_budget`), an unknown unit, a non-positive size."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidCapacity(f"not a size: {text!r} (expected e.g. 40GiB, 512MiB, 80GB)")
    number, unit = match.groups()
    scale = UNITS.get(unit.lower() if unit else "b")
    if scale is None:
        raise InvalidCapacity(
            f"unknown unit {unit!r} in {text!r}; use one of {', '.join(sorted(UNITS))}"
        )
    size = int(float(number) * scale)
    if size <= 0:
        raise InvalidCapacity(f"size must be positive, got {text!r}")
    return size


def resolve_budget(budget: str | int | float, *, free_bytes: int | None) -> int:
    """The budget in bytes. `budget`: bytes (int or size string) or a fraction of `free_bytes`
    (a float in (0, 1], `"0.9"`, `"90%"`). `free_bytes`: the free memory a fraction refers
    to; None refuses a fraction (InvalidCapacity)."""
    if isinstance(budget, bool):
        raise InvalidCapacity(f"not a budget: {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise InvalidCapacity(f"budget must be positive, got {budget}")
        return budget
    if isinstance(budget, float):
        return _fraction(budget, free_bytes, text=repr(budget))
    if is_fraction(budget):
        stripped = budget.strip()
        value = float(stripped[:-1]) / 100 if stripped.endswith("%") else float(stripped)
        return _fraction(value, free_bytes, text=budget)
    return parse_size(budget)


def is_fraction(budget: str | int | float) -> bool:
    """Whether `budget` names a fraction of free memory (a float, `"0.9"`, `"90%"`) rather
    than a size: the question a caller asks before measuring the free memory."""
    if isinstance(budget, (bool, int)):
        return False
    if isinstance(budget, float):
        return True
    if _PERCENT.match(budget):
        return True
    stripped = budget.strip()
    return "." in stripped and stripped.replace(".", "", 1).isdigit() and float(stripped) <= 1.0


def _fraction(value: float, free_bytes: int | None, *, text: str) -> int:
    if not 0.0 < value <= 1.0:
        raise InvalidCapacity(f"a fraction of free memory must be in (0, 1], got {text}")
    if free_bytes is None:
        raise InvalidCapacity(
            f"budget {text} is a fraction of free device memory, but no free memory figure "
            "was given (pass free_device_bytes, or a size such as 40GiB)"
        )
    return int(free_bytes * value)


def free_device_memory(device: torch.device | str) -> int:
    """Free bytes on `device` now: `torch.cuda.mem_get_info` for CUDA, the host's available
    memory for "cpu" (the pools live in host memory there)."""
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {device!r}: no CUDA device on this machine")
        free, _total = torch.cuda.mem_get_info(resolved)
        return int(free)
    if resolved.type == "cpu":
        return free_host_memory()
    raise DeviceUnavailable(f"cannot measure free memory of device {device!r}")


def free_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Available host bytes now: `MemAvailable` of /proc/meminfo (what can be allocated without
    swapping), else free physical pages by sysconf."""
    try:
        text = meminfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * 1024  # reported in kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(size: int) -> str:
    """`size` in the largest binary unit that keeps it >= 1 (`"39.50 GiB"`)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the loop returns at TiB")
