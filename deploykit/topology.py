"""What the machine (or a --sysroot snapshot of it) offers: CPUs, cores, L3 groups, sockets, NUMA nodes, cpuset,
quota, ISA.

Facts only, no policy: the planner decides what to use. Reads the same files as `lscpu --sysroot` plus the
process's own limits (/proc/self/status, and cgroup v1/v2 through deploykit.cgroups). `read_with_sources` names every
path read, so `snapshot` can copy exactly those.
"""

from __future__ import annotations

import contextlib
import re
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from . import cgroups, cpulist, procfs
from . import isa as _isa
from .errors import TopologyError
from .procfs import Reader

CPU_DIR = "sys/devices/system/cpu"
NODE_DIR = "sys/devices/system/node"
TOPOLOGY_FILES = ("core_id", "physical_package_id", "thread_siblings_list")


@dataclass(frozen=True, slots=True)
class Cpu:
    id: int
    socket: int
    node: int
    core: tuple[int, ...]  # all SMT siblings of this CPU's physical core (incl. itself): the core's identity
    l3: int | None = None  # id of the L3 group (CPUs sharing one last-level cache); None when the host does not say


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """CPUs sharing one L3 (last-level) cache: an AMD CCD (8 cores + siblings on Zen 4/5), an Intel socket."""

    id: int  # the kernel's cache id when it names every group apart, else the group's rank by lowest CPU
    cpus: tuple[int, ...]  # online CPUs only
    size_bytes: int


@dataclass(frozen=True, slots=True)
class Node:
    id: int
    cpus: tuple[int, ...]  # online CPUs; () for a memory-only node (CXL, HBM-only)
    memory_bytes: int
    distances: tuple[int, ...] = ()  # SLIT row, indexed like `Topology.nodes` ids order


@dataclass(frozen=True, slots=True)
class Topology:
    cpus: tuple[Cpu, ...]  # online CPUs, sorted by id
    offline: tuple[int, ...]
    nodes: tuple[Node, ...]
    allowed_cpus: tuple[int, ...]  # this process may run on (affinity ∩ cgroup cpuset)
    allowed_mems: tuple[int, ...]
    quota_cpus: float | None  # CFS quota / period, None when unlimited
    memory_limit_bytes: int | None  # cgroup memory limit, None when unlimited
    isa: tuple[str, ...]  # flags of interest present on the CPUs
    cpu_model: str
    source: str  # "/" (live), a sysroot path, or "inline"
    cpuset: tuple[int, ...] | None = None  # the cgroup cpuset alone (allowed_cpus also has the affinity); None: none
    l3_groups: tuple[CacheGroup, ...] = ()  # sorted by lowest CPU; () = unknown (no cache files, or inconsistent)

    @property
    def isa_tier(self) -> str:
        return _isa.tier(self.isa)

    @property
    def has_bf16(self) -> bool:
        return _isa.has_bf16(self.isa)

    def cpu(self, cpu_id: int) -> Cpu:
        for c in self.cpus:
            if c.id == cpu_id:
                return c
        raise KeyError(cpu_id)

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def l3_group(self, group_id: int) -> CacheGroup:
        for g in self.l3_groups:
            if g.id == group_id:
                return g
        raise KeyError(group_id)

    @property
    def sockets(self) -> tuple[int, ...]:
        return tuple(sorted({c.socket for c in self.cpus}))

    @property
    def threads_per_core(self) -> int:
        return max((len(c.core) for c in self.cpus), default=1)

    def to_dict(self) -> dict:
        """The one JSON form (`topology show --format json`, the engine's binding report): CPU sets in the Linux
        list syntax, plus `isa_tier` for people (from_dict derives it again)."""
        fmt = cpulist.format
        return {"cpus": [{"id": c.id, "socket": c.socket, "node": c.node, "core": fmt(c.core), "l3": c.l3}
                         for c in self.cpus],
                "offline": fmt(self.offline),
                "nodes": [{"id": n.id, "cpus": fmt(n.cpus), "memory_bytes": n.memory_bytes,
                           "distances": list(n.distances)} for n in self.nodes],
                "l3_groups": [{"id": g.id, "cpus": fmt(g.cpus), "size_bytes": g.size_bytes} for g in self.l3_groups],
                "allowed_cpus": fmt(self.allowed_cpus), "allowed_mems": fmt(self.allowed_mems),
                "cpuset": None if self.cpuset is None else fmt(self.cpuset), "quota_cpus": self.quota_cpus,
                "memory_limit_bytes": self.memory_limit_bytes, "isa": list(self.isa), "isa_tier": self.isa_tier,
                "cpu_model": self.cpu_model, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        """The inverse of to_dict; TopologyError names the first key that does not fit."""
        parse = cpulist.parse
        try:
            return cls(
                cpus=tuple(Cpu(c["id"], c["socket"], c["node"], parse(c["core"]), c["l3"]) for c in d["cpus"]),
                offline=parse(d["offline"]),
                nodes=tuple(Node(n["id"], parse(n["cpus"]), n["memory_bytes"], tuple(n["distances"]))
                            for n in d["nodes"]),
                l3_groups=tuple(CacheGroup(g["id"], parse(g["cpus"]), g["size_bytes"]) for g in d["l3_groups"]),
                allowed_cpus=parse(d["allowed_cpus"]), allowed_mems=parse(d["allowed_mems"]),
                cpuset=None if d["cpuset"] is None else parse(d["cpuset"]), quota_cpus=d["quota_cpus"],
                memory_limit_bytes=d["memory_limit_bytes"], isa=tuple(d["isa"]), cpu_model=d["cpu_model"],
                source=d["source"])
        except KeyError as e:
            raise TopologyError("missing from the topology", path=f"topology.{e.args[0]}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise TopologyError(f"not a topology: {e}", path="topology") from None


def read(sysroot: str | Path = "/", pid: int | None = None) -> Topology:
    """Read the live host (sysroot '/') or a snapshot directory with the same relative paths. The process limits
    (affinity, cpuset, quota, memory limit) are this process's, or those of process `pid` when given."""
    return read_with_sources(sysroot, pid)[0]


@contextlib.contextmanager
def opened(sysroot: str | Path = "/") -> Iterator[Path]:
    """The sysroot as a directory: itself, or a snapshot archive unpacked for the duration of the block."""
    if Path(sysroot).is_file():
        with tempfile.TemporaryDirectory(prefix="deploykit-sysroot-") as tmp:
            _extract(Path(sysroot), Path(tmp))
            yield Path(tmp)
    else:
        yield Path(sysroot)


def read_with_sources(sysroot: str | Path = "/", pid: int | None = None) -> tuple[Topology, tuple[str, ...]]:
    """Like read(), also returning every relative path that was read or probed (what a snapshot must copy).
    `sysroot` may also be a snapshot archive (.tar, .tar.gz, .tgz) as written by `topology snapshot`."""
    if Path(sysroot).is_file():
        with opened(sysroot) as tmp:
            topo, seen = read_with_sources(tmp, pid)
            return replace(topo, source=str(sysroot)), seen
    root = Path(sysroot)
    proc = procfs.proc_dir(pid)
    if not (root / CPU_DIR).is_dir() and not (root / "proc/cpuinfo").is_file():
        raise TopologyError("not a sysroot: neither sys/devices/system/cpu nor proc/cpuinfo exists", path=str(root),
                            hint="make one with `deploykit topology snapshot DIR` on the machine to describe")
    r = Reader(root)
    online = r.cpus(f"{CPU_DIR}/online")
    if online is None:
        online = tuple(int(m) for m in re.findall(r"^processor\s*:\s*(\d+)", r.text("proc/cpuinfo") or "", re.M))
    if not online:
        raise TopologyError("no online CPUs found", path=f"{root / CPU_DIR}/online")
    present = r.cpus(f"{CPU_DIR}/present") or online
    offline = tuple(sorted((set(present) | set(r.cpus(f"{CPU_DIR}/offline") or ())) - set(online)))

    nodes = _nodes(r, online)
    node_of = {c: n.id for n in nodes for c in n.cpus}
    on = set(online)
    raw = []
    for cid in online:
        base = f"{CPU_DIR}/cpu{cid}/topology"
        socket = max(r.int(f"{base}/physical_package_id", 0), 0)
        siblings = r.cpus(f"{base}/thread_siblings_list")
        raw.append((cid, socket, siblings, None if siblings else r.int(f"{base}/core_id", -1)))
    by_core_id: dict[tuple[int, int], list[int]] = {}
    for cid, socket, siblings, core_id in raw:
        if not siblings and core_id is not None and core_id >= 0:
            by_core_id.setdefault((socket, core_id), []).append(cid)
    cpus = []
    for cid, socket, siblings, core_id in raw:
        if siblings:
            core = tuple(s for s in siblings if s in on) or (cid,)
        else:  # old kernels / partial snapshots: siblings are the CPUs sharing (socket, core_id)
            core = tuple(by_core_id.get((socket, core_id if core_id is not None else -1), [cid]))
        cpus.append(Cpu(cid, socket, node_of.get(cid, nodes[0].id), core))
    l3 = _l3_groups(r, online)
    if l3:
        group_of = {c: g.id for g in l3 for c in g.cpus}
        cpus = [replace(c, l3=group_of[c.id]) for c in cpus]

    allowed = set(online)
    status = procfs.status_fields(r.text(f"{proc}/status") or "")
    affinity = procfs.status_list(status, "Cpus_allowed_list")
    if affinity is not None:
        allowed &= set(affinity)
    cg = cgroups.limits(r, proc)
    if cg.cpus is not None:
        allowed &= set(cg.cpus)
    mems = {n.id for n in nodes if n.memory_bytes > 0}
    mems_allowed = procfs.status_list(status, "Mems_allowed_list")
    if mems_allowed is not None:
        mems &= set(mems_allowed)
    if cg.mems is not None:
        mems &= set(cg.mems)
    if not allowed:
        raise TopologyError("this process may run on no online CPU (cpuset and affinity do not intersect the "
                            "online CPUs)", path=str(root))

    cpuinfo = r.text("proc/cpuinfo") or ""
    flags = _isa.flags_in(cpuinfo)
    topo = Topology(cpus=tuple(cpus), offline=offline, nodes=nodes, allowed_cpus=tuple(sorted(allowed)),
                    allowed_mems=tuple(sorted(mems)), quota_cpus=cg.quota_cpus, memory_limit_bytes=cg.memory_bytes,
                    isa=tuple(f for f in _isa.OF_INTEREST if f in flags), cpu_model=_isa.model_in(cpuinfo),
                    source=str(root), cpuset=tuple(c for c in cg.cpus if c in on) if cg.cpus is not None else None,
                    l3_groups=l3)
    return topo, tuple(sorted(r.seen))


L3_MISSING = ("no L3 cache information (/sys/devices/system/cpu/cpuN/cache/index*/ is missing or inconsistent): "
              "L3 groups are unknown")


def _l3_groups(r: Reader, online: tuple[int, ...]) -> tuple[CacheGroup, ...]:
    """Each online CPU's level-3 cache from cpuN/cache/index*/{level,shared_cpu_list,id,size}. () unless every
    online CPU names one and the CPU lists partition the online CPUs (a partial snapshot must not half-plan)."""
    on = set(online)
    found: dict[tuple[int, ...], tuple[int | None, int]] = {}
    member: dict[int, tuple[int, ...]] = {}
    for cid in online:
        base = f"{CPU_DIR}/cpu{cid}/cache"
        for index in r.listdir(base, prefix="index"):
            if (r.text(f"{base}/{index}/level") or "").strip() != "3":
                continue
            shared = tuple(c for c in (r.cpus(f"{base}/{index}/shared_cpu_list") or (cid,)) if c in on)
            cache_id = r.int(f"{base}/{index}/id", -1)
            found.setdefault(shared, (cache_id if cache_id >= 0 else None, _size(r.text(f"{base}/{index}/size"))))
            member[cid] = shared
            break
    if not member or set(member) != on or any(cid not in shared for cid, shared in member.items()):
        return ()
    if sum(len(s) for s in found) != len(on):  # overlapping lists: the files contradict each other
        return ()
    ordered = sorted(found, key=min)
    ids = [found[s][0] for s in ordered]
    named = None not in ids and len(set(ids)) == len(ids)
    return tuple(CacheGroup(ids[i] if named else i, s, found[s][1]) for i, s in enumerate(ordered))  # type: ignore


def _size(text: str | None) -> int:
    """sysfs cache sizes: "32768K", "1M"; 0 when absent."""
    m = re.match(r"\s*(\d+)\s*([KMG]?)", text or "")
    return int(m.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[m.group(2)] if m else 0


def _extract(archive: Path, dest: Path) -> None:
    try:
        with tarfile.open(archive) as tar:
            # Regular files and directories with plain relative names only: no links, devices or "..".
            members = [m for m in tar.getmembers() if (m.isfile() or m.isdir()) and not m.name.startswith("/")
                       and ".." not in m.name.split("/")]
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12 / 3.11.4
            tar.extractall(dest, members=members, **kw)
    except (tarfile.TarError, OSError) as e:
        raise TopologyError(f"cannot read snapshot archive: {e}", path=str(archive),
                            hint="pass a directory or a .tar.gz written by `deploykit topology snapshot`") from None


def _nodes(r: Reader, online: tuple[int, ...]) -> tuple[Node, ...]:
    total = _kib(r.text("proc/meminfo"), "MemTotal") or 0
    ids = r.cpus(f"{NODE_DIR}/online")
    if ids is None:  # no NUMA support compiled in, or a snapshot without it: one node with everything
        return (Node(0, online, total),)
    nodes = []
    for nid in ids:
        cpus = tuple(c for c in (r.cpus(f"{NODE_DIR}/node{nid}/cpulist") or ()) if c in set(online))
        mem = _kib(r.text(f"{NODE_DIR}/node{nid}/meminfo"), f"Node {nid} MemTotal") or 0
        nodes.append(Node(nid, cpus, mem, _distances(r.text(f"{NODE_DIR}/node{nid}/distance"))))
    with_mem = [n for n in nodes if n.memory_bytes]
    if len(with_mem) == 1 and total:
        # One memory node owns all memory; some VMs (hot-plugged memory) under-report it in nodeN/meminfo.
        nodes = [Node(n.id, n.cpus, max(n.memory_bytes, total), n.distances) if n in with_mem else n for n in nodes]
    elif not with_mem and total:
        # No per-node meminfo at all (a trimmed snapshot): an equal share of MemTotal per node, memory-only nodes
        # included, rather than MemTotal once per node (which would let KV auto-sizing overcommit N times).
        share = total // len(nodes)
        nodes = [Node(n.id, n.cpus, share, n.distances) for n in nodes]
    orphans = set(online) - {c for n in nodes for c in n.cpus}
    if orphans and nodes:  # CPUs no node claims (odd firmware): attach to the first node rather than lose them
        first = nodes[0]
        nodes[0] = Node(first.id, tuple(sorted(set(first.cpus) | orphans)), first.memory_bytes, first.distances)
    return tuple(nodes)


def _distances(text: str | None) -> tuple[int, ...]:
    """A SLIT row ("10 21 ..."); () when absent or unreadable, and the planner falls back to node ids."""
    try:
        return tuple(int(x) for x in (text or "").split())
    except ValueError:
        return ()


def _kib(text: str | None, key: str) -> int | None:
    m = re.search(rf"^{re.escape(key)}:\s*(\d+)\s*kB", text or "", re.M)
    return int(m.group(1)) * 1024 if m else None
