"""Turn the spec's `hardware` section (auto | {sysroot} | inline description) into a Topology."""

from __future__ import annotations

from pathlib import Path

from . import isa, topology
from .errors import TopologyError
from .spec import InlineHardware, Spec, SysrootHardware
from .topology import Cpu, Node, Topology


def resolve(spec: Spec, sysroot: str | Path | None = None) -> Topology:
    """`sysroot` from the command line overrides the spec's hardware section."""
    if sysroot is not None:
        return topology.read(sysroot)
    hw = spec.hardware
    if isinstance(hw, SysrootHardware):
        if not Path(hw.sysroot).exists():
            raise TopologyError("sysroot does not exist", path="hardware.sysroot", value=hw.sysroot,
                                hint="make one with `deploykit topology snapshot DIR` on the target machine")
        return topology.read(hw.sysroot)
    if isinstance(hw, InlineHardware):
        return from_inline(hw)
    return topology.read("/")


def from_inline(hw: InlineHardware) -> Topology:
    """Sockets come from each node's `socket` (default: one socket per CPU-bearing node, in order)."""
    all_cpus = sorted(c for n in hw.numa_nodes for c in n.cpus)
    tpc = hw.threads_per_core
    ncores = len(all_cpus) // tpc
    order = {c: i for i, c in enumerate(all_cpus)}

    def core_of(cid: int) -> tuple[int, ...]:
        if tpc == 1:
            return (cid,)
        i = order[cid]
        if hw.sibling_numbering == "adjacent":
            start = i - i % tpc
            return tuple(all_cpus[start:start + tpc])
        k = i % ncores
        return tuple(all_cpus[k + j * ncores] for j in range(tpc))

    cpus: list[Cpu] = []
    nodes: list[Node] = []
    socket_seq = 0
    for n in sorted(hw.numa_nodes, key=lambda n: n.id):
        socket = n.socket if n.socket is not None else socket_seq
        if n.cpus and n.socket is None:
            socket_seq += 1
        nodes.append(Node(n.id, tuple(sorted(n.cpus)), n.memory))
        cpus += [Cpu(c, socket, n.id, core_of(c)) for c in n.cpus]
    for c in cpus:
        node = {x.node for x in cpus if x.id in c.core}
        if len(node) > 1:
            raise TopologyError(f"SMT siblings {c.core} fall in different NUMA nodes {sorted(node)}",
                                path="hardware.sibling_numbering", value=hw.sibling_numbering,
                                hint="check threads_per_core and sibling_numbering against `lscpu -e`")
    return Topology(cpus=tuple(sorted(cpus, key=lambda c: c.id)), offline=(), nodes=tuple(nodes),
                    allowed_cpus=tuple(all_cpus), allowed_mems=tuple(n.id for n in nodes if n.memory_bytes),
                    quota_cpus=None, memory_limit_bytes=None, isa=tuple(f for f in isa.OF_INTEREST if f in hw.isa), cpu_model="",
                    source="inline")
