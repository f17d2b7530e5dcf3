"""Topology must read real Linux layouts correctly: siblings, nodes, cpusets, quotas, offline and CXL nodes."""

import pytest

from deploykit import snapshot, topology
from deploykit.errors import TopologyError
from deploykit.placement import physical_cores

GiB = 1024**3


def test_epyc_siblings_are_192_apart_and_nodes_split_by_socket(sysroots):
    t = topology.read(sysroots["epyc-2s-nps1"])
    assert len(t.cpus) == 384 and t.sockets == (0, 1) and t.threads_per_core == 2
    assert t.cpu(5).core == (5, 197) and t.cpu(197).core == (5, 197)
    assert t.node(0).cpus == tuple(range(0, 96)) + tuple(range(192, 288))
    assert t.node(1).memory_bytes == 768 * GiB
    assert t.isa_tier == "avx512_bf16" and t.has_bf16
    assert t.quota_cpus is None and t.allowed_cpus == tuple(range(384))


def test_nps4_gives_four_nodes_per_socket(sysroots):
    t = topology.read(sysroots["epyc-2s-nps4"])
    assert [n.id for n in t.nodes] == list(range(8))
    assert t.node(5).cpus == tuple(range(120, 144)) + tuple(range(312, 336))
    assert {t.cpu(c).socket for c in t.node(5).cpus} == {1}
    assert t.node(0).distances[:5] == (10, 12, 12, 12, 32)


def test_roundrobin_numbering_puts_even_cpus_on_socket_0(sysroots):
    t = topology.read(sysroots["roundrobin-2s"])
    assert t.node(0).cpus == tuple(range(0, 32, 2))
    assert t.cpu(2).core == (2, 18) and t.cpu(3).socket == 1
    assert physical_cores(t, t.node(1).cpus)[:2] == [(1, 17), (3, 19)]


def test_adjacent_siblings_without_node_directory_is_one_node(sysroots):
    t = topology.read(sysroots["desktop-adjacent"])
    assert [n.id for n in t.nodes] == [0] and t.node(0).cpus == tuple(range(16))
    assert t.node(0).memory_bytes == 32 * GiB  # from /proc/meminfo
    assert t.cpu(6).core == (6, 7) and t.isa_tier == "avx2"


def test_cgroup_v1_cpuset_and_quota_inside_a_container(sysroots):
    t = topology.read(sysroots["epyc-container-8c"])
    assert t.allowed_cpus == tuple(range(8, 16)) + tuple(range(200, 208))
    assert t.allowed_mems == (0,) and t.quota_cpus == 8.0


def test_cgroup_v2_quota(sysroots):
    t = topology.read(sysroots["quota4-in-16"])
    assert t.allowed_cpus == tuple(range(16)) and t.quota_cpus == 4.0


@pytest.mark.parametrize("machine,stat,key,unit", [("quota4-in-16", "sys/fs/cgroup/cpu.stat", "throttled_usec", 1e6),
                                                    ("epyc-container-8c", "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.stat",
                                                     "throttled_time", 1e9)])
def test_throttling_counters_of_the_cgroup_whose_quota_applies(sysroots, tmp_path, machine, stat, key, unit):
    """doctor samples cpu.stat before and after its window: the difference is the throttling during it (v2 counts
    microseconds, v1 nanoseconds)."""
    import shutil

    from deploykit import cgroups
    root = shutil.copytree(sysroots[machine], tmp_path / "root", symlinks=True)
    (root / stat).parent.mkdir(parents=True, exist_ok=True)
    if machine == "epyc-container-8c":  # the quota must sit where the process's cgroup path points
        (root / stat).with_name("cpu.cfs_quota_us").write_text("800000\n")
    (root / stat).write_text(f"nr_periods 100\nnr_throttled 10\n{key} {int(0.5 * unit)}\n")
    before = cgroups.throttling(root)
    (root / stat).write_text(f"nr_periods 150\nnr_throttled 40\n{key} {int(2.0 * unit)}\n")
    during = cgroups.throttling(root) - before
    assert (before.periods, before.throttled, before.seconds) == (100, 10, 0.5)
    assert (during.periods, during.throttled, during.seconds) == (50, 30, 1.5)
    assert cgroups.throttling(sysroots["epyc-2s-nps1"]) is None  # no quota: nothing to measure


def test_offline_cpus_and_memory_only_node(sysroots):
    t = topology.read(sysroots["cxl-offline"])
    assert t.offline == (15, 31)
    assert 15 not in {c.id for c in t.cpus} and 15 not in t.node(0).cpus
    assert t.node(1).cpus == () and t.node(1).memory_bytes == 256 * GiB
    assert t.allowed_mems == (0, 1)


def test_sibling_list_missing_falls_back_to_core_id(tmp_path, sysroots):
    import shutil
    root = tmp_path / "s"
    shutil.copytree(sysroots["desktop-adjacent"], root)
    for f in root.glob("sys/devices/system/cpu/cpu*/topology/thread_siblings_list"):
        f.unlink()
    t = topology.read(root)
    assert t.cpu(0).core == (0, 1) and t.cpu(15).core == (14, 15)


@pytest.mark.parametrize("dest", ["snap", "snap.tar.gz"])
@pytest.mark.slow
def test_snapshot_round_trip_reads_the_same(tmp_path, sysroots, dest):
    src = sysroots["epyc-container-8c"]
    written = snapshot.take(tmp_path / dest, src)
    assert "proc/self/status" in written and "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us" in written
    a, b = topology.read(src), topology.read(tmp_path / dest)
    assert a.cpus == b.cpus and a.nodes == b.nodes and a.allowed_cpus == b.allowed_cpus
    assert a.quota_cpus == b.quota_cpus and a.isa == b.isa


def test_snapshot_archive_is_deterministic_and_refuses_to_overwrite(tmp_path, sysroots):
    snapshot.take(tmp_path / "a.tar.gz", sysroots["two-cpu"])
    snapshot.take(tmp_path / "b.tar.gz", sysroots["two-cpu"])
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
    with pytest.raises(Exception, match="already exists"):
        snapshot.take(tmp_path / "a.tar.gz", sysroots["two-cpu"])


def test_live_host_reads_and_snapshots(tmp_path):
    t = topology.read("/")
    assert t.cpus and set(t.allowed_cpus) <= {c.id for c in t.cpus}
    snapshot.take(tmp_path / "live", "/")
    assert topology.read(tmp_path / "live").cpus == t.cpus


def test_not_a_sysroot_is_a_clear_error(tmp_path):
    with pytest.raises(TopologyError, match="not a sysroot"):
        topology.read(tmp_path)
    (tmp_path / "x.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(TopologyError, match="archive"):
        topology.read(tmp_path / "x.tar.gz")


def test_cpu_flags_and_tiers_have_one_reader(tmp_path):
    """The topology reader, the engine's dtype choice and the kernel loader all read flags through deploykit.isa."""
    from deploykit import isa
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\n")
    assert isa.cpu_flags(info) == frozenset({"fpu", "avx512f", "avx512_bf16", "amx_tile"})
    assert isa.cpu_flags(tmp_path / "absent") == frozenset()
    assert isa.tier({"amx_tile", "amx_bf16", "avx512_bf16"}) == "amx" and isa.has_bf16({"avx512_bf16"})
    assert isa.tier({"avx512f", "avx512bw", "avx512vl"}) == "avx512" and not isa.has_bf16({"avx512f"})
    assert isa.tier({"avx2"}) == "avx2" and isa.tier(set()) == "baseline"
