"""Linux NUMA memory-policy syscalls through ctypes (no libnuma needed): set/get_mempolicy, migrate_pages.

Failures come back as OSError with errno set, so callers can tell seccomp/capability refusals (EPERM) from
bad arguments (EINVAL) and decide how loudly to warn.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Iterable

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE, MPOL_LOCAL = 0, 1, 2, 3, 4
MODE_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind",
              MPOL_INTERLEAVE: "interleave", MPOL_LOCAL: "local"}
_NR = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "migrate_pages": 256, "move_pages": 279},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237, "migrate_pages": 238, "move_pages": 239},
}
MAX_NODES = 1024
_WORDS = MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def supported() -> bool:
    return platform.machine() in _NR


def _nr(name: str) -> int:
    try:
        return _NR[platform.machine()][name]
    except KeyError:
        raise OSError(errno.ENOSYS, f"{name}: unsupported architecture {platform.machine()}") from None


def _mask(nodes: Iterable[int]) -> ctypes.Array:
    bits = (ctypes.c_ulong * _WORDS)()
    width = 8 * ctypes.sizeof(ctypes.c_ulong)
    for n in nodes:
        if not 0 <= n < MAX_NODES:
            raise OSError(errno.EINVAL, f"NUMA node {n} out of range")
        bits[n // width] |= 1 << (n % width)
    return bits


def _nodes(mask: ctypes.Array) -> tuple[int, ...]:
    width = 8 * ctypes.sizeof(ctypes.c_ulong)
    return tuple(i * width + b for i, word in enumerate(mask) for b in range(width) if word >> b & 1)


def _call(name: str, *args) -> int:
    ret = _libc.syscall(ctypes.c_long(_nr(name)), *args)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")
    return ret


def set_mempolicy(mode: int, nodes: Iterable[int] = ()) -> None:
    """Policy for this thread and the threads it creates afterwards (so call it before starting workers)."""
    mask = _mask(nodes)
    _call("set_mempolicy", ctypes.c_int(mode), mask if mode != MPOL_DEFAULT else None,
          ctypes.c_ulong(MAX_NODES + 1 if mode != MPOL_DEFAULT else 0))


def get_mempolicy() -> tuple[int, tuple[int, ...]]:
    """(mode, nodes) of the calling thread."""
    mode = ctypes.c_int(0)
    mask = _mask(())
    _call("get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NODES + 1), None, ctypes.c_ulong(0))
    return mode.value, _nodes(mask)


def migrate_pages(to_nodes: Iterable[int], from_nodes: Iterable[int], pid: int = 0) -> int:
    """Move pages of `pid` (0 = this process) from `from_nodes` to `to_nodes`; returns pages that could not move."""
    return _call("migrate_pages", ctypes.c_int(pid), ctypes.c_ulong(MAX_NODES + 1), _mask(from_nodes),
                 _mask(to_nodes))
