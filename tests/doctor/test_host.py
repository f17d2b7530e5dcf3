"""`deploykit doctor [--sysroot DIR] [SPEC]`: one synthesized machine per problem, each flagged with its fix; a
healthy machine with no ✖ (and no ⚠); the exit code, JSON, snapshots that carry what doctor needs, and a spec's
plan laid over a host it was not made for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploykit import errors, hostsettings, procfs, snapshot
from deploykit.doctor import fixes
from deploykit.doctor.command import examine_host
from deploykit.render import seccomp
from tests.conftest import make_spec
from tests.sysroots import DOCTOR, MACHINES, write

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def machines(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("doctor-sysroots")
    return {name: write(m, base / name) for name, m in {**DOCTOR, **MACHINES}.items()}


def doctor(*args, env=None):
    return subprocess.run([sys.executable, "-m", "deploykit.cli", "doctor", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=env)


def problems(report) -> dict[str, str]:
    return {f.id: f.level for f in report.findings if f.level in ("warn", "fail")}


# fixture -> (finding id, level, text the fix must contain)
CASES = {
    "numa-balancing-on": ("numa.balancing", "warn", "sysctl -w kernel.numa_balancing=0"),
    "thp-never": ("memory.thp", "warn", "transparent_hugepage/enabled"),
    "seccomp-docker-default": ("numa.syscalls", "fail", "--security-opt seccomp=seccomp.json"),
    "seccomp-default-sys-nice": ("numa.syscalls", "warn", "still refuses migrate_pages and move_pages"),
    "seccomp-unprobed": ("numa.syscalls", "warn", "seccompProfile: {type: Localhost"),
    "quota-below-cpuset": ("cpu.quota", "warn", "--cpuset-cpus"),
    "omp-threads-over-cpuset": ("openmp.threads", "fail", "OMP_NUM_THREADS=7 (one per physical core: CPUs 8-14)"),
    "omp-threads-over-quota": ("openmp.threads", "fail", "OMP_NUM_THREADS=3"),
    "omp-threads-unset-in-cpuset": ("openmp.threads", "warn", "OMP_NUM_THREADS=7"),
    "omp-threads-on-smt": ("openmp.threads", "warn", "OMP_NUM_THREADS=191"),
    "gomp-affinity-container": ("openmp.affinity_env", "fail", "remove GOMP_CPU_AFFINITY"),
    "omp-places-container": ("openmp.affinity_env", "fail", "remove OMP_PLACES, OMP_PROC_BIND"),
    "kmp-with-gomp": ("openmp.kmp", "warn", "deploykit doctor --pid"),
    "iomp-preloaded": ("openmp.preload", "warn", "remove /opt/intel/lib/libiomp5.so from LD_PRELOAD"),
    "two-runtimes-preloaded": ("openmp.preload", "fail", "remove libiomp5.so, libgomp.so.1 from LD_PRELOAD"),
    "no-tcmalloc": ("malloc.tcmalloc", "warn", "LD_PRELOAD=libtcmalloc_minimal.so.4"),
    "cpus-offline": ("cpu.offline", "warn", "echo 1 > /sys/devices/system/cpu/cpu95/online"),
    "avx2-only": ("cpu.isa", "warn", ""),
    "amx-not-granted": ("cpu.amx", "warn", "5.16"),
    "vllm-bind-across-nodes": ("vllm.bind", "warn", "one CPU per physical core of one NUMA node"),
}


# Problems a fixture shows besides its own, because they go together.
ALSO = {"omp-threads-over-quota": {"cpu.quota": "warn"}}


def test_every_problem_fixture_has_a_case():
    assert set(CASES) == set(DOCTOR) - {"healthy"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_problem_is_flagged_with_its_fix(machines, name):
    fid, level, fix = CASES[name]
    rep = examine_host(str(machines[name]), None)
    # Exactly this problem: the fixture differs from the healthy machine in one setting.
    assert problems(rep) == {fid: level, **ALSO.get(name, {})}, [(f.id, f.level, f.title) for f in rep.findings if f.level != "ok"]
    found = rep.find(fid)
    assert fix in "\n".join(found.fix), found.fix
    if level == "fail":
        assert found.evidence, "a ✖ names its evidence"


def test_healthy_machine_has_no_problem(machines):
    rep = examine_host(str(machines["healthy"]), None)
    assert problems(rep) == {}
    r = doctor("--sysroot", machines["healthy"])
    assert r.returncode == 0, r.stderr
    assert not [line for line in r.stdout.splitlines() if line.startswith(("  ✖", "  ⚠"))]
    assert "0 ✖: nothing critical" in r.stdout


def test_critical_problem_exits_8_with_json_on_stdout(machines):
    r = doctor("--sysroot", machines["seccomp-docker-default"], "--format", "json")
    assert r.returncode == errors.EXIT_CODES[errors.Unhealthy] == 9
    rep = json.loads(r.stdout)
    assert rep["summary"]["fail"] == 1
    (numa,) = [f for s in rep["sections"] for f in s["findings"] if f["id"] == "numa.syscalls"]
    assert numa["level"] == "fail" and "set_mempolicy EPERM" in " ".join(numa["evidence"])
    assert any(f.startswith("docker run --cap-drop ALL") for f in numa["fix"])
    assert any(f.startswith("compose: security_opt") for f in numa["fix"])
    assert any("Localhost" in f and "seccomp-oci.json" in f for f in numa["fix"])
    assert "critical" in r.stderr and "Traceback" not in r.stderr


def test_text_report_shows_evidence_cause_and_fix(machines):
    r = doctor("--sysroot", machines["gomp-affinity-container"])
    assert r.returncode == 9
    lines = r.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("  ✖ GOMP_CPU_AFFINITY"))
    block = "\n".join(lines[i:i + 12])
    assert "CPU 192" in block and "GOMP_CPU_AFFINITY=192-286" in block
    assert "cause: container-wide OpenMP affinity" in block and "fix: remove GOMP_CPU_AFFINITY" in block


def test_the_fix_follows_the_profile():
    """--cap-add appears in the printed fix exactly when deploykit's profile gates the NUMA calls on a capability."""
    gated = set()
    for rule in seccomp.profile()["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW" and "set_mempolicy" in rule["names"]:
            gated |= set((rule.get("includes") or {}).get("caps") or ())
    docker = fixes.numa_calls(("set_mempolicy",))[0]
    assert ("--cap-add SYS_NICE" in docker) == ("CAP_SYS_NICE" in gated)
    assert "--cap-drop ALL" in docker


def test_write_seccomp_writes_both_forms(tmp_path):
    r = doctor("--write-seccomp", tmp_path / "prof")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "prof/seccomp.json").read_text()) == seccomp.profile()
    oci = json.loads((tmp_path / "prof/seccomp-oci.json").read_text())
    assert "archMap" not in oci and "architectures" in oci
    assert {"set_mempolicy", "migrate_pages"} <= seccomp.allowed(oci)


def test_snapshot_carries_what_doctor_reads(tmp_path, machines):
    for name in ("gomp-affinity-container", "seccomp-docker-default", "numa-balancing-on", "thp-never"):
        snap = tmp_path / f"{name}.tar.gz"
        snapshot.take(snap, machines[name])
        assert problems(examine_host(str(snap), None)) == problems(examine_host(str(machines[name]), None))


def test_live_snapshot_records_the_probes_and_no_secrets(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "3", "DEPLOYKIT_API_KEY": "sk-secret", "HF_TOKEN": "hf_secret"}
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "topology", "snapshot", str(tmp_path / "snap")],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    environ = (tmp_path / "snap/proc/self/environ").read_bytes()
    assert b"OMP_NUM_THREADS=3\0" in environ and b"secret" not in environ
    probe = json.loads((tmp_path / "snap" / hostsettings.PROBE_FILE).read_text())
    assert set(probe["numa_calls"]) == set(fixes.NUMA_CALLS)
    status = (tmp_path / "snap/proc/self/status").read_text()
    assert "Seccomp:" in status and "CapEff:" in status
    rep = examine_host(str(tmp_path / "snap"), None)
    assert rep.find("openmp.threads").title.startswith("OMP_NUM_THREADS=3 ")


def test_live_host_probes_its_own_numa_calls():
    """This process is unfiltered here (CI runs as root without seccomp): the live probe must say allowed."""
    status = procfs.read_status()
    if status.get("Seccomp") != "0":
        pytest.skip("this test process runs under a seccomp filter")
    rep = examine_host(None, None)
    assert rep.find("numa.syscalls").level == "ok"
    assert "probe on this process's own memory: get_mempolicy ok" in " ".join(rep.find("numa.syscalls").evidence)


def test_container_wide_affinity_in_this_shell_is_critical():
    env = {**os.environ, "GOMP_CPU_AFFINITY": "0-1"}
    r = doctor("--format", "json", env=env)
    assert r.returncode == 9, r.stderr
    rep = json.loads(r.stdout)
    (f,) = [f for s in rep["sections"] for f in s["findings"] if f["id"] == "openmp.affinity_env"]
    assert f["level"] == "fail" and "CPU 0" in f["title"]


def write_spec(tmp_path, **sections) -> Path:
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(make_spec(**sections)))
    return f


def test_spec_plan_fits_the_host(tmp_path, machines):
    rep = examine_host(str(machines["healthy"]), str(write_spec(tmp_path)))
    assert rep.find("plan.place").level == "ok" and rep.find("plan.memory").level == "ok"
    assert "qwen-0" in rep.find("plan.place").title and "qwen-1" in rep.find("plan.place").title
    cores = rep.find("plan.cores")
    assert cores.level == "ok" and cores.title == "2 replica(s), 190 OpenMP threads: 192 of the 192 physical cores " \
        "allowed here"


def test_spec_made_for_other_hardware_does_not_fit(tmp_path, machines):
    """Rendered for the 2x EPYC (a snapshot), run on a 2-CPU host: the replicas' CPUs do not exist here."""
    spec = write_spec(tmp_path, hardware={"sysroot": str(machines["epyc-2s-nps1"])})
    rep = examine_host(str(machines["two-cpu"]), str(spec))
    assert rep.find("plan.cpus").level == "fail" and "qwen-0 wants CPUs" in rep.find("plan.cpus").title
    assert rep.find("plan.memory").level == "fail"  # 2x 768 GiB nodes' worth of KV on a 24 GiB host
    assert rep.find("plan.cores").level == "fail"
    r = doctor(spec, "--sysroot", machines["two-cpu"])
    assert r.returncode == 9 and "✖ qwen-0 wants CPUs" in r.stdout


def test_spec_with_other_smt_numbering_shares_cores(tmp_path, machines):
    """Planned for offset sibling numbering, run where siblings are adjacent: threads pair up on cores."""
    nodes = [{"id": 0, "socket": 0, "cpus": "0-15", "memory": "64GiB"}]
    hw = {"threads_per_core": 2, "sibling_numbering": "offset", "isa": ["avx512f", "avx512bw", "avx512vl"],
          "numa_nodes": nodes}
    adjacent = write(MACHINES["desktop-adjacent"].__class__(sockets=1, cores_per_socket=8, numbering="adjacent",
                                                           node_memory=64 * 1024**3), tmp_path / "adjacent")
    rep = examine_host(str(adjacent), str(write_spec(tmp_path, hardware=hw)))
    assert rep.find("plan.smt").level == "fail"


def test_spec_that_cannot_be_placed(tmp_path, machines):
    rep = examine_host(str(machines["two-cpu"]), str(write_spec(tmp_path, model={
        "source": "Qwen/Qwen3-8B", "max_model_len": 32768,
        "architecture": {"num_parameters": 70_000_000_000, "num_hidden_layers": 80, "num_key_value_heads": 8,
                         "head_dim": 128, "max_position_embeddings": 32768}})))
    f = rep.find("plan.place")
    assert f.level == "fail" and "cannot hold the model" in f.title and f.fix


def test_usage_errors_are_messages_not_tracebacks(tmp_path):
    r = doctor("--pid", "1", "--url", "http://127.0.0.1:1")
    assert r.returncode == errors.EXIT_CODES[errors.TargetError] and "one target at a time" in r.stderr
    assert "Traceback" not in r.stderr


def test_snapshot_older_than_doctor_says_what_it_cannot_judge(machines):
    """A snapshot without the settings doctor reads (like examples/epyc-9655-2s.sysroot.tar.gz): ℹ, never a
    guess."""
    rep = examine_host(str(machines["epyc-2s-nps1"]), None)
    assert problems(rep) == {}
    assert rep.find("openmp.environment").level == "info" and rep.find("malloc.tcmalloc") is None
    assert rep.find("numa.balancing").level == "info" and rep.find("numa.syscalls").level == "info"
