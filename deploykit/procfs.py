"""/proc and /sys read in one place: files under a sysroot (`Reader`), a process's `status` fields, its `stat` line as
a typed `Stat`, the files it mapped (/proc/PID/maps), its threads and children, the CPUs' busy time (/proc/stat),
and the patterns that name OpenMP runtimes and fast allocators among those files.

Everything above (topology, cgroups, hostsettings, doctor, the local runtime, the engine's binding, benchmarks/)
parses /proc through these functions, so a field is split one way everywhere. The readers raise OSError as `open`
does (a process may exit, or keep its files private); callers decide what that means.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import cpulist
from .errors import TopologyError

PROC = Path("/proc")
CLK_TCK = os.sysconf("SC_CLK_TCK")  # the unit of stat's utime/stime and of /proc/stat's CPU columns
# Basenames of OpenMP runtimes as they appear in /proc/PID/maps or LD_PRELOAD: GNU (libgomp, also PyTorch's bundled
# copy), Intel (libiomp5) and LLVM (libomp); and of the allocators that replace glibc malloc.
OMP_RUNTIME = re.compile(r"(?:^|/)(libgomp[^/]*\.so[^/]*|libiomp5[^/]*\.so[^/]*|libomp[^/]*\.so[^/]*)$")
FAST_MALLOC = re.compile(r"(?:^|/)(libtcmalloc[^/]*\.so[^/]*|libjemalloc[^/]*\.so[^/]*)$")


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of /proc/PID/stat (or /proc/PID/task/TID/stat) that deploykit reads; see proc(5)."""

    pid: int
    comm: str  # the command name: up to 15 bytes, may hold spaces and parentheses
    state: str  # R running, S sleeping, Z zombie, ...
    ppid: int
    pgrp: int  # the process group: a server started in a session of its own leads one with all its workers
    utime: int  # clock ticks in user mode
    stime: int  # clock ticks in kernel mode
    start_time: int  # clock ticks after boot when the process started: with the pid, its identity
    processor: int  # the CPU it last ran on

    @property
    def cpu_seconds(self) -> float:
        """CPU time used so far, user + kernel."""
        return (self.utime + self.stime) / CLK_TCK


def parse_stat(text: str) -> Stat:
    """One stat line. The command name sits in parentheses and may itself hold ") (", so it ends at the LAST ')'."""
    head, closing, tail = text.rpartition(")")
    pid, opening, comm = head.partition("(")
    f = tail.split()  # f[0] is field 3 (state) of proc(5): field n is f[n - 3]
    if not (closing and opening) or len(f) < 37:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    return Stat(pid=int(pid), comm=comm, state=f[0], ppid=int(f[1]), pgrp=int(f[2]), utime=int(f[11]), stime=int(f[12]),
                start_time=int(f[19]), processor=int(f[36]))


def read_stat(pid: int | str = "self", proc: Path = PROC, tid: int | None = None) -> Stat:
    """The stat of a process (or of one of its threads)."""
    return parse_stat(_path(proc, pid, tid, "stat").read_text())


def status_fields(text: str) -> dict[str, str]:
    """/proc/PID/status as {name: value}: 'Cpus_allowed_list:\\t0-3' -> {'Cpus_allowed_list': '0-3'}."""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def read_status(pid: int | str = "self", proc: Path = PROC, tid: int | None = None) -> dict[str, str]:
    return status_fields(_path(proc, pid, tid, "status").read_text())


def status_bytes(status: dict[str, str], key: str) -> int | None:
    """A memory field ('VmRSS:\t 1234 kB') in bytes; None when absent or malformed."""
    n = int_field(status.get(key, "").removesuffix("kB"))
    return None if n is None else n * 1024


def status_list(status: dict[str, str], key: str) -> tuple[int, ...] | None:
    """A CPU or node list field (Cpus_allowed_list, Mems_allowed_list); None when absent or empty."""
    value = status.get(key)
    return cpulist.parse(value) if value else None


def int_field(text: str | None) -> int | None:
    """A decimal /proc or /sys value, None when absent or not a number."""
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def hex_field(text: str | None) -> int | None:
    """A hexadecimal /proc value (CapEff: '000001ffffffffff'), None when absent or malformed."""
    try:
        return int((text or "").strip(), 16)
    except ValueError:
        return None


def mapped_files(text: str) -> tuple[str, ...]:
    """The files a /proc/PID/maps text maps (absolute paths, first-mapped order, each once)."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            seen[parts[5].strip()] = None
    return tuple(seen)


def read_mapped_files(pid: int | str = "self", proc: Path = PROC) -> tuple[str, ...]:
    """Reading another user's maps needs ptrace access: PermissionError then."""
    return mapped_files(_path(proc, pid, None, "maps").read_text())


def omp_runtimes(files) -> tuple[str, ...]:
    """The OpenMP runtimes among mapped or preloaded files, sorted."""
    return tuple(sorted({f for f in files if OMP_RUNTIME.search(f)}))


def tids(pid: int | str = "self", proc: Path = PROC) -> list[int]:
    """The thread ids of a process, sorted."""
    return sorted(int(t) for t in os.listdir(_path(proc, pid, None, "task")))


def children(pid: int | str = "self", proc: Path = PROC) -> list[int]:
    """The direct children of a process's main thread (those its other threads started are not listed)."""
    pid = os.getpid() if pid == "self" else pid
    return [int(c) for c in _path(proc, pid, int(pid), "children").read_text().split()]


def group_cpu_seconds(pgrp: int, proc: Path = PROC) -> float:
    """CPU time so far of every live process in process group `pgrp`, user + kernel. A process that exits before it
    is read is skipped (its time is no longer anywhere to read)."""
    total = 0.0
    for entry in os.listdir(proc):
        if entry.isdigit():
            try:
                st = read_stat(entry, proc)
            except (OSError, ValueError):
                continue
            total += st.cpu_seconds if st.pgrp == pgrp else 0.0
    return total


def busy_seconds(cpus, text: str | None = None) -> float:
    """Non-idle time of these CPUs since boot, summed, from /proc/stat (or its `text`): every column of a `cpuN`
    row but idle and iowait (proc(5): user nice system idle iowait irq softirq steal guest guest_nice; guest time
    is already inside user, so the last two are left out too)."""
    text = (PROC / "stat").read_text() if text is None else text
    rows = {f[0]: f[1:] for f in (line.split() for line in text.splitlines()) if f and f[0].startswith("cpu")}
    return sum(int(v) for c in cpus for i, v in enumerate(rows[f"cpu{c}"][:8]) if i not in (3, 4)) / CLK_TCK


def proc_dir(pid: int | None) -> str:
    """The sysroot-relative /proc directory of process `pid` (None: the reading process), for a `Reader`."""
    return f"proc/{pid}" if pid else "proc/self"


def _path(proc: Path, pid: int | str, tid: int | None, name: str) -> Path:
    base = proc / str(pid)
    return (base / "task" / str(tid) if tid is not None else base) / name


class Reader:
    """File access relative to a sysroot ('/' or a snapshot with the same relative paths), tolerant of missing files
    (a snapshot holds only what exists). `seen` names every file read: what a snapshot must copy."""

    def __init__(self, root: Path):
        self.root = root
        self.seen: set[str] = set()

    def exists(self, rel: str) -> bool:
        if (self.root / rel).is_file():
            self.seen.add(rel)
        return (self.root / rel).exists()

    def text(self, rel: str) -> str | None:
        try:
            t = (self.root / rel).read_text(errors="replace")
            self.seen.add(rel)
            return t
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
            return None
        except OSError as e:
            raise TopologyError(f"cannot read {rel}: {e}", path=str(self.root / rel)) from None

    def listdir(self, rel: str, prefix: str = "") -> list[str]:
        """Names in a directory starting with `prefix`, sorted; [] when it is absent."""
        try:
            return sorted(p.name for p in (self.root / rel).iterdir() if p.name.startswith(prefix))
        except OSError:
            return []

    def cpus(self, rel: str) -> tuple[int, ...] | None:
        t = self.text(rel)
        if t is None:
            return None
        try:
            return cpulist.parse(t)
        except ValueError as e:
            raise TopologyError(f"malformed CPU list: {e}", path=str(self.root / rel)) from None

    def int(self, rel: str, default: int) -> int:
        t = (self.text(rel) or "").strip()
        try:
            return int(t)
        except ValueError:
            return default
