"""Seccomp rendering without Docker: determinism, flattening for Kubernetes, containers-common agreement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploykit.errors import SpecError
from deploykit.render import seccomp, syscalls

CONTAINERS_COMMON = Path("/usr/share/containers/seccomp.json")
DOCKER_ONLY_KEYS = {"includes", "excludes", "archMap", "minKernel", "comment"}
NICE = frozenset({"CAP_SYS_NICE"})
RENDER = ("import sys; from deploykit.render import seccomp as s; p = s.profile(); "
          "sys.stdout.buffer.write(s.dumps(p) + s.dumps(s.flatten_for_oci(p)))")


def _keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return set(obj).union(*(_keys(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_keys(v) for v in obj))
    return set()


def test_render_is_byte_identical_across_runs_and_hash_seeds():
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", RENDER], env=env, check=True,
                                capture_output=True, cwd=Path(__file__).parents[1]).stdout)
    assert len(outs) == 1
    assert seccomp.dumps(seccomp.profile()) == seccomp.dumps(seccomp.profile())


def test_dumps_format():
    text = seccomp.dumps(seccomp.profile()).decode()
    assert text.endswith("}\n") and not text.endswith("\n\n")
    assert text.startswith('{\n  "defaultAction": "SCMP_ACT_ERRNO"')
    for rule in json.loads(text)["syscalls"]:
        assert rule["names"] == sorted(rule["names"])


@pytest.mark.parametrize("mode", ["runtime-default", "unconfined"])
def test_modes_without_a_profile_file(mode):
    assert seccomp.profile(mode) is None


def test_unknown_mode_is_a_spec_error_with_a_hint():
    with pytest.raises(SpecError) as err:
        seccomp.profile("least-privelege")
    assert "least-privilege" in str(err.value)


def test_docker_form_allows_numa_calls_without_any_capability():
    rules = seccomp.profile()["syscalls"]
    holders = [r for r in rules if set(r["names"]) & syscalls.NUMA]
    assert {n for r in holders for n in r["names"]} >= syscalls.NUMA
    assert all(r["action"] == "SCMP_ACT_ALLOW" and "includes" not in r and "excludes" not in r and "args" not in r
               for r in holders)
    assert all(r["comment"] for r in holders)  # a deviation from Docker's default, so it says why


@pytest.mark.parametrize("arch, native", [("x86_64", ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]),
                                          ("aarch64", ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"])])
def test_flattened_form_is_plain_oci(arch, native):
    flat = seccomp.flatten_for_oci(seccomp.profile(), arch=arch)
    assert not _keys(flat) & DOCKER_ONLY_KEYS
    assert flat["architectures"] == native
    assert (flat["defaultAction"], flat["defaultErrnoRet"]) == ("SCMP_ACT_ERRNO", 1)
    allowed = seccomp.allowed(flat)
    assert syscalls.NUMA <= allowed
    assert not {"mount", "unshare", "ptrace", "bpf", "kexec_load", "setns", "io_uring_setup"} & allowed
    assert ("arch_prctl" in allowed) == (arch == "x86_64")
    assert ("set_tls" in allowed) == (arch == "aarch64")


def test_flattened_form_has_one_action_per_name():
    # libseccomp refuses two different actions for one syscall; arg-filtered allows may repeat a name.
    for caps in (NICE, frozenset(), frozenset({"CAP_SYS_ADMIN", "CAP_SYS_NICE"})):
        flat = seccomp.flatten_for_oci(seccomp.profile(), caps=caps)
        action: dict[str, str] = {}
        for rule in flat["syscalls"]:
            for name in rule["names"]:
                assert action.setdefault(name, rule["action"]) == rule["action"], name


def test_flattening_resolves_caps_like_docker():
    profile = seccomp.profile()
    bare = seccomp.flatten_for_oci(profile, caps=frozenset())
    assert syscalls.NUMA <= seccomp.allowed(bare)  # zero capabilities, NUMA binding still allowed
    assert seccomp.flatten_for_oci(profile) == bare  # the default: a pod that drops ALL and adds nothing
    admin = seccomp.flatten_for_oci(profile, caps=frozenset({"SYS_ADMIN"}))  # Docker spelling works too
    assert {"mount", "unshare", "clone3"} <= seccomp.allowed(admin)
    clone_rules = [r for r in admin["syscalls"] if "clone" in r["names"]]
    assert len(clone_rules) == 1 and "args" not in clone_rules[0]  # no namespace-flag filter with SYS_ADMIN
    nice = seccomp.flatten_for_oci(profile)
    (clone3,) = [r for r in nice["syscalls"] if "clone3" in r["names"]]
    assert (clone3["action"], clone3["errnoRet"]) == ("SCMP_ACT_ERRNO", 38)  # ENOSYS: glibc falls back to clone


def test_every_deviation_from_docker_is_explained():
    allowed = syscalls.allowed_names(frozenset(), "x86_64")
    for name, why in syscalls.DENIED.items():
        assert why and name not in set(syscalls.BASE), name
    assert not {"io_uring_setup", "vmsplice", "process_vm_readv"} & allowed
    assert all(syscalls.justification(n) for n in ("migrate_pages", "move_pages", "ptrace", "fchmodat2"))


def test_no_more_permissive_than_containers_common_without_a_reason():
    if not CONTAINERS_COMMON.exists():
        why = f"{CONTAINERS_COMMON} missing: install golang-github-containers-common to compare"
        if os.environ.get("DEPLOYKIT_REQUIRE_DOCKER") == "1":  # CI installs it (scripts/test): never a silent skip
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    theirs = seccomp.allowed(seccomp.flatten_for_oci(json.loads(CONTAINERS_COMMON.read_text())))
    ours = seccomp.allowed(seccomp.flatten_for_oci(seccomp.profile()))
    unexplained = sorted(n for n in ours - theirs if n not in syscalls.NUMA and not syscalls.justification(n))
    assert unexplained == []
    assert {"migrate_pages", "move_pages"} <= ours - theirs  # containers-common denies them outright
