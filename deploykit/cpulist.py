"""Linux CPU/node list syntax ("0-3,8,10-11"): parse and format, the one place that knows it."""

from __future__ import annotations

from collections.abc import Iterable

MAX_ID = 65535  # Linux's NR_CPUS tops out at 8192; anything far beyond is a typo, not a machine


def parse(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8). Empty or whitespace -> (). Raises ValueError on bad syntax or ids > MAX_ID
    (checked before a range is expanded, so '0-4000000000' costs nothing)."""
    text = text.strip()
    if not text:
        return ()
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty element in CPU list {text!r}")
        lo, sep, hi = part.partition("-")
        if not (lo.strip().isdigit() and (not sep or hi.strip().isdigit())):
            raise ValueError(f"bad element {part!r} in CPU list {text!r} (expected N or N-M)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"descending range {part!r} in CPU list {text!r}")
        if b > MAX_ID:
            raise ValueError(f"CPU id {b} is out of range (max {MAX_ID})")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def format(ids: Iterable[int]) -> str:  # noqa: A001 - mirrors the kernel's own name for it
    """(0, 1, 2, 3, 8) -> '0-3,8'. Sorted, deduplicated."""
    s = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(parts)


def parse_mask(text: str) -> tuple[int, ...]:
    """Hex mask as in /proc/self/status Cpus_allowed ('ff,ffffffff') -> CPU ids."""
    bits = int(text.replace(",", "").strip() or "0", 16)
    return tuple(i for i in range(bits.bit_length()) if bits >> i & 1)
