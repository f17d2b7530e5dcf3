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


MPOL_MF_MOVE = 1 << 1
PROBED = ("get_mempolicy", "set_mempolicy", "mbind", "migrate_pages", "move_pages")


def mbind(addr: int, length: int, mode: int, nodes: Iterable[int], flags: int = 0) -> None:
    """Policy for the pages in [addr, addr + length) of this process; MPOL_MF_MOVE also moves them."""
    _call("mbind", ctypes.c_ulong(addr), ctypes.c_ulong(length), ctypes.c_int(mode), _mask(nodes),
          ctypes.c_ulong(MAX_NODES + 1), ctypes.c_uint(flags))


def move_pages_query(addrs: Iterable[int]) -> tuple[int, ...]:
    """The node each page of this process sits on (move_pages with nodes=NULL moves nothing)."""
    pages = list(addrs)
    ptrs = (ctypes.c_void_p * len(pages))(*pages)
    status = (ctypes.c_int * len(pages))(*([-1] * len(pages)))
    _call("move_pages", ctypes.c_int(0), ctypes.c_ulong(len(pages)), ptrs, None, status, ctypes.c_int(0))
    return tuple(status)


def probe(node: int = 0) -> dict[str, int]:
    """Make each NUMA call once on this process's own memory, the way an engine binding itself would, and return
    {call: errno} (0 = allowed). The calls need no capability for the caller's own pages, so an EPERM here is a
    seccomp filter saying no (Docker's default profile, a pod's RuntimeDefault). `node` must be a node this
    process may allocate on. The memory policy is left as it was found (or default when it could not be read)."""
    import mmap

    out: dict[str, int] = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            out[name] = 0
        except OSError as e:
            out[name] = e.errno or errno.EIO

    if not supported():
        return {name: errno.ENOSYS for name in PROBED}
    found: list[tuple[int, tuple[int, ...]]] = []
    attempt("get_mempolicy", lambda: found.append(get_mempolicy()))
    mode, nodes = found[0] if found else (MPOL_DEFAULT, ())
    attempt("set_mempolicy", lambda: set_mempolicy(mode, nodes))
    page = mmap.mmap(-1, mmap.PAGESIZE)
    page.write(b"x")  # resident, so there is a page to bind, migrate and query
    view = ctypes.c_char.from_buffer(page)
    addr = ctypes.addressof(view)
    attempt("mbind", lambda: mbind(addr, mmap.PAGESIZE, MPOL_BIND, (node,), MPOL_MF_MOVE))
    attempt("migrate_pages", lambda: migrate_pages((node,), (node,)))
    attempt("move_pages", lambda: move_pages_query((addr,)))
    del view  # the buffer export must end before the mapping can close
    page.close()
    return out
