"""Binding as the engine process applies it: every OpenMP worker on its own CPU, memory bound, loud but
non-fatal when the kernel refuses (a seccomp profile without the NUMA calls)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import binding
from tests.engine.conftest import NATIVE

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, sys
from engine import binding
{pre}
b = binding.prepare(binding.resolve({mode!r}, mems={mems!r}))
import torch
binding.finish(b)
x = torch.randn(512, 512)
for _ in range(200):
    x = torch.tanh(x @ x)  # enough parallel work for every worker to run on its CPU
print(json.dumps(binding.report(b).to_dict()))
"""
# A real seccomp filter (libseccomp via ctypes) that refuses set_mempolicy with EPERM, as Docker's default
# profile does without CAP_SYS_NICE.
REFUSE = """
import ctypes
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
ctx = ctypes.c_void_p(lib.seccomp_init(0x7fff0000))
for name in (b"set_mempolicy", b"migrate_pages"):
    assert lib.seccomp_rule_add(ctx, 0x00050000 | 1, lib.seccomp_syscall_resolve_name(name), 0) == 0
assert lib.seccomp_load(ctx) == 0
"""


def child(mode=(0, 1), mems=(0,), pre=""):
    code = CHILD.format(pre=pre, mode=mode, mems=mems)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@needs_two_cpus
@pytest.mark.slow
def test_each_openmp_worker_runs_on_its_own_cpu():
    rep, _ = child()
    omp = sorted((t for t in rep["threads"] if t["omp_thread"] is not None), key=lambda t: t["omp_thread"])
    assert [t["allowed_cpus"] for t in omp] == ["0", "1"]
    assert [t["last_cpu"] for t in omp] == [0, 1]
    assert all(t["cpu_seconds"] > 0 for t in omp)
    assert rep["memory_policy"] == {"mode": "bind", "nodes": "0"}
    assert len(rep["openmp_runtimes"]) == 1 and rep["warnings"] == []
    others = [t for t in rep["threads"] if t["omp_thread"] is None]
    assert all(t["allowed_cpus"] == "0-1" for t in others)  # helper threads re-pinned off worker 0's CPU


@needs_two_cpus
@pytest.mark.slow
def test_refused_set_mempolicy_keeps_running_and_names_the_fix():
    rep, err = child(pre=REFUSE)
    assert rep["memory_policy"]["mode"] == "default"
    (w,) = [w for w in rep["warnings"] if "NUMA memory binding" in w]
    assert "refused (EPERM)" in w and "seccomp profile" in w and "no capability" in w
    assert "NUMA memory binding" in err  # logged loudly, not only in the report
    assert [t["allowed_cpus"] for t in rep["threads"] if t["omp_thread"] is not None] == ["0", "1"]


# Decode steps through the fused native step (its own OpenMP region) after binding; CPU time is counted from the
# first decode on, so model loading does not count.
FUSED = """
import json
from engine import binding
b = binding.prepare(binding.resolve((0, 1), mems=(0,)))
import torch
binding.finish(b)
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams
core = EngineCore(EngineConfig({model!r}, dtype="bfloat16"))
assert core.model.step_weights is not None
before = {{t["tid"]: t["cpu_seconds"] for t in binding.report(b).to_dict()["threads"]}}
core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=400, min_tokens=400))
while core.has_unfinished_requests():
    core.step()
rep = binding.report(b).to_dict()
for t in rep["threads"]:
    t["cpu_seconds"] -= before.get(t["tid"], 0.0)
print(json.dumps(rep))
"""


@needs_two_cpus
@pytest.mark.skipif(not NATIVE, reason="no native path here (a CPU without AVX-512, or DEPLOYKIT_KERNELS off)")
@pytest.mark.slow
def test_fused_decode_step_runs_on_the_pinned_workers(tiny_model, native_kernels):
    # ~30 MB of bf16 weights: each step streams them, so both workers get measurable CPU time.
    model = tiny_model("qwen2", hidden=512, layers=4, heads=8, kv_heads=2, intermediate=2048)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    r = subprocess.run([sys.executable, "-c", FUSED.format(model=model)], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    omp = sorted((t for t in rep["threads"] if t["omp_thread"] is not None), key=lambda t: t["omp_thread"])
    assert [(t["allowed_cpus"], t["last_cpu"]) for t in omp] == [("0", 0), ("1", 1)]
    assert omp[1]["cpu_seconds"] >= 0.1, omp  # worker 1 shares the step's work
    # No thread outside the two workers (e.g. a second OpenMP pool) did the work.
    assert all(t["cpu_seconds"] < 0.05 for t in rep["threads"] if t["omp_thread"] is None), rep["threads"]
    assert len(rep["openmp_runtimes"]) == 1


def test_auto_uses_this_process_cpuset():
    b = binding.resolve("auto")
    assert set(b.cpus) <= os.sched_getaffinity(0) and b.threads == len(b.cpus) >= 1
    assert b.mems


def test_explicit_cpus_outside_the_cpuset_are_rejected():
    with pytest.raises(ValueError, match="outside this process's cpuset"):
        binding.resolve((4000,))
    with pytest.raises(ValueError, match="parse CPU-list text"):  # text is parsed at the edges, never here
        binding.resolve("0-1")


@pytest.mark.parametrize("machine, kwargs, cpus, front", [
    # A Guaranteed pod of 4 whole cores (8 CPUs) on the EPYC: 3 OpenMP threads, one per core, front end on the last
    # core with both siblings. The kubelet chose host CPUs 8-11 + siblings 200-203; nothing else tells us that.
    ("pod-4-cores", {}, "8-10", "11,203"),
    ("pod-4-cores", {"use_smt": True}, "8-10,200-202", "11,203"),
    ("pod-4-cores", {"reserved": 0}, "8-11", ""),
    ("pod-4-cores", {"reserved": 2, "threads": 1}, "8", "10-11,202-203"),
    # A CFS quota of 3 CPUs inside a 16-core cpuset (no static CPU manager): 2 threads + the front end's core.
    ("quota3-in-16", {}, "0-1", "15"),
])
def test_auto_applies_the_placement_policy_to_the_cpuset_it_got(tmp_path, machine, kwargs, cpus, front):
    from deploykit import cpulist
    from tests.sysroots import Machine, write
    machines = {"pod-4-cores": Machine(sockets=2, cores_per_socket=96, cpuset="8-11,200-203", mems="0",
                                       quota=(800000, 100000)),
                "quota3-in-16": Machine(sockets=1, cores_per_socket=16, threads_per_core=1, cpuset="0-15",
                                        quota=(300000, 100000))}
    b = binding.resolve("auto", sysroot=str(write(machines[machine], tmp_path)), **kwargs)
    assert (cpulist.format(b.cpus), cpulist.format(b.frontend_cpus), b.threads) == (cpus, front, len(b.cpus))
    assert b.mems == (0,) and b.source == "auto"
