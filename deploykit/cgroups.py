"""A process's cgroup limits (v2 or v1) under a sysroot: its cpuset, memory nodes, CFS quota and memory limit, and how
much the quota has throttled it so far.

The process's cgroup path comes from /proc/PID/cgroup; inside a container the host's path is often absent (the
container sees its own cgroup as the root), so limits are read from every ancestor directory that exists and the
tightest one wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .procfs import Reader, proc_dir

CGROUP = "sys/fs/cgroup"
V1_CPU_MOUNTS = ("cpu,cpuacct", "cpu", "cpuacct,cpu")


@dataclass(frozen=True, slots=True)
class Limits:
    """What the cgroups allow; None where unlimited (or where the host has no such controller)."""

    cpus: tuple[int, ...] | None  # cpuset
    mems: tuple[int, ...] | None  # cpuset memory nodes
    quota_cpus: float | None  # CFS quota / period
    memory_bytes: int | None


@dataclass(frozen=True, slots=True)
class Throttling:
    """cpu.stat's CFS counters, summed over the cgroups whose quota applies; the difference of two samples is what
    happened between them."""

    periods: int  # enforcement periods elapsed while the cgroup had runnable threads
    throttled: int  # periods that ended with the quota used up
    seconds: float  # thread time held back

    def __sub__(self, earlier: Throttling) -> Throttling:
        return Throttling(self.periods - earlier.periods, self.throttled - earlier.throttled,
                          self.seconds - earlier.seconds)


def paths(r: Reader, proc: str) -> tuple[dict[str, str], str | None]:
    """({v1 controller: path}, v2 path or None) from /proc/<pid>/cgroup."""
    v1: dict[str, str] = {}
    v2 = None
    for line in (r.text(f"{proc}/cgroup") or "").splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and ctrls == "":
            v2 = path
        for c in ctrls.split(","):
            if c:
                v1[c] = path
    return v1, v2


def limits(r: Reader, proc: str = "proc/self") -> Limits:
    """The limits of the process whose /proc directory is `proc`, from cgroup v2 or v1."""
    v1, v2 = paths(r, proc)
    if r.exists(f"{CGROUP}/cgroup.controllers") and v2 is not None:
        dirs = _ancestors(r, CGROUP, v2)
        return Limits(cpus=_first(r.cpus(f"{d}/cpuset.cpus.effective") for d in dirs),
                      mems=_first(r.cpus(f"{d}/cpuset.mems.effective") for d in dirs),
                      quota_cpus=_min(_v2_quota(r.text(f"{d}/cpu.max")) for d in dirs),
                      memory_bytes=_min(_limit(r.text(f"{d}/memory.max")) for d in dirs))
    cs = _ancestors(r, f"{CGROUP}/cpuset", v1.get("cpuset", "/"))
    cpus = _first(r.cpus(f"{d}/cpuset.effective_cpus") or r.cpus(f"{d}/cpuset.cpus") for d in cs)
    mems = _first(r.cpus(f"{d}/cpuset.effective_mems") or r.cpus(f"{d}/cpuset.mems") for d in cs)
    quota = None
    for mount in V1_CPU_MOUNTS:
        for d in _ancestors(r, f"{CGROUP}/{mount}", v1.get("cpu", "/")):
            q, p = r.int(f"{d}/cpu.cfs_quota_us", -1), r.int(f"{d}/cpu.cfs_period_us", 0)
            if q > 0 and p > 0:
                quota = q / p if quota is None else min(quota, q / p)
    mem = _min(_limit(r.text(f"{d}/memory.limit_in_bytes"))
               for d in _ancestors(r, f"{CGROUP}/memory", v1.get("memory", "/")))
    return Limits(cpus, mems, quota, mem)  # type: ignore[arg-type]


def throttling(sysroot: str | Path = "/", pid: int | None = None) -> Throttling | None:
    """The counters so far, from cpu.stat of the cgroups whose CFS quota applies to
    the process (the same directories the quota is read from); None when no quota applies. Sample twice: a count
    that grows while the process works is the quota biting."""
    r = Reader(Path(sysroot))
    v1, v2 = paths(r, proc_dir(pid))
    if r.exists(f"{CGROUP}/cgroup.controllers") and v2 is not None:
        dirs = [d for d in _ancestors(r, CGROUP, v2) if _v2_quota(r.text(f"{d}/cpu.max")) is not None]
        key, scale = "throttled_usec", 1e-6
    else:
        dirs = [d for mount in V1_CPU_MOUNTS for d in _ancestors(r, f"{CGROUP}/{mount}", v1.get("cpu", "/"))
                if r.int(f"{d}/cpu.cfs_quota_us", -1) > 0]
        key, scale = "throttled_time", 1e-9
    if not dirs:
        return None
    periods, throttled, seconds = 0, 0, 0.0
    for d in dirs:
        stat = dict(line.split()[:2] for line in (r.text(f"{d}/cpu.stat") or "").splitlines() if " " in line)
        periods += int(stat.get("nr_periods", 0))
        throttled += int(stat.get("nr_throttled", 0))
        seconds += int(stat.get(key, 0)) * scale
    return Throttling(periods, throttled, seconds)


def _ancestors(r: Reader, mount: str, path: str) -> list[str]:
    """The cgroup dir and its parents up to the mount, only the ones that exist."""
    parts = [p for p in path.split("/") if p]
    out = []
    for i in range(len(parts), -1, -1):
        d = "/".join([mount, *parts[:i]])
        if r.exists(d):
            out.append(d)
    return out


def _v2_quota(text: str | None) -> float | None:
    if not text:
        return None
    q, _, p = text.strip().partition(" ")
    return int(q) / int(p or 100000) if q.isdigit() and (p or "1").isdigit() and int(p or 1) > 0 else None


def _limit(text: str | None) -> int | None:
    t = (text or "").strip()
    # v1 reports "unlimited" as a page-rounded LONG_MAX.
    return int(t) if t.isdigit() and int(t) < 2**60 else None


def _first(values) -> tuple[int, ...] | None:
    for v in values:
        if v:
            return v
    return None


def _min(values) -> float | int | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None
