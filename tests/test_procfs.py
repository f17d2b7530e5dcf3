"""/proc and cgroup parsing, one reader: against this test process's real /proc and against fake trees."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from deploykit import cgroups, procfs
from deploykit import process
from deploykit.procfs import Reader
from tests.sysroots import write_process

TRICKY = "a) (b c"  # a comm may hold ") (": stat's fields start after the LAST ')'


def test_stat_of_this_process_matches_what_the_os_says():
    me = procfs.read_stat()
    assert (me.pid, me.ppid, me.state) == (os.getpid(), os.getppid(), "R")  # reading its own stat, it runs
    assert me.processor in os.sched_getaffinity(0)
    assert me.start_time > 0 and procfs.read_stat(os.getpid()).start_time == me.start_time  # the pid's identity
    assert me.utime + me.stime >= 0 and me.comm == procfs.read_status()["Name"]


def test_status_threads_and_maps_of_this_process():
    status = procfs.read_status()
    assert status["Pid"] == str(os.getpid())
    assert procfs.status_list(status, "Cpus_allowed_list") == tuple(sorted(os.sched_getaffinity(0)))
    assert procfs.status_list(status, "Missing_list") is None
    ready, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker():
        tid.append(threading.get_native_id())
        ready.set()
        stop.wait()

    t = threading.Thread(target=worker, name="procfs-test")
    t.start()
    try:
        ready.wait(10)
        assert os.getpid() in procfs.tids() and tid[0] in procfs.tids()
        with open(f"/proc/self/task/{tid[0]}/comm", "w") as f:  # a process may rename its own threads
            f.write(TRICKY)
        st = procfs.read_stat(tid=tid[0])
        assert (st.pid, st.comm, st.ppid) == (tid[0], TRICKY, os.getppid())  # the kernel's own ") (" line
        assert procfs.read_status(tid=tid[0])["Name"] == TRICKY
    finally:
        stop.set()
        t.join()
    files = procfs.read_mapped_files()
    assert os.path.realpath(sys.executable) in files and len(files) == len(set(files))


def test_what_the_benchmarks_read_of_a_process():
    """CPU time, resident memory and children: how benchmarks/ split the engine's CPU use and memory."""
    me = procfs.read_stat()
    spin = time.process_time() + 0.3
    while time.process_time() < spin:
        pass
    assert 0.2 <= procfs.read_stat().cpu_seconds - me.cpu_seconds < 5  # seconds: clock ticks would be ~100x more
    status = procfs.read_status()
    assert 10 * 2**20 < procfs.status_bytes(status, "VmRSS") == int(status["VmRSS"].split()[0]) * 1024
    assert procfs.status_bytes(status, "Name") is None and procfs.status_bytes(status, "Missing") is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in procfs.children() and procfs.children(os.getpid()) == procfs.children()
    finally:
        child.kill()
        child.wait()
    assert child.pid not in procfs.children()


def test_group_cpu_seconds_counts_every_process_of_a_group_and_no_other():
    """How benchmarks/serving.py charges an idle server (a session of its own, workers included) for the CPU it takes
    while another server is measured: a group whose child spins, against the group this test runs in."""
    spin = "import time; t = time.process_time() + 0.4\nwhile time.process_time() < t: pass\ntime.sleep(30)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {spin!r}]); time.sleep(30)"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while procfs.group_cpu_seconds(leader.pid) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        used = procfs.group_cpu_seconds(leader.pid)
        assert 0.4 <= used < 3  # the child's spin (and both interpreters' start-up), counted in the leader's group
        (child,) = procfs.children(leader.pid)
        assert procfs.read_stat(child).pgrp == leader.pid != os.getpgrp()  # its group, not this test's
        assert procfs.group_cpu_seconds(2**22 + 7) == 0.0  # no such group
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


def test_busy_seconds_leaves_idle_iowait_and_guest_out():
    tck = procfs.CLK_TCK
    text = ("cpu  99 99 99 99 99 99 99 99 99 99\n"
            "cpu0 10 1 2 1000 50 3 4 6 700 80\n"  # user nice system idle iowait irq softirq steal guest guest_nice
            "cpu1 20 0 0 2000 0 0 0 0 0 0\nintr 5 6\n")
    assert procfs.busy_seconds([0], text) == pytest.approx(26 / tck)
    assert procfs.busy_seconds((0, 1), text) == pytest.approx(46 / tck)
    with pytest.raises(KeyError):
        procfs.busy_seconds([7], text)  # a CPU the kernel does not list is a caller's mistake, not zero
    cpus = sorted(os.sched_getaffinity(0))
    before, spin = procfs.busy_seconds(cpus), time.process_time() + 0.3
    while time.process_time() < spin:
        pass
    assert procfs.busy_seconds(cpus) - before >= 0.2


def test_stat_splits_at_the_last_parenthesis(tmp_path):
    base = write_process(tmp_path, 4242, comm=TRICKY, ppid=7, pgrp=4240, state="Z", utime=5, stime=6,
                         start_time=123456, processor=3)
    st = procfs.read_stat(4242, tmp_path)
    assert st == procfs.Stat(pid=4242, comm=TRICKY, state="Z", ppid=7, pgrp=4240, utime=5, stime=6,
                             start_time=123456, processor=3)
    assert procfs.parse_stat((base / "stat").read_text()) == st
    with pytest.raises(ValueError, match="not a /proc stat line"):
        procfs.parse_stat("4242 (truncated")


def test_doctor_reads_a_process_with_a_tricky_comm(tmp_path):
    write_process(tmp_path, 4242, comm=TRICKY, ppid=7, cpus="0-3", processor=2, utime=100, stime=100,
                  maps=("/usr/lib/libgomp.so.1", "/opt/torch/lib/libgomp-a34b3233.so.1", "/usr/lib/libgomp.so.1",
                        "/usr/lib/libtcmalloc_minimal.so.4"),
                  threads=((4243, "x) (y", "1"),))
    write_process(tmp_path, 4300, comm="child", ppid=4242)
    p = process.read(4242, tmp_path)
    assert (p.ppid, p.name) == (7, TRICKY)
    assert [(t.tid, t.name, t.allowed, t.last_cpu) for t in p.threads] == \
        [(4242, TRICKY, (0, 1, 2, 3), 2), (4243, "x) (y", (1,), 2)]
    assert p.threads[0].cpu_ns == int(200 * 1e9 / os.sysconf("SC_CLK_TCK"))  # no schedstat: utime + stime ticks
    assert p.libraries == ("/usr/lib/libgomp.so.1", "/opt/torch/lib/libgomp-a34b3233.so.1",
                           "/usr/lib/libtcmalloc_minimal.so.4")
    assert procfs.omp_runtimes(p.libraries) == ("/opt/torch/lib/libgomp-a34b3233.so.1", "/usr/lib/libgomp.so.1")
    assert process.tree(4242, tmp_path) == [4242, 4300]


@pytest.mark.parametrize(("path", "omp", "malloc"), [
    ("/usr/lib/x86_64-linux-gnu/libgomp.so.1", True, False),
    ("torch/lib/libgomp-a34b3233.so.1", True, False),
    ("/opt/intel/lib/libiomp5.so", True, False),
    ("/usr/lib/llvm-17/lib/libomp.so.5", True, False),
    ("libtcmalloc_minimal.so.4", False, True),
    ("/usr/lib/libjemalloc.so.2", False, True),
    ("/usr/lib/libgomp.so.1.d/notes.txt", False, False),
    ("/usr/lib/libgompish.a", False, False),
])
def test_runtime_and_allocator_patterns(path, omp, malloc):
    assert bool(procfs.OMP_RUNTIME.search(path)) is omp and bool(procfs.FAST_MALLOC.search(path)) is malloc


def test_cgroup_limits_v1_and_v2(sysroots):
    assert cgroups.limits(Reader(sysroots["epyc-container-8c"])) == cgroups.Limits(
        cpus=tuple(range(8, 16)) + tuple(range(200, 208)), mems=(0,), quota_cpus=8.0, memory_bytes=None)
    assert cgroups.limits(Reader(sysroots["quota4-in-16"])) == cgroups.Limits(
        cpus=tuple(range(16)), mems=(0,), quota_cpus=4.0, memory_bytes=None)
