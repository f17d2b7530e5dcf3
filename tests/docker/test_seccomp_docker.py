"""Our least-privilege seccomp profile, enforced by a real Docker engine, lets a container with no capabilities at
all bind and migrate its own memory, and allows little else."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from deploykit import cpulist
from deploykit.render import seccomp

pytestmark = pytest.mark.docker

PROBE = (Path(__file__).parent / "numa_probe.py").read_text()
NUMA_CALLS = ("get_mempolicy", "set_mempolicy", "mbind", "migrate_pages", "move_pages")
DENIED_CALLS = ("mount", "unshare", "ptrace", "kexec_load", "bpf")
MARK = errno.ENOSYS
# What every rendered container gets: no capabilities at all (security.sys_nice is an opt-in).
HARDENED = ("--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--user", "10001", "--read-only", "--network", "none")
WITH_SYS_NICE = (*HARDENED, "--cap-add", "SYS_NICE")


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("seccomp")
    docker_form = out / "least-privilege.json"
    docker_form.write_bytes(seccomp.dumps(seccomp.profile()))
    flat = out / "least-privilege.oci.json"
    flat.write_bytes(seccomp.dumps(seccomp.flatten_for_oci(seccomp.profile(), arch=os.uname().machine)))
    # The same rules with a default action that no kernel check imitates: SCMP_ACT_TRACE without a tracer
    # fails the call with ENOSYS, which these (existing) syscalls never return on their own.
    marked = out / "least-privilege.marked.json"
    marked.write_bytes(seccomp.dumps({**seccomp.profile(), "defaultAction": "SCMP_ACT_TRACE"}))
    return {"docker": str(docker_form), "flat": str(flat), "marked": str(marked)}


@pytest.fixture(scope="module")
def probe(docker, base_image, profiles):
    """probe(seccomp_opt or None, *extra_flags) -> the probe's JSON, cached per argument tuple."""
    cache: dict[tuple, dict] = {}

    def run(which: str | None, *extra: str, flags: tuple[str, ...] = HARDENED) -> dict:
        key = (which, extra, flags)
        if key not in cache:
            sec = () if which is None else ("--security-opt", f"seccomp={profiles.get(which, which)}")
            cache[key] = docker.run_python(base_image, PROBE, flags=(*flags, *sec, *extra)).json()
        return cache[key]

    return run


def test_numa_binding_and_page_migration_with_zero_capabilities(probe):
    seen = probe("docker")
    assert int(seen["cap_eff"], 16) == 0 and int(seen["cap_bnd"], 16) == 0
    assert {n: seen["syscalls"][n] for n in NUMA_CALLS} == {n: 0 for n in NUMA_CALLS}
    node = int(seen["mems_allowed_list"].split(",")[0].split("-")[0])
    assert seen["bound_policy"] == [2, 1 << node]  # MPOL_BIND on our node really took effect
    assert seen["moved_page_node"] == node  # move_pages moved our page there


def test_docker_default_profile_refuses_the_same_calls_without_sys_nice(probe):
    # Why containers used to get SYS_NICE or seccomp=unconfined: Docker's default profile gates the binding calls on
    # CAP_SYS_NICE and denies page migration outright.
    calls = probe(None)["syscalls"]
    assert {n: calls[n] for n in NUMA_CALLS} == {n: errno.EPERM for n in NUMA_CALLS}


def test_docker_default_profile_with_sys_nice_still_blocks_page_migration(probe):
    calls = probe(None, flags=WITH_SYS_NICE)["syscalls"]
    assert (calls["set_mempolicy"], calls["mbind"]) == (0, 0)
    assert (calls["migrate_pages"], calls["move_pages"]) == (errno.EPERM, errno.EPERM)


def test_probe_reaches_the_kernel_when_unconfined(probe):
    # Without seccomp the probe's deliberately bad arguments earn kernel errnos, never EPERM; so EPERM
    # under our profile below is seccomp's doing, not a missing capability.
    calls = probe("unconfined")["syscalls"]
    assert calls["mount"] == errno.EFAULT
    assert calls["unshare"] == 0
    assert calls["ptrace"] == errno.ESRCH
    assert all(calls[n] == 0 for n in NUMA_CALLS)


def test_escape_hatches_denied_by_seccomp(probe):
    calls = probe("docker")["syscalls"]
    assert {n: calls[n] for n in DENIED_CALLS} == {n: errno.EPERM for n in DENIED_CALLS}


def test_escape_hatches_are_denied_by_our_filter_not_only_by_missing_caps(probe):
    """kexec_load and bpf would return EPERM anyway without CAP_SYS_BOOT / CAP_BPF; with the profile's default
    action made distinguishable, every one of them returns MARK: the filter itself stops them."""
    calls = probe("marked")["syscalls"]
    assert {n: calls[n] for n in DENIED_CALLS} == {n: MARK for n in DENIED_CALLS}
    assert {n: calls[n] for n in NUMA_CALLS} == {n: 0 for n in NUMA_CALLS}


def test_flattened_profile_behaves_the_same_under_a_plain_runtime(probe):
    # The OCI form carries no conditions for the runtime to evaluate: what containerd/CRI-O would load.
    assert probe("flat")["syscalls"] == probe("docker")["syscalls"]


def test_sys_nice_opt_in_changes_nothing_the_engine_needs(probe):
    assert probe("docker", flags=WITH_SYS_NICE)["syscalls"] == probe("docker")["syscalls"]


def test_runs_unprivileged_on_read_only_root(probe):
    seen = probe("docker")
    assert (seen["uid"], seen["euid"], seen["gid"]) == (10001, 10001, 10001)
    assert seen["root_write_errno"] == errno.EROFS
    assert seen["no_new_privs"] == "1"
    assert seen["seccomp_mode"] == "2"  # filter mode
    assert int(seen["cap_bnd"], 16) == 0  # no capability at all


def _own(field: str) -> tuple[int, ...]:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return cpulist.parse(line.split(":", 1)[1])
    raise AssertionError(f"{field} missing from /proc/self/status")


def test_cpuset_is_what_the_container_sees(probe):
    cpus, mems = _own("Cpus_allowed_list"), _own("Mems_allowed_list")
    want_cpus = cpulist.format(cpus[-1:] if len(cpus) < 2 else (cpus[0], cpus[-1]))
    want_mems = cpulist.format(mems[:1])
    seen = probe("docker", "--cpuset-cpus", want_cpus, "--cpuset-mems", want_mems)
    assert seen["cpus_allowed_list"] == want_cpus
    assert seen["mems_allowed_list"] == want_mems
