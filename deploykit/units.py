"""Byte sizes as users write them ('40GiB', '512M', 1073741824) and as we print them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_FORMS = "an integer number of bytes or a size such as 512MiB, 40GiB, 1.5TiB (also KB/MB/GB/TB = powers of 1000)"


def parse_size(value: object) -> int:
    """'40GiB' -> 42949672960. Raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"expected {SIZE_FORMS}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("size must not be negative")
        return value
    if isinstance(value, float) and value >= 0 and value == value and value != float("inf"):
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected {SIZE_FORMS}")
    m = _SIZE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; expected {SIZE_FORMS}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: int | float) -> str:
    """42949672960 -> '40.0 GiB'. Binary units; deterministic formatting."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
