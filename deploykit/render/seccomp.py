"""Seccomp profiles: the Docker-form least-privilege profile and its flattened OCI form for Kubernetes.

Docker evaluates `includes`/`excludes` (caps, arches, minKernel) itself; containerd and CRI-O load a
Kubernetes Localhost profile as a plain OCI object and silently ignore those keys, which would turn every
conditional allow into an unconditional one. `flatten_for_oci` resolves the conditions for the exact caps
the pod runs with, so the file means the same thing under every runtime.
"""

from __future__ import annotations

import copy
import json

from deploykit.errors import SpecError, did_you_mean
from deploykit.render import syscalls
from deploykit.render.syscalls import ALLOW, Rule

MODES = ("least-privilege", "runtime-default", "unconfined")
DEFAULT_CAPS: frozenset[str] = frozenset()  # every container drops ALL and adds nothing (security.sys_nice opts in)


def profile(mode: str = "least-privilege") -> dict | None:
    """Docker-form profile for `mode`; None for modes that use the runtime's own (or no) filter."""
    if mode not in MODES:
        raise SpecError("unknown seccomp mode", path="security.seccomp", value=mode,
                        allowed=", ".join(MODES), hint=did_you_mean(mode, MODES))
    if mode != "least-privilege":
        return None
    return {
        "defaultAction": syscalls.ERRNO,
        "defaultErrnoRet": syscalls.EPERM,
        "archMap": [{"architecture": arch, "subArchitectures": list(subs)}
                    for arch, subs in syscalls.ARCH_MAP.items()],
        "syscalls": [_docker_rule(r) for r in (Rule(syscalls.BASE), *syscalls.RULES)],
    }


def _docker_rule(rule: Rule) -> dict:
    out: dict = {"names": sorted(rule.names), "action": rule.action}
    if rule.args:
        out["args"] = [_arg(a) for a in rule.args]
    if rule.errno is not None:
        out["errnoRet"] = rule.errno
    if rule.why:
        out["comment"] = rule.why
    includes = {k: list(v) for k, v in (("caps", rule.caps), ("arches", rule.arches)) if v}
    if includes:
        out["includes"] = includes
    if rule.unless_caps:
        out["excludes"] = {"caps": list(rule.unless_caps)}
    return out


def _arg(a: syscalls.Arg) -> dict:
    out = {"index": a.index, "value": a.value, "op": a.op}
    if a.value_two:
        out["valueTwo"] = a.value_two
    return out


def _norm_caps(caps: frozenset[str]) -> frozenset[str]:
    return frozenset(c.upper() if c.upper().startswith("CAP_") else "CAP_" + c.upper() for c in caps)


def _in_force(rule: dict, caps: frozenset[str], go_arch: str) -> bool:
    """Docker's semantics: includes.caps all held, includes.arches contains us, excludes match nothing.

    minKernel cannot be evaluated without the node's kernel, so a rule gated on it is dropped (denied).
    """
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    if inc.get("minKernel") or exc.get("minKernel"):
        return False
    if not _norm_caps(frozenset(inc.get("caps") or ())) <= caps:
        return False
    if inc.get("arches") and go_arch not in inc["arches"]:
        return False
    if caps & _norm_caps(frozenset(exc.get("caps") or ())):
        return False
    return go_arch not in (exc.get("arches") or ())


def flatten_for_oci(profile: dict, arch: str = "x86_64",
                    caps: frozenset[str] = DEFAULT_CAPS) -> dict:
    """Resolve a Docker-form profile for one host arch and the exact caps the pod holds.

    Output is a plain OCI LinuxSeccomp object: defaultAction, defaultErrnoRet, flat architectures and
    syscalls with only names/action/args/errnoRet. Unconditional allows are merged into the first rule.
    """
    if arch not in syscalls.HOST_ARCHES:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {sorted(syscalls.HOST_ARCHES)}")
    go_arch, native = syscalls.HOST_ARCHES[arch]
    caps = _norm_caps(caps)

    architectures = list(profile.get("architectures") or ())
    for entry in profile.get("archMap") or ():
        if entry["architecture"] == native:
            architectures = [native, *(entry.get("subArchitectures") or ())]

    plain: set[str] = set()
    rest: list[dict] = []
    for rule in profile.get("syscalls") or ():
        if not _in_force(rule, caps, go_arch):
            continue
        if rule["action"] == ALLOW and not rule.get("args"):
            plain.update(rule["names"])
            continue
        out = {"names": sorted(rule["names"]), "action": rule["action"]}
        if rule.get("args"):
            out["args"] = [{k: a[k] for k in ("index", "value", "valueTwo", "op") if k in a}
                           for a in rule["args"]]
        if rule.get("errnoRet") is not None:
            out["errnoRet"] = rule["errnoRet"]
        rest.append(out)

    # A conditional ALLOW for a name already allowed outright is redundant. A deny for such a name is a
    # contradiction (containers-common has one for setns); the deny wins, as least privilege asks.
    for rule in rest:
        if rule["action"] != ALLOW:
            plain.difference_update(rule["names"])
    kept = [{**r, "names": [n for n in r["names"] if n not in plain or r["action"] != ALLOW]} for r in rest]
    kept = [r for r in kept if r["names"]]

    out: dict = {"defaultAction": profile["defaultAction"]}
    if profile.get("defaultErrnoRet") is not None:
        out["defaultErrnoRet"] = profile["defaultErrnoRet"]
    out["architectures"] = architectures
    out["syscalls"] = ([{"names": sorted(plain), "action": ALLOW}] if plain else []) + kept
    return out


def allowed(flat: dict) -> frozenset[str]:
    """Names a flattened profile lets through for at least some arguments."""
    return frozenset(n for r in flat["syscalls"] if r["action"] == ALLOW for n in r["names"])


def dumps(obj: dict) -> bytes:
    """Deterministic JSON: names sorted within each rule, rule order kept, 2-space indent, final newline."""
    obj = copy.deepcopy(obj)
    for rule in obj.get("syscalls") or ():
        rule["names"] = sorted(rule["names"])
    return (json.dumps(obj, indent=2) + "\n").encode()
