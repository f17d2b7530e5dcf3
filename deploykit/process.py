"""Read any running process from /proc, deploykit's or not (vLLM, llama.cpp, Ollama): every thread's allowed
CPUs, last CPU and CPU time, the libraries it mapped, its OpenMP/allocator environment, its seccomp mode and
capabilities, and its pages per NUMA node and memory policy. `sample()` reads a process tree twice, so CPU time
becomes CPU use. Doctor judges what this reads; the engine's binding report shows its own process through it.

Files another user's process keeps private (environ, maps, numa_maps need ptrace-read access) are listed in
`Proc.unreadable` instead of failing: the thread table alone is world-readable and answers most questions.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from . import cpulist, hostsettings, procfs
from .errors import TargetError

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class Thread:
    tid: int
    name: str
    allowed: tuple[int, ...]
    last_cpu: int
    cpu_ns: int  # CPU time so far (schedstat when the kernel keeps it, else utime + stime)
    wait_ns: int = 0  # time spent runnable but waiting for a CPU (schedstat); 0 when the kernel does not keep it


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    name: str
    cmdline: str
    uid: int
    threads: tuple[Thread, ...]
    libraries: tuple[str, ...] | None  # mapped files (paths); None when unreadable
    env: dict[str, str] | None  # the relevant variables only (hostsettings.relevant); None when unreadable
    numa_pages: dict[str, dict[int, int]] | None  # memory policy -> {node: bytes}; None when unreadable
    seccomp: int | None
    cap_eff: int | None
    mems_allowed: tuple[int, ...]
    unreadable: tuple[str, ...]  # /proc files we were not allowed to read

    @property
    def label(self) -> str:
        cmd = self.cmdline if len(self.cmdline) <= 60 else self.cmdline[:57] + "..."
        return f"pid {self.pid} ({cmd or self.name})"


@dataclass(frozen=True, slots=True)
class Sample:
    before: dict[int, Proc]
    after: dict[int, Proc]
    seconds: float

    def use(self, pid: int) -> dict[int, float]:
        """{tid: CPUs used (1.0 = one CPU all the time)} for threads alive at both reads."""
        a, b = self.before.get(pid), self.after.get(pid)
        if a is None or b is None:
            return {}
        old = {t.tid: t.cpu_ns for t in a.threads}
        return {t.tid: max(0.0, (t.cpu_ns - old[t.tid]) / 1e9 / self.seconds) for t in b.threads if t.tid in old}

    def wait(self, pid: int) -> dict[int, float]:
        """{tid: share of the window spent runnable but waiting for a CPU}."""
        a, b = self.before.get(pid), self.after.get(pid)
        if a is None or b is None:
            return {}
        old = {t.tid: t.wait_ns for t in a.threads}
        return {t.tid: max(0.0, (t.wait_ns - old[t.tid]) / 1e9 / self.seconds) for t in b.threads if t.tid in old}


def exists(pid: int, proc: Path = PROC) -> bool:
    return (proc / str(pid)).is_dir()


def read(pid: int, proc: Path = PROC) -> Proc:
    """`proc`: /proc, or a directory laid out like it (a recorded snapshot of a process tree)."""
    base = proc / str(pid)
    try:
        status = procfs.read_status(pid, proc)
        stat = procfs.read_stat(pid, proc)
    except FileNotFoundError:
        raise TargetError("no such process", path="--pid", value=pid, hint="check the PID with `ps -e` or `pgrep`")
    except PermissionError:
        raise TargetError("cannot read this process's /proc entry", path="--pid", value=pid,
                          hint="run doctor as the process's owner or as root (/proc may be mounted hidepid)") from None
    unreadable: list[str] = []

    def private(name: str, parse):
        try:
            return parse(base / name)
        except PermissionError:
            unreadable.append(name)
        except (FileNotFoundError, ProcessLookupError, OSError):
            pass
        return None

    cmdline = private("cmdline", lambda p: p.read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()) or ""
    return Proc(
        pid=pid, ppid=stat.ppid, name=status.get("Name", ""), cmdline=cmdline,
        uid=int(status.get("Uid", "0").split()[0]), threads=tuple(_threads(pid, proc)),
        libraries=private("maps", lambda p: procfs.mapped_files(p.read_text())),
        env=private("environ", lambda p: hostsettings.parse_environ(p.read_bytes())),
        numa_pages=private("numa_maps", _numa_pages), seccomp=procfs.int_field(status.get("Seccomp")),
        cap_eff=procfs.hex_field(status.get("CapEff")),
        mems_allowed=cpulist.parse(status.get("Mems_allowed_list", "") or "0"), unreadable=tuple(unreadable))


def tree(pid: int, proc: Path = PROC) -> list[int]:
    """`pid` and all its descendants, parents first."""
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = procfs.read_stat(d.name, proc).ppid
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += sorted(children.get(p, []))
    return out


def sample(pid: int, seconds: float, during=None) -> Sample:
    """Read the tree of `pid` twice, `seconds` apart (`during()`, if given, runs in between and its duration is
    the window: e.g. a generation driven through the server)."""
    pids = tree(pid)
    before = {p: read(p) for p in pids if exists(p)}
    t0 = time.monotonic()
    if during is not None:
        during()
    else:
        time.sleep(seconds)
    after = {}
    for p in before:
        try:
            after[p] = read(p)
        except TargetError:  # exited meanwhile
            pass
    return Sample(before, after, max(time.monotonic() - t0, 1e-3))


def _threads(pid: int, proc: Path) -> list[Thread]:
    out = []
    try:
        tids = procfs.tids(pid, proc)
    except OSError:
        return out
    for tid in tids:
        try:
            stat = procfs.read_stat(pid, proc, tid)
            status = procfs.read_status(pid, proc, tid)
        except OSError:
            continue  # the thread exited meanwhile
        try:
            schedstat = (proc / str(pid) / "task" / str(tid) / "schedstat").read_text()
            cpu_ns, wait_ns = (int(x) for x in schedstat.split()[:2])
        except (OSError, ValueError):
            cpu_ns, wait_ns = int(stat.cpu_seconds * 1e9), 0
        out.append(Thread(tid, stat.comm, procfs.status_list(status, "Cpus_allowed_list") or (), stat.processor,
                          cpu_ns, wait_ns))
    return out


_NODE = re.compile(r"\bN(\d+)=(\d+)")
_PAGE = re.compile(r"\bkernelpagesize_kB=(\d+)")


def _numa_pages(path: Path) -> dict[str, dict[int, int]]:
    """numa_maps summed per memory policy ("default", "bind:1", "interleave:0-1", ...) and node, in bytes."""
    out: dict[str, dict[int, int]] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) < 2:
                continue
            page = int((_PAGE.search(line) or _ONE).group(1)) * 1024
            per = out.setdefault(parts[1], {})
            for node, pages in _NODE.findall(line):
                per[int(node)] = per.get(int(node), 0) + int(pages) * page
    return {k: v for k, v in out.items() if v}


class _One:
    def group(self, _: int) -> str:
        return "4"


_ONE = _One()
