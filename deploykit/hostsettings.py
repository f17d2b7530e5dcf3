"""How the host and this process are set up beyond their shape (deploykit.topology has the shape): the kernel knobs
that move pages (NUMA balancing, transparent hugepages), the process's seccomp mode and capabilities, its OpenMP
and allocator environment, preloaded libraries, and whether the NUMA calls and AMX are allowed here.

Read from the live host or a `--sysroot` snapshot with the same relative paths; `read_with_sources` names every
path it read, which is what `topology snapshot` copies. The live probes cannot run on a snapshot, so a snapshot taken live
carries their results in PROBE_FILE.
"""

from __future__ import annotations

import errno
import json
import re
from dataclasses import dataclass
from pathlib import Path

from . import cpulist, isa, numa
from .errors import TopologyError
from .procfs import Reader, hex_field, int_field, status_fields

NUMA_BALANCING = "proc/sys/kernel/numa_balancing"
THP_ENABLED = "sys/kernel/mm/transparent_hugepage/enabled"
THP_DEFRAG = "sys/kernel/mm/transparent_hugepage/defrag"
LD_SO_PRELOAD = "etc/ld.so.preload"
PROBE_FILE = "deploykit/probe.json"  # not a kernel file: the live probes' results, written by `topology snapshot`
STATUS_KEYS = ("Seccomp", "Seccomp_filters", "NoNewPrivs", "CapEff", "CapBnd")
# The environment that decides threads, placement and allocation. Only these are ever read or copied into a
# snapshot or a report: the rest of an environment holds API keys and tokens.
ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "VLLM_CPU_")
ENV_NAMES = frozenset({"LD_PRELOAD", "OPENBLAS_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "DEPLOYKIT_CPUS",
                       "DEPLOYKIT_FRONTEND_CPUS", "DEPLOYKIT_MEMS", "CPU_VISIBLE_MEMORY_NODES"})
CAP_SYS_NICE = 23
SECCOMP_MODES = {0: "disabled", 1: "strict", 2: "filter"}


def relevant(name: str) -> bool:
    return name in ENV_NAMES or name.startswith(ENV_PREFIXES)


def parse_environ(raw: bytes | str) -> dict[str, str]:
    """The relevant variables of a NUL-separated /proc/<pid>/environ."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    out = {}
    for item in text.split("\0"):
        name, eq, value = item.partition("=")
        if eq and relevant(name):
            out[name] = value
    return out


@dataclass(frozen=True, slots=True)
class Probe:
    """What the live probes found: {NUMA call: errno} (0 = allowed) and whether AMX tile state was granted."""

    numa_calls: tuple[tuple[str, int], ...]
    amx_granted: bool | None  # None: the CPU has no AMX (nothing to ask for)

    @property
    def refused(self) -> tuple[str, ...]:
        return tuple(name for name, err in self.numa_calls if err == errno.EPERM)

    @property
    def failed(self) -> tuple[tuple[str, int], ...]:
        return tuple((name, err) for name, err in self.numa_calls if err not in (0, errno.EPERM))

    def to_dict(self) -> dict:
        return {"numa_calls": {n: errno.errorcode.get(e, str(e)) if e else "ok" for n, e in self.numa_calls},
                "amx_granted": self.amx_granted}

    @classmethod
    def from_dict(cls, data: dict) -> Probe:
        codes = {name: code for code, name in errno.errorcode.items()}
        calls = tuple((n, 0 if v == "ok" else codes.get(v, errno.EIO)) for n, v in sorted(data["numa_calls"].items()))
        return cls(calls, data.get("amx_granted"))


def probe(mems_allowed: tuple[int, ...], flags: frozenset[str]) -> Probe:
    """Run the probes in this process: the NUMA calls on its own memory, and the AMX permission request."""
    calls = numa.probe(mems_allowed[0] if mems_allowed else 0)
    amx = isa.amx_granted() if {"amx_tile", "amx_bf16"} <= flags else None
    return Probe(tuple(sorted(calls.items())), amx)


@dataclass(frozen=True, slots=True)
class HostSettings:
    numa_balancing: int | None  # None: the kernel has no NUMA balancing (or the snapshot lacks the file)
    thp_enabled: str | None  # always | madvise | never
    thp_defrag: str | None
    seccomp_mode: int | None  # 0 off, 1 strict, 2 filter
    no_new_privs: bool | None
    cap_eff: int | None  # effective capability bits
    env: tuple[tuple[str, str], ...]  # relevant variables only, sorted
    ld_so_preload: tuple[str, ...]
    probe: Probe | None  # None: not probed (a snapshot taken without it)
    live: bool
    env_known: bool = True  # False: a snapshot without proc/self/environ (older than doctor)

    @property
    def environ(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def has_sys_nice(self) -> bool | None:
        return None if self.cap_eff is None else bool(self.cap_eff >> CAP_SYS_NICE & 1)


def read(sysroot: str | Path = "/") -> HostSettings:
    return read_with_sources(sysroot)[0]


def read_with_sources(sysroot: str | Path = "/") -> tuple[HostSettings, tuple[str, ...]]:
    """Settings of the live host (sysroot "/", probes run in this process) or of a snapshot directory."""
    root = Path(sysroot)
    r = Reader(root)
    live = root.resolve() == Path("/")
    status = status_fields(r.text("proc/self/status") or "")
    try:
        raw_env = (root / "proc/self/environ").read_bytes()
        r.seen.add("proc/self/environ")
        env_known = True
    except OSError:
        raw_env, env_known = b"", False
    preload = tuple((r.text(LD_SO_PRELOAD) or "").split())
    if live:
        mems = cpulist.parse(status.get("Mems_allowed_list", "0"))
        result: Probe | None = probe(mems, isa.cpu_flags(root / "proc/cpuinfo"))
    else:
        text = r.text(PROBE_FILE)
        try:
            result = Probe.from_dict(json.loads(text)) if text else None
        except (ValueError, KeyError, TypeError) as e:
            raise TopologyError(f"malformed probe record: {e}", path=str(root / PROBE_FILE),
                                hint="take the snapshot again with `deploykit topology snapshot`") from None
    thp = _bracketed(r.text(THP_ENABLED))
    settings = HostSettings(
        numa_balancing=int_field(r.text(NUMA_BALANCING)), thp_enabled=thp, thp_defrag=_bracketed(r.text(THP_DEFRAG)),
        seccomp_mode=int_field(status.get("Seccomp")), no_new_privs=_bool(status.get("NoNewPrivs")),
        cap_eff=hex_field(status.get("CapEff")), env=tuple(sorted(parse_environ(raw_env).items())),
        ld_so_preload=preload, probe=result, live=live, env_known=env_known)
    return settings, tuple(sorted(r.seen))


def thp_mode(sysroot: str | Path = "/") -> str | None:
    """transparent_hugepage/enabled's selected word (always | madvise | never); None where the kernel has none."""
    return _bracketed(Reader(Path(sysroot)).text(THP_ENABLED))


def _bracketed(text: str | None) -> str | None:
    """The selected word of a sysfs choice file: 'always [madvise] never' -> 'madvise'."""
    m = re.search(r"\[(\w[\w+]*)\]", text or "")
    return m.group(1) if m else None


def _bool(text: str | None) -> bool | None:
    value = int_field(text)
    return None if value is None else bool(value)
