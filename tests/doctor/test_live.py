"""`deploykit doctor --pid`: live processes with deliberately broken set-ups, each found and named with its fix.

The workload is PyTorch's real OpenMP pool (tests/doctor/workload.py); cgroups are real (created as root). Heavy:
run under the heavy-job lock.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploykit import errors
from tests.doctor.cgroups import Cgroup

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = Path(__file__).with_name("workload.py")
LIBOMP = Path("/usr/lib/x86_64-linux-gnu/libomp.so.5")  # Debian's libomp5: LLVM's OpenMP runtime
# slow: each test samples a live OpenMP workload for seconds, and needs both CPUs to itself (not the fast lane)
pytestmark = [pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs"), pytest.mark.slow]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMP_", "GOMP_", "KMP_", "DEPLOYKIT_")) and k != "LD_PRELOAD"}
    return {**env, **extra}


class Workload:
    def __init__(self, *args: str, env: dict, wrap=lambda cmd: cmd):
        self.proc = subprocess.Popen(wrap([sys.executable, str(WORKLOAD), *args]), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"workload did not start (exit {self.proc.poll()})"
        time.sleep(0.5)  # the pool is spinning

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def doctor(pid: int, *, user: int | None = None) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "deploykit.cli", "doctor", "--pid", str(pid), "--seconds", "2", "--format", "json"]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout), r.stderr


def finding(rep: dict, fid: str) -> dict:
    (f,) = [f for s in rep["sections"] for f in s["findings"] if f["id"] == fid]
    return f


def fails(rep: dict) -> set[str]:
    return {f["id"] for s in rep["sections"] for f in s["findings"] if f["level"] == "fail"}


def test_container_wide_gomp_affinity_puts_the_worker_on_one_cpu():
    """The 'two threads busy' report: GOMP_CPU_AFFINITY set for everything narrows the front end to CPU 0 when it
    loads libgomp; the worker it starts inherits CPU 0, so its whole OpenMP team takes turns on one CPU."""
    w = Workload("--launcher", env=clean_env(GOMP_CPU_AFFINITY="0-1", OMP_NUM_THREADS="2"))
    try:
        code, rep, _ = doctor(w.proc.pid)
    finally:
        w.close()
    assert code == errors.EXIT_CODES[errors.Unhealthy]
    f = finding(rep, "threads.stacked")
    assert f["level"] == "fail" and f["title"].startswith("3 threads allowed only CPU 0, 2 of them working")  # + the front end
    assert "GOMP_CPU_AFFINITY=0-1" in f["cause"] and "whole process tree" in f["cause"]
    assert f["fix"][0].startswith("remove GOMP_CPU_AFFINITY from the container's environment")
    busy = finding(rep, "threads.busy")
    assert busy["level"] == "fail" and "on 1 CPU(s) 0" in busy["title"]
    assert len(rep["data"]["processes"]) == 2  # the launcher and its worker


def test_omp_num_threads_above_the_cpuset():
    cg = Cgroup(cpus="0")
    w = Workload(env=clean_env(OMP_NUM_THREADS="4"), wrap=cg.wrap)
    try:
        code, rep, _ = doctor(w.proc.pid)
    finally:
        w.close()
        cg.close()
    assert code == 9
    f = finding(rep, "openmp.threads")
    assert f["level"] == "fail" and f["title"].startswith("OMP_NUM_THREADS=4 but only 1 CPUs are allowed")
    assert "OMP_NUM_THREADS=1" in f["fix"][0]
    over = finding(rep, "threads.oversubscribed")
    assert over["level"] == "fail" and " threads on CPU(s) 0 spent " in over["title"]


def test_two_openmp_runtimes_loaded():
    if not LIBOMP.exists():
        pytest.skip(f"{LIBOMP} missing (scripts/test installs Debian's libomp5)")
    w = Workload(env=clean_env(OMP_NUM_THREADS="2", LD_PRELOAD=str(LIBOMP)))
    try:
        code, rep, _ = doctor(w.proc.pid)
    finally:
        w.close()
    assert code == 9
    f = finding(rep, "openmp.runtimes")
    assert f["level"] == "fail" and f["title"].startswith("libgomp and libomp both mapped in pid")
    assert any(e.endswith("libomp.so.5") for e in f["evidence"]) and any("libgomp" in e for e in f["evidence"])
    assert f["fix"] == [f"remove {LIBOMP} from LD_PRELOAD"]


def test_quota_below_the_cpuset_is_measured_as_throttling():
    cg = Cgroup(quota=0.5)
    w = Workload(env=clean_env(OMP_NUM_THREADS="2"), wrap=cg.wrap)
    try:
        code, rep, _ = doctor(w.proc.pid)
    finally:
        w.close()
        cg.close()
    assert code == 9
    f = finding(rep, "cpu.throttled")
    assert f["level"] == "fail" and f["title"].startswith("the CFS quota of 0.5 CPUs throttled the process in")
    assert "while the cpuset has 2 CPUs" in f["title"]
    assert any("--cpuset-cpus" in x for x in f["fix"]) and any("OMP_NUM_THREADS=1" in x for x in f["fix"])


def test_a_sound_process_has_nothing_critical():
    """The control: two unpinned threads on two CPUs, one runtime, no quota."""
    env = clean_env(OMP_NUM_THREADS="2")
    tcmalloc = shutil.which("ldconfig") and next(
        (p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if Path(p).exists()), None)
    if tcmalloc:
        env["LD_PRELOAD"] = tcmalloc
    w = Workload(env=env)
    try:
        code, rep, _ = doctor(w.proc.pid)
    finally:
        w.close()
    assert fails(rep) == set() and code == 0, rep
    assert finding(rep, "threads.busy")["title"].startswith("2 of ")


def test_neighbours_on_the_same_cpus_are_not_the_process_s_fault():
    """Two OpenMP threads on two CPUs is sound; two other busy processes on the same CPUs make them wait. doctor
    says the CPUs are shared (a warning: isolate the deployment), not that the process has too many threads."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    w = Workload(env=clean_env(OMP_NUM_THREADS="2"))
    try:
        code, rep, _ = doctor(w.proc.pid)
    finally:
        w.close()
        for sp in spinners:
            sp.kill()
            sp.wait()
    over = finding(rep, "threads.oversubscribed")
    assert over["level"] == "warn" and over["title"].endswith(": other processes ran on them"), over
    assert "threads.oversubscribed" not in fails(rep) and code == 0, rep


def test_another_users_process_is_a_clear_partial_report():
    """As an unprivileged user, a root process's environ, maps and numa_maps are private: doctor says so and
    judges what it can read (the threads)."""
    w = Workload(env=clean_env(OMP_NUM_THREADS="2"))
    try:
        code, rep, err = doctor(w.proc.pid, user=65534)
    finally:
        w.close()
    f = finding(rep, "access.partial")
    assert f["level"] == "info" and "environ" in f["title"] and "maps" in f["title"]
    assert f["fix"] == [f"run doctor as uid 0 or as root (sudo deploykit doctor --pid {w.proc.pid})"]
    assert finding(rep, "threads.busy")["title"].startswith("2 of ")
    assert code == 0


def test_missing_process_is_a_message():
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "doctor", "--pid", "999999999"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == errors.EXIT_CODES[errors.TargetError]
    assert "no such process" in r.stderr and "Traceback" not in r.stderr
